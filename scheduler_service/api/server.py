"""The scheduler service: the API process's gRPC server in front of the core
process (spawned here) and its worker group."""

from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from observability import health_port, tracing
from scheduler_service.api.auth import ApiKeyFileError, ApiKeyInterceptor, load_api_keys
from scheduler_service.api.core_client import CoreClient, CoreUnavailable
from scheduler_service.api.core_supervisor import CoreSupervisor
from scheduler_service.api.decode_guard import DecodeGuard
from scheduler_service.api.drain import drain
from scheduler_service.api.grammar_check import GrammarChecker
from scheduler_service.api.metrics import SchedulerMetrics, start_metrics
from scheduler_service.api.model_info import ModelContext
from scheduler_service.api.readiness import Readiness
from scheduler_service.api.servicer import SchedulerServicer
from scheduler_service.config import TRACING_SERVICE_NAME, ServiceConfig
from scheduler_service.tls import TlsConfigError, public_server_credentials

logger = structlog.get_logger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SglangScheduler"].full_name

# What stops the service at start with a message, not a traceback: a bad TLS or
# key file, or a worker group that cannot be reached (e.g. refused handshake).
STARTUP_ERRORS = (TlsConfigError, ApiKeyFileError, CoreUnavailable)


# Once the drain is over, what RPCs are left (an Abort, a GetLoads; the KV
# event and health Watch streams, which never end by themselves) get this long.
STOP_GRACE_S = 0.5


async def serve(
    config: ServiceConfig, stop: asyncio.Event | None = None, force: asyncio.Event | None = None
) -> None:
    """Run until ``stop`` is set (or SIGINT/SIGTERM), then drain and shut down
    (drain.py); ``force`` (or a second signal) cuts the drain short."""
    if stop is None:
        stop, force = _stop_on_signals()
    force = force or asyncio.Event()
    api = config.api
    # Security files first: a bad one stops the service before the core starts.
    credentials = public_server_credentials(config.security)
    interceptors = []
    if config.security.api_key_file:
        digests = load_api_keys(config.security.api_key_file)
        interceptors.append(ApiKeyInterceptor(SERVICE_NAME, digests))
        logger.info("API keys required on the public API", keys=len(digests))
    tracing.setup_tracing(TRACING_SERVICE_NAME)
    core = CoreClient(config)
    supervisor = CoreSupervisor(core, config)
    grammars = None
    workdir = Path(tempfile.mkdtemp(prefix="radixserve-"))
    try:
        ready = await supervisor.start()
        model = ModelContext.build(ready, config, workdir)
        metrics = SchedulerMetrics(core) if api.metrics_port is not None else None
        grammars = GrammarChecker(config, ready.sampling_worker) if ready.sampling_worker else None
        servicer = SchedulerServicer(core, model, metrics, grammars)
        limit = config.limits.max_message_mb << 20
        server = grpc.aio.server(
            # after the API key check: garbage without a key is UNAUTHENTICATED
            interceptors=[*interceptors, DecodeGuard(SERVICE_NAME, metrics)],
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                ("grpc.keepalive_permit_without_calls", 1),
            ],
        )
        pb_grpc.add_SglangSchedulerServicer_to_server(servicer, server)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        address = f"{api.host}:{api.port}"
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
        await server.start()
        health_server = None
        if api.health_port is not None:
            health_server = await health_port.start_aio(health, api.host, api.health_port)
        if metrics is not None:
            start_metrics(api.metrics_port, api.host, metrics)
        readiness = Readiness(health, core, ("", SERVICE_NAME))
        await readiness.start()
        if api.port_file:
            Path(api.port_file).write_text(str(port))
        logger.info(
            "scheduler serving",
            port=port,
            model=model.served_model_name,
            pages=ready.num_pages,
            page_size=ready.page_size,
            tls=credentials is not None,
            worker_mutual_tls=config.security.worker_tls_ca is not None,
        )
        print(f"radixserve-scheduler listening on {api.host}:{port}", flush=True)
        await stop.wait()
        logger.info("shutting down")
        servicer.begin_shutdown()
        await readiness.drain()
        await drain(core, api.drain_timeout_s, force)
        servicer.admin.publisher.close()
        await readiness.stop()
        await server.stop(grace=STOP_GRACE_S)
        if health_server is not None:
            await health_server.stop(grace=None)
    finally:
        if grammars is not None:
            await grammars.close()
        supervisor.stop()  # the core process flushes its spans as it exits
        tracing.shutdown_tracing()
        shutil.rmtree(workdir, ignore_errors=True)


def _stop_on_signals() -> tuple[asyncio.Event, asyncio.Event]:
    """(stop, force): the first SIGINT/SIGTERM starts the drain, a second one
    ends it at once."""
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            force.set()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    return stop, force
