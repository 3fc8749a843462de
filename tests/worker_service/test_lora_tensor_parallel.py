"""LoRA with tensor parallelism: 2 gloo ranks, each loading its shard of the
adapters over gRPC, give the tokens of 1 rank and of transformers + PEFT."""

from __future__ import annotations

from pathlib import Path

import pytest

from protos import worker_pb2 as pb
from tests.support.lora_adapters import ALL, ATTENTION, make_adapter, peft_greedy
from tests.worker_service.support.tiny_hf_models import tiny_model
from tests.worker_service.support.worker_process import (
    PlanStream,
    free_port,
    greedy_over_grpc,
    worker_process,
    worker_processes,
)

# Starts worker processes (tests/support/process_guard.py).
pytestmark = pytest.mark.server

STEPS = 12


def _load(streams: list[PlanStream], adapters: dict[str, Path]) -> None:
    for s in streams:
        for name, path in adapters.items():
            resp = s.stub.LoadAdapter(pb.LoadAdapterRequest(name=name, path=str(path)))
            assert not resp.error, resp.error


def test_two_gloo_ranks_with_adapters_match_one_rank_and_peft(tmp_path):
    hf = tiny_model("llama3-rope-scaling", tmp_path)
    adapters = {
        # Column (q,k,v,gate,up) and row (o,down) parallel shards.
        "all": make_adapter(tmp_path / "adapters", "all", 8, ALL, seed=11, base=hf),
        "attn": make_adapter(tmp_path / "adapters", "attn", 4, ATTENTION, seed=12, base=hf),
    }
    prompts = [[7, 8, 9, 10, 11, 12], [250, 3], list(range(40, 70)), [7, 8, 9, 10, 11, 12]]
    slots = [1, 2, 0, 0]
    assign = [(1, "all"), (2, "attn")]
    common = ("--model", str(tmp_path), "--page-size", "16", "--num-pages", "64", "--threads", "1")
    tp = ("--tp-size", "2", "--dist-addr", f"127.0.0.1:{free_port()}")
    ranks = [(*common, *tp, "--tp-rank", str(r)) for r in (0, 1)]
    with worker_processes(tmp_path, *ranks) as addresses:
        streams = [PlanStream(a) for a in addresses]
        _load(streams, adapters)
        two_ranks = greedy_over_grpc(streams, prompts, STEPS, 16, slots, assign)
        for s in streams:
            s.close()
    with worker_process(tmp_path, *common, name="single") as addr:
        stream = PlanStream(addr)
        _load([stream], adapters)
        one_rank = greedy_over_grpc([stream], prompts, STEPS, 16, slots, assign)
        stream.close()
    assert two_ranks == one_rank
    names = {1: "all", 2: "attn"}
    for prompt, slot, out in zip(prompts, slots, one_rank, strict=True):
        path = adapters[names[slot]] if slot else None
        assert out == peft_greedy(path, prompt, STEPS, base=hf)[0]
    assert one_rank[0] != one_rank[3]  # the same prompt: the adapter changed the output
