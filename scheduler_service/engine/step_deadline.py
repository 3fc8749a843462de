"""How long the core waits for a worker's answer before it counts the group
as lost (a hung worker: a stopped process, a GPU kernel that never returns).

The deadline is fixed (``--worker-step-timeout``) or, by default, derived:
max(FLOOR_S, FACTOR x the p99 of the last WINDOW waits for a step result).
The floor covers what a short history cannot foresee (the first long prefill
chunk, a kernel compiled on first use); the derived part follows a slow
deployment upwards. A watchdog thread enforces it: the waiting thread only
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

    def observe(self, waited_s: float) -> None:
        if self.fixed_s > 0:
            return
        if len(self._waits) < WINDOW:
            self._waits.append(waited_s)
        else:
            self._waits[self._next] = waited_s
            self._next = (self._next + 1) % WINDOW
        self._count += 1
        if self._count % RECOMPUTE_EVERY == 0:
            ordered = sorted(self._waits)
            p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
            self.current_s = max(FLOOR_S, FACTOR * p99)


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
