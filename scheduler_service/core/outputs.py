"""What the scheduler hands back to the service after each update."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_service.core.adapters import AdapterSlots
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.plan import TokenLogprobs
from scheduler_service.core.request import Request
from scheduler_service.core.request_table import RequestTable


@dataclass(slots=True)
class RequestDelta:
    """New tokens of one request (and whether it just finished).

    ``req.finish_reason`` tells why when ``finished``; the delta of a request
    finished outside a step (abort, out of memory) carries no tokens.
    """

    req: Request
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # Prompt logprobs, in prompt order, starting at prompt position
    # ``prompt_logprobs_start``; each position is delivered once.
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_start: int = 0
    finished: bool = False
    # Prefill-only scoring: the requested ids' logprobs after the prompt.
    next_token_logprobs: TokenLogprobs | None = None
    # The text so far ends with the start of one of the request's stop
    # strings: a streaming call holds these tokens back (results.py).
    holding: bool = False
    # An embedding request's pooled vector (then no tokens).
    embedding: list[float] | None = None
    # One token and nothing else (no logprobs asked, no finish, not holding):
    # set where a plain token is received, so a reader can skip its checks.
    plain: bool = False


_new_delta = RequestDelta.__new__


def plain_delta(req: Request, token: int) -> RequestDelta:
    """The delta of one plain token, not yet known to finish anything (one
    per running request per step: built without the dataclass __init__)."""
    d = _new_delta(RequestDelta)
    d.req = req
    d.new_token_ids = [token]
    d.logprobs = [None]
    d.prompt_logprobs = None
    d.prompt_logprobs_start = 0
    d.finished = False
    d.next_token_logprobs = None
    d.holding = False
    d.embedding = None
    d.plain = True
    return d


@dataclass(frozen=True, slots=True)
class LoadFigures:
    """What a load report needs beyond the table's sizes and the KV pool."""

    # Prompt (and, after a requeue, output) tokens the waiting requests and a
    # chunked prefill still have to compute: SGLang's
    # num_waiting_uncached_tokens, the gateway's measure of queued work. A
    # waiting request counts its last matched prefix as cached (matched each
    # step under the cache-aware policies; under fcfs a request not yet
    # matched counts whole). Held n > 1 siblings count nothing: their prompt
    # is their leader's.
    waiting_uncached_tokens: int
    retracted_waiting: int  # waiting requests that were retracted to fit decode
    adapter_slots_used: int  # worker adapter slots that hold an adapter
    adapter_slots_total: int
    host_pages_used: int = 0  # the host KV tier's pool: pages holding KV, and in all
    host_pages_total: int = 0


def load_figures(
    table: RequestTable, slots: AdapterSlots, host: PagePool | None = None
) -> LoadFigures:
    """The load report's figures; ``host`` is the host tier's pool, if any."""
    uncached = retracted = 0
    for r in table.waiting:
        uncached += max(0, r.num_tokens - r.match_len)
        retracted += r.retractions > 0
    if table.chunked is not None:
        uncached += max(0, table.chunked.num_tokens - table.chunked.kv_len)
    used = sum(holder is not None for holder in slots.holder[1:])
    return LoadFigures(
        uncached,
        retracted,
        used,
        slots.max_per_batch,
        host.num_used if host else 0,
        host.num_pages if host else 0,
    )


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    retractions: int = 0
    preemptions: int = 0
    oom_aborts: int = 0
    discarded_tokens: int = 0  # sampled in flight for requests that had moved on
    worker_losses: int = 0  # times the worker group was lost and the KV state dropped
    worker_loss_requeues: int = 0  # requests sent back to wait by those losses
    finished: dict[str, int] = field(default_factory=dict)  # by finish kind
    # Speculative decoding: steps with drafted rows, drafts sent and drafts the
    # worker accepted (acceptance rate = accepted / draft tokens), and the
    # times step() planned nothing so the pipeline drained for drafts.
    spec_steps: int = 0
    spec_rows: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drains: int = 0
    # The host tier: tokens of the pages loaded from the host (host hits) and
    # written to it, counted as the plans carrying them are made.
    hicache_loaded_tokens: int = 0
    hicache_written_tokens: int = 0
    # Disaggregation (core/disagg/): KV sent and acknowledged (prefill unit),
    # KV received (decode unit), and requests ended by a failed or timed-out
    # transfer or peer.
    disagg_sent: int = 0
    disagg_received: int = 0
    disagg_failed: int = 0
