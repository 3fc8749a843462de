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

Pacing: ``take(not_before)`` does not return before that loop time unless
something urgent came (a finish, an error: anything but news of tokens), and
news that can wait does not even wake the reader: a stream paced to one
chunk per interval costs one wake-up per interval, not one per token.
"""

from __future__ import annotations

import asyncio
import math

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


def _urgent(item: object) -> bool:
    """Whether ``item`` ends a paced wait: anything but news of tokens."""
    if type(item) is tuple:
        return False
    return not isinstance(item, ipc.DeltaOut) or item.finish is not None


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Inbox:
    __slots__ = ("_items", "_mixed", "_paced", "_urgent", "_waiter", "news_only")

    def __init__(self) -> None:
        self._items: list = []
        self._waiter: asyncio.Future | None = None
        self._paced = False  # the reader waits for its deadline: news alone does not wake it
        self._urgent = False  # an item that ends a paced wait is in
        self._mixed = False  # an item other than token news is in
        # the items ``take`` returned last are token news only (the reader's fast path)
        self.news_only = False

    def put_news(self, rid: str, token: int, cached: int) -> None:
        """``put_nowait`` of token news (the hot path: once per token streamed)."""
        self._items.append((rid, token, cached))
        if self._waiter is not None and not self._paced:
            waiter, self._waiter = self._waiter, None
            _wake(waiter)

    def put_nowait(self, item: object) -> None:
        self._items.append(item)
        if type(item) is not tuple:
            self._mixed = True
        if not self._urgent and _urgent(item):
            self._urgent = True
        waiter = self._waiter
        if waiter is not None and (self._urgent or not self._paced):
            self._waiter = None
            _wake(waiter)

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    async def take(self, not_before: float = 0.0) -> list:
        """Everything in the inbox (at least one item), in the order it came,
        not before loop time ``not_before`` (``math.inf``: only when
        something urgent comes) unless something urgent is in."""
        loop = asyncio.get_running_loop()
        while True:
            paced = not self._urgent and not_before > 0 and loop.time() < not_before
            if self._items and not paced:
                break
            waiter = self._waiter = loop.create_future()
            self._paced = paced
            timer = (
                loop.call_at(not_before, _wake, waiter) if paced and not_before < math.inf else None
            )
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        items, self._items = self._items, []
        self.news_only = not self._mixed
        self._urgent = self._mixed = False
        return items

    async def get(self) -> object:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            self._paced = False
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.pop(0)
        self._urgent = any(map(_urgent, self._items)) if self._urgent else False
        return as_delta(item)

    def get_nowait(self) -> object:
        if not self._items:
            raise asyncio.QueueEmpty
        item = self._items.pop(0)
        self._urgent = any(map(_urgent, self._items)) if self._urgent else False
        return as_delta(item)
