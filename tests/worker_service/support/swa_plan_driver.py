"""A stand-in scheduler for two KV pools (sliding-window layers), for worker
tests until the real Scheduler frees sliding pages: plans like plan_driver.py's
(joins, chunked prefill, a cached prefix, mixed extends and decodes, greedy
decodes), plus the sliding pages by docs/design.md's rule.

- Each request holds a sliding page list as long as its full one. After every
  step, page i of a request whose next query sits at kv_len is dropped once
  (i + 1) * page_size <= kv_len - window + 1 (no query can see it), its entry
  becoming the null page 0; a page is freed when no request or cache entry
  holds it, and the free list hands the most recently freed page out first,
  so freed pages are soon written by other requests.
- A cached prefix (``share_from``): when the source's prompt is computed, a
  cache entry holds the source's sliding pages that the sharer's match needs
  (those covering [L - window + 1, L) for the page-aligned common length L);
  the sharer's join gets those, and the null page for the prefix's pages
  before them (tombstones, as a radix cache whose sliding pages were evicted).
- ``swa_pages=None``: one pool, no sliding lists (the same model, freeing off).

Full pages are never reused (as plan_driver.py). It records which requests
each sliding page served and how many null entries plans carried.
"""

from __future__ import annotations

from collections import defaultdict

from tests.worker_service.support.plan_driver import GREEDY, DriverRequest
from worker_service.execution.model_runner import ModelRunner
from worker_service.execution.plan import Extend, ForwardMode, Join, Plan


