"""Test drafters and a recording worker for the speculative-decoding tests.

``OracleDrafter`` knows the simulated model's rule, so it can propose drafts
that are right, wrong, or right for a chosen number of tokens and then wrong;
``RecordingWorker`` checks that the simulated worker accepted exactly that
many and records every (draft_len, accepted) it saw.
"""

from __future__ import annotations

import random

from common.simulated_model import absorb, initial_state, token_of
from scheduler_service.core.plan import StepPlan, StepResult
from scheduler_service.core.request import Request
from scheduler_service.core.spec.state import SpecState
from scheduler_service.testing.simulated_worker import SimulatedWorker


def true_next(req: Request, k: int, vocab: int) -> list[int]:
    """The simulated model's next k tokens after req's known tokens."""
    h = absorb(initial_state(req.adapter), req.all_token_ids())
    out = []
    for _ in range(k):
        t = token_of(h, vocab)
        out.append(t)
        h = absorb(h, (t,))
    return out


class OracleDrafter:
    """mode "right": every draft right; "wrong": every draft wrong; "mixed":
    right for a random number of tokens 0..k, then wrong."""

    def __init__(self, vocab: int, mode: str = "mixed", seed: int = 0) -> None:
        self.vocab = vocab
        self.mode = mode
        self.rng = random.Random(seed)
        self.intended: dict[tuple[str, int], int] = {}  # (rid, tokens) -> right drafts
        self.calls = 0

    def propose(self, req: Request, state: SpecState, k: int) -> list[int]:
        self.calls += 1
        true = true_next(req, k, self.vocab)
        if self.mode == "right":
            a = k
        elif self.mode == "wrong":
            a = 0
        else:
            a = self.rng.randint(0, k)
        self.intended[(req.rid, req.num_tokens)] = a
        return true[:a] + [(t + 1) % self.vocab for t in true[a:]]


class RecordingWorker(SimulatedWorker):
    def __init__(self, *args, drafter: OracleDrafter | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drafter = drafter
        self.verified: list[tuple[int, int]] = []  # (draft_len, accepted)
        self.max_new: dict[str, int] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for join in plan.joins:
            self.max_new[join.rid] = join.sampling.max_new_tokens
        for e in plan.entries:
            r = self.reqs.get(e.rid)
            if e.draft_len and r is not None:
                # k + 1 tokens may come back: they must fit max_new_tokens.
                outputs = len(r.tokens) - r.prompt_len
                assert outputs + e.draft_len + 1 <= self.max_new[e.rid], (e.rid, outputs)
        result = super().execute(plan)
        by_rid = {o.rid: o for o in result.outputs}
        for e in plan.entries:
            if not e.draft_len:
                continue
            out = by_rid[e.rid]
            accepted = len(out.more_tokens or ())
            self.verified.append((e.draft_len, accepted))
            if self.drafter is not None:
                intended = self.drafter.intended[(e.rid, e.start_pos + 1)]
                assert accepted == min(intended, e.draft_len), (e.rid, accepted, intended)
        return result
