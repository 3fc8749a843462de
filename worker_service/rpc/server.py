"""The worker's gRPC server: Worker service, grpc.health.v1 and reflection."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.worker_token import TokenCheck, TokenFileError, read_token
from observability import health_port, tracing
from observability.metrics_server import new_registry, serve_metrics
from protos import worker_pb2, worker_pb2_grpc
from worker_service.config import WorkerConfig
from worker_service.rpc.call_budget import worker_threads
from worker_service.rpc.call_guard import WorkerCallGuard
from worker_service.rpc.servicer import WorkerServicer
from worker_service.telemetry.metrics import WorkerMetrics
from worker_service.telemetry.step_tracing import StepTracer
from worker_service.worker import Worker

logger = structlog.get_logger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name

# The scheduler pings its worker channels every --worker-keepalive seconds
# (busy or idle) to notice a worker that stopped answering: accept that, however
# often. The worker pings back less often to drop streams of a scheduler that
# vanished without closing them.
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
)


def serve(worker: Worker) -> tuple[grpc.Server, int]:
    """Start serving; returns the server and the port it bound."""
    cfg = worker.config
    metrics = None
    if cfg.metrics_port is not None:
        host_kv = getattr(worker.runner.compute, "host_kv", None)
        metrics = WorkerMetrics(
            lambda: len(worker.runner.slots),
            worker.num_pages,
            host_pages=worker.num_host_pages,
            host_page_bytes=host_kv.bytes_per_page if host_kv is not None else 0,
            copy_timings=host_kv.take_timings if host_kv is not None else None,
            file_counts=worker.runner.files.counts if worker.runner.files is not None else None,
        )
        registry = new_registry()
        metrics.register(registry)
        serve_metrics(cfg.metrics_port, cfg.host, registry)
    tracer = StepTracer(worker.tp.rank) if tracing.configured() else None
    limit = cfg.max_message_mb << 20
    token = None
    if cfg.worker_token_file:
        try:
            token = TokenCheck(read_token(cfg.worker_token_file))
        except TokenFileError as e:
            raise SystemExit(str(e)) from e
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=worker_threads(cfg.grammar_compile_queue)),
        interceptors=[WorkerCallGuard(SERVICE_NAME, token, metrics)],
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            *KEEPALIVE_OPTIONS,
        ],
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(worker, metrics, tracer), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    credentials = _server_credentials(cfg)
    if credentials is None:
        port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    else:
        port = server.add_secure_port(f"{cfg.host}:{cfg.port}", credentials)
    if port == 0:
        raise SystemExit(f"cannot bind {cfg.host}:{cfg.port}")
    server.start()
    if cfg.health_port is not None:
        # Held by the main server: a grpc.Server that is garbage collected stops.
        server.health_server = health_port.start_sync(health_servicer, cfg.host, cfg.health_port)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if cfg.port_file:
        Path(cfg.port_file).write_text(str(port))
    logger.info(
        "worker serving",
        host=cfg.host,
        port=port,
        rank=worker.tp.rank,
        mutual_tls=credentials is not None,
        token=token is not None,
    )
    if credentials is None and token is None:
        logger.warning(
            "no mutual TLS and no --worker-token-file: any caller that reaches this port "
            "can drive the worker (keep it on a private network)"
        )
    return server, port


def _server_credentials(cfg: WorkerConfig) -> grpc.ServerCredentials | None:
    """Mutual TLS: a scheduler without a certificate from the CA is refused in
    the handshake, before any RPC (the worker trusts whatever plan it is sent)."""
    if not cfg.worker_tls_ca:
        return None

    def read(path: str | None, flag: str) -> bytes:
        try:
            data = Path(path or "").read_bytes()
        except OSError as e:
            raise SystemExit(f"{flag} {path}: cannot read it: {e.strerror or e}") from e
        if not data.strip():
            raise SystemExit(f"{flag} {path} is empty")
        return data

    return grpc.ssl_server_credentials(
        [
            (
                read(cfg.worker_tls_key, "--worker-tls-key"),
                read(cfg.worker_tls_cert, "--worker-tls-cert"),
            )
        ],
        root_certificates=read(cfg.worker_tls_ca, "--worker-tls-ca"),
        require_client_auth=True,
    )
