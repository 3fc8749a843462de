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
from tests.worker_service.support.worker_process import greedy_on_two_gloo_ranks

# Starts worker processes (tests/support/process_guard.py); transformers reference.
pytestmark = [pytest.mark.server, pytest.mark.slow]

STEPS = 32


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3-longrope"])
def test_two_gloo_ranks_match_hf(name, tmp_path):
    hf = tiny_model(name, tmp_path)
    g = torch.Generator().manual_seed(3)
    # Longer than every window, and short.
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (50, 4, 41)]
    outputs = greedy_on_two_gloo_ranks(tmp_path, prompts, STEPS)
    for prompt, tokens in zip(prompts, outputs, strict=True):
        assert tokens == hf_greedy_check(hf, prompt, tokens)[0]
