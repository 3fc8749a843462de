"""Requests whose bytes do not parse as the method's request message.

gRPC's own answer is UNKNOWN with a Python class name in the message, and
nothing is logged or counted. ``DecodeGuard`` wraps every public method's
deserializer so that bad bytes become an ``Undecodable`` value instead of an
exception, and ``refuse_undecodable`` answers such a value with
INVALID_ARGUMENT and a message a person can act on, logs it, and counts it
in the error metrics. The guard wraps each method's behaviour with that
check, except for the methods the servicer checks itself (Generate: a
wrapper there would cost an extra async generator hop per streamed
response); a good request costs one isinstance check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import grpc
import structlog

from scheduler_service.api.metrics import SchedulerMetrics

logger = structlog.get_logger(__name__)


class Undecodable:
    """Bytes that ``method``'s request message (``message``) could not be parsed from."""

    __slots__ = ("error", "message", "method", "size")

    def __init__(self, method: str, message: str, error: str, size: int) -> None:
        self.method = method
        self.message = message
        self.error = error
        self.size = size

    def details(self) -> str:
        return (
            f"the request ({self.size} bytes) does not parse as a {self.message} message: "
            f"{self.error}"
        )


async def refuse_undecodable(
    bad: Undecodable, metrics: SchedulerMetrics | None, context: grpc.aio.ServicerContext
) -> None:
    """Log, count and end the call with INVALID_ARGUMENT (raises, as context.abort does)."""
    logger.warning(
        "undecodable request refused",
        method=bad.method,
        bytes=bad.size,
        error=bad.error,
        peer=context.peer(),
    )
    if metrics is not None:
        metrics.error("INVALID_ARGUMENT")
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad.details())


def _message_name(deserialize: Callable[[bytes], Any]) -> str:
    owner = getattr(deserialize, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "request")


def _tolerant(deserialize: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    name = _message_name(deserialize)

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, or whatever a parser raises
            return Undecodable(method, name, str(e) or type(e).__name__, len(data))

    return parse


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Guards the unary-request methods of ``service`` (a full service name);
    ``self_checked``: names of the methods whose servicer checks for
    ``Undecodable`` itself (only their deserializer is wrapped)."""

    def __init__(
        self,
        service: str,
        metrics: SchedulerMetrics | None,
        self_checked: Collection[str] = ("Generate",),
    ) -> None:
        self.prefix = f"/{service}/"
        self.metrics = metrics
        self.self_checked = frozenset(self.prefix + m for m in self_checked)

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

    def _guarded(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        deserializer = _tolerant(handler.request_deserializer, method)
        metrics = self.metrics
        if handler.response_streaming:
            streaming = handler.unary_stream
            if method not in self.self_checked:

                async def unary_stream(request, context):
                    if isinstance(request, Undecodable):
                        await refuse_undecodable(request, metrics, context)
                    # aclosing: a cancelled call closes the method's own generator at once
                    async with contextlib.aclosing(streaming(request, context)) as responses:
                        async for response in responses:
                            yield response

            else:
                unary_stream = streaming
            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        behaviour = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, Undecodable):
                await refuse_undecodable(request, metrics, context)
            return await behaviour(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary,
            request_deserializer=deserializer,
            response_serializer=handler.response_serializer,
        )
