"""The families with sliding and full layers (Gemma 3, GPT-OSS) on two KV
pools, driven by the real Scheduler, which frees the sliding pages behind the
window and hands them to other requests: tokens and logprobs equal those of
the same model on one pool (checked against transformers in
test_families_vs_hf.py / test_moe_models_vs_hf.py)."""

from __future__ import annotations

import pytest
import torch

from tests.worker_service.support.scheduler_plans import serve_with_scheduler
from tests.worker_service.support.tiny_hf_models import VOCAB, tiny_model
from tests.worker_service.support.tiny_moe_models import tiny_moe_model
from tests.worker_service.support.worker_factory import worker_for

STEPS = 24
BUILD = {"gemma3": tiny_model, "gpt-oss": tiny_moe_model}


def arrivals(seed: int) -> list[tuple[int, list[int]]]:
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    shared = rand(40)
    # Prompts longer than the windows (8, 12), a shared prefix the radix
    # cache serves, a short one, and one after the others freed their windows.
    return [
        (0, shared + rand(7)),
        (1, rand(23)),
        (4, shared + rand(12)),
        (6, rand(3)),
        (20, rand(30)),
    ]


@pytest.mark.slow  # builds transformers checkpoints
@pytest.mark.parametrize("name", sorted(BUILD))
@pytest.mark.parametrize(("page_size", "pages", "ratio"), [(1, 2048, 0.04), (16, 128, 0.15)])
def test_two_pools_give_one_pools_tokens(name, page_size, pages, ratio, tmp_path) -> None:
    BUILD[name](name, tmp_path)
    common = {"page_size": page_size, "num_pages": pages, "threads": 1}
    two = worker_for(tmp_path, swa_full_tokens_ratio=ratio, **common)
    assert two.num_swa_pages == int(pages * ratio) and two.swa_window
    one = worker_for(tmp_path, swa_memory=False, **common)
    assert one.num_swa_pages == 0
    kw = {"new_tokens": STEPS, "chunk": 16}
    got, stats = serve_with_scheduler(two.runner, arrivals(page_size), **kw)
    assert stats.reused > 0, "no freed sliding page was written by another request"
    want, _ = serve_with_scheduler(one.runner, arrivals(page_size), **kw)
    assert got == want
