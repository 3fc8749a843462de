"""Histograms cheap enough to observe per token, and their Prometheus export.

prometheus_client's Histogram takes a lock and walks its buckets on every
observation; at tens of thousands of tokens a second that shows. These keep
per-bucket counts found by bisection (one writer per histogram) and are
exported by ``HistogramCollector`` at scrape time. A histogram can also be
filled from a snapshot taken in another process (the scheduler's core).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

# Seconds: from a millisecond to tens of minutes (TTFT, end-to-end, queue).
REQUEST_LATENCY_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# Seconds: one step or the gap between two tokens.
STEP_LATENCY_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04,
    0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
BATCH_REQUESTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
BATCH_TOKENS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class Histogram:
    """Counts per bucket (upper bounds inclusive, then +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_many(self, value: float, times: int) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> tuple[tuple[int, ...], float]:
        return tuple(self.counts), self.sum

    def restore(self, snapshot: tuple[Sequence[int], float]) -> None:
        counts, total = snapshot
        if len(counts) != len(self.counts):
            raise ValueError("snapshot of a histogram with other buckets")
        self.counts = list(counts)
        self.sum = total

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


class HistogramCollector(Collector):
    """Exports registered histograms; one family per name, label sets as members."""

    def __init__(self) -> None:
        self._families: dict[
            str, tuple[str, tuple[str, ...], dict[tuple[str, ...], Histogram]]
        ] = {}

    def add(
        self,
        name: str,
        doc: str,
        bounds: Sequence[float],
        labels: dict[str, str] | None = None,
    ) -> Histogram:
        labels = labels or {}
        label_names = tuple(labels)
        have = self._families.setdefault(name, (doc, label_names, {}))
        if have[1] != label_names:
            raise ValueError(f"{name}: label names {label_names} differ from {have[1]}")
        hist = Histogram(bounds)
        have[2][tuple(labels.values())] = hist
        return hist

    def collect(self) -> Iterator[HistogramMetricFamily]:
        for name, (doc, label_names, members) in self._families.items():
            family = HistogramMetricFamily(name, doc, labels=list(label_names))
            for values, hist in members.items():
                family.add_metric(list(values), hist.cumulative(), hist.sum)
            yield family
