"""API keys on the public API: every RPC of sglang.grpc.scheduler.SglangScheduler
needs gRPC metadata ``authorization: Bearer <key>`` when keys are configured.

grpc.health.v1 and reflection stay open: probes and tools carry no key, and
neither says anything a caller could misuse. Keys are never logged nor echoed
back; only their number is.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import structlog

logger = structlog.get_logger(__name__)

DENIED = "missing or invalid API key (send gRPC metadata 'authorization: Bearer <key>')"


class ApiKeyFileError(RuntimeError):
    """The key file cannot be read or holds no key."""


def load_api_keys(path: str) -> tuple[bytes, ...]:
    """The keys of ``path`` (one a line; blank lines and ``#`` comments skipped),
    as sha256 digests: what is kept in memory is never the key itself."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ApiKeyFileError(f"cannot read the API key file {path}: {e}") from e
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ApiKeyFileError(f"the API key file {path} holds no key")
    return tuple(_digest(k) for k in dict.fromkeys(keys))


def _digest(key: str) -> bytes:
    # Comparing fixed-length digests keeps the comparison's time independent of
    # the configured keys' lengths.
    return hashlib.sha256(key.encode()).digest()


def presented_key(metadata: tuple | None) -> str | None:
    """The key of an ``authorization: Bearer <key>`` header, if any."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def key_matches(presented: str | None, digests: tuple[bytes, ...]) -> bool:
    """Constant time over the configured keys: every one is compared, no early exit."""
    given = _digest(presented or "")
    ok = False
    for digest in digests:
        ok |= hmac.compare_digest(given, digest)
    return ok and presented is not None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Guards the methods of ``service`` (a full service name); others pass."""

    def __init__(self, service: str, digests: tuple[bytes, ...]) -> None:
        self.prefix = f"/{service}/"
        self.digests = digests

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        if key_matches(presented_key(details.invocation_metadata), self.digests):
            return handler
        logger.warning("call refused: missing or invalid API key", method=details.method)
        return _denying(handler)


async def _deny(request: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind (unary or streaming) that refuses the call,
    so the request is still deserialized the way the client expects."""
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        _deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
