"""Step plans and results: what the scheduler sends the worker each step
and what comes back (the shape of the worker protocol, transport-neutral).

The worker keeps per-request state between steps (page table, sampling
params, sequence so far, last sampled token), so a plan carries deltas only;
its parts have the worker protocol's names:

- ``leaves``: requests whose state the worker drops (finished, aborted,
  retracted), applied first;
- ``joins``: requests the worker does not hold yet, with their parameters
  and the tokens before their first scheduled position (served from the
  prefix cache, so never sent as inputs);
- ``extends`` then ``decodes``: for each scheduled request, the tokens to
  compute from ``start_pos`` and the page ids appended to its table. An
  extend carries its tokens (a prefill chunk, or a drafted row: the last
  sampled token and drafts); a decode computes "my last sampled token", which
  lets the scheduler send plan N+1 before result N arrives. The worker
  computes extends before decodes: the plan keeps them in two lists, so that
  order needs no sorting.

Every position p the plan computes is written at slot p % page_size of page
table[p // page_size].

With the host tier (kv/hiradix_cache.py) a plan also carries page copies
between the worker's device pool and its host pool:

- ``write_backs``: device page -> host page (a node copied to the host:
  write-through, or written back as the device evicts it);
- ``loads``: host page -> device page (a host-only prefix a request of this
  plan reads).

What the worker must guarantee: it applies a plan's write-backs (in list
order: a host page freed and reused while the plan was built may be written
twice, the later copy the one kept), then its loads, then runs its forward,
and plans in order. So every write-back has
read its device page before this plan's loads or forward write any page (a
device page the scheduler freed by planning its write-back may be handed to
a load or a new table in the same plan), every load has filled its device
page before the forward reads it, and a host page is read by a load only
after the write-back that filled it (same plan or earlier). Nothing of
either crosses into the next plan: the next plan may reuse any page freed
here.

With the file tier behind the host tier (kv/storage_tier.py) a plan may
also carry copies between the host pool and the worker's file store
(files named by the page's chained block hash):

- ``storage_writes``: host page -> the file of its block hash (a node
  written to the host is backed up). The worker reads each host page after
  this plan's write-backs and before it answers the plan (it may copy the
  bytes aside and write the file later, atomically; a page whose file
  exists is skipped). The scheduler counts the block as stored at once and
  learns of no failure: a later read of a file that never came whole fails
  and is handled as below.
- ``storage_reads``: the file of a block hash -> host page (a prefetch for
  a waiting request). The worker may finish them after it answers the plan
  (a background reader): each host page named is the read's alone until
  the worker reports it. It reports every plan's reads once all of them
  are done, in any later result (``StepResult.storage_done``: the plan's
  step id and the indices that failed: a missing, truncated, corrupt or
  foreign file). Only then does the scheduler put the pages that came
  whole into the tree; a failed read's page is freed and its tokens are
  computed. While reads are outstanding and nothing else runs, the
  scheduler sends IDLE plans to collect the reports: the worker answers
  such a plan (nothing to run, reads outstanding) once some report is
  ready or a few milliseconds passed, so the poll does not spin.

A plan is also the scheduler's record of itself until its result comes
back (``Scheduler.in_flight()``): each ``PlanEntry`` names its request and the
request's epoch when planned, so a result for a request that moved on since
(retracted, preempted, finished) is recognised and dropped.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field

from scheduler_service.core.embedding import EmbedOptions
from scheduler_service.core.ids import PageCopies, StorageCopies, StorageReadsDone
from scheduler_service.core.request import Request
from scheduler_service.core.sampling import LogprobOptions, SamplingParams


class ProtocolError(RuntimeError):
    """A step result that does not fit the plan it answers."""


class ForwardMode(enum.Enum):
    PREFILL = "prefill"  # extends only
    DECODE = "decode"  # decodes only
    MIXED = "mixed"  # extends and decodes in one forward
    IDLE = "idle"  # no forward: only joins / leaves to apply


@dataclass(frozen=True, slots=True)
class Join:
    rid: str
    sampling: SamplingParams
    logprobs: LogprobOptions
    prompt_len: int
    _: KW_ONLY
    # Tokens [0, first start_pos): the cached prefix the worker will not see as
    # inputs. Together with inputs and samples it gives the whole sequence
    # (penalties, seeds and prompt logprobs need it).
    prefix_ids: list[int]
    # Output tokens already generated (a retracted request resuming): they sit
    # at positions >= prompt_len and count for penalties and seeded sampling.
    num_output_tokens: int = 0
    # (traceparent, tracestate) of a traced request: its step spans link to it.
    trace_context: tuple[str, str] | None = None
    # The adapter slot the request runs with (0: the base model).
    adapter_slot: int = 0
    # An embedding request: the worker pools its prompt's hidden states.
    embed: EmbedOptions | None = None
    # A decode unit's request whose prompt KV came from a prefill unit
    # (core/disagg/): the worker takes ``kv_pages`` as its table, holding the
    # KV of ``prefix_ids`` (the whole prompt), and ``last_token`` (the first
    # token, sampled by the prefill unit; counted in num_output_tokens) as its
    # last sampled token, which its first decode computes. None: a plain join.
    last_token: int | None = None
    kv_pages: Sequence[int] = ()


@dataclass(slots=True, eq=False)
class PlanEntry:
    """One request's part of a step (an extend or a decode)."""

    req: Request
    epoch: int  # the request's epoch when planned
    start_pos: int
    input_ids: list[int] | None  # None (a decode): the last token the worker sampled for it
    _: KW_ONLY
    # Page ids appended to the request's table: a list, or a slice of the
    # request's packed page table (array('i')) for a prefill.
    new_pages: Sequence[int]
    sample: bool  # False for a prefill chunk that does not reach the end
    # The prompt token right after a chunk that stops inside the prompt, sent
    # when prompt logprobs are wanted so the chunk's last logits can score it.
    next_token: int | None = None
    # A model with a sliding pool: the sliding pages appended to the
    # request's sliding table, parallel to new_pages (0: the null page).
    new_swa_pages: Sequence[int] = ()
    # Speculative decoding: the drafted tokens after input_ids[0] (the last
    # sampled token); the worker verifies them and answers 1..len + 1 tokens
    # (RequestOutput.more_tokens).
    drafts: list[int] | None = None
    # The transport's name for the request in this plan (the worker
    # protocol's slot), set when the plan is encoded.
    slot: int = -1

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def draft_len(self) -> int:
        return len(self.drafts) if self.drafts is not None else 0

    @property
    def num_tokens(self) -> int:
        return 1 if self.input_ids is None else len(self.input_ids)


