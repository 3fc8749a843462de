"""Messages between the API process and the core process (a local pipe).

The API process (public gRPC, tokenization, one coroutine per client stream)
and the core process (Scheduler + worker streams) run apart so that no slow
client can ever delay a step: the core only ever writes one message per step
into a pipe. Both ends are our own processes, spawned together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from scheduler_service.core.disagg.orders import DisaggFigures
from scheduler_service.core.intake import Submission
from scheduler_service.core.kv.events import KvEvent
from scheduler_service.core.plan import TokenLogprobs


# ----------------------------------------------------------- API -> core
@dataclass
class Submit:
    """One Generate call's samples, as plain submission records (the core
    builds its own requests from them): each carries its trace context and,
    for n > 1, the sample whose prefill it waits for (``waits_for``)."""

    submissions: list[Submission]


@dataclass
class Abort:
    rids: list[str]
    reason: str


@dataclass
class FlushCache:
    token: int


@dataclass
class Shutdown:
    pass


@dataclass
class LoadAdapter:
    """LoadLoRAAdapter: load on every worker rank, then register."""

    token: int
    lora_id: str
    name: str
    path: str
    pinned: bool


@dataclass
class UnloadAdapter:
    """UnloadLoRAAdapter by lora_id (and/or name); refused while requests use it."""

    token: int
    lora_id: str
    name: str


# ----------------------------------------------------------- core -> API
@dataclass(frozen=True)
class AdapterInfo:
    lora_id: str
    name: str
    path: str
    pinned: bool


@dataclass
class AdapterReply:
    """The answer to a LoadAdapter or UnloadAdapter, with the adapters loaded
    after it (the engine's truth). ``code``: a gRPC status name when not ok."""

    token: int
    ok: bool
    message: str
    adapters: list[AdapterInfo]
    code: str = "OK"


@dataclass
class Ready:
    model_name: str
    architecture: str
    vocab_size: int
    eos_token_ids: list[int]
    max_context_len: int
    page_size: int
    num_pages: int
    tp_size: int
    tokenizer_zip: bytes
    worker_info: dict
    sampling_worker: str = ""  # HOST:PORT of rank 0, which compiles grammars
    adapters: list[AdapterInfo] = field(default_factory=list)  # loaded at start
    # rank 0's device memory (GetLoads' memory section) and grammar backend
    # ("xgrammar" or "none"; "" from a worker that does not say)
    weight_bytes: int = 0
    kv_cache_bytes: int = 0
    graph_bytes: int = 0
    grammar_backend: str = ""
    bos_token_id: int | None = None
    pad_token_id: int | None = None  # the tokenizer's (None: it declares none)
    # The model author's sampling defaults (temperature, top_p, top_k, min_p,
    # repetition_penalty, max_new_tokens: those declared).
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)


@dataclass
class Finish:
    kind: str  # stop | length | abort
    matched_token: int | None = None
    matched_str: str | None = None
    message: str = ""
    # An abort the service decided (core.request.FinishAbort.code): the call
    # ends with this gRPC status and ``message`` instead of a completion.
    code: str = ""
    # Speculative decoding: tokens drafted for the sample and those accepted.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class DeltaOut(NamedTuple):
    """One request's news of one step (a tuple: hundreds cross the pipe per step)."""

    rid: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_start: int = 0
    cached_tokens: int = 0
    finish: Finish | None = None
    # prefill-only scoring: the requested ids' logprobs after the prompt
    next_token_logprobs: TokenLogprobs | None = None
    # The text so far ends with the start of a stop string: a streaming call
    # sends nothing yet (core/results.py).
    holding: bool = False
    embedding: list[float] | None = None  # an embedding request's vector


@dataclass
class Load:
    running: int
    waiting: int
    used_tokens: int
    total_tokens: int
    cache_hit_rate: float
    gen_tokens: int  # generated so far (throughput is derived by the reader)
    steps: int
    worker_busy_ms: float
    worker_idle_ms: float
    core_cpu_s: float
    max_running_requests: int
    retractions: int = 0
    preemptions: int = 0
    # (bucket counts, sum) of arrival -> admission times, when they changed
    queue_time: tuple[tuple[int, ...], float] | None = None
    worker_connected: bool = True
    worker_losses: int = 0  # times the worker group's streams broke
    # Speculative decoding since start: steps that verified drafts, drafted
    # and accepted tokens.
    spec_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    worker_recoveries: int = 0  # times it came back and serving resumed
    # requests the core holds any state for (the scheduler's request table,
    # which includes held n > 1 siblings): 0 when idle, or something leaked
    tracked: int = 0
    # tokens the waiting requests still have to prefill (core/outputs.py
    # LoadFigures), the worker's adapter slots in use and in all, and the
    # drafted rows verified since start (speculative acceptance length)
    waiting_uncached_tokens: int = 0
    retracted_waiting: int = 0
    adapter_slots_used: int = 0
    adapter_slots_total: int = 0
    spec_rows: int = 0
    # The host KV tier since start: tokens of the pages loaded from the host
    # (host hits) and written to it, counted as planned.
    hicache_loaded_tokens: int = 0
    hicache_written_tokens: int = 0
    # its host pool's pages holding KV, and in all (0 without the tier)
    hicache_host_pages_used: int = 0
    hicache_host_pages_total: int = 0
    # Prefill/decode disaggregation: the unit's role and queues (GetLoads'
    # disagg section); None when it serves alone.
    disagg: DisaggFigures | None = None


_new_delta = tuple.__new__  # DeltaOut without the Python-level __new__


@dataclass
class Outputs:
    """One step's news. The common delta, one token without logprobs or a
    finish, travels as three flat columns (a list of ints pickles far faster
    than hundreds of small tuples): entry i is ``rids[i]`` getting
    ``tokens[i]`` with ``cached[i]`` cached tokens, or, where ``tokens[i]``
    is None, the next delta of ``deltas``. With no columns, ``deltas`` is all."""

    deltas: list[DeltaOut]
    load: Load
    events: list[KvEvent] = field(default_factory=list)
    rids: list[str] = field(default_factory=list)
    tokens: list[int | None] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)

    def items(self) -> list[DeltaOut]:
        """Every delta, in the order the core produced them."""
        if not self.rids:
            return self.deltas
        others = iter(self.deltas).__next__
        return [
            others()
            if token is None
            else _new_delta(
                DeltaOut, (rid, [token], None, None, 0, cached, None, None, False, None)
            )
            for rid, token, cached in zip(self.rids, self.tokens, self.cached, strict=True)
        ]


@dataclass
class Rejected:
    rid: str
    message: str


@dataclass
class Flushed:
    token: int
    success: bool
    message: str


@dataclass
class Unavailable:
    """These requests are dropped: the worker group stayed lost past
    --worker-recovery-timeout. Their calls end with UNAVAILABLE; the core
    lives on and serves again once the group is back."""

    rids: list[str]
    message: str


@dataclass
class Failed:
    """The core cannot go on: the worker group broke (the API reports
    UNAVAILABLE) or its own state did (INTERNAL, with --check-integrity)."""

    message: str
    code: str = "UNAVAILABLE"
