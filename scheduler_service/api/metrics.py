"""The scheduler's Prometheus metrics (names in docs/observability.md).

Latencies the client sees (TTFT, inter-token, end-to-end) and the request
and token counts are measured in the API process, where tokens leave; the
queue time histogram and the retraction and preemption counts come from the
core process inside its load snapshots; gauges read the latest snapshot at
scrape time. Nothing here runs unless --metrics-port is given.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from observability.histograms import REQUEST_LATENCY_S, STEP_LATENCY_S, HistogramCollector
from observability.metrics_server import new_registry, serve_metrics
from scheduler_service import ipc
from scheduler_service.api.core_client import CoreClient

FINISH_REASONS = ("stop", "length", "abort")
# gRPC status names a Generate call can end with (pre-created so rates exist at 0).
ERROR_CODES = (
    "INVALID_ARGUMENT",
    "UNAVAILABLE",
    "RESOURCE_EXHAUSTED",
    "UNAUTHENTICATED",
    "CANCELLED",
    "INTERNAL",
)


# Counters by label: (name, help, label, the attribute holding label -> count).
LABELLED_COUNTERS = (
    ("radixserve_requests", "Samples that finished, by reason.", "finish_reason", "finished"),
    (
        "radixserve_request_errors",
        "Generate calls that ended with an error status, by gRPC code.",
        "code",
        "errors",
    ),
    (
        "radixserve_lora_requests",
        "Samples accepted with a LoRA adapter, by lora_id.",
        "lora_id",
        "lora_samples",
    ),
    (
        "radixserve_lora_generation_tokens",
        "Tokens generated with a LoRA adapter, by lora_id.",
        "lora_id",
        "lora_generated",
    ),
)
# Counters the API process keeps: (name, help, attribute).
API_COUNTERS = (
    (
        "radixserve_prompt_tokens",
        "Prompt tokens of samples that got a token (counted when the call ends).",
        "prompt_tokens",
    ),
    ("radixserve_generation_tokens", "Tokens generated and sent.", "generation_tokens"),
    (
        "radixserve_cached_tokens",
        "Prompt tokens those samples read from the prefix cache, once.",
        "cached_tokens",
    ),
)
# Counters of the core's latest load snapshot (0 before the first):
# (name, help, ipc.Load field).
LOAD_COUNTERS = (
    (
        "radixserve_retractions",
        "Running requests sent back to wait for lack of KV memory.",
        "retractions",
    ),
    (
        "radixserve_preemptions",
        "Running requests preempted by higher-priority ones.",
        "preemptions",
    ),
    (
        "radixserve_worker_losses",
        "Times the worker group's streams broke (its KV cache dropped, requests requeued).",
        "worker_losses",
    ),
    (
        "radixserve_worker_recoveries",
        "Times a lost worker group came back and the interrupted requests resumed.",
        "worker_recoveries",
    ),
    ("radixserve_spec_verify_steps", "Steps that verified speculative drafts.", "spec_steps"),
    (
        "radixserve_spec_draft_tokens",
        "Drafted tokens sent to the worker for verification (speculative decoding).",
        "spec_draft_tokens",
    ),
    (
        "radixserve_spec_accepted_tokens",
        "Drafted tokens the worker accepted (each one a forward saved).",
        "spec_accepted_tokens",
    ),
    (
        "radixserve_hicache_loaded_tokens",
        "Host hits: cached tokens loaded from the host KV tier instead of computed.",
        "hicache_loaded_tokens",
    ),
    (
        "radixserve_hicache_written_tokens",
        "Cached tokens copied from the device to the host KV tier.",
        "hicache_written_tokens",
    ),
)


class SchedulerMetrics(Collector):
    def __init__(self, core: CoreClient) -> None:
        self.core = core
        self.histograms = HistogramCollector()
        h = self.histograms.add
        self.ttft = h(
            "radixserve_time_to_first_token_seconds",
            "Generate received to the sample's first token sent.",
            REQUEST_LATENCY_S,
        )
        self.itl = h(
            "radixserve_inter_token_latency_seconds",
            "Time between a sample's successive tokens.",
            STEP_LATENCY_S,
        )
        self.e2e = h(
            "radixserve_e2e_request_latency_seconds",
            "Generate received to the sample's last token sent.",
            REQUEST_LATENCY_S,
        )
        self.queue = h(
            "radixserve_queue_time_seconds",
            "Arrival in the scheduler to first admission.",
            REQUEST_LATENCY_S,
        )
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.errors = dict.fromkeys(ERROR_CODES, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        # Per LoRA adapter (lora_id): samples accepted, tokens generated.
        self.lora_samples: dict[str, int] = {}
        self.lora_generated: dict[str, int] = {}
        core.on_load(self._take_load)

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(self.histograms)
        registry.register(self)

    def _take_load(self, load: ipc.Load) -> None:
        if load.queue_time is not None:
            self.queue.restore(load.queue_time)

    def lora_request(self, lora_id: str, samples: int) -> None:
        self.lora_samples[lora_id] = self.lora_samples.get(lora_id, 0) + samples

    def lora_tokens(self, lora_id: str, n: int) -> None:
        self.lora_generated[lora_id] = self.lora_generated.get(lora_id, 0) + n

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        for name, doc, label, attr in LABELLED_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=[label])
            for key, n in getattr(self, attr).items():
                c.add_metric([key], n)
            yield c
        for name, doc, attr in API_COUNTERS:
            yield CounterMetricFamily(name, doc, getattr(self, attr))
        yield CounterMetricFamily(
            "radixserve_core_restarts",
            "Times a dead core process was replaced by one that serves (the core's own "
            "counters start over with it).",
            self.core.restarts,
        )
        load = self.core.load
        ready = self.core.ready

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        for name, doc, field in LOAD_COUNTERS:
            yield CounterMetricFamily(name, doc, getattr(load, field) if load else 0)
        yield gauge(
            "radixserve_requests_running",
            "Requests being prefilled or decoded.",
            load.running if load else 0,
        )
        yield gauge(
            "radixserve_requests_waiting",
            "Requests waiting for admission.",
            load.waiting if load else 0,
        )
        page = ready.page_size if ready else 1
        yield gauge(
            "radixserve_kv_pages_used",
            "KV pages held by requests (not counting evictable cache).",
            load.used_tokens // page if load else 0,
        )
        yield gauge(
            "radixserve_kv_pages_total",
            "KV pages in the pool.",
            ready.num_pages if ready else 0,
        )
        yield gauge("radixserve_kv_page_size_tokens", "Tokens per KV page.", page)
        yield gauge(
            "radixserve_hicache_host_pages_used",
            "Pages of the host KV tier's pool holding KV (0 without the tier).",
            load.hicache_host_pages_used if load else 0,
        )
        yield gauge(
            "radixserve_hicache_host_pages_total",
            "Pages in the host KV tier's pool (0 without the tier).",
            load.hicache_host_pages_total if load else 0,
        )
        yield gauge(
            "radixserve_cache_hit_ratio",
            "Cached over prompt tokens since start.",
            load.cache_hit_rate if load else 0.0,
        )
        connected = GaugeMetricFamily(
            "radixserve_worker_connected",
            "1 while the worker's stream is up.",
            labels=["worker"],
        )
        up = 1.0 if ready is not None and not self.core.failed else 0.0
        if load is not None and not load.worker_connected:
            up = 0.0  # lost, being reconnected
        for address in self.core.config.workers:
            connected.add_metric([address], up)
        yield connected


def start_metrics(port: int, host: str, metrics: SchedulerMetrics) -> CollectorRegistry:
    registry = new_registry()
    metrics.register(registry)
    serve_metrics(port, host, registry)
    return registry
