"""Prometheus metrics on --metrics-port (the observability issue extends them).

Gauges are read from the latest load snapshot the core sent, at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from scheduler_service.hub import Hub


def start_metrics(port: int, host: str, hub: Hub) -> CollectorRegistry:
    registry = CollectorRegistry()

    def gauge(name: str, doc: str, read) -> None:
        g = Gauge(name, doc, registry=registry)
        g.set_function(lambda: read(hub.load) if hub.load is not None else 0.0)

    gauge(
        "radixserve_running_requests", "Requests being prefilled or decoded.", lambda s: s.running
    )
    gauge("radixserve_waiting_requests", "Requests waiting to be admitted.", lambda s: s.waiting)
    gauge("radixserve_kv_used_tokens", "KV cache tokens held by requests.", lambda s: s.used_tokens)
    gauge("radixserve_kv_total_tokens", "KV cache tokens in all.", lambda s: s.total_tokens)
    gauge(
        "radixserve_cache_hit_rate",
        "Prompt tokens served from the prefix cache, as a share.",
        lambda s: s.cache_hit_rate,
    )
    gauge("radixserve_generated_tokens", "Tokens generated since start.", lambda s: s.gen_tokens)
    gauge(
        "radixserve_worker_busy_seconds",
        "Time the worker spent in steps.",
        lambda s: s.worker_busy_ms / 1e3,
    )
    start_http_server(port, addr=host, registry=registry)
    return registry