_new_entry = PlanEntry.__new__
_NO_PAGES: tuple[int, ...] = ()  # shared: nobody changes an entry's new_pages


def decode_entry(req: Request, start_pos: int) -> PlanEntry:
    """A plain decode's entry (the hot path: one per running request per
    step), built without the dataclass __init__'s keyword parsing, which
    costs more than twice as much at a 256-request batch. It counts as in
    flight at once (``req.kv_len`` and ``req.pending`` advance); the caller
    gives it its page if it starts one (``new_pages``, none until then)."""
    e = _new_entry(PlanEntry)
    e.req = req
    e.epoch = req.epoch
    e.start_pos = start_pos
    e.input_ids = None
    e.new_pages = e.new_swa_pages = _NO_PAGES
    e.sample = True
    e.next_token = None
    e.drafts = None
    e.slot = -1
    req.kv_len = start_pos + 1
    req.pending += 1
    return e


@dataclass(slots=True, eq=False)
class StepPlan:
    step_id: int
    mode: ForwardMode
    _: KW_ONLY
    extends: list[PlanEntry] = field(default_factory=list)
    decodes: list[PlanEntry] = field(default_factory=list)
    joins: list[Join] = field(default_factory=list)
    leaves: list[str] = field(default_factory=list)
    # (slot, lora_id) adapter slot assignments, applied after the leaves and
    # before the joins.
    adapter_slots: list[tuple[int, str]] = field(default_factory=list)
    # When the plan was sent (ns since the epoch; set by the engine): the
    # start of its requests' prefill spans.
    sent_ns: int = 0
    # The host tier (module docstring): device -> host copies, then host ->
    # device copies, both before the forward. None: no copies (always so
    # without a host tier).
    write_backs: PageCopies | None = None
    loads: PageCopies | None = None
    # The file tier (module docstring): host -> file after the write-backs,
    # and file -> host reads the worker reports later. None: none (always so
    # without a file tier).
    storage_writes: StorageCopies | None = None
    storage_reads: StorageCopies | None = None

    @property
    def entries(self) -> list[PlanEntry]:
        """Extends, then decodes: the worker's order, and its results'."""
        return self.extends + self.decodes if self.decodes else self.extends

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.extends) + len(self.decodes)

    @property
    def sampling_entries(self) -> int:
        """Entries that sample (each answers one token, a drafted one 1..k+1)."""
        return sum(e.sample for e in self.extends) + len(self.decodes)

    @property
    def drafted(self) -> bool:
        return any(e.drafts is not None for e in self.extends)


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob payload the worker returns for one position (all optional)."""

    logprob: float | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    ids: list[int] | None = None  # the requested token_ids_logprob
    ids_logprobs: list[float] | None = None


@dataclass(slots=True)
class RequestOutput:
    """What one entry of a plan produced."""

    rid: str
    token_id: int | None  # None for a prefill chunk that did not sample
    logprobs: TokenLogprobs | None = None
    _: KW_ONLY
    # Prompt logprobs computed in this step, when the request asked for them:
    # entry i is for the prompt token at position prompt_logprobs_start + i.
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_start: int = 0
    # The token completed the request's grammar: nothing more can follow.
    grammar_ended: bool = False
    # A drafted entry's tokens after token_id (accepted drafts and the sample
    # after them), with their logprobs when asked (same length); None: none.
    more_tokens: list[int] | None = None
    more_logprobs: list[TokenLogprobs | None] | None = None
    # An embedding request's pooled vector (its last prompt chunk's output).
    embedding: list[float] | None = None


@dataclass(slots=True)
class StepResult:
    step_id: int
    outputs: list[RequestOutput] = field(default_factory=list)
    forward_ms: float = 0.0
    # Time the worker spent waiting for this plan after finishing the last one.
    idle_ms: float = 0.0
    # The common result as one column instead of ``outputs``: token i is
    # the one sampled for the plan's sampling entry i (extends that sample,
    # then decodes), with no logprobs, no grammar ending, no drafts and
    # nothing for entries that do not sample. A result decoder takes this
    # form when it fits: a batch of plain tokens then makes no RequestOutput.
    tokens: list[int] | None = None
    # The file tier: plans whose storage_reads the worker finished since its
    # last result, with the reads that failed (plan.py's docstring). None:
    # none finished.
    storage_done: list[StorageReadsDone] | None = None
