"""Grammars checked before their requests reach the core: a structured
generation request (regex, JSON schema, EBNF, structural tag) is sent to the
scheduler only once the sampling worker (rank 0) has its grammar compiled in
its cache, so a grammar that does not compile is answered INVALID_ARGUMENT
at once with the compiler's message, and a long compile keeps only its own
request waiting (the worker compiles in a pool of processes of its own).

Only "does not compile" verdicts are remembered here (kind and text,
bounded): a timeout, a full compile queue or an unreachable worker says
nothing about the grammar, and one that compiled is asked for again with
every request (a hit in the worker's cache answers at once), so the worker's
cache is fresh when the request joins. Concurrent checks of one grammar
share one call, cancelled when none of them waits any more. Each client
(its API key, else its IP address) waits on at most
``--grammar-compiles-per-client`` distinct grammars at a time.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass

import grpc
import structlog

from common.worker_token import metadata
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from scheduler_service.api.auth import presented_key
from scheduler_service.config import ServiceConfig
from scheduler_service.grammar_proto import grammar_to_proto
from scheduler_service.tls import worker_channel_credentials, worker_token

logger = structlog.get_logger(__name__)

VERDICTS = 4096  # grammars that do not compile, remembered


class GrammarUnavailable(RuntimeError):
    """The sampling worker cannot be asked (lost, or not serving grammars)."""


class GrammarBusy(RuntimeError):
    """No verdict now (compile capacity, per client or on the worker, or the
    compile timeout): the client may retry later. RESOURCE_EXHAUSTED."""


def client_of(context: grpc.aio.ServicerContext) -> str:
    """Whom a call's compiles count against: its API key (a digest: keys are
    never kept), else the peer's address without its port."""
    key = presented_key(context.invocation_metadata())
    if key is not None:
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0].strip("[]") or rest
    return peer


@dataclass(eq=False)
class _Shared:
    task: asyncio.Future
    waiters: int = 0


class GrammarChecker:
    def __init__(self, config: ServiceConfig, address: str) -> None:
        self.timeout_s = config.limits.grammar_compile_timeout_s
        self.per_client = config.limits.grammar_compiles_per_client
        credentials, options = worker_channel_credentials(config.security)
        self._metadata = metadata(worker_token(config.security))
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self._channel = grpc.aio.secure_channel(address, credentials, options=options)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._refused: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._running: dict[tuple[str, str], _Shared] = {}
        # Per client, the grammars its checks wait on (requests sharing one count once).
        self._per_client: dict[str, Counter[tuple[str, str]]] = {}

    async def check(self, kind: str, text: str, client: str = "") -> str:
        """'' when the grammar compiles, else why it does not. GrammarBusy: no
        verdict now, retry later; GrammarUnavailable: the worker cannot say."""
        key = (kind, text)
        verdict = self._refused.get(key)
        if verdict is not None:
            self._refused.move_to_end(key)
            return verdict
        waiting = self._per_client.setdefault(client, Counter())
        if key not in waiting and len(waiting) >= self.per_client:
            raise GrammarBusy(
                f"too many grammars compiling for this client ({self.per_client}, "
                "--grammar-compiles-per-client); retry later"
            )
        waiting[key] += 1
        try:
            return await self._shared(key)
        finally:
            waiting[key] -= 1
            if not waiting[key]:
                del waiting[key]
                if not waiting:
                    self._per_client.pop(client, None)

    async def _shared(self, key: tuple[str, str]) -> str:
        shared = self._running.get(key)
        if shared is None:
            shared = _Shared(asyncio.ensure_future(self._compile(*key)))
            self._running[key] = shared
            shared.task.add_done_callback(lambda _: self._forget(key, shared))
        shared.waiters += 1
        try:
            return await asyncio.shield(shared.task)
        finally:
            shared.waiters -= 1
            if not shared.waiters and not shared.task.done():
                # Nobody waits: the worker kills the compile when the call ends.
                shared.task.cancel()

    def _forget(self, key: tuple[str, str], shared: _Shared) -> None:
        if self._running.get(key) is shared:
            del self._running[key]

    async def _compile(self, kind: str, text: str) -> str:
        request = pb.CompileGrammarRequest()
        grammar_to_proto((kind, text), request.grammar)
        try:
            reply = await self._stub.CompileGrammar(
                request, timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise GrammarBusy(
                    f"{kind}: the grammar did not compile within {self.timeout_s:g} s "
                    "(--grammar-compile-timeout; the server may be busy compiling others): "
                    "retry later, or simplify it"
                ) from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise GrammarBusy(f"the sampling worker is busy: {e.details()}") from None
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                return f"structured generation is not available: {e.details()}"
            raise GrammarUnavailable(
                f"the sampling worker cannot compile grammars: {e.details()}"
            ) from None
        if reply.compile_ms:
            logger.info("grammar compiled", kind=kind, bytes=len(text), ms=round(reply.compile_ms))
        if reply.error:
            self._refused[(kind, text)] = reply.error
            while len(self._refused) > VERDICTS:
                self._refused.popitem(last=False)
        return reply.error

    async def close(self) -> None:
        await self._channel.close()
