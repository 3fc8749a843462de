"""Checks a plan against the worker's state before anything of it is applied.

A bad plan is answered with an error naming the first problem, and leaves the
worker's state as it was; it never crashes the worker and never produces a
silently wrong answer.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from worker_service.execution.landed_validation import landed_join_problem
from worker_service.execution.plan import Extend, PageCopies, Plan
from worker_service.execution.request_state import SlotState
from worker_service.execution.storage_validation import storage_problem


class PlanError(ValueError):
    pass


def validate_plan(
    plan: Plan,
    slots: dict[int, SlotState],
    *,
    num_pages: int,
    page_size: int,
    vocab_size: int,
    max_context: int,
    adapter_slots: Mapping[int, object] | None = None,
    loaded: Mapping[str, object] | None = None,
    scores_only: bool = False,
    num_swa_pages: int = 0,
    swa_window: int = 0,
    num_host_pages: int = 0,
    file_tier: bool = False,
) -> None:
    """``adapter_slots``: adapter slot -> adapter before the plan;
    ``loaded``: the adapters the plan's slot assignments name that are loaded;
    ``scores_only``: the model is a sequence classifier (no LM head), so every
    request must be one its score head reads (last-token pooling);
    ``num_swa_pages`` > 0: two pools (``_SlidingCheck``); ``num_host_pages``:
    the host tier's pool (0: none, and a plan with page copies is refused);
    ``file_tier``: the worker has one (without it a plan with file copies is
    refused)."""
    if plan.copies is not None:
        _check_copies(plan.copies, num_pages=num_pages, num_host_pages=num_host_pages)
    if plan.storage is not None:
        problem = storage_problem(plan.storage, file_tier=file_tier, num_host_pages=num_host_pages)
        if problem is not None:
            raise PlanError(problem)
    swa = _SlidingCheck(num_swa_pages, swa_window, page_size) if num_swa_pages else None
    held = set(slots)
    for slot in plan.leaves:
        if slot not in held:
            raise PlanError(f"leave of slot {slot}, which the worker does not hold")
        held.discard(slot)
    filled = _check_adapter_slots(plan, adapter_slots or {}, loaded or {})
    # slot -> (kv_len, table length, has a sampled token) at join
    joined: dict[int, tuple[int, int, bool]] = {}
    # Slots of embedding requests (they never sample).
    poolers = {slot for slot, s in slots.items() if s.pooling}
    for j in plan.joins:
        if j.adapter_slot and j.adapter_slot not in filled:
            raise PlanError(
                f"join of slot {j.slot} ({j.rid}) uses adapter slot {j.adapter_slot}, "
                "which holds no adapter"
            )
        if j.slot in held:
            raise PlanError(f"join of slot {j.slot} ({j.rid}), which the worker already holds")
        _check_tokens(j.prefix_ids, vocab_size, f"join of {j.rid}: prefix")
        end = j.sampling.reasoning_end_token
        if end is not None:
            _check_tokens([end], vocab_size, f"join of {j.rid}: reasoning_end_token")
        if j.prompt_len < 1:
            raise PlanError(f"join of {j.rid}: prompt_len must be >= 1")
        if scores_only and j.pooling != "last":
            raise PlanError(
                f"join of {j.rid}: the model is a sequence classifier (a score head, no LM "
                "head); it takes only embedding requests with last-token pooling"
            )
        if j.pooling == "mean" and j.prefix_ids:
            raise PlanError(
                f"join of {j.rid}: mean pooling needs the hidden state of every prompt "
                f"position, but {len(j.prefix_ids)} come from the cache"
            )
        problem = landed_join_problem(
            j,
            num_pages=num_pages,
            page_size=page_size,
            vocab_size=vocab_size,
            max_context=max_context,
            two_pools=bool(num_swa_pages),
        )
        if problem is not None:
            raise PlanError(problem)
        if j.pooling:
            poolers.add(j.slot)
        else:
            poolers.discard(j.slot)
        held.add(j.slot)
        joined[j.slot] = (len(j.prefix_ids), len(j.kv_pages), j.last_token is not None)
    seen: set[int] = set()

    def state_of(slot: int, what: str) -> tuple[int, int, bool, int]:
        """(kv_len, table length, has a sampled token, sliding live from) of a
        slot in this plan."""
        if slot not in held:
            raise PlanError(f"{what} for slot {slot}, which the worker does not hold")
        if slot in seen:
            raise PlanError(f"slot {slot} is scheduled twice in one step")
        seen.add(slot)
        if slot in joined:
            return *joined[slot], 0
        s = slots[slot]
        return s.kv_len, len(s.pages), s.has_sampled_token, s.swa_live_from

    for e in plan.extends:
        kv_len, n_pages, sampled, live_from = state_of(e.slot, "extend")
        if e.draft_len:
            _check_drafted(e, None if e.slot in joined else slots[e.slot], sampled)
        elif sampled:
            raise PlanError(f"extend of slot {e.slot}, which has a sampled token to decode")
        if e.start_pos != kv_len:
            raise PlanError(
                f"extend of slot {e.slot} starts at {e.start_pos}, its KV ends at {kv_len}"
            )
        if not e.input_ids:
            raise PlanError(f"extend of slot {e.slot} has no input tokens")
        if e.sample and e.slot in poolers:
            raise PlanError(f"extend of slot {e.slot} samples, but it is an embedding request")
        _check_tokens(e.input_ids, vocab_size, f"extend of slot {e.slot}")
        if e.next_token is not None:
            _check_tokens([e.next_token], vocab_size, f"extend of slot {e.slot}: next_token")
        _check_pages(e.new_pages, num_pages, f"extend of slot {e.slot}")
        if swa is not None:
            swa.extend(e, n_pages, live_from)
        elif e.new_swa_pages:
            raise PlanError(f"extend of slot {e.slot} has sliding pages; the worker has one pool")
        end = e.start_pos + len(e.input_ids)
        _check_context(e.slot, end, max_context)
        _check_coverage(e.slot, end, n_pages + len(e.new_pages), page_size)
    if not len(plan.decode_slots) == len(plan.decode_positions) == len(plan.decode_new_pages):
        raise PlanError("decode arrays have different lengths")
    swa_new = plan.decode_new_swa_pages
    if len(swa_new) != (len(plan.decode_slots) if swa is not None else 0):
        raise PlanError(
            f"{len(swa_new)} decode sliding pages for {len(plan.decode_slots)} decodes"
            + ("" if swa is not None else "; the worker has one pool")
        )
    for i, (slot, pos, new_page) in enumerate(
        zip(plan.decode_slots, plan.decode_positions, plan.decode_new_pages, strict=True)
    ):
        kv_len, n_pages, sampled, live_from = state_of(slot, "decode")
        if swa is not None:
            swa.decode(slot, pos, new_page=new_page, new_swa=swa_new[i], live_from=live_from)
        if not sampled or slot in poolers:
            raise PlanError(f"decode of slot {slot}, which has no sampled token")
        if pos != kv_len:
            raise PlanError(f"decode of slot {slot} at position {pos}, its KV ends at {kv_len}")
        if new_page:
            _check_pages([new_page - 1], num_pages, f"decode of slot {slot}")
        _check_context(slot, pos + 1, max_context)
        _check_coverage(slot, pos + 1, n_pages + (1 if new_page else 0), page_size)


class _SlidingCheck:
    """Two pools: a plan's sliding pages are parallel to its full ones, inside
    the sliding pool, and none the null page (0) inside a query's window: the
    step reads those entries unmasked (keys at positions >= q - window + 1
    for a query at q), and writes its own positions there. Entries the window
    left behind may be null or stale; they are read only masked."""

    def __init__(self, num_swa_pages: int, window: int, page_size: int) -> None:
        self.num_swa_pages, self.window, self.page_size = num_swa_pages, window, page_size

    def _window_start(self, slot: int, first_query: int, live_from: int, what: str) -> None:
        first_page = max(0, first_query - self.window + 1) // self.page_size
        if first_page < live_from:
            raise PlanError(
                f"{what}: its sliding page {live_from - 1} is the null page "
                f"inside the window of its query at position {first_query} (window "
                f"{self.window}: pages from {first_page} on are read)"
            )

    def extend(self, e: Extend, n_pages: int, live_from: int) -> None:
        new, what = e.new_swa_pages, f"extend of slot {e.slot}"
        if len(new) != len(e.new_pages):
            raise PlanError(
                f"{what}: {len(new)} sliding pages for {len(e.new_pages)} pages (parallel lists)"
            )
        _check_pages(new, self.num_swa_pages, f"{what}: sliding")
        if 0 in new:
            live_from = n_pages + len(new) - new[::-1].index(0)
        self._window_start(e.slot, e.start_pos, live_from, what)

    def decode(self, slot: int, pos: int, *, new_page: int, new_swa: int, live_from: int) -> None:
        what = f"decode of slot {slot}"
        if bool(new_swa) != bool(new_page):
            raise PlanError(f"{what}: a sliding page without a page, or a page without one")
        if new_swa == 1:
            raise PlanError(f"{what}: its new sliding page is the null page 0")
        if new_swa:
            _check_pages([new_swa - 1], self.num_swa_pages, f"{what}: sliding")
        self._window_start(slot, pos, live_from, what)


def _check_copies(copies: PageCopies, *, num_pages: int, num_host_pages: int) -> None:
    """The host tier's columns: a host pool to copy to, parallel columns, every
    page inside its pool, and no device page loaded twice (which copy would
    win is undefined). A host page written back twice is allowed: the later
    copy is kept (a host page freed and reused while the plan was built)."""
    if not num_host_pages:
        raise PlanError(
            f"{copies.num_write_backs} write-backs and {copies.num_loads} loads of host pages, "
            "but the worker has no host KV pool (--enable-hierarchical-cache)"
        )
    pairs = (
        ("write_back_device_pages", copies.write_back_device, num_pages),
        ("write_back_host_pages", copies.write_back_host, num_host_pages),
        ("load_host_pages", copies.load_host, num_host_pages),
        ("load_device_pages", copies.load_device, num_pages),
    )
    for (name_a, a, _), (name_b, b, _) in (pairs[:2], pairs[2:]):
        if len(a) != len(b):
            raise PlanError(f"{len(a)} {name_a} but {len(b)} {name_b} (parallel columns)")
    for name, pages, size in pairs:
        if len(pages) and (int(pages.min()) < 0 or int(pages.max()) >= size):
            bad = pages[(pages < 0) | (pages >= size)][:5].tolist()
            raise PlanError(f"{name}: page ids outside the pool [0, {size}): {bad}")
    load_device = copies.load_device
    if len(np.unique(load_device)) != len(load_device):
        values, counts = np.unique(load_device, return_counts=True)
        raise PlanError(
            f"load_device_pages: device pages loaded twice: {values[counts > 1][:5].tolist()}"
        )


def _check_drafted(e: Extend, state: SlotState | None, sampled: bool) -> None:
    """A drafted extend (speculative decoding) verifies drafts after a decoding
    request's last sampled token: ``input_ids`` = that token, then the drafts.
    ``state``: the slot's state before the plan (None: it joins in this plan);
    ``sampled``: it has a sampled token to decode."""
    what = f"drafted extend of slot {e.slot}"
    if e.draft_len >= len(e.input_ids):
        raise PlanError(
            f"{what}: draft_len {e.draft_len} needs the last sampled token before the "
            f"drafts, but the extend has {len(e.input_ids)} input tokens"
        )
    if not e.sample:
        raise PlanError(f"{what}: drafts are verified by sampling, but sample is false")
    if e.next_token is not None:
        raise PlanError(f"{what}: next_token (prompt logprobs) does not go with drafts")
    if state is not None and state.sampling.grammar is not None:
        raise PlanError(f"{what}: speculative drafts are not supported with a grammar")
    if state is None or not sampled:
        raise PlanError(f"{what}, which is not decoding (it has no sampled token to compute)")
    if e.input_ids[0] != state.tokens[-1]:
        raise PlanError(
            f"{what}: its first input {e.input_ids[0]} is not the request's last sampled "
            f"token {state.tokens[-1]}"
        )


def _check_adapter_slots(
    plan: Plan, before: Mapping[int, object], loaded: Mapping[str, object]
) -> set[int]:
    """The adapter slots that hold an adapter once the plan's assignments apply."""
    filled = set(before)
    assigned: set[int] = set()
    for a in plan.adapter_slots:
        if a.slot < 1:
            raise PlanError(f"adapter slot {a.slot}: slots are numbered from 1 (0 is the base)")
        if a.slot in assigned:
            raise PlanError(f"adapter slot {a.slot} is assigned twice in one plan")
        assigned.add(a.slot)
        if not a.name:
            filled.discard(a.slot)
        elif a.name not in loaded:
            raise PlanError(f"adapter slot {a.slot}: adapter {a.name!r} is not loaded")
        else:
            filled.add(a.slot)
    return filled


def _check_tokens(ids: list[int], vocab_size: int, what: str) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = [t for t in ids if not 0 <= t < vocab_size][:5]
        raise PlanError(f"{what}: token ids outside the vocabulary [0, {vocab_size}): {bad}")


def _check_pages(pages: list[int], num_pages: int, what: str) -> None:
    if pages and (min(pages) < 0 or max(pages) >= num_pages):
        bad = [p for p in pages if not 0 <= p < num_pages][:5]
        raise PlanError(f"{what}: page ids outside the pool [0, {num_pages}): {bad}")


def _check_context(slot: int, kv_len: int, max_context: int) -> None:
    if kv_len > max_context:
        raise PlanError(
            f"slot {slot} would reach position {kv_len - 1}, past the model's context "
            f"({max_context} positions)"
        )


def _check_coverage(slot: int, kv_len: int, n_pages: int, page_size: int) -> None:
    if n_pages * page_size < kv_len:
        raise PlanError(
            f"slot {slot} would hold positions up to {kv_len - 1} in {n_pages} pages of {page_size}"
        )
