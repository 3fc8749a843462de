"""SimulatedWorker: executes StepPlans without a model (tests and benchmarks).

It is the oracle of the scheduler's tests:

- it mirrors the KV pool at slot granularity, recording the token id whose
  "KV" was written at each slot, and before computing a request it reads the
  request's page table back and checks it yields exactly the request's
  tokens so far, so any page handed to two owners, freed too early, or
  named wrongly in a plan is caught at the step that reads it;
- the token it samples is a hash of the request's whole context
  (``next_token``), so the correct output of any request is known in advance
  whatever the batching, caching, chunking or retraction (``expected_output``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_service.core.plan import (
    JoinRequest,
    RequestOutput,
    StepPlan,
    StepResult,
    TokenLogprobs,
)

_MASK = (1 << 64) - 1


class SimulatedWorkerError(AssertionError):
    pass


def _absorb(state: int, token: int) -> int:
    return ((state ^ (token + 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9) & _MASK


def _finalize(state: int) -> int:
    z = (state ^ (state >> 31)) * 0x94D049BB133111EB & _MASK
    return z ^ (z >> 29)


def next_token(state: int, vocab_size: int) -> int:
    return _finalize(state) % vocab_size


def context_state(tokens: list[int], state: int = 0) -> int:
    for t in tokens:
        state = _absorb(state, t)
    return state


def expected_output(
    prompt: list[int],
    max_new_tokens: int,
    vocab_size: int,
    stop_ids: frozenset[int] = frozenset(),
    min_new_tokens: int = 0,
    stops: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """What any correct scheduler makes the simulated worker generate for a
    prompt: it stops after a stop id, or once ``stops(output)`` holds (say a
    stop string showed up), when more than min_new_tokens tokens exist."""
    state = context_state(prompt)
    out: list[int] = []
    while len(out) < max_new_tokens:
        tok = next_token(state, vocab_size)
        out.append(tok)
        state = _absorb(state, tok)
        if len(out) > min_new_tokens and (tok in stop_ids or (stops is not None and stops(out))):
            break
    return out


@dataclass(slots=True)
class _SimRequest:
    prompt_len: int
    tokens: list[int]  # the whole sequence as far as the worker knows it
    state: int  # context_state(tokens)
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0


class SimulatedWorker:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        vocab_size: int,
        check_reads: bool = True,
        step_time_s: float = 0.0,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.check_reads = check_reads
        self.step_time_s = step_time_s
        self.slots: list[int] = [-1] * (num_pages * page_size)
        self.reqs: dict[str, _SimRequest] = {}
        self.steps = 0

    def _join(self, join: JoinRequest) -> None:
        if join.rid in self.reqs:
            raise SimulatedWorkerError(f"join of {join.rid}, which the worker already holds")
        tokens = list(join.prefix_ids)
        self.reqs[join.rid] = _SimRequest(
            join.prompt_len, tokens, context_state(tokens), kv_len=len(tokens)
        )

    def _slot(self, r: _SimRequest, pos: int, rid: str) -> int:
        page_size = self.page_size
        idx = pos // page_size
        if idx >= len(r.pages):
            raise SimulatedWorkerError(f"{rid}: position {pos} is past its {len(r.pages)} pages")
        page = r.pages[idx]
        if not 0 <= page < self.num_pages:
            raise SimulatedWorkerError(f"{rid}: page id {page} is outside the pool")
        return page * page_size + pos % page_size

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        for rid in plan.leaves:
            if self.reqs.pop(rid, None) is None:
                raise SimulatedWorkerError(f"leave of {rid}, which the worker does not hold")
        for join in plan.joins:
            self._join(join)
        outputs: list[RequestOutput] = []
        for e in plan.entries:
            r = self.reqs.get(e.rid)
            if r is None:
                raise SimulatedWorkerError(f"step {plan.step_id} schedules unknown {e.rid}")
            r.pages.extend(e.new_pages)
            if e.start_pos != r.kv_len:
                raise SimulatedWorkerError(
                    f"{e.rid}: plan starts at {e.start_pos}, the worker has KV up to {r.kv_len}"
                )
            if e.input_ids is None:
                if len(r.tokens) != r.kv_len + 1:
                    raise SimulatedWorkerError(f"{e.rid}: decode without a sampled token")
                inputs = [r.tokens[-1]]
            else:
                inputs = e.input_ids
                if len(r.tokens) != r.kv_len:
                    raise SimulatedWorkerError(f"{e.rid}: prefill after a sampled token")
                r.tokens.extend(inputs)
                r.state = context_state(inputs, r.state)
            if self.check_reads:
                self._check_context(e.rid, r, e.start_pos)
            slots = self.slots
            for i, tok in enumerate(inputs):
                slots[self._slot(r, e.start_pos + i, e.rid)] = tok
            r.kv_len = e.start_pos + len(inputs)
            if e.sample:
                tok = next_token(r.state, self.vocab_size)
                r.tokens.append(tok)
                r.state = _absorb(r.state, tok)
                outputs.append(RequestOutput(e.rid, tok, TokenLogprobs(logprob=-1.0)))
            else:
                outputs.append(RequestOutput(e.rid, None))
        self.steps += 1
        if self.step_time_s:
            remaining = self.step_time_s - (time.perf_counter() - t0)
            if remaining > 0:
                time.sleep(remaining)
        return StepResult(plan.step_id, outputs, forward_ms=(time.perf_counter() - t0) * 1e3)

    def _check_context(self, rid: str, r: _SimRequest, upto: int) -> None:
        """The KV read for positions [0, upto) must be the request's own tokens."""
        slots = self.slots
        for pos in range(upto):
            got = slots[self._slot(r, pos, rid)]
            if got != r.tokens[pos]:
                raise SimulatedWorkerError(
                    f"{rid}: KV at position {pos} holds token {got}, expected {r.tokens[pos]} "
                    "(page reused or misnamed)"
                )
