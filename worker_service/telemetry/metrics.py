"""The worker's Prometheus metrics: per-step time and batch size, busy and
idle time, the scheduler's stream state, refused calls, the host KV tier's
copies (see docs/observability.md)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from observability.histograms import (
    BATCH_REQUESTS,
    BATCH_TOKENS,
    STEP_LATENCY_S,
    HistogramCollector,
)
from protos import worker_pb2 as pb

MODES = {
    pb.FORWARD_MODE_PREFILL: "prefill",
    pb.FORWARD_MODE_DECODE: "decode",
    pb.FORWARD_MODE_MIXED: "mixed",
    pb.FORWARD_MODE_IDLE: "idle",
}


class FileCounts(NamedTuple):
    """The file tier's pages so far: read into the host pool, reads that
    found no whole file, written to files, writes that failed."""

    read: int
    read_failed: int
    written: int
    write_failed: int


class WorkerMetrics(Collector):
    def __init__(
        self,
        active_requests: Callable[[], int],
        kv_pages: int,
        *,
        host_pages: int = 0,
        host_page_bytes: int = 0,
        copy_timings: Callable[[], list[float]] | None = None,
        file_counts: Callable[[], FileCounts] | None = None,
    ) -> None:
        """``host_pages``, ``host_page_bytes``: the host tier's pool and the
        bytes of one page (every layer); ``copy_timings``: seconds of the
        plans' copies finished since the last call (HostKvPool.take_timings);
        ``file_counts``: the file tier's counts so far (None: no file tier)."""
        self.histograms = HistogramCollector()
        self.step_s = {
            mode: self.histograms.add(
                "radixserve_worker_step_duration_seconds",
                "One step on this worker, plan in to result out.",
                STEP_LATENCY_S,
                {"mode": name},
            )
            for mode, name in MODES.items()
        }
        self.batch_requests = self.histograms.add(
            "radixserve_worker_batch_size_requests", "Requests per step.", BATCH_REQUESTS
        )
        self.batch_tokens = self.histograms.add(
            "radixserve_worker_batch_size_tokens", "Tokens computed per step.", BATCH_TOKENS
        )
        self.copy_s = self.histograms.add(
            "radixserve_worker_hicache_transfer_duration_seconds",
            "One plan's host-tier page copies (write-backs and loads), first to last.",
            STEP_LATENCY_S,
        )
        self.busy_s = 0.0
        self.idle_s = 0.0
        self._host_pages = host_pages
        self._host_page_bytes = host_page_bytes
        self._copy_timings = copy_timings
        self._file_counts = file_counts
        self.loaded_bytes = 0
        self.written_bytes = 0
        self.streams = 0
        self._active = active_requests
        self._kv_pages = kv_pages
        # (method, status code name) -> calls refused; written on gRPC threads
        self._refused: Counter[tuple[str, str]] = Counter()
        self._refused_lock = threading.Lock()

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(self.histograms)
        registry.register(self)

    def step(
        self, plan: pb.StepPlan, busy_s: float, idle_s: float, *, applied: bool = True
    ) -> None:
        """Account one step (a few microseconds, on the executing thread);
        ``applied``: the plan ran (its copies were made)."""
        self.busy_s += busy_s
        self.idle_s += idle_s
        if applied and (plan.write_back_host_pages or plan.load_host_pages):
            self.written_bytes += len(plan.write_back_host_pages) * self._host_page_bytes
            self.loaded_bytes += len(plan.load_host_pages) * self._host_page_bytes
        if self._copy_timings is not None:
            for seconds in self._copy_timings():
                self.copy_s.observe(seconds)
        hist = self.step_s.get(plan.mode)
        if hist is not None:
            hist.observe(busy_s)
        if plan.mode != pb.FORWARD_MODE_IDLE:
            self.batch_requests.observe(len(plan.extends) + len(plan.decode_slots))
            self.batch_tokens.observe(
                sum(len(e.input_ids) for e in plan.extends) + len(plan.decode_slots)
            )

    def refused(self, method: str, code: str) -> None:
        """A Worker call refused by the worker's guards (rpc/call_guard.py) or an
        Execute stream refused its session."""
        with self._refused_lock:
            self._refused[(method, code)] += 1

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        refused = CounterMetricFamily(
            "radixserve_worker_request_errors",
            "Worker calls refused: undecodable request bytes, a missing token, a full budget, "
            "a refused session.",
            labels=["method", "code"],
        )
        with self._refused_lock:
            counts = sorted(self._refused.items())
        for (method, code), n in counts:
            refused.add_metric([method, code], n)
        yield refused
        yield CounterMetricFamily(
            "radixserve_worker_busy_seconds", "Time inside steps.", value=self.busy_s
        )
        yield CounterMetricFamily(
            "radixserve_worker_idle_seconds",
            "Time waiting for the next plan while a scheduler is connected.",
            value=self.idle_s,
        )
        yield GaugeMetricFamily(
            "radixserve_worker_scheduler_connected",
            "1 while a scheduler's Execute stream is open.",
            value=1.0 if self.streams > 0 else 0.0,
        )
        yield GaugeMetricFamily(
            "radixserve_worker_requests_active",
            "Requests whose state this worker holds.",
            value=self._active(),
        )
        yield GaugeMetricFamily(
            "radixserve_worker_kv_pages_total", "KV pages on this rank.", value=self._kv_pages
        )
        if self._host_pages:
            yield GaugeMetricFamily(
                "radixserve_worker_hicache_host_pages_total",
                "KV pages of the host tier's pool on this rank.",
                value=self._host_pages,
            )
            yield CounterMetricFamily(
                "radixserve_worker_hicache_loaded_bytes",
                "KV bytes copied from the host tier to the device (loads).",
                value=self.loaded_bytes,
            )
            yield CounterMetricFamily(
                "radixserve_worker_hicache_written_bytes",
                "KV bytes copied from the device to the host tier (write-backs).",
                value=self.written_bytes,
            )
        if self._file_counts is not None:
            counts = self._file_counts()
            yield CounterMetricFamily(
                "radixserve_worker_hicache_file_reads",
                "KV pages read from the file tier into the host pool.",
                value=counts.read,
            )
            yield CounterMetricFamily(
                "radixserve_worker_hicache_file_read_failures",
                "File-tier reads that found no whole, checked file (a miss).",
                value=counts.read_failed,
            )
            yield CounterMetricFamily(
                "radixserve_worker_hicache_file_writes",
                "KV pages written from the host pool to the file tier.",
                value=counts.written,
            )
            yield CounterMetricFamily(
                "radixserve_worker_hicache_file_write_failures",
                "File-tier writes that failed (logged).",
                value=counts.write_failed,
            )
