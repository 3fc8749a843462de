"""A plaintext port that serves grpc.health.v1 and nothing else.

Kubelet's gRPC probes cannot use TLS, so a service whose own port does TLS
(the scheduler's public API, a worker under mutual TLS) also answers health
checks here. It shares the service's health servicer, so it reports exactly
what the main port reports, and nothing but health is reachable through it.
"""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2_grpc


def start_sync(servicer: object, host: str, port: int) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise SystemExit(f"cannot bind the health port {host}:{port}")
    server.start()
    return server


async def start_aio(servicer: object, host: str, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise SystemExit(f"cannot bind the health port {host}:{port}")
    await server.start()
    return server
