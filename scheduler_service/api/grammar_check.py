"""Grammars checked before their requests reach the core: a structured
generation request (regex, JSON schema, EBNF, structural tag) is sent to the
scheduler only once the sampling worker (rank 0) has compiled its grammar
into its cache, so a grammar that does not compile is answered
INVALID_ARGUMENT at once with the compiler's message, and a long compile
keeps only its own request waiting (the worker compiles on a gRPC thread;
every other stream keeps decoding).

Verdicts are cached here (kind and text, bounded); concurrent checks of one
grammar share one compile.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import grpc
import structlog

from common.worker_token import metadata
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from scheduler_service.config import ServiceConfig
from scheduler_service.grammar_proto import grammar_to_proto
from scheduler_service.tls import worker_channel_credentials, worker_token

logger = structlog.get_logger(__name__)

VERDICTS = 4096  # grammars whose verdict is remembered


class GrammarUnavailable(RuntimeError):
    """The sampling worker cannot be asked (lost, or not serving grammars)."""


class GrammarChecker:
    def __init__(self, config: ServiceConfig, address: str) -> None:
        self.timeout_s = config.limits.grammar_compile_timeout_s
        credentials, options = worker_channel_credentials(config.security)
        self._metadata = metadata(worker_token(config.security))
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self._channel = grpc.aio.secure_channel(address, credentials, options=options)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._verdicts: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._running: dict[tuple[str, str], asyncio.Future] = {}

    async def check(self, kind: str, text: str) -> str:
        """'' when the grammar compiles, else why it does not."""
        key = (kind, text)
        verdict = self._verdicts.get(key)
        if verdict is not None:
            self._verdicts.move_to_end(key)
            return verdict
        running = self._running.get(key)
        if running is None:
            running = asyncio.ensure_future(self._compile(kind, text))
            self._running[key] = running
            running.add_done_callback(lambda _: self._running.pop(key, None))
        return await asyncio.shield(running)

    async def _compile(self, kind: str, text: str) -> str:
        request = pb.CompileGrammarRequest()
        grammar_to_proto((kind, text), request.grammar)
        try:
            reply = await self._stub.CompileGrammar(
                request, timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                verdict = f"{kind}: the grammar took longer than {self.timeout_s:g} s to compile"
            elif e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                verdict = f"structured generation is not available: {e.details()}"
            else:
                raise GrammarUnavailable(
                    f"the sampling worker cannot compile grammars: {e.details()}"
                ) from None
            self._remember((kind, text), verdict)
            return verdict
        if reply.compile_ms:
            logger.info("grammar compiled", kind=kind, bytes=len(text), ms=round(reply.compile_ms))
        self._remember((kind, text), reply.error)
        return reply.error

    def _remember(self, key: tuple[str, str], verdict: str) -> None:
        self._verdicts[key] = verdict
        while len(self._verdicts) > VERDICTS:
            self._verdicts.popitem(last=False)

    async def close(self) -> None:
        await self._channel.close()
