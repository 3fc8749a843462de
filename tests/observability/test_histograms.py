from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from observability.histograms import Histogram, HistogramCollector


def test_buckets_are_upper_inclusive_and_cumulative():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        h.observe(v)
    h.observe_many(0.2, 3)
    assert h.counts == [2, 5, 1]
    assert h.count == 8
    assert h.sum == pytest.approx(0.05 + 0.1 + 0.5 + 1.0 + 7.0 + 0.6)
    assert h.cumulative() == [("0.1", 2), ("1.0", 7), ("+Inf", 8)]


def test_snapshot_restores_and_refuses_other_buckets():
    a, b = Histogram((1, 2)), Histogram((1, 2))
    a.observe(1.5)
    b.restore(a.snapshot())
    assert b.counts == a.counts and b.sum == a.sum
    with pytest.raises(ValueError):
        Histogram((1,)).restore(a.snapshot())


def test_collector_exports_prometheus_histograms_with_labels():
    c = HistogramCollector()
    fast = c.add("x_seconds", "doc", (0.5,), {"mode": "fast"})
    slow = c.add("x_seconds", "doc", (0.5,), {"mode": "slow"})
    fast.observe(0.1)
    slow.observe(2.0)
    with pytest.raises(ValueError):
        c.add("x_seconds", "doc", (0.5,), {"other": "label"})
    registry = CollectorRegistry()
    registry.register(c)
    text = generate_latest(registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("x_seconds_bucket", (("le", "0.5"), ("mode", "fast")))] == 1
    assert samples[("x_seconds_bucket", (("le", "0.5"), ("mode", "slow")))] == 0
    assert samples[("x_seconds_count", (("mode", "slow"),))] == 1
    assert samples[("x_seconds_sum", (("mode", "slow"),))] == 2.0
