"""Tensor parallelism with 2 gloo ranks on CPU gives the tokens of 1 rank."""

from __future__ import annotations

import pytest

from tests.support.hf_reference import hf_greedy
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


def test_two_gloo_ranks_match_one_rank_and_hf(tmp_path):
    hf = tiny_model("llama3-rope-scaling", tmp_path)
    prompts = [[7, 8, 9, 10, 11, 12], [250, 3], list(range(40, 70))]
    common = ("--model", str(tmp_path), "--page-size", "16", "--num-pages", "64", "--threads", "1")
    dist = f"127.0.0.1:{free_port()}"
    tp = ("--tp-size", "2", "--dist-addr", dist)
    ranks = [(*common, *tp, "--tp-rank", str(r)) for r in (0, 1)]
    with worker_processes(tmp_path, *ranks) as addresses:
        streams = [PlanStream(a) for a in addresses]
        two_ranks = greedy_over_grpc(streams, prompts, 16, 16)
        for s in streams:
            s.close()
    with worker_process(tmp_path, *common, name="single") as addr:
        stream = PlanStream(addr)
        one_rank = greedy_over_grpc([stream], prompts, 16, 16)
        stream.close()
    assert two_ranks == one_rank
    for prompt, out in zip(prompts, one_rank, strict=True):
        assert out == hf_greedy(hf, prompt, 16)[0]
