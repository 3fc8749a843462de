"""A generation request as the scheduler sees it: tokens, its place, and KV holdings.

Places (``Request.place``; only the request table, request_table.py, moves a
request, and every move checks where it is)::

    NEW --add--> HELD --leader planned--> WAITING --admit--> CHUNKED --last chunk--> RUNNING
                                             ^                  |  ^ (next chunk)      |
                                             |                  v  |                   |
                                             +---- retract / preempt / worker loss ----+
                                             |
                         SCORING (max_new_tokens 0, prefill in flight) --result--> FINISHED

    and any live place --abort / finish--> FINISHED

Prefill/decode disaggregation (core/disagg/) adds four places, off the
worker, for requests that carry a bootstrap room::

    prefill unit:  NEW -> BOOTSTRAPPING --peer claimed the room--> WAITING -> ...
                   ... RUNNING --first token--> SENDING --peer acknowledged--> FINISHED
    decode unit:   NEW -> PREALLOC --pages allocated--> RECEIVING --KV landed--> RUNNING

A request back in WAITING keeps ``output_ids``; it re-prefills prompt +
output (mostly from the prefix cache) and its output continues unchanged.
"""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field
from typing import Any

from scheduler_service.core.bootstrap import Bootstrap
from scheduler_service.core.embedding import EmbedOptions
from scheduler_service.core.ids import IdRangeError, id_array
from scheduler_service.core.sampling import (
    NO_LOGPROBS,
    InvalidRequestError,
    LogprobOptions,
    SamplingParams,
)


class Place(enum.Enum):
    NEW = "new"  # not in the table yet
    HELD = "held"  # an n > 1 sibling: waits until its leader's prompt is planned
    WAITING = "waiting"  # in the queue (new, or back after retraction, preemption, loss)
    CHUNKED = "chunked"  # its prefill continues next step
    RUNNING = "running"  # in the decode batch
    SCORING = "scoring"  # max_new_tokens 0: its last prefill chunk is in flight
    # Disaggregation (core/disagg/): a prefill unit's request waiting for the
    # decode unit to claim its room, and one whose KV pages are being sent; a
    # decode unit's request waiting for pages, and one whose pages are being
    # filled by the prefill unit.
    BOOTSTRAPPING = "bootstrapping"
    SENDING = "sending"
    PREALLOC = "prealloc"
    RECEIVING = "receiving"
    FINISHED = "finished"


# Where the worker holds the request's state (a join put it there; leaving
# one of these places tells the worker to drop it, unless the worker is lost).
ON_WORKER = frozenset({Place.CHUNKED, Place.RUNNING, Place.SCORING})
# The disaggregation places: off the worker, in the request table's
# ``parked`` container (core/disagg/ decides every move in or out).
PARKED = frozenset({Place.BOOTSTRAPPING, Place.SENDING, Place.PREALLOC, Place.RECEIVING})


class IllegalMoveError(RuntimeError):
    """A request was moved from a place it is not in (a scheduler bug)."""


@dataclass(frozen=True, slots=True)
class FinishStop:
    """Stopped on an EOS / stop token id (int) or a stop string (str)."""

    matched: int | str
    kind = "stop"


@dataclass(frozen=True, slots=True)
class FinishLength:
    """Reached max_new_tokens (or the context length)."""

    length: int
    kind = "length"


@dataclass(frozen=True, slots=True)
class FinishAbort:
    """Aborted by the client, by validation, or by the scheduler (out of memory).

    ``code``: the gRPC status name the call ends with when the scheduler or
    the engine decided the abort (SGLang's servicer ends such a stream with
    the abort's status and message, never with a completion that drops the
    message); empty for an abort the client asked for, which ends as a
    completion with finish_reason "abort"."""

    message: str
    code: str = ""
    kind = "abort"


# The status of an abort the scheduler decides because the KV cache cannot
# hold the request (and of a request evicted from a full queue, which the
# API process decides): the server's capacity, not a fault (INTERNAL is a
# broken invariant) nor a lost worker (UNAVAILABLE).
OUT_OF_CAPACITY = "RESOURCE_EXHAUSTED"
# A request lost with the worker group's state that cannot run on (an
# adapter that no longer loads): retry it elsewhere.
WORKER_LOST = "UNAVAILABLE"


FinishReason = FinishStop | FinishLength | FinishAbort


