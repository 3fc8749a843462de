"""The worker's server interceptor, in order: the shared token on every Worker
RPC (when one is configured); request bytes that do not parse answered
INVALID_ARGUMENT with a message, logged and counted (Execute's stream is
parsed leniently too, and refused by session.py); the bounds on calls that
can hold a gRPC thread for long (call_budget.py) other than Execute's, which
the servicer keeps.

grpc.health.v1 and reflection stay open: probes carry no token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
import structlog

from common.worker_token import TokenCheck
from worker_service.rpc.call_budget import ADAPTER_LOADS, TOKENIZER_STREAMS, CallSlots
from worker_service.rpc.request_decoding import Undecodable, tolerant
from worker_service.rpc.session import parse_plan
from worker_service.telemetry.metrics import WorkerMetrics

logger = structlog.get_logger(__name__)

DENIED = (
    "missing or invalid worker token (the scheduler's --worker-token-file must hold the "
    "worker's token)"
)


def default_limits() -> dict[str, CallSlots]:
    """The bounded methods' slots, by method name."""
    return {
        "GetTokenizer": CallSlots("GetTokenizer streams", TOKENIZER_STREAMS),
        "LoadAdapter": CallSlots("LoadAdapter calls", ADAPTER_LOADS),
    }


class WorkerCallGuard(grpc.ServerInterceptor):
    def __init__(
        self,
        service: str,
        token: TokenCheck | None,
        metrics: WorkerMetrics | None = None,
        limits: Mapping[str, CallSlots] | None = None,
    ) -> None:
        self.prefix = f"/{service}/"
        self.execute = f"/{service}/Execute"
        self.token = token
        self.metrics = metrics
        self.limits = default_limits() if limits is None else dict(limits)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        name = details.method[len(self.prefix) :]
        if self.token is not None and not self.token.accepts(details.invocation_metadata):
            logger.warning("call refused: missing or invalid worker token", method=details.method)
            self._count(name, grpc.StatusCode.UNAUTHENTICATED)
            return _denying(handler)
        if details.method == self.execute:  # session.py refuses what does not parse
            return handler._replace(request_deserializer=parse_plan)
        if handler.request_streaming:
            return handler
        return self._guarded(handler, name)

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        if self.metrics is not None:
            self.metrics.refused(method, code.name)

    def _admit(self, request: object, context: grpc.ServicerContext) -> None:
        """Abort (raise) if the request did not parse."""
        if isinstance(request, Undecodable):
            logger.warning(
                "undecodable request refused",
                method=request.method,
                bytes=request.size,
                error=request.error,
                peer=context.peer(),
            )
            self._count(request.method, grpc.StatusCode.INVALID_ARGUMENT)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details())

    def _take(self, slots: CallSlots, method: str, context: grpc.ServicerContext) -> None:
        """Take one of the method's slots, or abort (raise) RESOURCE_EXHAUSTED."""
        if not slots.try_take():
            logger.warning("call refused: too many at once", method=method, limit=slots.limit)
            self._count(method, grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, slots.refusal())

    def _guarded(self, handler: grpc.RpcMethodHandler, name: str) -> grpc.RpcMethodHandler:
        """The handler with a lenient deserializer, whose behaviour first
        refuses bytes that did not parse and takes a slot if it is bounded."""
        deserializer = tolerant(handler.request_deserializer, name)
        slots = self.limits.get(name)
        if handler.response_streaming:
            streaming = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                self._admit(request, context)
                if slots is None:
                    yield from streaming(request, context)
                    return
                self._take(slots, name, context)
                try:
                    yield from streaming(request, context)
                finally:
                    slots.give_back()

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        behaviour = handler.unary_unary

        def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
            self._admit(request, context)
            if slots is None:
                return behaviour(request, context)
            self._take(slots, name, context)
            try:
                return behaviour(request, context)
            finally:
                slots.give_back()

        return grpc.unary_unary_rpc_method_handler(
            unary_unary,
            request_deserializer=deserializer,
            response_serializer=handler.response_serializer,
        )


def _deny(request: object, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind (unary or streaming) that refuses the call;
    its request is never read, so any bytes do."""
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        _deny,
        request_deserializer=lambda data: data,
        response_serializer=handler.response_serializer,
    )
