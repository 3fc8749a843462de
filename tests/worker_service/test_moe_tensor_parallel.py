"""Mixture-of-experts models on 2 gloo ranks (each expert's intermediate
dimension split between them, partial sums all-reduced; OLMoE's q/k norms
over the whole projection from all-reduced sums of squares; GPT-OSS's sinks
split by head and its biases counted once) give transformers' greedy tokens.
Qwen3-MoE and Mixtral shard their experts by the same code as OLMoE."""

from __future__ import annotations

import pytest

from tests.support.hf_reference import hf_greedy
from tests.worker_service.support.tiny_moe_models import tiny_moe_model
from tests.worker_service.support.worker_process import greedy_on_two_gloo_ranks

# Starts worker processes (tests/support/process_guard.py); transformers references.
pytestmark = [pytest.mark.server, pytest.mark.slow]

STEPS = 32


@pytest.mark.parametrize("arch", ["olmoe", "gpt-oss"])
def test_two_gloo_ranks_match_hf(arch, tmp_path):
    hf = tiny_moe_model(arch, tmp_path)
    prompts = [[7, 8, 9, 10, 11, 12], [250, 3], list(range(40, 90))]
    two_ranks = greedy_on_two_gloo_ranks(tmp_path, prompts, STEPS)
    for prompt, out in zip(prompts, two_ranks, strict=True):
        assert out == hf_greedy(hf, prompt, STEPS)[0]
