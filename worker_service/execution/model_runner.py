"""Runs step plans in order: validation, per-request state, the model's step, results.

``ModelRunner`` owns what a plan means: leaves before joins, pages appended
to tables, extends before decodes, each decode computing the request's last
sampled token. The arithmetic is delegated to a ``Compute``: ``ModelCompute``
(model_compute.py, the real model) or ``SimulatedCompute`` (simulated_compute.py).
"""

from __future__ import annotations

import time

import structlog

from worker_service.device.context import DeviceFailure, is_sticky_device_error
from worker_service.device.distributed import GroupStepFailed, TensorParallel
from worker_service.device.page_table import PageTable
from worker_service.execution.file_copies import HostKvFiles
from worker_service.execution.plan import Plan, Result
from worker_service.execution.request_state import SlotState
from worker_service.execution.step_work import (
    PENDING,
    Compute,
    SeqWork,
    StartedStep,
)
from worker_service.execution.validation import PlanError, validate_plan
from worker_service.lora.store import AdapterStore, LoadedAdapter
from worker_service.sampling.draft_acceptance import accept_drafts
from worker_service.sampling.grammar import GrammarCompiler, GrammarError
from worker_service.sampling.rows import SampleOutput

logger = structlog.get_logger(__name__)


# What a rank tells the others about a step before queueing any of its
# collectives (TensorParallel.agree): it can run it, it refused the plan
# (not applied), or it failed (its state is dropped, or was already).
_GO, _REFUSED, _FAILED = 0, 1, 2


