"""Tensor-parallel collectives on 2 gloo ranks: the logits gather is one
all_gather_into_tensor (no list all_gather, no cat of parts) with the old
result, and ``agree`` gives every rank every rank's code."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.worker_service.support.gloo_ranks import on_gloo_ranks
from worker_service.device.distributed import TensorParallel

# Spawns the ranks (tests/support/process_guard.py).
pytestmark = pytest.mark.server

SHAPES = [(5, 7), (1, 3), (0, 4), (2, 3, 4), (6,)]


def _list_gather_and_cat(x: torch.Tensor, size: int) -> torch.Tensor:
    """What all_gather_last_dim did before: a list all_gather, then cat."""
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def _gather_body(tp: TensorParallel) -> None:
    g = torch.Generator().manual_seed(10 + tp.rank)
    inputs = [torch.randn(shape, generator=g) for shape in SHAPES]
    inputs.append(torch.randn(7, 5, generator=g).t())  # not contiguous
    old = [_list_gather_and_cat(x, tp.size) for x in inputs]

    def no_list_gather(*args, **kwargs):
        raise AssertionError("all_gather_last_dim used a list all_gather")

    dist.all_gather = no_list_gather  # this rank's process only
    for x, want in zip(inputs, old, strict=True):
        got = tp.all_gather_last_dim(x)
        assert got.shape == want.shape and torch.equal(got, want), (x.shape, got, want)
    assert tp.agree(3 * tp.rank) == [0, 3]
    assert tp.agree(0) == [0, 0]


def test_logits_gather_is_one_collective_with_the_old_result_and_ranks_agree():
    on_gloo_ranks(_gather_body)