class SwaPlanDriver:
    def __init__(
        self,
        runner: ModelRunner,
        page_size: int,
        *,
        window: int,
        swa_pages: int | None,
        chunk: int | None = None,
    ) -> None:
        self.runner, self.page_size, self.window, self.chunk = runner, page_size, window, chunk
        self.two_pools = swa_pages is not None
        self.free = list(range(runner.num_pages - 1, -1, -1))
        # Sliding pages 1..swa_pages - 1 (0 is the null page); popped from the end.
        self.swa_free = list(range((swa_pages or 1) - 1, 0, -1))
        self.refs: dict[int, int] = defaultdict(int)
        self.swa: dict[int, list[int]] = {}  # slot -> sliding list (0: dropped / null)
        self.cached: dict[int, list[int]] = {}  # source slot -> sliding pages a sharer needs
        self.served: dict[int, set[int]] = defaultdict(set)  # sliding page -> slots
        self.reused = 0  # sliding pages handed out again after another request freed them
        self.null_entries = 0
        self.step_id = 0

    # ---- the sliding pool ----------------------------------------------------

    def _take(self, slot: int) -> int:
        page = self.swa_free.pop()  # IndexError: the test's pool is too small
        self.reused += bool(self.served[page] - {slot})
        self.refs[page] += 1
        self.served[page].add(slot)
        return page

    def _drop(self, page: int) -> None:
        if page:
            self.refs[page] -= 1
            if not self.refs[page]:
                self.swa_free.append(page)

    def _pages_to(self, r: DriverRequest, kv_len: int) -> tuple[list[int], list[int]]:
        need = -(-kv_len // self.page_size) - len(r.pages)
        new = [self.free.pop() for _ in range(need)]
        r.pages.extend(new)
        swa = [self._take(r.slot) for _ in new] if self.two_pools else []
        self.swa[r.slot].extend(swa)
        return new, swa

    def _free_out_of_window(self, r: DriverRequest) -> None:
        pages = self.swa[r.slot]
        for i in range(len(pages)):
            if (i + 1) * self.page_size > r.kv_len - self.window + 1:
                break
            self._drop(pages[i])
            pages[i] = 0

    # ---- plans ---------------------------------------------------------------

    def run(self, reqs: list[DriverRequest], max_steps: int = 10_000) -> list[DriverRequest]:
        for i, r in enumerate(reqs):
            r.slot = i
        step = 0
        while not all(r.done for r in reqs):
            plan = Plan(self.step_id, ForwardMode.MIXED)
            decoding = []
            for r in reqs:
                if r.done or r.arrive > step:
                    continue
                if not r.joined:
                    self._join(r, reqs, plan)
                if r.kv_len < len(r.prompt):
                    self._extend(r, plan)
                elif r.outputs:
                    decoding.append(r)
            for r in decoding:
                plan.decode_slots.append(r.slot)
                plan.decode_positions.append(r.kv_len)
                new, swa = self._pages_to(r, r.kv_len + 1)
                plan.decode_new_pages.append(new[0] + 1 if new else 0)
                if self.two_pools:
                    plan.decode_new_swa_pages.append(swa[0] + 1 if swa else 0)
                r.kv_len += 1
            if plan.extends or plan.decode_slots:
                self._apply(reqs, plan)
            step += 1
            self.step_id += 1
            assert step < max_steps
        return reqs

    def _join(self, r: DriverRequest, reqs: list[DriverRequest], plan: Plan) -> None:
        self.swa[r.slot] = []
        prefix: list[int] = []
        if r.share_from is not None and r.share_from in self.cached:
            src = reqs[r.share_from]
            n = self._shared_pages(src, r)
            held = self.cached.pop(r.share_from)
            r.pages = src.pages[:n]
            if self.two_pools:  # the cache's pages become the sharer's
                self.swa[r.slot] = [0] * (n - len(held)) + held
                for page in held:
                    self.served[page].add(r.slot)
            r.kv_len = n * self.page_size
            prefix = r.prompt[: r.kv_len]
        plan.joins.append(Join(r.slot, f"r{r.slot}", r.sampling, r.logprobs, len(r.prompt), prefix))
        r.joined = True

    def _shared_pages(self, src: DriverRequest, r: DriverRequest) -> int:
        common = 0
        limit = min(len(src.prompt), len(r.prompt) - 1)
        while common < limit and src.prompt[common] == r.prompt[common]:
            common += 1
        return common // self.page_size

    def _dropped_before(self, n: int) -> int:
        """Pages of an n-page prefix no query after it can see: tombstones."""
        return max(0, n * self.page_size - self.window + 1) // self.page_size

    def _extend(self, r: DriverRequest, plan: Plan) -> None:
        start = r.kv_len
        end = len(r.prompt) if self.chunk is None else min(len(r.prompt), start + self.chunk)
        joining = plan.joins and plan.joins[-1].slot == r.slot
        known = len(r.pages) if joining else 0
        known_swa = list(self.swa[r.slot]) if joining else []
        new, swa = self._pages_to(r, end)
        pages = r.pages[:known] + new if joining else new
        swa_pages = known_swa + swa if joining else swa
        self.null_entries += swa_pages.count(0)
        nxt = r.prompt[end] if end < len(r.prompt) else None
        plan.extends.append(
            Extend(
                r.slot,
                start,
                r.prompt[start:end],
                pages,
                end == len(r.prompt),
                nxt,
                new_swa_pages=swa_pages if self.two_pools else [],
            )
        )
        r.kv_len = end

    def _apply(self, reqs: list[DriverRequest], plan: Plan) -> None:
        result = self.runner.execute(plan)
        assert not result.error, result.error
        self.runner.check_integrity()
        for i, slot in enumerate(result.slots):
            r = reqs[slot]
            r.outputs.append(result.token_ids[i])
            r.logprob_values.append(result.logprobs[i])
            if len(r.outputs) >= r.max_new:
                r.done = True
                self._leave(r)
        for r in reqs:
            if r.joined and not r.done:
                self._cache_for_sharers(r, reqs)
                if self.two_pools:
                    self._free_out_of_window(r)

    def _cache_for_sharers(self, src: DriverRequest, reqs: list[DriverRequest]) -> None:
        """Once the source computed a sharer's prefix (before its window moves
        past it), hold the sliding pages the sharer's match needs."""
        if src.slot in self.cached:
            return
        for r in reqs:
            if r.share_from == src.slot and not r.joined:
                n = self._shared_pages(src, r)
                if src.kv_len < n * self.page_size:
                    return
                held: list[int] = []
                if self.two_pools:
                    held = self.swa[src.slot][self._dropped_before(n) : n]
                    assert 0 not in held, "the source dropped a page the sharer needs"
                    for page in held:
                        self.refs[page] += 1
                self.cached[src.slot] = held
                return

    def _leave(self, r: DriverRequest) -> None:
        for page in self.swa.pop(r.slot):
            self._drop(page)
        self.runner.execute(
            Plan(self.step_id + 100_000 + r.slot, ForwardMode.IDLE, leaves=[r.slot])
        )


__all__ = ["GREEDY", "DriverRequest", "SwaPlanDriver"]
