"""The running batch: requests past their prefill, decoding one token a step.

Decode under overlap: when plan N+1 is built, the token of step N may not be
known yet. Each decode entry therefore says "compute your last sampled token
at position kv_len", and ``pending`` counts the tokens in flight, so::

    kv_len == len(prompt) + len(output) + pending - 1   (while decoding)

A request whose known plus in-flight outputs reach max_new_tokens is not
scheduled again: it only waits for its last result.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from scheduler_service.core.kv_manager import KvManager
from scheduler_service.core.plan import ScheduledRequest
from scheduler_service.core.request import Request


@dataclass(slots=True)
class DecodeRoom:
    """What making room for a decode step decided (see make_room_for_decode)."""

    # Running requests whose KV was released, least progress last: back to wait.
    retracted: list[Request] = field(default_factory=list)
    # The chunked prefill's KV was released too: it goes back, first in line.
    chunked_released: bool = False
    # Requests that cannot fit even alone, with no result in flight: abort.
    out_of_memory: list[Request] = field(default_factory=list)
    # Whether the decode can run now.
    ready: bool = False


class RunningBatch:
    def __init__(self, kv: KvManager) -> None:
        self.kv = kv
        self._reqs: dict[str, Request] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs.values())

    def __contains__(self, req: Request) -> bool:
        return self._reqs.get(req.rid) is req

    def reqs(self) -> list[Request]:
        return list(self._reqs.values())

    def merge(self, reqs: list[Request]) -> None:
        for r in reqs:
            self._reqs[r.rid] = r

    def remove(self, req: Request) -> None:
        """Take out a request that finished, was retracted or preempted. This is
        SGLang's filter_batch, done at the moment it happens rather than by a
        sweep, so the batch never holds a finished request."""
        del self._reqs[req.rid]

    # ------------------------------------------------------------ decode
    def decode_candidates(self) -> list[Request]:
        return [
            r
            for r in self._reqs.values()
            if len(r.output_ids) + r.pending < r.sampling.max_new_tokens
        ]

    def pages_needed(self, reqs: list[Request]) -> int:
        page_size = self.kv.page_size
        return sum(1 for r in reqs if r.kv_len % page_size == 0)

    @staticmethod
    def retraction_order(reqs: list[Request]) -> list[Request]:
        """Most progress first; retraction pops from the end (least progress:
        fewest outputs, then the longest prompt)."""
        return sorted(reqs, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)), reverse=True)

    def make_room_for_decode(
        self,
        candidates: list[Request],
        chunked: Request | None,
        results_pending: bool,
    ) -> DecodeRoom:
        """Decide which requests give up their KV so the next decode fits.

        Retracts least progress first, keeping at least one request; if even
        that one cannot fit, the chunked prefill in progress gives up its KV
        too, then any request left that holds duplicates of cached pages
        (kv_manager.py). If it still cannot fit and results are in flight (which may
        finish requests and free pages), decoding waits for them; otherwise
        the requests left are out of memory. Requests only waiting for their
        last token (not among ``candidates``) are left alone.

        The KV of every request named in the answer is released here (each
        release changes what the next one must free); taking the requests
        out of the batch and sending them back to wait is the scheduler's.
        """
        kv = self.kv
        page_size = kv.page_size
        room = DecodeRoom()
        needed = self.pages_needed(candidates)
        if needed <= kv.available_pages():
            room.ready = True
            return room
        order = self.retraction_order(candidates)
        while len(order) > 1 and needed > kv.available_pages():
            victim = order.pop()
            needed -= victim.kv_len % page_size == 0
            kv.release(victim, cache_tokens=True)
            room.retracted.append(victim)
        if needed > kv.available_pages() and chunked is not None:
            kv.release(chunked, cache_tokens=True)
            room.chunked_released = True
        if needed > kv.available_pages():
            # A request holding duplicates of cached pages pins both copies
            # (its later pages hang under the cache's); retracted, it reads the
            # cache's copy back and needs no more than it would have alone.
            # Not while its prompt logprobs are still to come: it would
            # compute the same duplicates again (results in flight deliver
            # them, and decoding waits for those).
            for victim in [r for r in order if r.dup_pages and not r.prompt_logprobs_pending]:
                order.remove(victim)
                needed -= victim.kv_len % page_size == 0
                kv.release(victim, cache_tokens=True)
                room.retracted.append(victim)
        if needed <= kv.available_pages():
            room.ready = True
        elif not results_pending:
            room.out_of_memory = order
        return room

    def prepare_decode(self, reqs: list[Request]) -> list[ScheduledRequest]:
        """One decode entry per request; the caller made sure the pages fit."""
        page_size = self.kv.page_size
        needed = self.pages_needed(reqs)
        fresh = self.kv.alloc(needed)
        if fresh is None:
            raise RuntimeError(f"decode needs {needed} pages that make_room_for_decode found")
        entries: list[ScheduledRequest] = []
        append = entries.append
        take = iter(fresh.tolist()).__next__
        for r in reqs:
            pos = r.kv_len
            if pos % page_size:
                new_pages = []
            else:
                page = take()
                r.pages.append(page)
                new_pages = [page]
            append(ScheduledRequest(r.rid, pos, None, new_pages, True))
            r.kv_len = pos + 1
            r.pending += 1
        return entries
