"""What serving LoRA adapters costs (a program, not a test), on a running
server (``radixserve serve``; the default model on CPU by default):

32 requests in flight, spread over 4 adapters plus the base model (request i
uses adapter i mod 5, the fifth being none), against the same 32 requests
all on the base model: same prompts, same output lengths (``ignore_eos``),
alternating, ``--rounds`` times. Reported: the median TPOT of each run, its
ratio (adapters / base), and output tokens per second.

The adapters are PEFT adapters drawn on the default model's weights
(tests/support/lora_adapters.py: q/k/v/o rank 4, gate/up/down rank 8, all seven
rank 16, q/v rank 64 rsLoRA), saved under ``--adapter-dir`` and loaded with
LoadLoRAAdapter (needs ``--max-loras-per-batch`` >= 4, the default).

    .venv/bin/radixserve serve --port 30000 &
    python benchmarks/lora.py --server 127.0.0.1:30000 --rounds 3

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

TOPICS = ["a lighthouse", "a library", "the desert", "a violin", "a glacier", "a market"]


async def one(stub, req: pb.GenerateRequest) -> list[float]:
    """Arrival times of a streamed call's tokens."""
    times: list[float] = []
    async for r in stub.Generate(req, timeout=900):
        if r.HasField("chunk") and r.chunk.token_ids:
            times += [time.perf_counter()] * len(r.chunk.token_ids)
    return times


def request(rid: str, text: str, max_new: int, lora_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(original_text=text),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True),
        lora_id=lora_id,
        stream=True,
    )


async def run(stub, texts: list[str], max_new: int, ids: list[str], tag: str) -> tuple:
    t0 = time.perf_counter()
    calls = await asyncio.gather(
        *(one(stub, request(f"{tag}-{i}", t, max_new, ids[i])) for i, t in enumerate(texts))
    )
    wall = time.perf_counter() - t0
    tpots = [(c[-1] - c[0]) / (len(c) - 1) for c in calls if len(c) > 1]
    return statistics.median(tpots), sum(map(len, calls)) / wall


def ensure_adapters(stub_sync, directory: Path) -> list[str]:
    """The standard adapters, drawn once into ``directory`` and loaded."""
    from tests.support.lora_adapters import STANDARD, make_adapter

    listed = stub_sync.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest())
    loaded = {a.lora_id for a in listed.loaded_adapters}
    for name, (r, modules, rslora, seed) in STANDARD.items():
        path = directory / name
        if not (path / "adapter_config.json").exists():
            path = make_adapter(directory, name, r, modules, rslora, seed)
        if name not in loaded:
            stub_sync.LoadLoRAAdapter(
                pb.LoadLoRAAdapterRequest(lora_id=name, lora_name=name, lora_path=str(path)),
                timeout=300,
            )
    return list(STANDARD)


async def main_async(args: argparse.Namespace, names: list[str]) -> dict:
    texts = [
        f"Write a short story about {TOPICS[i % len(TOPICS)]}, number {i}."
        for i in range(args.batch)
    ]
    mixed = [(names + [""])[i % (len(names) + 1)] for i in range(args.batch)]
    base = [""] * args.batch
    async with grpc.aio.insecure_channel(args.server) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        await run(stub, texts[:5], 4, mixed[:5], "warm")  # first steps, adapters touched
        ratios, lora_tpot, base_tpot, lora_tps, base_tps = [], [], [], [], []
        for r in range(args.rounds):
            order = (
                [("lora", mixed), ("base", base)]
                if r % 2 == 0
                else [("base", base), ("lora", mixed)]
            )
            got = {}
            for kind, ids in order:
                got[kind] = await run(stub, texts, args.max_new_tokens, ids, f"{kind}{r}")
            (lt, ls), (bt, bs) = got["lora"], got["base"]
            lora_tpot.append(lt)
            base_tpot.append(bt)
            lora_tps.append(ls)
            base_tps.append(bs)
            ratios.append(lt / bt)
            print(
                f"round {r + 1}: TPOT with adapters {lt * 1e3:.1f} ms, base {bt * 1e3:.1f} ms, "
                f"ratio {lt / bt:.3f}; output tok/s {ls:.1f} vs {bs:.1f}",
                flush=True,
            )
    return {
        "batch": args.batch,
        "adapters": names,
        "max_new_tokens": args.max_new_tokens,
        "tpot_lora_ms": statistics.median(lora_tpot) * 1e3,
        "tpot_base_ms": statistics.median(base_tpot) * 1e3,
        "tpot_ratio_median": statistics.median(ratios),
        "output_tok_s_lora": statistics.median(lora_tps),
        "output_tok_s_base": statistics.median(base_tps),
        "rounds": args.rounds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", default="127.0.0.1:30000")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--adapter-dir", type=Path, default=None)
    args = p.parse_args()
    directory = args.adapter_dir or Path(tempfile.mkdtemp(prefix="radixserve-lora-"))
    names = ensure_adapters(
        pb_grpc.SglangSchedulerStub(grpc.insecure_channel(args.server)), directory
    )
    print(json.dumps(asyncio.run(main_async(args, names))))


if __name__ == "__main__":
    main()
