"""How long to wait before restarting a process that died: the same policy
for `radixserve serve`'s worker groups and the API process's core.

The first restart waits ``first_s``; each one after a short life doubles
the wait up to ``max_s``, so a process that dies at once over and over
neither spins nor hammers what it connects to; one that stayed up
``stable_s`` was healthy, and its next restart starts the backoff over.
"""

from __future__ import annotations

from dataclasses import dataclass

RESTART_FIRST_S = 1.0
RESTART_MAX_S = 30.0
STABLE_S = 60.0


@dataclass
class RestartBackoff:
    first_s: float = RESTART_FIRST_S
    max_s: float = RESTART_MAX_S
    stable_s: float = STABLE_S
    _next_s: float = 0.0  # 0: the next restart is the first

    def delay(self, up_for_s: float) -> float:
        """The wait before restarting something that died after ``up_for_s``
        seconds up (0 for an attempt that never came up)."""
        if not self._next_s or up_for_s >= self.stable_s:
            self._next_s = self.first_s
        wait = self._next_s
        self._next_s = min(wait * 2, self.max_s)
        return wait
