"""The running batch: requests past their prefill, decoding one token a step.

Decode under overlap: when plan N+1 is built, the token of step N may not be
known yet. Each decode entry therefore says "compute your last sampled token
at position kv_len", and ``pending`` counts the tokens in flight, so::

    kv_len == len(prompt) + len(output) + pending - 1   (while decoding)

A request whose known plus in-flight outputs reach max_new_tokens is not
scheduled again: it only waits for its last result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from scheduler_service.core.kv_ownership import KvManager
from scheduler_service.core.plan import ScheduledRequest
from scheduler_service.core.request import Request


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
        retract: Callable[[Request], None],
        retract_chunked: Callable[[], bool],
        abort_oom: Callable[[Request], None],
        results_pending: bool,
        candidates: list[Request] | None = None,
    ) -> tuple[int, bool]:
        """Retract requests until the next decode step's pages fit.

        Keeps at least one request; if even that one cannot fit, the chunked
        prefill in progress is put back. If it still cannot fit and results
        are in flight (which may finish requests and free pages), decoding
        waits for them; otherwise the request is aborted. Requests only
        waiting for their last token are left alone.

        ``candidates``: ``decode_candidates()`` if the caller has them; when
        nothing is retracted and the decode can run, they are still the batch's
        candidates afterwards.

        Returns (requests retracted, whether the decode can run now).
        """
        kv = self.kv
        page_size = kv.page_size
        if candidates is None:
            candidates = self.decode_candidates()
        needed = self.pages_needed(candidates)
        if needed <= kv.available_pages():
            return 0, True
        order = self.retraction_order(candidates)
        retracted = 0
        while len(order) > 1 and needed > kv.available_pages():
            victim = order.pop()
            needed -= victim.kv_len % page_size == 0
            retract(victim)
            retracted += 1
        if needed <= kv.available_pages() or (retract_chunked() and needed <= kv.available_pages()):
            return retracted, True
        if results_pending:
            return retracted, False
        for r in order:
            abort_oom(r)
        return retracted, False

    def prepare_decode(self, reqs: list[Request]) -> list[ScheduledRequest]:
        """One decode entry per request; the caller made sure the pages fit."""
        page_size = self.kv.page_size
        needed = self.pages_needed(reqs)
        fresh = self.kv.alloc(needed)
        if fresh is None:
            raise RuntimeError(f"decode needs {needed} pages that make_room_for_decode promised")
        entries: list[ScheduledRequest] = []
        append = entries.append
        take = iter(fresh).__next__
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
