"""Mixture-of-experts models on 2 gloo ranks (each expert's intermediate
dimension split between them, partial sums all-reduced; OLMoE's q/k norms
over the whole projection from all-reduced sums of squares; GPT-OSS's sinks
split by head and its biases counted once) give transformers' greedy tokens.
Qwen3-MoE and Mixtral shard their experts by the same code as OLMoE."""

from __future__ import annotations

import pytest

from tests.support.hf_reference import hf_greedy
from tests.worker_service.support.tiny_moe_models import tiny_moe_model
from tests.worker_service.support.worker_process import (
    PlanStream,
    free_port,
    greedy_over_grpc,
    worker_processes,
)

# Starts worker processes (tests/support/process_guard.py); transformers references.
pytestmark = [pytest.mark.server, pytest.mark.slow]

STEPS = 32


@pytest.mark.parametrize("arch", ["olmoe", "gpt-oss"])
def test_two_gloo_ranks_match_hf(arch, tmp_path):
    hf = tiny_moe_model(arch, tmp_path)
    prompts = [[7, 8, 9, 10, 11, 12], [250, 3], list(range(40, 90))]
    # One KV pool: greedy_over_grpc's plans carry no sliding pages (two pools
    # on two ranks: test_swa_grpc.py).
    common = (
        *("--model", str(tmp_path), "--page-size", "16", "--num-pages", "64", "--threads", "1"),
        "--no-swa-memory",
    )
    tp = ("--tp-size", "2", "--dist-addr", f"127.0.0.1:{free_port()}")
    ranks = [(*common, *tp, "--tp-rank", str(r)) for r in (0, 1)]
    with worker_processes(tmp_path, *ranks) as addresses:
        streams = [PlanStream(a) for a in addresses]
        two_ranks = greedy_over_grpc(streams, prompts, STEPS, 16)
        for s in streams:
            s.close()
    for prompt, out in zip(prompts, two_ranks, strict=True):
        assert out == hf_greedy(hf, prompt, STEPS)[0]
