"""How long the core waits for a worker's answer before it counts the group
as lost (a hung worker: a stopped process, a GPU kernel that never returns).

The deadline is fixed (``--worker-step-timeout``) or, by default, derived:
max(FLOOR_S, FACTOR x the p99 of the last WINDOW waits for a step result,
the step's tokens x the seconds a token may take). The floor covers what a
short history cannot foresee (a kernel compiled on first use); the derived
part follows a slow deployment upwards; the per-token part lets a step far
bigger than the usual ones take its time: FACTOR x the p99 seconds per
token of the recent steps of at least PER_TOKEN_MIN_TOKENS tokens, and
never less than PRIOR_S_PER_TOKEN (before any such step was seen). On 2
busy CPU cores the default model prefilled a prompt at its 8192-token
context in one step of 190 s (two together: 260 and 400 s); at 60 s such a
step was declared hung, the group was dropped and re-prefilled, three
times, and every other request with it. A watchdog thread enforces it: the waiting thread only
arms and disarms it (two attribute writes per step), and past the deadline
the watchdog calls ``on_expiry`` (the group cancels its streams, so the wait
ends at once with the reason).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

FLOOR_S = 60.0
FACTOR = 20.0
PRIOR_S_PER_TOKEN = 0.05  # 20 tokens/s: below the CPU worker's long prefills measured
PER_TOKEN_MIN_TOKENS = 32  # steps this big tell the cost of a token (not of a step)
WINDOW = 1024
RECOMPUTE_EVERY = 64  # waits between two p99 computations
TICK_S = 0.05  # the watchdog's resolution


class StepDeadline:
    def __init__(self, fixed_s: float = 0.0) -> None:
        """``fixed_s`` > 0: that deadline; 0: derived from the observed waits."""
        self.fixed_s = fixed_s
        self._waits: list[float] = []
        self._next = 0  # ring position once the window is full
        self._count = 0
        self.current_s = fixed_s if fixed_s > 0 else FLOOR_S
        self._per_token: list[float] = []  # seconds per token of big steps, a ring
        self._next_per_token = 0
        self.per_token_s = PRIOR_S_PER_TOKEN

    def for_step(self, tokens: int) -> float:
        """The deadline for a step computing ``tokens`` tokens."""
        if self.fixed_s > 0:
            return self.fixed_s
        return max(self.current_s, tokens * self.per_token_s)

    def observe(self, waited_s: float, tokens: int = 0) -> None:
        if self.fixed_s > 0:
            return
        _ring_put(self._waits, waited_s, self._next)
        self._next = (self._next + 1) % WINDOW
        if tokens >= PER_TOKEN_MIN_TOKENS:
            _ring_put(self._per_token, waited_s / tokens, self._next_per_token)
            self._next_per_token = (self._next_per_token + 1) % WINDOW
        self._count += 1
        if self._count % RECOMPUTE_EVERY == 0:
            self.current_s = max(FLOOR_S, FACTOR * _p99(self._waits))
            if self._per_token:
                self.per_token_s = max(PRIOR_S_PER_TOKEN, FACTOR * _p99(self._per_token))


def _ring_put(ring: list[float], value: float, at: int) -> None:
    """Append until WINDOW long, then overwrite the oldest (``at``)."""
    if len(ring) < WINDOW:
        ring.append(value)
    else:
        ring[at] = value


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


class Watchdog:
    """One daemon thread; ``arm`` before a wait, ``disarm`` after it."""

    def __init__(self, on_expiry: Callable[[str, float], None]) -> None:
        """``on_expiry(what, timeout_s)`` runs on the watchdog's thread."""
        self._on_expiry = on_expiry
        self._due = 0.0  # monotonic time; 0: disarmed
        self._what = ""
        self._timeout_s = 0.0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._thread.start()

    def arm(self, timeout_s: float, what: str) -> None:
        self._what = what
        self._timeout_s = timeout_s
        self._due = time.monotonic() + timeout_s

    def disarm(self) -> None:
        self._due = 0.0

    def close(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(TICK_S):
            due = self._due
            if due and time.monotonic() > due and self._due == due:
                self._due = 0.0
                self._on_expiry(self._what, self._timeout_s)
