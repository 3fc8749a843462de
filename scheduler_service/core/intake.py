"""New requests: what a caller submits, the checks a request passes before it
is queued, and the rule that holds an n > 1 sibling until the request whose
prompt it shares (its leader, ``waits_for``) is planned and so cached.

A ``Submission`` is the plain record a caller hands the core (the API
process sends them across its pipe, like vLLM's EngineCoreRequest or
SGLang's TokenizedGenerateReqInput): ids, sampling, limits and trace
context, nothing of the scheduler's own. The core builds its ``Request``
from it; KV holdings, epochs and speculative scratch never leave the core.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from scheduler_service.core.adapters import AdapterSlots
from scheduler_service.core.bootstrap import Bootstrap
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.embedding import EmbedOptions
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.request import Place, Request
from scheduler_service.core.sampling import (
    NO_LOGPROBS,
    InvalidRequestError,
    LogprobOptions,
    SamplingParams,
)


@dataclass(frozen=True, slots=True)
class Submission:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    logprobs: LogprobOptions = NO_LOGPROBS
    priority: int = 0
    extra_key: str | None = None  # cache namespace (requests with other keys share nothing)
    adapter: str | None = None  # the LoRA adapter's lora_id; None: the base model
    routing_key: str | None = None
    # W3C (traceparent, tracestate) of the traced Generate call.
    trace_context: tuple[str, str] | None = None
    # n > 1: the rid of the sample that prefills the shared prompt.
    waits_for: str | None = None
    speculative: bool = True  # False: this request never drafts
    # An embedding request (max_new_tokens 0): how its vector is pooled.
    embed: EmbedOptions | None = None
    # Prefill/decode disaggregation: the gateway's disaggregated_params.
    bootstrap: Bootstrap | None = None

    def validate(self, vocab_size: int | None, context_len: int | None) -> None:
        """InvalidRequestError if the core would refuse it (the API process
        checks before anything crosses the pipe; the core checks again)."""
        self.to_request().validate(vocab_size, context_len)

    def to_request(self) -> Request:
        return Request(
            self.rid,
            list(self.prompt_ids),
            self.sampling,
            self.logprobs,
            priority=self.priority,
            extra_key=self.extra_key,
            adapter=self.adapter,
            routing_key=self.routing_key,
            trace_context=self.trace_context,
            waits_for=self.waits_for,
            speculative=self.speculative,
            embed=self.embed,
            bootstrap=self.bootstrap,
        )


def check_new_request(
    req: Request,
    requests: Mapping[str, Request],
    config: SchedulerConfig,
    *,
    adapters: AdapterSlots,
    pool: PagePool,
) -> None:
    """Raise InvalidRequestError if ``req`` can never run; a request with a
    LoRA adapter gets the adapter's cache namespace (``extra_key``)."""
    if req.rid in requests:
        raise InvalidRequestError(f"request id {req.rid!r} is already in use")
    if req.place is not Place.NEW or req.output_ids or req.pages:
        raise InvalidRequestError(f"request {req.rid!r} is not a fresh request")
    req.validate(config.vocab_size, config.context_len)
    if req.bootstrap is not None and config.disaggregation_mode is None:
        raise InvalidRequestError(
            f"request {req.rid}: disaggregated_params name bootstrap room "
            f"{req.bootstrap.room}, but this unit is not disaggregated"
        )
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
        leader.place is not Place.WAITING and leader.kv_len >= len(leader.prompt_ids)
    )
