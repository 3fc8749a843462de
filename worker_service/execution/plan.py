"""The worker's view of a step plan and its result (converted from and to the
protocol in convert.py, the only module that knows both). A join's sampling
and logprob options, and a result's prompt logprobs, are the sampler's words
(sampling/params.py, sampling/rows.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from worker_service.sampling.params import LogprobOptions, SamplingParams
from worker_service.sampling.rows import PooledEmbedding, PromptLogprobs


class ForwardMode(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"
    IDLE = "idle"


@dataclass(slots=True)
class Join:
    slot: int
    rid: str
    sampling: SamplingParams
    logprobs: LogprobOptions
    prompt_len: int
    prefix_ids: list[int]
    num_output_tokens: int = 0
    traceparent: str = ""
    tracestate: str = ""
    # 0: the base model; k >= 1: the adapter in adapter slot k when it joins
    # (the request keeps that adapter for its whole life on the worker).
    adapter_slot: int = 0
    # An embedding request: "last" or "mean" pooling ("": a generation request).
    pooling: str = ""
    normalize: bool = False
    # A landed request (disaggregation, decode unit): its prompt's KV is in
    # ``kv_pages`` (its whole table, received from a prefill unit) and
    # ``last_token`` is its last sampled token (its first decode computes it).
    last_token: int | None = None
    kv_pages: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class AdapterSlot:
    """Adapter slot ``slot`` (1..N) holds adapter ``name`` from this plan on;
    "" empties it."""

    slot: int
    name: str


@dataclass(slots=True)
class Extend:
    slot: int
    start_pos: int
    input_ids: list[int]
    new_pages: list[int]
    sample: bool
    next_token: int | None = None
    # Speculative decoding: the last draft_len input_ids are drafts to verify
    # (see Extend in protos/worker.proto).
    draft_len: int = 0
    # Two pools (sliding-window layers): parallel to new_pages, the pages
    # appended to the slot's sliding table; 0 is the null page (a cached
    # prefix's entry the scheduler freed: out of every query's window).
    new_swa_pages: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Plan:
    step_id: int
    mode: ForwardMode
    leaves: list[int] = field(default_factory=list)
    joins: list[Join] = field(default_factory=list)
    extends: list[Extend] = field(default_factory=list)
    decode_slots: list[int] = field(default_factory=list)
    decode_positions: list[int] = field(default_factory=list)
    # page appended to the slot's table, plus one; 0 = none
    decode_new_pages: list[int] = field(default_factory=list)
    # Two pools: parallel to decode_new_pages, the sliding page plus one; 0 = none
    decode_new_swa_pages: list[int] = field(default_factory=list)
    # applied after the leaves, before the joins
    adapter_slots: list[AdapterSlot] = field(default_factory=list)
    # The host tier's page copies (protos/worker.proto, StepPlan): write-backs
    # device -> host in list order, then loads host -> device, then the forward.
    copies: PageCopies | None = None
    # The file tier's copies (protos/worker.proto, StepPlan): host pages to
    # files after the write-backs, files to host pages in the background.
    storage: StorageCopies | None = None


@dataclass(frozen=True, slots=True)
class PageCopies:
    """A plan's copies between the device KV pool and the host pool, as packed
    int64 columns: ``write_back_device[i]`` -> ``write_back_host[i]``, then
    ``load_host[i]`` -> ``load_device[i]``, whole pages of every layer."""

    write_back_device: np.ndarray
    write_back_host: np.ndarray
    load_host: np.ndarray
    load_device: np.ndarray

    @property
    def num_write_backs(self) -> int:
        return len(self.write_back_device)

    @property
    def num_loads(self) -> int:
        return len(self.load_host)


@dataclass(frozen=True, slots=True)
class StorageCopies:
    """A plan's file-tier copies as packed int64 columns: host page
    ``write_host[i]`` -> the file of block hash ``write_hashes[i]``, and the
    file of ``read_hashes[i]`` -> host page ``read_host[i]``."""

    write_hashes: np.ndarray
    write_host: np.ndarray
    read_hashes: np.ndarray
    read_host: np.ndarray

    @property
    def num_writes(self) -> int:
        return len(self.write_hashes)

    @property
    def num_reads(self) -> int:
        return len(self.read_hashes)


@dataclass(frozen=True, slots=True)
class StorageReadsDone:
    """Plan ``step_id``'s file reads all finished; ``failed``: indices into
    its read columns that found no whole, checked file."""

    step_id: int
    failed: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Result:
    step_id: int
    error: str = ""
    slots: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_counts: list[int] = field(default_factory=list)
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    ids_counts: list[int] = field(default_factory=list)
    ids_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    forward_ms: float = 0.0
    idle_ms: float = 0.0
    grammar_ended: list[int] = field(default_factory=list)  # indices into token_ids
    # Tokens per sampling entry (drafted extends: 1..draft_len + 1); empty:
    # one each, and then the per-token lists are per entry.
    token_counts: list[int] = field(default_factory=list)
    embeddings: list[PooledEmbedding] = field(default_factory=list)
    # The file tier: plans whose reads finished since the last result.
    storage_done: list[StorageReadsDone] = field(default_factory=list)
