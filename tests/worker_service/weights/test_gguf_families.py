"""Gemma 2, Gemma 3, Phi-3, Qwen3-MoE and Mixtral from GGUF files written as llama.cpp's converter
writes them (support/gguf_build.py: write_family_gguf, write_moe_gguf): the worker loads the
file and gives transformers' greedy tokens and logprobs (within 1e-4, fp32,
F32 tensors) on the Hugging Face checkpoint the file was made from, in a
mixed batch with chunked prefill and a cached prefix."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.support.hf_reference import hf_greedy_check
from tests.worker_service.support.plan_driver import DriverRequest, PlanDriver
from tests.worker_service.support.tiny_hf_models import VOCAB, tiny_model
from tests.worker_service.support.tiny_moe_models import tiny_moe_model
from tests.worker_service.support.worker_factory import runner_for
from tests.worker_service.weights.support.gguf_build import write_family_gguf, write_moe_gguf
from worker_service.models.config import UnsupportedModelError
from worker_service.weights import open_model

# Out of make test-fast: transformers references.
pytestmark = pytest.mark.slow

STEPS = 32
TOL = 1e-4


def workload() -> list[DriverRequest]:
    g = torch.Generator().manual_seed(7)

    def rand(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    shared = rand(40)
    return [
        DriverRequest(shared + rand(8), STEPS, arrive=0),
        DriverRequest(rand(3), STEPS, arrive=1),
        DriverRequest(shared + rand(15), STEPS, arrive=4, share_from=0),
    ]


@pytest.mark.parametrize(
    "name", ["gemma2-gguf", "gemma3-gguf", "phi3-longrope", "phi3-partial-rotary"]
)
def test_gguf_gives_the_hf_checkpoints_tokens(name, tmp_path):
    hf = tiny_model(name, tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_family_gguf(path, hf.config, hf.state_dict())

    cfg = open_model(path).config
    want = open_model(tmp_path / "hf").config
    assert cfg.architecture == want.architecture
    assert cfg.layer_types == want.layer_types and cfg.sliding_window == want.sliding_window
    assert cfg.rope_local == want.rope_local
    # Phi-3's longrope factors are float32 tensors in the file.
    factors = {"short_factor": None, "long_factor": None}
    assert replace(cfg.rope, **factors) == replace(want.rope, **factors)
    for key in factors:
        got, expected = getattr(cfg.rope, key), getattr(want.rope, key)
        assert (got is None) == (expected is None)
        assert got is None or got == pytest.approx(expected, rel=1e-7)
    assert cfg.attn_scale == want.attn_scale
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (
        want.attn_logit_softcap,
        want.final_logit_softcap,
    )

    runner = runner_for(path, page_size=16, num_pages=256)
    reqs = PlanDriver(runner, 16, chunk=20).run(workload())
    for r in reqs:
        choices, logprobs = hf_greedy_check(hf, r.prompt, r.outputs)
        assert r.outputs == choices
        assert max(abs(a - b) for a, b in zip(r.logprob_values, logprobs, strict=True)) < TOL


@pytest.mark.parametrize("name", ["qwen3-moe-normalised", "mixtral"])
def test_moe_gguf_gives_the_hf_checkpoints_tokens(name, tmp_path):
    hf = tiny_moe_model(name, tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_moe_gguf(path, hf.config, hf.state_dict())

    cfg = open_model(path).config
    want = open_model(tmp_path / "hf").config
    assert cfg.architecture == want.architecture
    assert cfg.moe == want.moe and cfg.moe is not None
    assert (cfg.rope, cfg.qk_norm, cfg.head_dim) == (want.rope, want.qk_norm, want.head_dim)

    runner = runner_for(path, page_size=16, num_pages=256, threads=1)
    reqs = PlanDriver(runner, 16, chunk=20).run(workload())
    for r in reqs:
        choices, logprobs = hf_greedy_check(hf, r.prompt, r.outputs)
        assert r.outputs == choices
        assert max(abs(a - b) for a, b in zip(r.logprob_values, logprobs, strict=True)) < TOL


def test_what_the_families_do_not_implement_is_refused_by_name(tmp_path):
    """A Gemma 3 file with an attention soft-cap (transformers' Gemma 3 has
    none) and a Qwen3-MoE file whose top-k weights are not renormalised (not
    how llama.cpp runs qwen3moe) are refused, naming what."""
    gemma = tiny_model("gemma3-gguf", tmp_path / "gemma")
    path = tmp_path / "capped.gguf"
    extra = {"gemma3.attn_logit_softcapping": 50.0}
    write_family_gguf(path, gemma.config, gemma.state_dict(), extra=extra)
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping"):
        open_model(path)

    qwen = tiny_moe_model("qwen3-moe-normalised", tmp_path / "qwen")
    path = tmp_path / "unnormalised.gguf"
    extra = {"qwen3moe.expert_weights_norm": False}
    write_moe_gguf(path, qwen.config, qwen.state_dict(), extra=extra)
    with pytest.raises(UnsupportedModelError, match="expert_weights_norm"):
        open_model(path)
