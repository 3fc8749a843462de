"""The /metrics endpoint of a service: its own registry plus process metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server


def new_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


def serve_metrics(port: int, host: str, registry: CollectorRegistry) -> None:
    """Serve ``registry`` at http://host:port/metrics (a daemon thread)."""
    start_http_server(port, addr=host, registry=registry)
