"""A running request's speculative-decoding state: its adaptive draft
length and its draft sources' scratch (docs/design.md, "Speculative
decoding").

The draft length k adapts to what the worker accepted:

- a request starts *dormant* (k = 0) and wakes once a source has a match
  for its known tokens: k = START_K (half the default maximum: a first
  draft's acceptance is unknown, and a wrong one wastes k rows of compute;
  a fully accepted one doubles k at once);
- all k drafts accepted: k doubles (up to the maximum); some accepted:
  k = accepted + 1; none: k halves (at least 1);
- FRUITLESS_LIMIT steps in a row with no draft accepted or no source
  match: dormant again, for a backoff that doubles each time a waking led
  to nothing accepted (BACKOFF_MIN .. BACKOFF_MAX steps) and then a probe
  of PROBE_K drafts; an accepted draft resets the backoff;
- a dormant request whose sources have no match looks again after
  RECHECK_MIN steps, then twice as long each time up to RECHECK_MAX (a
  dictionary lookup and the index catch-up; no drafts, no draining).

So random text never drafts and keeps full overlap (a dormant request does
not drain the pipeline), and text that repeats drafts up to the maximum.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

START_K = 4
PROBE_K = 2
FRUITLESS_LIMIT = 2
BACKOFF_MIN = 8
BACKOFF_MAX = 256
RECHECK_MIN = 8
RECHECK_MAX = 64


@dataclass(slots=True)
class SpecState:
    max_draft: int
    k: int = 0  # the draft length wanted now; 0: dormant
    wake_at: int = 0  # the scheduler step at which a dormant request looks again
    backoff: int = BACKOFF_MIN
    recheck: int = RECHECK_MIN
    fruitless: int = 0  # steps in a row with no draft accepted
    accepted_since_wake: bool = False
    inflight: int = 0  # drafts of the plan in flight (kv_len counts them)
    watch: int = 0  # its live entry in the DraftWatch heap (0: active or none)
    # --- the draft sources' scratch (drafts.py) ---
    lookup: Any = None  # PromptLookup, built at the first proposal
    radix_cont: array | None = None  # continuation copied from the cache
    radix_base: int = 0  # the sequence length it continues from
    radix_retry_at: int = 0  # no cache walk before the sequence is this long
    radix_backoff: int = 4

    def wake(self) -> None:
        """A source has a match: draft again."""
        first = self.backoff == BACKOFF_MIN
        self.k = min(START_K if first else PROBE_K, self.max_draft)
        self.fruitless = 0 if first else FRUITLESS_LIMIT - 1  # a probe gets one try
        self.accepted_since_wake = False
        self.recheck = RECHECK_MIN

    def recheck_later(self, step: int) -> None:
        """Dormant, and no source has a match: look again later."""
        self.wake_at = step + self.recheck
        self.recheck = min(2 * self.recheck, RECHECK_MAX)

    def no_match(self, step: int) -> None:
        """The request wanted drafts but no source had any."""
        self._fruitless(step)

    def verified(self, k: int, accepted: int, step: int) -> None:
        """The worker accepted ``accepted`` of ``k`` drafts."""
        if accepted == 0:
            self.k = max(1, self.k // 2)
            self._fruitless(step)
            return
        self.fruitless = 0
        self.accepted_since_wake = True
        self.backoff = BACKOFF_MIN
        self.k = min(2 * k if accepted == k else accepted + 1, self.max_draft)

    def _fruitless(self, step: int) -> None:
        self.fruitless += 1
        if self.fruitless < FRUITLESS_LIMIT:
            return
        if not self.accepted_since_wake:
            self.backoff = min(2 * self.backoff, BACKOFF_MAX)
        self.k = 0
        self.fruitless = 0
        self.wake_at = step + self.backoff


__all__ = ["SpecState"]
