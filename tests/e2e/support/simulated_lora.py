"""LoRA adapters through the public API on the simulated model: an adapter
directory (the simulated worker reads only adapter_config.json), loading it,
a streamed request that names it, and the tokens of the reply."""

from __future__ import annotations

import json
from pathlib import Path

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.system import greedy


def adapter_dir(root: Path, name: str, r: int = 8) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": r,
                "lora_alpha": 2 * r,
                "target_modules": ["q_proj", "v_proj"],
                "bias": "none",
            }
        )
    )
    return d


def load(s, lora_id: str, path: Path, pinned: bool = False) -> pb.LoadLoRAAdapterResponse:
    return s.LoadLoRAAdapter(
        pb.LoadLoRAAdapterRequest(
            lora_id=lora_id, lora_name=f"name-{lora_id}", lora_path=str(path), pinned=pinned
        ),
        timeout=30,
    )


def ask(rid: str, prompt: list[int], max_new: int, lora_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=greedy(max_new, ignore_eos=True),
        lora_id=lora_id,
        stream=True,
    )


def tokens_of(responses) -> list[int]:
    return [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]
