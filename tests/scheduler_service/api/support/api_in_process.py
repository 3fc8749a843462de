"""The API process's parts, wired as scheduler_service/api/server.py wires
them, in this process: a grpc.aio server on a loopback port (the servicer,
the decode guard, grpc.health.v1 with the readiness updater), the
CoreSupervisor and CoreClient, and a PipeCore (pipe_core.py) for the core.

An in-process gRPC server is not a server process: it starts no process and
dies with the test, so these tests run in `make test-fast`.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common.restart_backoff import RestartBackoff
from scheduler_service import ipc
from scheduler_service.api.core_client import CoreClient
from scheduler_service.api.core_supervisor import CoreSupervisor
from scheduler_service.api.decode_guard import DecodeGuard
from scheduler_service.api.drain import DrainResult, drain
from scheduler_service.api.metrics import SchedulerMetrics
from scheduler_service.api.model_info import ModelContext
from scheduler_service.api.readiness import Readiness
from scheduler_service.api.server import SERVICE_NAME
from scheduler_service.api.servicer import SchedulerServicer
from scheduler_service.config import LimitsConfig, PublicApiConfig, ServiceConfig
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.sampling import SamplingParams
from tests.scheduler_service.api.support.pipe_core import PipeCore, ready

WAIT_S = 5.0


@dataclass(frozen=True)
class Submitted:
    """What the core learns of one sample from a Submit. The one place that
    reads ``ipc.Submit``'s records, so a change of what crosses the pipe
    changes only this and ``submitted``."""

    rid: str
    prompt_ids: list[int]
    waits_for: str | None
    sampling: SamplingParams

    @property
    def reasoning_end_token(self) -> int | None:
        """require_reasoning's end-of-reasoning token."""
        return self.sampling.reasoning_end_token


def submitted(msg: ipc.Submit) -> list[Submitted]:
    return [Submitted(s.rid, list(s.prompt_ids), s.waits_for, s.sampling) for s in msg.submissions]


def generate_request(
    rid: str,
    ids: tuple[int, ...] = (1, 2, 3),
    max_new: int = 4,
    n: int = 1,
    stream: bool = True,
    *,
    priority: int | None = None,
) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=list(ids)), stream=stream
    )
    req.sampling_params.temperature = 0.0
    req.sampling_params.max_new_tokens = max_new
    req.sampling_params.n = n
    if priority is not None:
        req.sampling_params.custom_params.update({"priority": priority})
    req.logprob_start_len = -1
    return req


@dataclass
class Api:
    client: CoreClient
    supervisor: CoreSupervisor
    servicer: SchedulerServicer
    metrics: SchedulerMetrics
    readiness: Readiness
    server: grpc.aio.Server
    address: str
    channel: grpc.aio.Channel
    cores: list[PipeCore]

    @property
    def core(self) -> PipeCore:
        """The current core (the latest spawned)."""
        return self.cores[-1]

    @property
    def stub(self) -> pb_grpc.SglangSchedulerStub:
        return pb_grpc.SglangSchedulerStub(self.channel)

    async def health(self, service: str = "") -> int:
        check = health_pb2_grpc.HealthStub(self.channel).Check
        return (await check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT_S)).status

    async def submitted(self) -> list[Submitted]:
        """The samples of the next Submit the core receives."""
        return submitted(await self.core.receive_kind(ipc.Submit))

    async def shutdown(
        self, drain_timeout_s: float, force: asyncio.Event | None = None
    ) -> DrainResult:
        """What server.py does on SIGTERM, up to the end of the drain."""
        self.servicer.begin_shutdown()
        await self.readiness.drain()
        return await drain(self.client, drain_timeout_s, force or asyncio.Event())


async def until(pred, what: str, timeout_s: float = WAIT_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def api_in_process(
    max_queued_requests: int = 1024,
    first_ready: ipc.Ready | None = None,
    api_config: PublicApiConfig | None = None,
    scheduler: SchedulerConfig | None = None,
) -> AsyncIterator[Api]:
    """``scheduler``: the scheduling settings the API process reads (the
    core here is the test's)."""
    config = ServiceConfig(
        api=api_config or PublicApiConfig(),
        limits=LimitsConfig(max_queued_requests=max_queued_requests),
        scheduler=scheduler or SchedulerConfig(),
    )
    cores: list[PipeCore] = []

    def make_core(on_message, on_exit) -> PipeCore:
        cores.append(PipeCore(on_message, on_exit))
        return cores[-1]

    client = CoreClient(config)
    supervisor = CoreSupervisor(
        client, config, make_core=make_core, backoff=RestartBackoff(first_s=0.001, max_s=0.004)
    )
    starting = asyncio.create_task(supervisor.start(WAIT_S))
    await until(lambda: cores, "the core to be spawned")
    cores[0].say(first_ready or ready())
    first = await starting
    with tempfile.TemporaryDirectory(prefix="radixserve-api-") as workdir:
        model = ModelContext.build(first, config, Path(workdir))
        metrics = SchedulerMetrics(client)
        servicer = SchedulerServicer(client, model, metrics)
        server = grpc.aio.server(interceptors=[DecodeGuard(SERVICE_NAME, metrics)])
        pb_grpc.add_SglangSchedulerServicer_to_server(servicer, server)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        readiness = Readiness(health, client, ("", SERVICE_NAME))
        await readiness.start()
        address = f"127.0.0.1:{port}"
        channel = grpc.aio.insecure_channel(address)
        api = Api(client, supervisor, servicer, metrics, readiness, server, address, channel, cores)
        try:
            yield api
        finally:
            await channel.close()
            servicer.admin.publisher.close()
            await readiness.stop()
            await server.stop(grace=None)
            supervisor.stop()
