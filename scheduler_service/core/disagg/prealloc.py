"""A decode unit's preallocation (SGLang's DecodePreallocQueue.pop_preallocated):
which announced requests get the pages their prompt's KV will be written
into, this step.

Budgeted like admission (admission/adder.py): a request is taken while its
expected need (the prompt past its cached prefix, its clipped
max_new_tokens and a page) is below the total budget left after what the
running requests and the transfers already preallocated are expected to
need, and while the decode batch (running plus receiving) stays within
``max_running_requests``. When nothing runs and nothing is being received
a request is taken whenever its pages physically fit, as an idle scheduler
admits. The queue is served in order (by priority first under priority
scheduling), the first that does not fit stopping it.

Each taken request matches the radix cache first (a cached prefix is not
transferred), locks its match and gets pages for the rest of its prompt;
the pages it takes count for the next one.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_service.core.admission.adder import PrefillAdder
from scheduler_service.core.admission.decision import match_prefix
from scheduler_service.core.config import CLIP_MAX_NEW_TOKENS, SchedulerConfig
from scheduler_service.core.kv.manager import KvManager
from scheduler_service.core.request import Request


def preallocate(
    config: SchedulerConfig,
    kv: KvManager,
    queue: Sequence[Request],
    *,
    running: Sequence[Request],
    receiving: Sequence[Request],
    new_token_ratio: float,
) -> list[Request]:
    """Give pages to the requests of ``queue`` (PREALLOC, in order) that fit;
    the ones that got them, each with its table covering its whole prompt
    (``kv_len``) and its cached prefix in ``match_len``."""
    if config.enable_priority_scheduling:
        sign = config.priority_sign
        queue = sorted(queue, key=lambda r: r.priority * sign)
    budget = PrefillAdder(config, kv, list(running), new_token_ratio, reserved=receiving)
    page_size = kv.page_size
    taken: list[Request] = []
    for req in queue:
        if len(running) + len(receiving) + len(taken) >= config.max_running_requests:
            break
        idle = not running and not receiving and not taken
        match_prefix(kv.cache, req)
        if budget.admission_need(req) >= budget.rem_total_tokens and not idle:
            break
        kv.cache.lock(req.match_node)
        prompt_len = len(req.prompt_ids)
        if -(-prompt_len // page_size) - len(req.match_pages) > kv.available_pages():
            kv.cache.unlock(req.match_node)
            break
        kv.attach_prefix(req, req.match_pages, req.match_len, req.match_node)
        if kv.grow(req, prompt_len) is None:
            raise RuntimeError(f"preallocation of {req.rid} lacks pages it counted")
        req.kv_len = prompt_len
        # Its prompt's pages are taken now (and so out of the budget); what
        # it will decode is expected like a running request's need.
        remaining = min(req.sampling.max_new_tokens, CLIP_MAX_NEW_TOKENS)
        budget.rem_total_offset += remaining * new_token_ratio + page_size
        taken.append(req)
    return taken


__all__ = ["preallocate"]
