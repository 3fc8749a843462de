"""Generation throughput (tokens/s) over a sliding window of load snapshots."""

from __future__ import annotations

import time
from collections import deque

from scheduler_service import ipc

WINDOW_S = 10.0


class Throughput:
    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()

    def observe(self, load: ipc.Load) -> None:
        now = time.monotonic()
        if self._samples and load.gen_tokens < self._samples[-1][1]:
            self._samples.clear()  # a restarted core counts from 0 again
        self._samples.append((now, load.gen_tokens))
        while self._samples and now - self._samples[0][0] > WINDOW_S:
            self._samples.popleft()

    def rate(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
