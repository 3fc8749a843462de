"""The Gemma 2, Gemma 3 and Phi-3 families on 2 gloo ranks give
transformers' greedy tokens: sharded attention heads with their soft-cap,
scale, windows and query/key norms, Phi-3's fused checkpoint tensors split
into each rank's q, k, v and gate, up shards, the vocabulary-sharded head
with the final soft-cap."""

from __future__ import annotations

import pytest
import torch

from tests.support.hf_reference import hf_greedy_check
from tests.worker_service.support.tiny_hf_models import VOCAB, tiny_model
from tests.worker_service.support.worker_process import (
    PlanStream,
    free_port,
    greedy_over_grpc,
    worker_processes,
)

# Starts worker processes (tests/support/process_guard.py); transformers reference.
pytestmark = [pytest.mark.server, pytest.mark.slow]

STEPS = 32


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3-longrope"])
def test_two_gloo_ranks_match_hf(name, tmp_path):
    hf = tiny_model(name, tmp_path)
    g = torch.Generator().manual_seed(3)
    # Longer than every window, and short.
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (50, 4, 41)]
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
        outputs = greedy_over_grpc(streams, prompts, STEPS, 16)
        for s in streams:
            s.close()
    for prompt, tokens in zip(prompts, outputs, strict=True):
        assert tokens == hf_greedy_check(hf, prompt, tokens)[0]
