"""Order of the waiting queue before admission (SGLang's SchedulePolicy).

- ``fcfs``: arrival order; with priority scheduling, priority then arrival.
- ``lpm``: longest cached prefix first. Of several waiting requests that
  share a prefix the cache does not hold yet, only the first keeps its place
  and the rest wait a step, so they hit the cache once it is computed
  (in-batch prefix deduplication). Aging: a request that has waited
  ``lpm_max_wait_s`` goes ahead of all that have waited less, oldest first,
  so a prompt that matches nothing cannot starve behind a stream of matching
  ones (SGLang's lpm has no such bound). Past 128 waiting it is fcfs, in
  arrival order (matching the whole queue every step would cost more than
  it saves).
- ``dfs-weight``: walk the cache tree depth-first, heaviest subtree (most
  waiting requests) first, so requests sharing prefixes run together.
- ``lof``: longest max_new_tokens first (priority first when enabled).
- ``random``: shuffled (seeded).
- ``routing-key``: requests whose routing key is most common in the running
  batch first.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable

from scheduler_service.core.config import (
    IN_BATCH_PREFIX_CHECK_THRESHOLD,
    IN_BATCH_PREFIX_DEPRIORITIZE_THRESHOLD,
    LPM_FALLBACK_QUEUE_LEN,
    SchedulerConfig,
)
from scheduler_service.core.ids import zero_pages
from scheduler_service.core.kv.radix_cache import RadixCache, RadixNode
from scheduler_service.core.request import Request


def request_tokens(req: Request) -> list[int]:
    return req.prompt_ids if not req.output_ids else req.all_token_ids()


class SchedulePolicy:
    def __init__(self, config: SchedulerConfig, cache: RadixCache) -> None:
        self.policy = config.schedule_policy
        self.cache = cache
        self.priority = config.enable_priority_scheduling
        # Sorting key sign: high values first unless low values are asked for.
        self.priority_sign = 1 if config.schedule_low_priority_values_first else -1
        self._rng = random.Random(config.random_seed)
        self.lpm_max_wait_s = config.lpm_max_wait_s

    def active_policy(self, num_waiting: int) -> str:
        if self.policy == "lpm" and num_waiting > LPM_FALLBACK_QUEUE_LEN:
            return "fcfs"
        return self.policy

    def order(self, waiting: list[Request], running: Iterable[Request], now: float = 0.0) -> None:
        """Sort ``waiting`` in place (stable: ties keep arrival order); ``now``
        is the scheduler's clock (lpm's aging)."""
        if self.policy == "fcfs":
            if self.priority:
                sign = self.priority_sign
                waiting.sort(key=lambda r: (r.priority * sign, r.times.queue_entry))
            return
        policy = self.active_policy(len(waiting))
        if policy == "lpm":
            self._lpm_order(waiting, now)
        elif policy == "fcfs":  # lpm's fallback on a long queue: arrival order
            waiting.sort(key=lambda r: r.times.queue_entry)
        elif policy == "dfs-weight":
            self._match_waiting(waiting, dedup=False)
            waiting[:] = self._dfs_order(waiting)
        elif policy == "lof":
            if self.priority:
                sign = self.priority_sign
                waiting.sort(key=lambda r: (r.priority * sign, -r.sampling.max_new_tokens))
            else:
                waiting.sort(key=lambda r: -r.sampling.max_new_tokens)
        elif policy == "random":
            self._rng.shuffle(waiting)
        elif policy == "routing-key":
            self._sort_by_routing_key(waiting, running)

    # ----------------------------------------------------------- helpers
    def _lpm_order(self, waiting: list[Request], now: float) -> None:
        deprioritized = self._match_waiting(waiting, dedup=True)
        inf = float("inf")
        if self.lpm_max_wait_s <= 0:
            waiting.sort(key=lambda r: inf if r in deprioritized else -r.match_len)
            return
        aged = now - self.lpm_max_wait_s

        def key(r: Request) -> tuple[int, float]:
            entry = r.times.queue_entry
            if entry <= aged:
                return (0, entry)  # waited long enough: oldest first, ahead of the rest
            return (1, inf if r in deprioritized else -r.match_len)

        waiting.sort(key=key)

    def _match_waiting(self, waiting: list[Request], dedup: bool) -> set[Request]:
        """Record each request's cached prefix; return those to hold back a step."""
        deprioritized: set[Request] = set()
        in_batch = RadixCache(page_size=1) if dedup else None
        for req in waiting:
            tokens = req.token_array()
            m = self.cache.match(tokens, req.extra_key, limit=req.max_prefix_len(), touch=False)
            req.match_len = m.length
            req.match_node = m.node
            if in_batch is None or m.length > IN_BATCH_PREFIX_CHECK_THRESHOLD:
                continue
            shared = in_batch.match(tokens, req.extra_key, touch=False).length
            if shared >= IN_BATCH_PREFIX_DEPRIORITIZE_THRESHOLD:
                deprioritized.add(req)
            else:
                in_batch.insert(tokens, zero_pages(len(tokens)), req.extra_key)
        return deprioritized

    def _dfs_order(self, waiting: list[Request]) -> list[Request]:
        """Depth-first over the nodes the waiting requests matched, heaviest first;
        a node's own requests follow its subtree's (deeper matches first)."""
        at_node: dict[RadixNode, list[Request]] = {}
        for req in waiting:
            at_node.setdefault(req.match_node, []).append(req)
        weight: dict[RadixNode, int] = {}
        for node, reqs in at_node.items():
            while node is not None:
                weight[node] = weight.get(node, 0) + len(reqs)
                node = node.parent
        out: list[Request] = []
        roots = sorted((n for n in weight if n.parent is None), key=lambda n: -weight[n])
        # Iterative post-order: (node, expanded?)
        stack: list[tuple[RadixNode, bool]] = [(r, False) for r in reversed(roots)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.extend(at_node.get(node, ()))
                continue
            stack.append((node, True))
            kids = [c for c in node.children.values() if c in weight]
            kids.sort(key=lambda c: -weight[c])
            stack.extend((c, False) for c in reversed(kids))
        return out

    @staticmethod
    def _sort_by_routing_key(waiting: list[Request], running: Iterable[Request]) -> None:
        counts = Counter(r.routing_key for r in running if r.routing_key)
        if not counts:
            return

        def key(req: Request) -> tuple[int, int, str]:
            rk = req.routing_key
            if rk and rk in counts:
                return (0, -counts[rk], rk)
            return (1, 0, rk or "")

        waiting.sort(key=key)
