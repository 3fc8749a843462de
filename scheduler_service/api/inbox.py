"""One call's inbox: what the core's outputs leave for a Generate call's coroutine.

The streaming hot path. At batch 256 every core step puts a token in 256
inboxes, so an item costs what one list append costs: the common news, one
token without logprobs or a finish (the core's column form in ipc.Outputs),
is a plain ``(rid, token, cached_tokens)`` tuple (``TokenNews``), not an
``ipc.DeltaOut``; anything else (a DeltaOut, an error to end the call with)
goes in as it is. The reader takes everything there is at once (``take``):
a reader that fell behind gets one batch and sends fewer, bigger chunks.
``get``/``get_nowait`` keep asyncio.Queue's interface for the readers that
take one item at a time (Embed, the health probe), with token news turned
back into a DeltaOut.
"""

from __future__ import annotations

import asyncio

from scheduler_service import ipc

# (internal rid, token, cached tokens): a DeltaOut with one token and nothing else
TokenNews = tuple[str, int, int]

_new_delta = tuple.__new__


def as_delta(item: object) -> object:
    """``item`` with token news as the DeltaOut it stands for."""
    if type(item) is tuple:
        rid, token, cached = item
        return _new_delta(
            ipc.DeltaOut, (rid, [token], None, None, 0, cached, None, None, False, None)
        )
    return item


class Inbox:
    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list = []
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: object) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    async def take(self) -> list:
        """Everything in the inbox (at least one item), in the order it came."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items

    async def get(self) -> object:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return as_delta(self._items.pop(0))

    def get_nowait(self) -> object:
        if not self._items:
            raise asyncio.QueueEmpty
        return as_delta(self._items.pop(0))
