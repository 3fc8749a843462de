"""New requests: the checks a request passes before it is queued, and the
n > 1 siblings held until the request whose prompt they share (their
leader, ``waits_for``) is planned and so cached."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from scheduler_service.core.adapters import AdapterSlots
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.request import Request, RequestState
from scheduler_service.core.sampling import InvalidRequestError


def check_new_request(
    req: Request,
    requests: Mapping[str, Request],
    config: SchedulerConfig,
    adapters: AdapterSlots,
    pool: PagePool,
) -> None:
    """Raise InvalidRequestError if ``req`` can never run; a request with a
    LoRA adapter gets the adapter's cache namespace (``extra_key``)."""
    if req.rid in requests:
        raise InvalidRequestError(f"request id {req.rid!r} is already in use")
    if req.state is not RequestState.WAITING or req.output_ids or req.pages:
        raise InvalidRequestError(f"request {req.rid!r} is not a fresh request")
    req.validate(config.vocab_size, config.context_len)
    if req.adapter is not None:
        if req.adapter not in adapters.loaded:
            raise InvalidRequestError(f"lora_id {req.adapter!r} names no loaded LoRA adapter")
        # Each adapter's prefixes live in a cache namespace of their own.
        salt = f"|{req.extra_key}" if req.extra_key is not None else ""
        req.extra_key = f"lora:{req.adapter}{salt}"
    capacity = pool.num_pages * pool.page_size
    if len(req.prompt_ids) + 1 > capacity:
        raise InvalidRequestError(
            f"request {req.rid}: the prompt has {len(req.prompt_ids)} tokens but the KV "
            f"cache holds {capacity} tokens in all"
        )


def leader_planned(req: Request, requests: Mapping[str, Request]) -> bool:
    """Whether the sibling ``req`` waits for is gone or has its prompt planned."""
    leader = requests.get(req.waits_for)
    return leader is None or (
        leader.state is not RequestState.WAITING and leader.kv_len >= len(leader.prompt_ids)
    )


def release_held(
    held: list[Request],
    requests: Mapping[str, Request],
    waiting: list[Request],
    clock: Callable[[], float],
) -> list[Request]:
    """Move the held siblings whose leader is planned to ``waiting``; return
    those still held."""
    still = []
    for req in held:
        if leader_planned(req, requests):
            req.waits_for = None
            req.times.queue_entry = clock()
            waiting.append(req)
        else:
            still.append(req)
    return still