class ModelRunner:
    """Executes plans in order on its ``Compute``; holds every request's slot state.

    Overlap (``overlap=True`` and a compute with ``launch``/``finish``): the
    next plan may be started while the previous one runs. It is validated and
    applied against the state the previous step leaves (each sampling request
    one token longer, its value PENDING), its decode inputs are gathered on
    the device from the previous step's sampled tokens, and its kernels are
    queued behind the previous step's before the host waits for those tokens.
    A request whose sampling reads its token values (penalties) is not
    overlapped: the previous step is completed first.

    Drafted extends (speculative decoding) are never overlapped: a plan with
    one completes the step before it first (its first input must be a known
    token), and runs to its result at once (how many tokens it keeps is known
    only then), so the plan after it starts from settled state.

    Tensor parallelism (``tp``): the ranks must queue the same collectives in
    the same order, so each step is run or failed by all of them. Before
    queueing anything, ``start`` has the ranks agree on it (one host
    all-reduce): a rank that refused the plan, failed to prepare it, or
    failed an earlier step alone makes every rank fail it and drop its
    state. Rank 0 alone samples; its failure there rides to the others on
    the token broadcast, and every rank raises it in ``finish``
    (model_compute.py).
    """

    def __init__(
        self,
        compute: Compute,
        *,
        num_pages: int,
        page_size: int,
        vocab_size: int,
        max_context: int = 1 << 30,
        overlap: bool = False,
        grammars: GrammarCompiler | None = None,
        scores_only: bool = False,
        tp: TensorParallel | None = None,
        page_table: PageTable | None = None,
        num_swa_pages: int = 0,
        swa_window: int = 0,
        swa_table: PageTable | None = None,
        num_host_pages: int = 0,
    ) -> None:
        """``scores_only``: the model is a sequence classifier (validate_plan);
        ``page_table``: where the page lists are mirrored, by default the
        compute's (its attention reads the rows there). ``num_swa_pages`` > 0:
        two pools, the sliding layers' pages (window ``swa_window``) in
        ``swa_table`` (by default the compute's), same rows as ``page_table``.
        ``num_host_pages`` > 0: the host tier's pool, which the compute holds
        (``copy_pages``): a plan's page copies run after it is applied and
        before its forward."""
        self.compute = compute
        self.tp = tp or TensorParallel()
        # Every page-list change below is applied to the table too; a compute
        # without one gets a host table, kept all the same so check_integrity
        # holds everywhere (a few KB: rows of the held requests' page ids).
        if page_table is None:
            page_table = getattr(compute, "page_table", None) or PageTable("cpu")
        self.page_table = page_table
        self.swa_table: PageTable | None = None
        if num_swa_pages:
            if swa_window < 1:
                raise ValueError("a sliding pool needs the sliding layers' window")
            swa_table = swa_table or getattr(compute, "swa_table", None) or PageTable("cpu")
            self.swa_table = swa_table
        self.num_swa_pages = num_swa_pages
        self.swa_window = swa_window
        self.num_host_pages = num_host_pages
        # The file tier behind the host pool (set by the assembly; None: none,
        # and plans with file copies are refused).
        self.files: HostKvFiles | None = None
        # LoRA adapters: loaded by name (gRPC threads) and in adapter slots.
        self.adapters = AdapterStore()
        # Structured generation (None: this rank does not sample, or no vocabulary).
        self.grammars = grammars
        self.num_pages = num_pages
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.max_context = max_context  # positions the model can rotate
        self.scores_only = scores_only
        self.overlap = overlap and hasattr(compute, "launch")
        self.slots: dict[int, SlotState] = {}
        self._running: StartedStep | None = None  # started, not completed
        # This rank failed a step the others may have run (tensor parallelism):
        # its state differs from theirs until every rank drops its own.
        self._diverged = False

    def reset(self) -> None:
        """Drop every request (a new scheduler stream starts from nothing)."""
        self._diverged = False
        self.slots.clear()
        self.page_table.clear()
        if self.swa_table is not None:
            self.swa_table.clear()
        self.adapters.clear_slots()
        self._running = None  # its kernels finish on their own; nobody reads them
        if self.files is not None:  # reads the old session planned: never reported
            self.files.forget()

    def execute(self, plan: Plan) -> Result:
        """Run one plan to its result (no overlap with a next one)."""
        return self.complete(self.start(plan))

    def start(self, plan: Plan) -> StartedStep:
        """Validate and apply ``plan`` and queue its step; ``complete`` it later,
        in order. The step started before is completed first unless this one
        can overlap it."""
        previous = self._running
        if previous is not None and not self._can_overlap(plan, previous):
            self.complete(previous)
            previous = None
        step = StartedStep(plan.step_id)
        # One look-up of the names the plan puts in slots: the same objects are
        # checked and applied, whatever an UnloadAdapter does meanwhile.
        loaded = self.adapters.lookup(a.name for a in plan.adapter_slots)
        refused: PlanError | None = None
        failed: Exception | None = None
        try:
            validate_plan(
                plan,
                self.slots,
                num_pages=self.num_pages,
                num_swa_pages=self.num_swa_pages,
                swa_window=self.swa_window,
                num_host_pages=self.num_host_pages,
                file_tier=self.files is not None,
                page_size=self.page_size,
                vocab_size=self.vocab_size,
                max_context=self.max_context,
                adapter_slots=self.adapters.slots,
                loaded=loaded,
                scores_only=self.scores_only,
            )
        except PlanError as e:
            logger.warning("plan rejected", step_id=plan.step_id, error=str(e))
            refused = e
        else:
            step.work = self._apply(plan, loaded)
            step.num_extends = len(plan.extends)
            step.drafted = any(e.draft_len for e in plan.extends)
            try:
                self._attach_grammars(step.work)
            except GrammarError as e:
                failed = e
        refused, failed = self._agree(plan.step_id, refused, failed)
        if refused is not None:
            step.result = Result(plan.step_id, error=f"step {plan.step_id}: {refused}")
            return step
        if failed is not None:
            if previous is not None:
                self.complete(previous)
            step.result = self._failed(step, failed, agreed=True)
            return step
        work = step.work
        if previous is not None:
            for w in work:
                if w.inputs[0] == PENDING and w.start + 1 == len(w.state.tokens):
                    w.pending = previous.sample_index[id(w.state)]
        try:
            if plan.copies is not None:  # write-backs, loads: before the forward
                self.compute.copy_pages(plan.copies, forward=bool(work))  # type: ignore[attr-defined]
            if plan.storage is not None and self.files is not None:  # after the write-backs
                self.files.run(plan.step_id, plan.storage)
            if self.overlap and not step.drafted:
                prior = None if previous is None else previous.launched
                step.launched = self.compute.launch(work, step.num_extends, prior)
                self._advance(step)
                self._running = step
            else:
                out = self.compute.run(work, step.num_extends) if work else SampleOutput()
                self._advance(step)
                step.result = self._result(step, out)
        except Exception as e:
            if previous is not None:
                self.complete(previous)  # queued before this step: its result still counts
            step.result = self._failed(step, e, agreed=isinstance(e, GroupStepFailed))
        return step

    def complete(self, step: StartedStep) -> Result:
        """The step's result, waiting for its tokens if they are still on the device."""
        if step.result is not None:
            return step.result
        if self._running is step:
            self._running = None
        try:
            step.result = self._result(step, self.compute.finish(step.launched))
        except Exception as e:
            step.result = self._failed(step, e, agreed=isinstance(e, GroupStepFailed))
        return step.result

    def _can_overlap(self, plan: Plan, previous: StartedStep) -> bool:
        if previous.result is not None:
            return True
        if previous.drafted or any(e.draft_len for e in plan.extends):
            return False  # drafts are checked against settled tokens
        pending = previous.sample_index
        for slot in plan.decode_slots:
            state = self.slots.get(slot)
            if state is None or id(state) not in pending:
                continue
            # Penalties and grammars read the previous token's value.
            if state.sampling.has_penalties or state.sampling.grammar is not None:
                return False
        return True

    def _attach_grammars(self, work: list[SeqWork]) -> None:
        """A constrained request's matcher, at its first sampling step: replayed
        over the output it has (a re-joined request continues where it was)."""
        if self.grammars is None:
            return
        for w in work:
            state = w.state
            spec = state.sampling.grammar
            if w.sample and spec is not None and state.grammar is None:
                kind, text = spec
                state.grammar = self.grammars.matcher(
                    kind,
                    text,
                    state.tokens[state.prompt_len :],
                    state.sampling.reasoning_end_token,
                )

    def _agree(
        self, step_id: int, refused: PlanError | None, failed: Exception | None
    ) -> tuple[PlanError | None, Exception | None]:
        """The step's fixed point under tensor parallelism, before any of its
        collectives is queued: what every rank does with it, decided the same
        way on each. A refusal every rank shares leaves every state as it was
        (the plan was applied nowhere); any other failure anywhere fails the
        step on every rank, each dropping its state (``_failed``)."""
        if not self.tp.enabled:
            return refused, failed
        if failed is not None or self._diverged:
            code = _FAILED
        else:
            code = _GO if refused is None else _REFUSED
        try:
            codes = self.tp.agree(code)
        except RuntimeError as e:
            # A rank is gone (its connection reset) or hung past the group's
            # timeout: no collective of this group can work again, so end the
            # process (the servicer does) for a fresh group, like a broken GPU.
            raise DeviceFailure(f"step {step_id}: the tensor-parallel group broke: {e}") from e
        if max(codes) == _GO:
            return None, None
        if min(codes) == max(codes) == _REFUSED:
            return refused, None
        if failed is None:
            failed = refused
        if failed is None:
            if code == _FAILED:
                why = "this rank failed an earlier step the others ran"
            else:
                ranks = [r for r, c in enumerate(codes) if c != _GO]
                why = f"tensor-parallel rank(s) {ranks} could not run it"
            failed = GroupStepFailed(f"step {step_id}: {why}")
        return None, failed

    def _failed(self, step: StartedStep, error: Exception, *, agreed: bool = False) -> Result:
        """``agreed``: every rank fails this step (tensor parallelism); if not,
        the others may have run it and the next step's ``_agree`` fails them."""
        cause = error.__cause__
        if is_sticky_device_error(error) or (cause is not None and is_sticky_device_error(cause)):
            raise DeviceFailure(f"step {step.step_id}: {error}") from error
        # The KV cache may be half written: start over.
        logger.error(
            "step failed; dropping all request state",
            step_id=step.step_id,
            error=repr(error),
            exc_info=error,
        )
        self.reset()
        self._diverged = self.tp.enabled and not agreed
        return Result(step.step_id, error=f"step {step.step_id} failed on the worker: {error!r}")

    def adopt(self, slot: int, state: SlotState) -> None:
        """Hold ``state`` (made outside a plan, with its pages) under ``slot``:
        benchmarks that set up cached contexts without computing them."""
        if slot in self.slots:
            self._release(self.slots.pop(slot).row)
        state.row = self._acquire()
        self.page_table.append(state.row, state.pages)
        if self.swa_table is not None:
            self.swa_table.append(state.row, state.swa_pages)
        self.slots[slot] = state

    def check_integrity(self) -> None:
        """The page tables hold exactly every request's page lists (tests)."""
        self.page_table.check_integrity({s.row: s.pages for s in self.slots.values()})
        if self.swa_table is not None:
            self.swa_table.check_integrity({s.row: s.swa_pages for s in self.slots.values()})
            for s in self.slots.values():
                if len(s.swa_pages) != len(s.pages) or 0 in s.swa_pages[s.swa_live_from :]:
                    raise AssertionError(f"{s.rid}: its sliding pages are not its pages' twins")

    def _acquire(self) -> int:
        """A row of the page table and the same row of the sliding one: both
        see the same acquires and releases, smallest free first."""
        row = self.page_table.acquire()
        if self.swa_table is not None and self.swa_table.acquire() != row:
            raise AssertionError("the sliding page table's rows left the full table's")
        return row

    def _release(self, row: int) -> None:
        self.page_table.release(row)
        if self.swa_table is not None:
            self.swa_table.release(row)

    def _apply(self, plan: Plan, loaded: dict[str, LoadedAdapter]) -> list[SeqWork]:
        slots, table, swa = self.slots, self.page_table, self.swa_table
        for slot in plan.leaves:
            self._release(slots.pop(slot).row)
        adapters = self.adapters
        for a in plan.adapter_slots:
            adapters.assign(a.slot, loaded[a.name] if a.name else None)
        for join in plan.joins:
            adapter = adapters.slots[join.adapter_slot] if join.adapter_slot else None
            slots[join.slot] = state = SlotState.from_join(join, adapter)
            state.row = self._acquire()
            if state.pages:  # a landed join: its received pages are its table
                table.append(state.row, state.pages)
        work: list[SeqWork] = []
        for e in plan.extends:
            state = slots[e.slot]
            if swa is not None:
                _append_swa(state, e.new_swa_pages)
                swa.append(state.row, e.new_swa_pages)
            state.pages.extend(e.new_pages)
            table.append(state.row, e.new_pages)
            if not e.draft_len:  # a drafted extend's input 0 is the last token
                state.tokens.extend(e.input_ids)
            work.append(
                SeqWork(
                    slot=e.slot,
                    state=state,
                    start=e.start_pos,
                    inputs=e.input_ids,
                    sample=e.sample,
                    next_token=e.next_token,
                    draft_len=e.draft_len,
                )
            )
        swa_new = plan.decode_new_swa_pages if swa is not None else plan.decode_new_pages
        for slot, pos, new_page, new_swa in zip(
            plan.decode_slots, plan.decode_positions, plan.decode_new_pages, swa_new, strict=True
        ):
            state = slots[slot]
            if new_page:
                state.pages.append(new_page - 1)
                table.append(state.row, (new_page - 1,))
                if swa is not None:  # never the null page (validation)
                    state.swa_pages.append(new_swa - 1)
                    swa.append(state.row, (new_swa - 1,))
            work.append(
                SeqWork(slot=slot, state=state, start=pos, inputs=[state.tokens[-1]], sample=True)
            )
        return work

    @staticmethod
    def _advance(step: StartedStep) -> None:
        """The state the step leaves: KV computed, each sampled token PENDING.
        A drafted extend: the KV of its first input for now; ``_result``
        settles it once the drafts are checked."""
        for w in step.work:
            state = w.state
            state.kv_len = w.start + (1 if w.draft_len else len(w.inputs))
            if w.sample:
                step.sample_index[id(state)] = len(step.pending)
                step.pending.append((state, len(state.tokens)))
                state.tokens.append(PENDING)

    def _result(self, step: StartedStep, out: SampleOutput) -> Result:
        result = Result(step.step_id, forward_ms=(time.perf_counter() - step.started_at) * 1e3)
        if step.drafted:
            drafts = [w.inputs[len(w.inputs) - w.draft_len :] for w in step.work if w.sample]
            out = accept_drafts(drafts, out)
            self._settle_drafts(step, out, result)
        else:
            for i, ((state, at), token) in enumerate(zip(step.pending, out.token_ids, strict=True)):
                state.tokens[at] = token
                if state.grammar is not None:
                    state.grammar.accept(token)
                    if state.grammar.ended:
                        result.grammar_ended.append(i)
        result.token_counts = out.token_counts
        result.slots = [w.slot for w in step.work if w.sample]
        result.token_ids = out.token_ids
        result.logprobs = out.logprobs
        for ids, lps in zip(out.top_ids, out.top_logprobs, strict=True):
            result.top_counts.append(len(ids))
            result.top_ids.extend(ids)
            result.top_logprobs.extend(lps)
        for lps in out.ids_logprobs:
            result.ids_counts.append(len(lps))
            result.ids_logprobs.extend(lps)
        result.prompt_logprobs = out.prompt_logprobs
        result.embeddings = out.embeddings
        return result

    def _settle_drafts(self, step: StartedStep, out: SampleOutput, result: Result) -> None:
        """A drafted step's states once its tokens are known (no step overlaps
        it, so each PENDING token is its state's last): the entry's tokens
        replace it; a drafted extend keeps the KV of its first input and its
        accepted drafts, and the pages that hold them (the scheduler frees the
        rest). Drafted requests have no grammar (validation); others may."""
        sampling = [w for w in step.work if w.sample]
        i = 0
        for w, (state, at), count in zip(sampling, step.pending, out.token_counts, strict=True):
            tokens = out.token_ids[i : i + count]
            del state.tokens[at:]
            state.tokens.extend(tokens)
            if w.draft_len:
                state.kv_len = w.start + count
                keep = -(-state.kv_len // self.page_size)  # pages holding its KV
                del state.pages[keep:]
                self.page_table.truncate(state.row, keep)
                if self.swa_table is not None:
                    del state.swa_pages[keep:]
                    self.swa_table.truncate(state.row, keep)
                    state.swa_live_from = min(state.swa_live_from, keep)
            elif state.grammar is not None:
                state.grammar.accept(tokens[0])
                if state.grammar.ended:
                    result.grammar_ended.append(i)
            i += count


def _append_swa(state: SlotState, new: list[int]) -> None:
    """A sliding table grows by the scheduler's pages, the null page (0) for a
    cached prefix's entries it freed; ``swa_live_from`` moves past the last null
    one, so validation checks a window against one number, not the entries."""
    if 0 in new:
        state.swa_live_from = len(state.swa_pages) + len(new) - new[::-1].index(0)
    state.swa_pages.extend(new)