@dataclass(slots=True)
class RequestTimes:
    """Clock readings (the scheduler's clock) at the request's milestones."""

    arrival: float = 0.0
    queue_entry: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(slots=True, eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: LogprobOptions = NO_LOGPROBS
    priority: int = 0
    extra_key: str | None = None
    # The LoRA adapter (its lora_id) this request runs with; None: the base model.
    adapter: str | None = None
    routing_key: str | None = None
    trace_id: str = ""  # for log lines (the service sets it from the trace context)
    # W3C (traceparent, tracestate) of the request's traced Generate call: the
    # core's spans hang under it and the worker's step spans link to it.
    trace_context: tuple[str, str] | None = None
    # n > 1: the rid of the sample that prefills the shared prompt. This one is
    # held until that prefill is planned, then reads the prompt from the cache.
    waits_for: str | None = None
    # Speculative decoding for this request (custom_params "speculative":
    # false turns it off; the service's --speculative-ngram rules first).
    speculative: bool = True
    # An embedding request (max_new_tokens 0): its pooled vector comes back
    # with its last prompt chunk's result (core/embedding.py).
    embed: EmbedOptions | None = None
    # Prefill/decode disaggregation: the peer's bootstrap room (None: served
    # here alone, core/disagg/).
    bootstrap: Bootstrap | None = None

    output_ids: list[int] = field(default_factory=list)
    place: Place = Place.NEW
    finish_reason: FinishReason | None = None
    times: RequestTimes = field(default_factory=RequestTimes)

    # --- KV holdings, owned by the scheduler (see kv/manager.py) ---
    # Page table: page i holds positions [i * page_size, (i + 1) * page_size),
    # packed 32-bit page ids (radix_node.id_array).
    pages: array = field(default_factory=id_array)
    # The first `tree_pages` pages belong to the radix cache and are kept alive
    # by the lock on `last_node`, except `dup_pages`: this request's own
    # copies of pages the cache got from another request first; the pages
    # past `tree_pages` are this request's own.
    tree_pages: int = 0
    dup_pages: array = field(default_factory=id_array)
    last_node: Any = None
    # A model with a sliding pool (kv/sliding.py): the sliding table, parallel
    # to ``pages``; each nonzero entry is a reference this request holds, 0
    # where the page left every future query's window; entries
    # [0, swa_freed) are all 0.
    swa_pages: array = field(default_factory=id_array)
    swa_freed: int = 0
    # Positions [0, kv_len) have their KV computed or in an in-flight step.
    kv_len: int = 0
    # Sampled tokens in steps whose results have not come back (overlap).
    pending: int = 0
    # Bumped whenever in-flight results for this request become meaningless
    # (retraction, preemption, finish); results carry the epoch they were for.
    epoch: int = 0
    # The worker's adapter slot this request holds while on the worker (0: none).
    adapter_slot: int = 0
    # Whether prompt logprobs still have to be computed (cleared after the
    # first full prefill so a retracted request re-prefills from the cache).
    prompt_logprobs_pending: bool = False
    # Next prompt position whose logprob the client has not been sent.
    prompt_logprobs_sent: int = 0

    # --- statistics ---
    # Prompt tokens read from the prefix cache, counted once at the first
    # admission (SGLang's rule): a retracted or preempted request reads back
    # what it computed itself, which is no hit. A worker loss drops the cache
    # and resets the count (what was read is recomputed): the next admission
    # counts again.
    cached_tokens: int = 0
    cache_hits_counted: bool = False
    retractions: int = 0
    preemptions: int = 0
    # Speculative decoding: drafted tokens sent for verification, and those
    # the worker accepted (SGLang's spec_draft_tokens / spec_accepted_tokens).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    # --- per-step scratch written by the policy and the prefill adder ---
    match_pages: array = field(default_factory=id_array)
    match_node: Any = None
    match_len: int = 0
    match_swa: array | None = None
    # The host tier: tokens past match_len whose KV is only on the host, and
    # the deepest node of the whole match (kv/hiradix_cache.py).
    match_host_len: int = 0
    match_host_node: Any = None
    # The file tier: prefetches this request started (kv/storage_tier.py
    # bounds them).
    storage_prefetches: int = 0
    # Speculative decoding state (core/spec_state.SpecState) while the
    # request may draft; None: it never drafts (off, opted out, grammar).
    spec: Any = None

    # prompt_ids + output_ids packed for the radix cache: built once at
    # submission (validate) and appended to as outputs arrive (token_array).
    _tokens: array | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.prompt_logprobs_pending = self.logprobs.wants_prompt_logprobs
        self.prompt_logprobs_sent = max(self.logprobs.logprob_start_len, 0)

    # ---------------------------------------------------------------- state
    @property
    def on_worker(self) -> bool:
        """Whether the worker holds state for this request."""
        return self.place in ON_WORKER

    @property
    def finished(self) -> bool:
        return self.place is Place.FINISHED

    def finish(self, reason: FinishReason, now: float) -> None:
        """Record why it finished (the request table has taken it out)."""
        self.finish_reason = reason
        self.times.finished = now
        self.epoch += 1
        self.pending = 0

    def back_to_wait(self, now: float) -> None:
        """Its KV released or lost (retraction, preemption, worker loss): what
        plans already sent bring for it is stale (the table moves it)."""
        self.epoch += 1
        self.pending = 0
        if self.spec is not None:
            self.spec.inflight = 0
        self.times.queue_entry = now

    def forget_kv(self) -> None:
        """Drop every KV holding without giving anything back (the worker group
        that held the pages is gone, and the pool and cache are wiped)."""
        self.pages = id_array()
        self.tree_pages = 0
        self.dup_pages = id_array()
        self.last_node = None
        self.kv_len = 0
        self.swa_pages = id_array()
        self.swa_freed = 0

    # --------------------------------------------------------------- tokens
    @property
    def num_tokens(self) -> int:
        """Prompt plus known output tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def planned_outputs(self) -> int:
        """Output tokens known or already being sampled by in-flight steps."""
        return len(self.output_ids) + self.pending

    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_array(self) -> array:
        """Prompt plus known output tokens as the packed array the radix cache
        takes. Kept, not rebuilt: packed once, then only new outputs are
        appended (``prompt_ids`` does not change once submitted and
        ``output_ids`` only grows). The cache copies what it keeps."""
        t = self._tokens
        n_prompt = len(self.prompt_ids)
        total = n_prompt + len(self.output_ids)
        have = -1 if t is None else len(t)
        if have == total:
            return t
        if t is None or have < n_prompt or have > total:
            t = self._tokens = id_array(self.prompt_ids)
            have = n_prompt
        if have < total:
            # One bulk pack of the new outputs (array.extend(list) parses
            # each item, about 5x slower).
            t += id_array(self.output_ids[have - n_prompt :])
        return t

    def max_prefix_len(self) -> int:
        """How many leading tokens may come from the prefix cache.

        At least one token must be computed to get logits, and so must the
        positions whose logits score the prompt tokens whose logprobs were
        asked for (token p is scored by the logits at p - 1), and every
        prompt position of a mean-pooled embedding.
        """
        limit = self.num_tokens - 1
        if self.embed is not None and not self.embed.reads_cache:
            return 0
        if self.prompt_logprobs_pending:
            # The logprob of prompt token p comes from the logits at p - 1.
            limit = min(limit, self.logprobs.logprob_start_len - 1)
        return max(limit, 0)

    def validate(self, vocab_size: int | None = None, context_len: int | None = None) -> None:
        if not self.prompt_ids:
            raise InvalidRequestError(f"request {self.rid}: the prompt is empty")
        if vocab_size is not None:
            bad = [t for t in self.prompt_ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"request {self.rid}: prompt token ids outside the vocabulary "
                    f"[0, {vocab_size}): {bad[:5]}"
                )
        if context_len is not None:
            total = len(self.prompt_ids) + self.sampling.max_new_tokens
            if len(self.prompt_ids) >= context_len:
                raise InvalidRequestError(
                    f"request {self.rid}: the prompt has {len(self.prompt_ids)} tokens, "
                    f"the model's context is {context_len}"
                )
            if total > context_len:
                raise InvalidRequestError(
                    f"request {self.rid}: prompt ({len(self.prompt_ids)} tokens) + max_new_tokens "
                    f"({self.sampling.max_new_tokens}) = {total} exceeds the context length "
                    f"{context_len}"
                )
        self.sampling.validate(vocab_size)
        self.logprobs.validate(len(self.prompt_ids))
        if self.embed is not None and (self.sampling.max_new_tokens or self.output_ids):
            raise InvalidRequestError(f"request {self.rid}: an embedding request generates nothing")
        try:
            self.token_array()  # packed once, at submission
        except IdRangeError as e:
            raise InvalidRequestError(f"request {self.rid}: {e}") from None


__all__ = [
    "ON_WORKER",
    "OUT_OF_CAPACITY",
    "PARKED",
    "WORKER_LOST",
    "FinishAbort",
    "FinishLength",
    "FinishReason",
    "FinishStop",
    "IllegalMoveError",
    "Place",
    "Request",
    "RequestTimes",
]
