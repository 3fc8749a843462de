"""Admission of waiting requests into one step (SGLang's PrefillAdder).

Budgets, in tokens (pages x page_size):

- total: free + evictable, minus what running requests are expected to still
  need (``new_token_ratio`` x their remaining max_new_tokens, each clipped at
  CLIP_MAX_NEW_TOKENS), minus what this step has admitted (its prefill, its
  clipped max_new_tokens and one page of alignment slack each);
- current: free + evictable minus this step's prefill (what must be
  allocatable right now);
- input: ``max_prefill_tokens`` per step;
- chunk: ``chunked_prefill_size`` per step; a longer prompt is cut at a page
  boundary and continues first in line next step;
- sliding (a model with a sliding pool, kv/sliding.py): free + evictable
  sliding pages, minus a page per running request (its next page before the
  one behind its window is freed) and, per request admitted this step, what
  it computes now plus a window and a page (what it keeps holding). Tokens
  behind the window are freed, so a request's sliding need does not grow
  with its length. The current budget counts the smaller pool already.

The adder decides; the scheduler allocates pages afterwards. Locks taken
here on matched prefixes keep them out of the evictable budget. With the
host tier (kv/hiradix_cache.py) a match's host-only part needs device pages
like computed tokens (the total budget counts them) and no compute (the
input and chunk budgets do not); the adder loads it only if its pages can be
had now (the current budget) and then at once, so the pages it takes count
for every request admitted after it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from scheduler_service.core.config import CLIP_MAX_NEW_TOKENS, SchedulerConfig
from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.request import Request


class AddResult(enum.Enum):
    CONTINUE = "continue"
    NO_TOKEN = "no_token"  # memory budget exhausted
    OTHER = "other"  # a per-step limit (prefill tokens, chunk) reached


class PrefillAdder:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KvManager,
        running: list[Request],
        new_token_ratio: float,
        *,
        mixed_decode_tokens: int = 0,
        reserved: Sequence[Request] = (),
    ) -> None:
        """``reserved``: requests that will join the decode batch without
        being admitted here (a decode unit's transfers, core/disagg/): their
        expected need counts like a running request's."""
        self.config = config
        self.kv = kv
        self.page_size = config.page_size
        self.new_token_ratio = new_token_ratio
        self.rem_input_tokens = config.max_prefill_tokens - mixed_decode_tokens
        chunk = config.chunked_prefill_size
        self.rem_chunk_tokens = None if chunk is None else chunk - mixed_decode_tokens
        self.cur_rem_offset = mixed_decode_tokens
        self.rem_total_offset = mixed_decode_tokens + sum(self.running_need(r) for r in running)
        self.rem_total_offset += sum(self.running_need(r) for r in reserved)
        self.nothing_running = not running and not reserved
        sliding = kv.sliding
        self.swa_window = 0
        if sliding is not None:
            self.swa_window = self._ceil_paged(sliding.window)
            self.swa_offset = mixed_decode_tokens + self.page_size * len(running)
        # (request, end position of the tokens it computes this step)
        self.admitted: list[tuple[Request, int]] = []
        self.new_chunked: Request | None = None
        self.preempted: list[Request] = []

    # ------------------------------------------------------------ budgets
    def running_need(self, req: Request) -> float:
        remaining = req.sampling.max_new_tokens - req.planned_outputs
        return min(max(remaining, 0), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio

    def admission_need(self, req: Request) -> int:
        """Tokens a waiting request is expected to take (its matched prefix aside)."""
        remaining = max(req.sampling.max_new_tokens - len(req.output_ids), 0)
        extend = req.num_tokens - req.match_len
        return extend + min(remaining, CLIP_MAX_NEW_TOKENS) + self.page_size

    def _available_tokens(self) -> int:
        return self.kv.available_pages() * self.page_size

    @property
    def rem_total_tokens(self) -> float:
        # The full pool's: the sliding pool has its own (swa_rem_tokens).
        kv = self.kv
        full = kv.pool.num_free + kv.cache.evictable_pages
        return full * self.page_size - self.rem_total_offset

    @property
    def cur_rem_tokens(self) -> int:
        return self._available_tokens() - self.cur_rem_offset

    def _ceil_paged(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    @property
    def swa_rem_tokens(self) -> int:
        return self.kv.swa_available_pages() * self.page_size - self.swa_offset

    def _swa_need(self, computes: int) -> int:
        """Sliding tokens a request computing ``computes`` tokens now holds."""
        return self._ceil_paged(computes) + self.swa_window + self.page_size

    def _swa_computes(self, req: Request) -> int:
        """What a waiting request would compute this step (its chunk at most)."""
        computes = self._ceil_paged(req.num_tokens - req.match_len)
        if self.rem_chunk_tokens is not None:
            computes = min(computes, max(self.rem_chunk_tokens, 0))
        return computes

    def budget_state(self) -> AddResult:
        if self.rem_total_tokens <= 0 or self.cur_rem_tokens <= 0:
            return AddResult.NO_TOKEN
        if self.swa_window and self.swa_rem_tokens <= 0:
            return AddResult.NO_TOKEN
        if self.rem_input_tokens <= 0:
            return AddResult.OTHER
        if self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0:
            return AddResult.OTHER
        return AddResult.CONTINUE

    def _charge(self, extend: int, max_new: int) -> None:
        if self.swa_window:
            self.swa_offset += self._swa_need(extend)
        extend = self._ceil_paged(extend)
        self.rem_total_offset += extend + max_new + self.page_size
        self.cur_rem_offset += extend + self.page_size
        self.rem_input_tokens -= extend
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend

    def _chunk_end(self, req: Request, start: int, budget: int) -> int:
        """End of a chunk of at most ``budget`` tokens from ``start``, cut at a
        page boundary when one is in reach."""
        end = min(req.num_tokens, start + budget)
        if end < req.num_tokens:
            aligned = end - end % self.page_size
            if aligned > start:
                end = aligned
        return end

    def _physical_end(self, req: Request) -> int:
        """Furthest position ``req``'s table can cover with pages allocatable now."""
        free_pages = max(self.cur_rem_tokens, 0) // self.page_size
        return (len(req.pages) + free_pages) * self.page_size

    # ---------------------------------------------------------- admission
    def add_chunked_req(self, req: Request) -> AddResult:
        """Continue the prefill of the request chunked last step (first in line)."""
        start = req.kv_len
        budget = req.num_tokens - start
        if self.rem_chunk_tokens is not None:
            budget = min(budget, self.rem_chunk_tokens)
        # Like SGLang, a chunked request progresses even when the estimate of
        # future need says no (it already holds pages); only physical memory
        # can stop it.
        if self.rem_total_tokens > 0:
            budget = min(budget, int(self.rem_total_tokens))
        end = min(self._chunk_end(req, start, budget), self._physical_end(req))
        if end <= start:
            return AddResult.NO_TOKEN
        truncated = end < req.num_tokens
        self.admitted.append((req, end))
        self.new_chunked = req if truncated else None
        max_new = 0 if truncated else min(req.sampling.max_new_tokens, CLIP_MAX_NEW_TOKENS)
        self._charge(end - start, max_new)
        return self.budget_state()

    def add_one_req(self, req: Request) -> AddResult:
        """Try to admit a waiting request whose cache match is in req.match_*."""
        prefix = req.match_len
        # The host tier: the match's host-only part takes device pages like
        # computed tokens (in ``total``) but is not computed (SGLang's
        # real_input_tokens), if it is loaded (below).
        host = req.match_host_len
        extend = req.num_tokens - prefix
        total = self.admission_need(req)
        paged_extend = self._ceil_paged(extend - host)
        # An idle scheduler admits one request whenever it physically fits:
        # the estimate of future need must not block the only request.
        force = self.nothing_running and not self.admitted
        if total >= self.rem_total_tokens and not force:
            return AddResult.NO_TOKEN
        swa_short = self.swa_window and (
            self._swa_need(self._swa_computes(req)) >= self.swa_rem_tokens
        )
        if swa_short and not force:
            return AddResult.NO_TOKEN
        if (
            self.rem_chunk_tokens is None
            and self.admitted
            and paged_extend >= self.rem_input_tokens
        ):
            return AddResult.OTHER

        cache = self.kv.cache
        cache.lock(req.match_node)
        if total >= self.rem_total_tokens and not force:
            cache.unlock(req.match_node)
            return AddResult.NO_TOKEN
        chunk = self.rem_chunk_tokens
        # The matched prefix is page aligned, so the table holds prefix / page_size pages.
        cur_rem = self.cur_rem_tokens
        if self.swa_window:
            # Attaching takes references on cached sliding pages: those no
            # request held were counted as evictable (the lock above did the
            # same for the full pages).
            taken = self.kv.swa_attach_cost(req)
            if taken:
                swa_pages = self.kv.swa_available_pages() - taken
                cur_rem = min(cur_rem, swa_pages * self.page_size - self.cur_rem_offset)
        load = self._load_tokens(host, cur_rem) if host else 0
        if load:
            prefix += load
            cur_rem -= load
            extend -= load
        if host:
            paged_extend = self._ceil_paged(extend)
            if (
                not load  # a declined hit is computed: the input budget again
                and self.rem_chunk_tokens is None
                and self.admitted
                and paged_extend >= self.rem_input_tokens
            ):
                cache.unlock(req.match_node)
                return AddResult.OTHER
        physical_end = prefix + (max(cur_rem, 0) // self.page_size) * self.page_size
        fits = req.num_tokens <= physical_end
        if fits and (chunk is None or paged_extend <= chunk):
            end = req.num_tokens
            self._charge(extend, min(req.sampling.max_new_tokens, CLIP_MAX_NEW_TOKENS))
        elif chunk is None:
            cache.unlock(req.match_node)
            return AddResult.NO_TOKEN
        else:
            budget = chunk - chunk % self.page_size
            end = min(self._chunk_end(req, prefix, budget), physical_end)
            if budget <= 0 or end <= prefix:
                cache.unlock(req.match_node)
                return AddResult.OTHER if fits else AddResult.NO_TOKEN
            self.new_chunked = req
            self._charge(end - prefix, 0)
        if load:
            self._load(req)
        self.kv.attach_prefix(
            req, req.match_pages, req.match_len, req.match_node, swa=req.match_swa
        )
        self.admitted.append((req, end))
        return self.budget_state()

    def _load_tokens(self, host: int, cur_rem: int) -> int:
        """Tokens of a host hit to load: all of it if its pages can be had
        now and it is not too short to be worth a copy, else none (SGLang's
        load back: all or nothing; a declined hit is computed)."""
        if host > cur_rem or host < self.config.hicache_load_back_threshold:
            return 0
        return host

    def _load(self, req: Request) -> None:
        """Load ``req``'s host hit (its budget counted): its match grows by the
        loaded pages, and its lock moves to the match's new end."""
        cache = self.kv.cache
        pages = cache.load_back(req.match_host_node, req.match_node)
        if pages is None:
            raise RuntimeError(f"the load of {req.rid}'s host hit lacks pages the adder counted")
        cache.lock(req.match_host_node)
        cache.unlock(req.match_node)
        req.match_pages = req.match_pages + pages
        req.match_len += len(pages) * self.page_size
        req.match_node = req.match_host_node
        req.match_host_len = 0

    # -------------------------------------------------------- preemption
    def preempt_to_schedule(self, req: Request, running: list[Request]) -> bool:
        """Preempt lower-priority running requests to make room for ``req``.

        Candidates are taken lowest priority first (newest first among
        equals) while their priority is more than the threshold below
        ``req``'s, until their expected need covers ``req``'s. The chosen
        ones' KV is released at once (their pages count for this step's
        admission) and they are listed in ``preempted``: moving them back to
        the waiting queue is the scheduler's.
        """
        sign = 1 if self.config.schedule_low_priority_values_first else -1
        candidates = sorted(
            (r for r in running if r not in self.preempted and not r.finished),
            key=lambda r: (r.priority * -sign, -r.times.queue_entry),
        )
        # Admission needs admission_need < rem_total_tokens (strictly).
        to_remove = self.admission_need(req) - self.rem_total_tokens
        chosen: list[Request] = []
        for r in candidates:
            if (req.priority - r.priority) * -sign <= self.config.priority_preemption_threshold:
                break
            chosen.append(r)
            to_remove -= self.running_need(r)
            if to_remove < 0:
                break
        if not chosen or to_remove >= 0:
            return False
        sliding = self.kv.sliding
        if sliding is not None:
            # The sliding budget must fit too once they are gone, or the
            # preemption is wasted (and repeats every step: a livelock).
            gain = sliding.available_after_release([r.swa_pages for r in chosen])
            gain = (gain + len(chosen)) * self.page_size  # their pages, their per-request page
            if self._swa_need(self._swa_computes(req)) >= self.swa_rem_tokens + gain:
                return False
            self.swa_offset -= self.page_size * len(chosen)
        for r in chosen:
            self.rem_total_offset -= self.running_need(r)
            self.kv.release(r)
        self.preempted.extend(chosen)
        return True
