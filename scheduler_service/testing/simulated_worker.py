"""SimulatedWorker: executes the core's StepPlans in process, without a
model or a network (the scheduler core's tests and benchmarks).

It is the oracle of the scheduler's tests:

- it mirrors the KV pool at slot granularity, recording the token id whose
  "KV" was written at each slot, and before computing a request it reads the
  request's page table back and checks it yields exactly the request's
  tokens so far, so any page handed to two owners, freed too early, or
  named wrongly in a plan is caught at the step that reads it;
- the token it samples follows the simulated model's rule
  (common/simulated_model.py, shared with ``--model simulated``), so the
  correct output of any request is known in advance whatever the batching,
  caching, chunking or retraction (``expected_output``); a request of a
  LoRA adapter follows the rule from its adapter's own start, and the KV it
  reads must have been written by requests of the same adapter;
- it holds the adapter slots the plans assign, and refuses a join naming
  an empty slot or a slot reassigned while a request still uses it;
- an embedding request gets the simulated model's vector with its last
  prompt chunk (``simulated_embedding``); a mean-pooled one must compute its
  whole prompt here (a cached prefix has no hidden states to average);
- shaped like a model with sliding-window layers (``num_swa_pages``,
  ``swa_window``: Gemma 3, GPT-OSS), it also keeps each request's sliding
  table and a sliding pool, writes every computed position there too, and
  checks that each query's window (positions q - window < k <= q) reads
  non-null, in-range sliding pages holding the request's own tokens, so a
  sliding page freed while still visible fails the step that reads it;
- a join whose KV came from a prefill unit (disaggregation: ``last_token``,
  ``kv_pages``) takes its table as given; the first step that reads it
  checks the pages hold the prompt (the test's transfer copied them);
- with a host pool (``num_host_pages``, the host tier) it keeps the host
  pages' slots too and applies a plan's copies as the worker must: its
  write-backs (device -> host), then its loads (host -> device), then the
  forward. A load of a page no write-back filled, or filled with other
  tokens, puts wrong tokens in the device slots and the step that reads
  them fails.
- with a file tier (``files``, testing/simulated_files.py) it writes and
  reads host pages by block hash as the worker must, reads finishing some
  plans later, some failing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.simulated_model import (
    SIMULATED_HIDDEN,
    absorb,
    expected_output,
    hidden_sum,
    initial_state,
    pool,
    position_vector,
    token_of,
)
from scheduler_service.core.embedding import EmbedOptions
from scheduler_service.core.ids import PageCopies
from scheduler_service.core.plan import (
    Join,
    PlanEntry,
    RequestOutput,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from scheduler_service.testing.simulated_files import SimulatedFiles


class SimulatedWorkerError(AssertionError):
    pass


@dataclass(slots=True)
class _SimRequest:
    prompt_len: int
    tokens: list[int]  # the whole sequence as far as the worker knows it
    state: int  # absorb(initial_state(adapter), tokens)
    pages: list[int] = field(default_factory=list)
    swa_pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    adapter: str | None = None
    adapter_slot: int = 0
    # First prompt position whose logprob the join asked for (-1: none).
    logprob_start: int = -1
    embed: EmbedOptions | None = None
    hidden_total: list[float] = field(default_factory=lambda: [0.0] * SIMULATED_HIDDEN)


def prompt_logprobs_of(
    r: _SimRequest, start: int, end: int
) -> tuple[list[TokenLogprobs] | None, int]:
    """The prompt logprobs an extend over positions [start, end) scores, as
    the model worker gives them: token p is scored by the logits at p - 1
    (the chunk's last logits score token ``end`` through ``next_token``),
    position 0 has none (a NaN entry)."""
    if r.logprob_start < 0:
        return None, 0
    lo = max(r.logprob_start, start + 1 if start else 0)
    hi = min(end + 1, r.prompt_len)
    if lo >= hi:
        return None, 0
    return [TokenLogprobs(None if p == 0 else -1.0) for p in range(lo, hi)], lo


class SimulatedWorker:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        vocab_size: int,
        *,
        check_reads: bool = True,
        step_time_s: float = 0.0,
        adapter_slots: int = 4,
        num_swa_pages: int = 0,
        swa_window: int = 0,
        num_host_pages: int = 0,
        files: SimulatedFiles | None = None,
    ) -> None:
        """``files``: the file tier (with a host pool), shared with the worker
        that replaces this one after a loss."""
        self.files = files
        self.num_pages = num_pages
        self.num_host_pages = num_host_pages
        self.host_slots: list[int] = [-1] * (num_host_pages * page_size)
        self.host_slot_adapter: list[str | None] = [None] * (num_host_pages * page_size)
        self.num_swa_pages = num_swa_pages
        self.swa_window = swa_window if num_swa_pages else 0
        self.swa_slots: list[int] = [-1] * (num_swa_pages * page_size)
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.check_reads = check_reads
        self.step_time_s = step_time_s
        self.slots: list[int] = [-1] * (num_pages * page_size)
        self.slot_adapter: list[str | None] = [None] * (num_pages * page_size)
        self.max_adapter_slots = adapter_slots
        self.adapter_in_slot: dict[int, str] = {}
        self.adapters_seen_in_a_step = 0  # the most distinct adapters one step ran
        self.reqs: dict[str, _SimRequest] = {}
        self.steps = 0

    def _join(self, join: Join) -> None:
        if join.rid in self.reqs:
            raise SimulatedWorkerError(f"join of {join.rid}, which the worker already holds")
        tokens = list(join.prefix_ids)
        adapter = None
        if join.adapter_slot:
            adapter = self.adapter_in_slot.get(join.adapter_slot)
            if adapter is None:
                raise SimulatedWorkerError(
                    f"join of {join.rid} names adapter slot {join.adapter_slot}, which is empty"
                )
        kv_len = len(tokens)
        if join.last_token is not None:  # its prompt's KV came from a prefill unit
            tokens.append(join.last_token)
        self.reqs[join.rid] = _SimRequest(
            join.prompt_len,
            tokens,
            absorb(initial_state(adapter), tokens),
            pages=list(join.kv_pages),
            kv_len=kv_len,
            adapter=adapter,
            adapter_slot=join.adapter_slot,
            logprob_start=join.logprobs.logprob_start_len
            if join.logprobs.wants_prompt_logprobs
            else -1,
            embed=join.embed,
        )
        if join.embed is not None and not join.embed.reads_cache and tokens:
            raise SimulatedWorkerError(
                f"join of {join.rid}: a mean-pooled embedding with {len(tokens)} cached tokens"
            )

    def _assign(self, slot: int, lora_id: str) -> None:
        if not 1 <= slot <= self.max_adapter_slots:
            raise SimulatedWorkerError(f"adapter slot {slot} of {self.max_adapter_slots}")
        users = [rid for rid, r in self.reqs.items() if r.adapter_slot == slot]
        if users:
            raise SimulatedWorkerError(
                f"adapter slot {slot} reassigned to {lora_id!r} while {users[:3]} use it"
            )
        self.adapter_in_slot[slot] = lora_id

    def _slot(self, r: _SimRequest, pos: int, rid: str) -> int:
        page_size = self.page_size
        idx = pos // page_size
        if idx >= len(r.pages):
            raise SimulatedWorkerError(f"{rid}: position {pos} is past its {len(r.pages)} pages")
        page = r.pages[idx]
        if not 0 <= page < self.num_pages:
            raise SimulatedWorkerError(f"{rid}: page id {page} is outside the pool")
        return page * page_size + pos % page_size

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        for rid in plan.leaves:
            if self.reqs.pop(rid, None) is None:
                raise SimulatedWorkerError(f"leave of {rid}, which the worker does not hold")
        for slot, lora_id in plan.adapter_slots:
            self._assign(slot, lora_id)
        for join in plan.joins:
            self._join(join)
        if plan.write_backs is not None:  # before the loads, which may reuse their pages
            self._copy(plan.write_backs, to_host=True)
        files = self.files
        if files is not None and plan.storage_writes is not None:  # after the write-backs
            files.write(self, plan.storage_writes)
        if plan.loads is not None:  # before the forward reads them
            self._copy(plan.loads, to_host=False)
        entries = plan.entries
        adapters = {self.reqs[e.rid].adapter for e in entries if e.rid in self.reqs}
        adapters.discard(None)
        self.adapters_seen_in_a_step = max(self.adapters_seen_in_a_step, len(adapters))
        outputs: list[RequestOutput] = []
        unsampled: list[RequestOutput] = []  # answered after the samples (results.py)
        for e in entries:
            r = self.reqs.get(e.rid)
            if r is None:
                raise SimulatedWorkerError(f"step {plan.step_id} schedules unknown {e.rid}")
            r.pages.extend(e.new_pages)
            if self.swa_window:
                if len(e.new_swa_pages) != len(e.new_pages):
                    raise SimulatedWorkerError(
                        f"{e.rid}: {len(e.new_swa_pages)} sliding pages for "
                        f"{len(e.new_pages)} pages"
                    )
                r.swa_pages.extend(e.new_swa_pages)
            if e.start_pos != r.kv_len:
                raise SimulatedWorkerError(
                    f"{e.rid}: plan starts at {e.start_pos}, the worker has KV up to {r.kv_len}"
                )
            if e.draft_len:
                outputs.append(self._verify(e, r))
                continue
            if e.input_ids is None:
                if len(r.tokens) != r.kv_len + 1:
                    raise SimulatedWorkerError(f"{e.rid}: decode without a sampled token")
                inputs = [r.tokens[-1]]
            else:
                inputs = e.input_ids
                if len(r.tokens) != r.kv_len:
                    raise SimulatedWorkerError(f"{e.rid}: prefill after a sampled token")
                r.tokens.extend(inputs)
                if r.embed is not None and r.embed.pooling == "mean":
                    r.state = hidden_sum(r.state, inputs, r.hidden_total)
                else:
                    r.state = absorb(r.state, inputs)
            if self.check_reads:
                self._check_context(e.rid, r, e.start_pos)
            slots, owners = self.slots, self.slot_adapter
            for i, tok in enumerate(inputs):
                at = self._slot(r, e.start_pos + i, e.rid)
                slots[at] = tok
                owners[at] = r.adapter
            r.kv_len = e.start_pos + len(inputs)
            if self.swa_window:
                self._sliding(e.rid, r, e.start_pos, inputs)
            scored, scored_from = None, 0
            if e.input_ids is not None:
                scored, scored_from = prompt_logprobs_of(r, e.start_pos, r.kv_len)
            if e.sample:
                tok = token_of(r.state, self.vocab_size)
                r.tokens.append(tok)
                r.state = absorb(r.state, (tok,))
                out = RequestOutput(e.rid, tok, TokenLogprobs(logprob=-1.0))
            else:
                out = RequestOutput(e.rid, token_id=None)
            if scored is not None:
                out.prompt_logprobs, out.prompt_logprobs_start = scored, scored_from
            if r.embed is not None and r.kv_len == r.prompt_len:
                out.embedding = self._embedding(r)
            (outputs if e.sample else unsampled).append(out)
        outputs += unsampled
        self.steps += 1
        if self.step_time_s:
            remaining = self.step_time_s - (time.perf_counter() - t0)
            if remaining > 0:
                time.sleep(remaining)
        result = StepResult(plan.step_id, outputs, forward_ms=(time.perf_counter() - t0) * 1e3)
        if files is not None:
            if plan.storage_reads is not None:
                files.start_reads(self, plan.step_id, plan.storage_reads)
            result.storage_done = files.finish(self)
        return result

    def _copy(self, copies: PageCopies, *, to_host: bool) -> None:
        """Copy whole pages between the pools (a write-back or a load)."""
        if len(copies.src) != len(copies.dst):
            raise SimulatedWorkerError("a page copy without its source or destination")
        ps = self.page_size
        dev, dev_owner = self.slots, self.slot_adapter
        host, host_owner = self.host_slots, self.host_slot_adapter
        src, src_owner, dst, dst_owner = (
            (dev, dev_owner, host, host_owner) if to_host else (host, host_owner, dev, dev_owner)
        )
        src_n, dst_n = (
            (self.num_pages, self.num_host_pages)
            if to_host
            else (self.num_host_pages, self.num_pages)
        )
        for s, d in zip(copies.src, copies.dst, strict=True):
            if not (0 <= s < src_n and 0 <= d < dst_n):
                kind = "write-back" if to_host else "load"
                raise SimulatedWorkerError(f"{kind} of page {s} to page {d}: outside the pools")
            src_at, dst_at = s * ps, d * ps
            dst[dst_at : dst_at + ps] = src[src_at : src_at + ps]
            dst_owner[dst_at : dst_at + ps] = src_owner[src_at : src_at + ps]

    @staticmethod
    def _embedding(r: _SimRequest) -> list[float]:
        embed = r.embed
        if embed.pooling == "mean":
            return pool(r.hidden_total, r.prompt_len, normalize=embed.normalize)
        return pool(position_vector(r.state), 1, normalize=embed.normalize)

    def _verify(self, e: PlanEntry, r: _SimRequest) -> RequestOutput:
        """A drafted extend: input_ids = [last sampled token] + drafts. Sample
        each position as if the drafts before it were accepted; accept the
        drafts that equal the samples, then the sample after them (the
        worker's rule, protos/worker.proto Extend.draft_len)."""
        inputs = e.input_ids or []
        k = e.draft_len
        if len(inputs) != k + 1 or not e.sample:
            raise SimulatedWorkerError(f"{e.rid}: {len(inputs)} inputs for {k} drafts")
        if len(r.tokens) != r.kv_len + 1 or inputs[0] != r.tokens[-1]:
            raise SimulatedWorkerError(f"{e.rid}: drafted extend without its last sampled token")
        if self.check_reads:
            self._check_context(e.rid, r, e.start_pos)
        slots, owners = self.slots, self.slot_adapter
        for i, tok in enumerate(inputs):  # every position's KV is written
            at = self._slot(r, e.start_pos + i, e.rid)
            slots[at] = tok
            owners[at] = r.adapter
        if self.swa_window:
            r.tokens.extend(inputs[1:])  # the drafts' KV, for the window check
            self._sliding(e.rid, r, e.start_pos, inputs)
            del r.tokens[len(r.tokens) - k :]
        drafts = inputs[1:]
        state = r.state  # the context up to and with the last sampled token
        accepted: list[int] = []
        while True:
            tok = token_of(state, self.vocab_size)
            accepted.append(tok)
            state = absorb(state, (tok,))
            if len(accepted) > k or tok != drafts[len(accepted) - 1]:
                break
        r.tokens.extend(accepted)
        r.state = state
        r.kv_len = e.start_pos + len(accepted)
        del r.pages[-(-r.kv_len // self.page_size) :]
        del r.swa_pages[-(-r.kv_len // self.page_size) :]
        more = accepted[1:]
        return RequestOutput(
            e.rid,
            accepted[0],
            TokenLogprobs(logprob=-1.0),
            more_tokens=more or None,
            more_logprobs=[TokenLogprobs(logprob=-1.0) for _ in more] or None,
        )

    def _sliding_slot(self, r: _SimRequest, pos: int, rid: str) -> int:
        page_size = self.page_size
        idx = pos // page_size
        if idx >= len(r.swa_pages):
            raise SimulatedWorkerError(
                f"{rid}: position {pos} is past its {len(r.swa_pages)} sliding pages"
            )
        page = r.swa_pages[idx]
        if not 0 < page < self.num_swa_pages:
            what = "the null page" if page == 0 else "outside the sliding pool"
            raise SimulatedWorkerError(
                f"{rid}: sliding page {page} of position {pos} (in a query's window) is {what}"
            )
        return page * page_size + pos % page_size

    def _sliding(self, rid: str, r: _SimRequest, start: int, inputs: list[int]) -> None:
        """Write the computed positions' sliding KV, then check the windows of
        the queries at start .. start + len(inputs) - 1 read this request's
        own tokens through non-null pages."""
        slots = self.swa_slots
        for i, tok in enumerate(inputs):
            slots[self._sliding_slot(r, start + i, rid)] = tok
        if not self.check_reads:
            return
        tokens = r.tokens
        for pos in range(max(0, start - self.swa_window + 1), start + len(inputs)):
            got = slots[self._sliding_slot(r, pos, rid)]
            if got != tokens[pos]:
                raise SimulatedWorkerError(
                    f"{rid}: sliding KV at position {pos} holds token {got}, expected "
                    f"{tokens[pos]} (sliding page freed while visible, or reused)"
                )

    def _check_context(self, rid: str, r: _SimRequest, upto: int) -> None:
        """The KV read for positions [0, upto) must be the request's own tokens."""
        slots, owners = self.slots, self.slot_adapter
        for pos in range(upto):
            at = self._slot(r, pos, rid)
            got = slots[at]
            if got != r.tokens[pos]:
                raise SimulatedWorkerError(
                    f"{rid}: KV at position {pos} holds token {got}, expected {r.tokens[pos]} "
                    "(page reused or misnamed)"
                )
            if owners[at] != r.adapter:
                raise SimulatedWorkerError(
                    f"{rid} (adapter {r.adapter!r}) reads KV at position {pos} written with "
                    f"adapter {owners[at]!r} (cache namespaces mixed)"
                )


__all__ = ["SimulatedWorker", "SimulatedWorkerError", "expected_output"]
