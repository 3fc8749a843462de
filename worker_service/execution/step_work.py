"""What a step is made of, between the runner and the compute: each request's
share of a step (``SeqWork``), the compute's interface (``Compute``, and
``OverlapCompute`` for one that queues a step and finishes it later), and a
started plan (``StartedStep``). ``ModelRunner`` (model_runner.py) makes them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from worker_service.execution.plan import Result
from worker_service.execution.request_state import SlotState
from worker_service.sampling.rows import SampleOutput


@dataclass(slots=True, kw_only=True)
class SeqWork:
    """One request's share of a step."""

    slot: int
    state: SlotState
    start: int  # position of inputs[0]
    inputs: list[int]  # tokens computed this step (a decode: the last sampled one)
    sample: bool
    next_token: int | None = None  # prompt token after a chunk (prompt logprobs)
    # A decode whose input is still being sampled by the step before (overlap):
    # its index among that step's sampled tokens; ``inputs`` holds PENDING.
    pending: int | None = None
    # Speculative decoding: the last draft_len inputs are drafts to verify
    # (inputs[0] is the request's last sampled token, already in state.tokens).
    # The compute samples at each of the last draft_len + 1 positions, as if
    # the drafts before it were accepted: draft_len + 1 rows, in order.
    draft_len: int = 0


class Compute(Protocol):
    """``run`` gives one sampled row per sampling ``SeqWork``, draft_len + 1
    for a drafted one; ``ModelRunner`` accepts the drafts
    (sampling/draft_acceptance.py)."""

    def run(self, work: list[SeqWork], num_extends: int) -> SampleOutput: ...


class LaunchedStep(Protocol):
    """A step whose kernels are queued (ModelCompute.launch)."""

    @property
    def tokens(self) -> torch.Tensor: ...  # its sampled ids, on the device


class OverlapCompute(Compute, Protocol):
    """A compute that can queue a step and finish it later, so the next step's
    host work (layout, attention plan, uploads) runs while this one computes."""

    def launch(
        self, work: list[SeqWork], num_extends: int, previous: LaunchedStep | None
    ) -> LaunchedStep: ...

    def finish(self, launched: LaunchedStep) -> SampleOutput: ...


PENDING = -1  # a sampled token whose value is still on the device (overlap)


@dataclass
class StartedStep:
    """A plan the runner started; ``ModelRunner.complete`` gives its Result."""

    step_id: int
    work: list[SeqWork] = field(default_factory=list)
    num_extends: int = 0
    launched: Any = None  # the compute's LaunchedStep while it runs
    # (state, index in state.tokens) of each sampled token still PENDING
    pending: list[tuple[SlotState, int]] = field(default_factory=list)
    # id(state) -> index of its token among this step's sampled ones
    sample_index: dict[int, int] = field(default_factory=dict)
    result: Result | None = None
    started_at: float = field(default_factory=time.perf_counter)
    drafted: bool = False  # it verifies drafts (speculative decoding)
