"""Request bytes that do not parse as the method's message become a value
(``Undecodable``) instead of gRPC's own answer, INTERNAL "Exception
deserializing request!" with nothing logged; the interceptor
(call_guard.py) and Execute (session.py) answer it INVALID_ARGUMENT with
this message, as the public side does (scheduler_service/api/decode_guard.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Undecodable:
    """Bytes that ``method``'s request message (``message``) could not be parsed from."""

    __slots__ = ("error", "message", "method", "size")

    def __init__(self, method: str, message: str, error: str, size: int) -> None:
        self.method = method
        self.message = message
        self.error = error
        self.size = size

    def details(self) -> str:
        return f"the request ({self.size} bytes) does not parse as {self.message}: {self.error}"


def message_name(deserialize: Callable[[bytes], Any]) -> str:
    """A generated ``Message.FromString``'s full message name."""
    owner = getattr(deserialize, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "the method's request message")


def tolerant(deserialize: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    name = message_name(deserialize)

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # protobuf's DecodeError, or whatever a parser raises
            return Undecodable(method, name, str(e) or type(e).__name__, len(data))

    return parse
