"""Requests whose bytes do not parse as the method's request message.

gRPC's own answer is UNKNOWN with a Python class name in the message, and
nothing is logged or counted. ``DecodeGuard`` wraps every public method's
deserializer so that bad bytes become an ``Undecodable`` value instead of an
exception, and the method's behaviour answers such a value with
INVALID_ARGUMENT and a message a person can act on, logs it, and counts it
in the error metrics. A good request costs one isinstance check (and, on
streaming methods, one async generator hop per response).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog

from scheduler_service.api.metrics import SchedulerMetrics

logger = structlog.get_logger(__name__)


class Undecodable:
    """Bytes the method's request message could not be parsed from."""

    __slots__ = ("error", "size")

    def __init__(self, error: str, size: int) -> None:
        self.error = error
        self.size = size


def _message_name(deserialize: Callable[[bytes], Any]) -> str:
    owner = getattr(deserialize, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "request")


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, or whatever a parser raises
            return Undecodable(str(e) or type(e).__name__, len(data))

    return parse


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Guards the unary-request methods of ``service`` (a full service name)."""

    def __init__(self, service: str, metrics: SchedulerMetrics | None) -> None:
        self.prefix = f"/{service}/"
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if (
            handler is None
            or handler.request_streaming
            or handler.request_deserializer is None
            or not details.method.startswith(self.prefix)
        ):
            return handler
        return self._guarded(handler, details.method)

    async def _refuse(self, bad: Undecodable, method: str, message: str, context) -> None:
        logger.warning(
            "undecodable request refused",
            method=method,
            bytes=bad.size,
            error=bad.error,
            peer=context.peer(),
        )
        if self.metrics is not None:
            self.metrics.error("INVALID_ARGUMENT")
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    def _guarded(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        name = _message_name(handler.request_deserializer)

        def message(bad: Undecodable) -> str:
            return f"the request ({bad.size} bytes) does not parse as a {name} message: {bad.error}"

        if handler.response_streaming:
            behaviour = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, Undecodable):
                    await self._refuse(request, method, message(request), context)
                    return
                # aclosing: a cancelled call closes the method's own generator at once
                async with contextlib.aclosing(behaviour(request, context)) as responses:
                    async for response in responses:
                        yield response

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        behaviour = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, Undecodable):
                await self._refuse(request, method, message(request), context)
            return await behaviour(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary,
            request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
