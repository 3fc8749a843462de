"""The worker's server interceptor: the shared token on every Worker RPC (when
one is configured), and Execute's lenient deserializer (session.parse_plan).

grpc.health.v1 and reflection stay open: probes carry no token.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import structlog

from common.worker_token import TokenCheck
from worker_service.session import parse_plan

logger = structlog.get_logger(__name__)

DENIED = (
    "missing or invalid worker token (the scheduler's --worker-token-file must hold the "
    "worker's token)"
)


class WorkerCallGuard(grpc.ServerInterceptor):
    def __init__(self, service: str, token: TokenCheck | None) -> None:
        self.prefix = f"/{service}/"
        self.execute = f"/{service}/Execute"
        self.token = token

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        if self.token is not None and not self.token.accepts(details.invocation_metadata):
            logger.warning("call refused: missing or invalid worker token", method=details.method)
            return _denying(handler)
        if details.method == self.execute:
            return handler._replace(request_deserializer=parse_plan)
        return handler


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
