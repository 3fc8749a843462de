"""Tensor-parallel collectives on 2 gloo ranks: the logits gather is one
all_gather_into_tensor (no list all_gather, no cat of parts) with the old
result; ``agree`` gives every rank every rank's code, and a rank that is
gone breaks a runner's agreement at once as a DeviceFailure (the servicer
ends the process, to be restarted with a fresh group), not a hang."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.worker_service.support.gloo_ranks import on_gloo_ranks
from worker_service.device.context import DeviceFailure
from worker_service.device.distributed import TensorParallel
from worker_service.execution.model_runner import ModelRunner
from worker_service.execution.plan import ForwardMode, Plan
from worker_service.execution.simulated_compute import SimulatedCompute

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


def _lost_rank_body(tp: TensorParallel) -> None:
    runner = ModelRunner(SimulatedCompute(), num_pages=8, page_size=4, vocab_size=64, tp=tp)
    assert runner.execute(Plan(1, ForwardMode.IDLE)).error == ""  # both ranks agree
    if tp.rank == 1:
        os._exit(0)  # gone, as a crashed rank is
    t0 = time.monotonic()
    with pytest.raises(DeviceFailure, match="tensor-parallel group broke"):
        runner.start(Plan(2, ForwardMode.IDLE))
    assert time.monotonic() - t0 < 30


def test_a_lost_rank_breaks_the_step_agreement_at_once():
    on_gloo_ranks(_lost_rank_body)
