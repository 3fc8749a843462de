"""One step of the real model: flat batch -> forward -> logits -> tokens.

Only the rows that need logits reach the LM head: the last token of every
sampling request (the last draft_len + 1 of a drafted extend, speculative
decoding: one sampled row each, in one sampler call with the others; the
runner accepts the drafts, sampling/draft_acceptance.py), and the prompt
positions whose logprobs were asked for (the logits at position p score the
prompt token at p + 1; prompt_scores.py). Embedding requests never reach it:
their final-norm hidden states are pooled instead (pooling.py) and read back
with the chunk that ends the prompt. What a step leaves on the device until
``finish`` is a ``ModelStep`` (model_step.py); the CUDA graphs are
cuda_graphs.py's. ``ModelRunner`` (model_runner.py) hands it each step's work
in plan order; it runs a drafted step to its end (``run``), never overlapped,
so no later step gathers its inputs from a drafted step's tokens.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import structlog
import torch

from worker_service.attention.base import (
    AttentionBatch,
    ColumnSlices,
    SeqColumns,
    SequenceSlice,
)
from worker_service.attention.layer_groups import Attention, Batches, one_batch
from worker_service.device.distributed import GroupStepFailed, TensorParallel
from worker_service.device.host_kv_pool import HostKvPool
from worker_service.device.kv_cache import KvCache
from worker_service.device.page_table import PageTable
from worker_service.device.transfer import HostCopy, to_device
from worker_service.execution.cuda_graphs import DecodeGraphs, pad_verify_batch
from worker_service.execution.layer_copy_waits import CopyGatedAttention, LayerWaits
from worker_service.execution.model_step import ModelStep, SampleFault
from worker_service.execution.plan import PageCopies
from worker_service.execution.pooling import pool_embedding
from worker_service.execution.prompt_scores import prompt_spans, score_prompt
from worker_service.execution.step_work import SeqWork
from worker_service.lora.batch import LoraBatch, build_lora_batch
from worker_service.lora.graph_slots import LoraSlots, SlotLoraBatch
from worker_service.models.llama import LlamaForCausalLM
from worker_service.sampling.params import LogprobOptions
from worker_service.sampling.rows import (
    PooledEmbedding,
    SampleOutput,
    SampleRow,
)
from worker_service.sampling.sampler import SampleLaunch, Sampler

logger = structlog.get_logger(__name__)


class ModelCompute:
    """One step of the real model (see the module docstring)."""

    # Fault tests (--fail-sample-token): rank 0's sampler fails every step whose
    # inputs hold this token.
    fail_token: int | None = None

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        attn: Attention,
        kv: KvCache,
        sampler: Sampler,
        tp: TensorParallel,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attn = attn
        self.kv = kv
        self.sampler = sampler
        self.tp = tp
        self.device = device
        self.page_size = kv.page_size
        self.eos_token_ids = tuple(model.config.eos_token_ids)
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None  # drafted steps
        # Decode steps with adapter rows: adapters copied into fixed slots (set
        # before capture_decode_graphs to capture them).
        self.lora_slots: LoraSlots | None = None
        self.lora_graphs: DecodeGraphs | None = None
        # The requests' page ids on the device; ModelRunner applies each plan's
        # page deltas to it, the step reads it (O(batch) host work, no page lists).
        self.page_table = PageTable(device)
        # Two pools: the sliding layers' page ids, same rows (None: one pool).
        self.swa_table = PageTable(device) if kv.swa_layers else None
        # The layer groups the attention serves: "full", "sliding" or both. One
        # group: the backend gets that group's batch, as with one pool; both:
        # a mapping of batches (GroupedAttention).
        groups = ["full"] if kv.has_full_layers else []
        self.groups = tuple(groups + (["sliding"] if kv.swa_layers else []))
        # The host tier's pool (device/host_kv_pool.py; None: no host tier), and
        # on CUDA the copies the next forward's layers wait for.
        self.host_kv: HostKvPool | None = None
        self._copy_waits: LayerWaits | None = None

    def copy_pages(self, copies: PageCopies, *, forward: bool) -> None:
        """A plan's host-tier copies, before its forward (``forward``: the plan
        has one; else the compute stream waits for them at once, so whatever
        comes next is ordered after them). On the CPU they are done here."""
        if self.host_kv is None:
            raise ValueError("page copies, but this worker has no host KV pool")
        self._take_copy_waits(wait=True)  # a previous plan's, if no forward took them
        waits = self.host_kv.copy(
            copies.write_back_device, copies.write_back_host, copies.load_host, copies.load_device
        )
        self._copy_waits = waits  # type: ignore[assignment]
        if not forward:
            self._take_copy_waits(wait=True)

    def _take_copy_waits(self, *, wait: bool) -> LayerWaits | None:
        """The pending copies' waits (cleared); ``wait``: the current stream
        waits for all of them now."""
        waits, self._copy_waits = self._copy_waits, None
        if waits is not None and wait:
            waits.wait_all()
            return None
        return waits

    @property
    def scratch_page(self) -> int | dict[str, int]:
        """The page CUDA-graph padding rows write and read: the last of the pool
        the backend reads, which the scheduler is never told of; with two pools
        and two groups, each group's (its pool's last)."""
        full, swa = self.kv.num_pages - 1, self.kv.num_swa_pages - 1
        if len(self.groups) == 2:
            return {"full": full, "sliding": swa}
        return swa if self.groups == ("sliding",) else full

    def capture_decode_graphs(self) -> None:
        """Capture decode forwards (the model up to its final norm) in CUDA graphs,
        one per batch size the attention backend offers, and, where it offers
        verify graphs, drafted-step forwards per number of sequences; those steps
        replay them and run the LM head eagerly on the replay's output: one GEMM,
        and the per-size outputs kept outside the graphs' pool stay hidden-sized,
        not vocabulary-sized (cuda_graphs.py). One pool for all."""
        verify = getattr(self.attn, "verify_graphs", None)
        largest = max(self.attn.graph_sizes)
        if verify is not None:
            largest = max(largest, max(verify.graph_sizes) * verify.rows_per_seq)
        buffers = {
            "ids": torch.zeros(largest, dtype=torch.long, device=self.device),
            "positions": torch.zeros(largest, dtype=torch.long, device=self.device),
        }

        def forward(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.model(inputs["ids"], inputs["positions"], attn=self.attn, kv=self.kv)

        def lora_forward(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            assert self.lora_slots is not None
            lora = SlotLoraBatch(self.lora_slots, inputs["lora_slot"])
            ids, positions = inputs["ids"], inputs["positions"]
            return self.model(ids, positions, attn=self.attn, kv=self.kv, lora=lora)

        pool = torch.cuda.graph_pool_handle()
        self.graphs = DecodeGraphs(self.attn, forward, buffers, self.page_size)
        self.graphs.capture(pool)
        if verify is not None:
            self.verify_graphs = DecodeGraphs(
                verify, forward, buffers, self.page_size, rows_per_seq=verify.rows_per_seq
            )
            self.verify_graphs.capture(pool)
        if self.lora_slots is not None:
            size = max(self.attn.graph_sizes)
            slot_buffer = torch.full((size,), -1, dtype=torch.long, device=self.device)
            with_slots = buffers | {"lora_slot": slot_buffer}
            self.lora_graphs = DecodeGraphs(self.attn, lora_forward, with_slots, self.page_size)
            self.lora_graphs.capture(pool)

    def run(self, work: list[SeqWork], num_extends: int) -> SampleOutput:
        return self.finish(self.launch(work, num_extends, previous=None))

    def launch(
        self, work: list[SeqWork], num_extends: int, previous: ModelStep | None
    ) -> ModelStep:
        """Queue the step (``_queue``) and, right behind its kernels, the copies
        of what ``finish`` reads: were they queued in ``finish``, after the next
        step's kernels (overlap), the wait for them would wait for that step too."""
        step = self._queue(work, num_extends, previous)
        step.readback = HostCopy(step.device_tensors())
        return step

    def _queue(
        self, work: list[SeqWork], num_extends: int, previous: ModelStep | None
    ) -> ModelStep:
        """Queue the step: layout up, attention planned, forward, LM head and
        sampling on the device; the host does not wait. Decode inputs still
        PENDING are gathered on the device from ``previous``'s sampled tokens."""
        device = self.device
        # The host tier on CUDA: an eager forward's layers wait for their own
        # pages' copies; a graph replay waits for all of them first.
        waits = self._take_copy_waits(wait=False)
        graphs_may_run = num_extends == 0 or any(w.draft_len for w in work[:num_extends])
        if waits is not None and graphs_may_run:
            waits.wait_all()
            waits = None
        batches, input_ids = self._batch(work, num_extends, previous)
        # The group batches share their sequences and positions.
        batch = next(iter(batches.values()))
        # What the attention takes: one group's batch, or (GroupedAttention) each group's.
        attn_batch = batch if len(batches) == 1 else batches
        adapters = any(w.state.adapter is not None for w in work)
        if self.graphs is not None and num_extends == 0:
            hidden = self._replay_decode(work, attn_batch, input_ids, adapters=adapters)
            if hidden is not None:  # every row of a decode step samples
                return self._sample(self.model.logits(hidden), work)
        lora = self._lora_batch(work, batch.seqs) if adapters else None
        drafted = any(w.draft_len for w in work[:num_extends])
        if drafted and self.verify_graphs is not None and lora is None:
            replayed = self._replay_drafted(work, num_extends, batches, input_ids)
            if replayed is not None:
                return replayed
        self.attn.begin_step(attn_batch)  # type: ignore[arg-type]
        attn = self.attn if waits is None else CopyGatedAttention(self.attn, waits)
        hidden = self.model(input_ids, batch.positions, attn=attn, kv=self.kv, lora=lora)
        if waits is not None:  # what follows the forward comes after every copy
            waits.wait_all()

        if drafted:  # a drafted extend samples at its last draft_len + 1 positions
            sample_rows = [
                row
                for s, w in zip(batch.seqs, work, strict=True)
                if w.sample
                for row in range(s.q_start + s.q_len - 1 - w.draft_len, s.q_start + s.q_len)
            ]
        else:
            sample_rows = [
                s.q_start + s.q_len - 1 for s, w in zip(batch.seqs, work, strict=True) if w.sample
            ]
        step = ModelStep(sample=None)
        if sample_rows:
            (index,) = to_device([np.array(sample_rows, dtype=np.int64)], device)
            logits = self.model.logits(hidden.index_select(0, index))
            step = self._sample(logits, [w for w in work if w.sample], drafted)
        for span in prompt_spans(work, batch.seqs):
            step.prompt_logprobs.append(score_prompt(span, hidden, self.model.logits))
        for s, w in zip(batch.seqs, work[:num_extends], strict=False):
            if w.state.pooling:
                pooled = pool_embedding(
                    w, hidden[s.q_start : s.q_start + s.q_len], self.model.score
                )
                if pooled is not None:
                    step.embeddings.append(pooled)
        return step

    def _replay_decode(
        self,
        work: list[SeqWork],
        batch: Batches,
        input_ids: torch.Tensor,
        *,
        adapters: bool,
    ) -> torch.Tensor | None:
        """A decode step's hidden states from a graph: the base model's, or with
        adapter rows the LoRA graphs' once its adapters hold slots; None: eager."""
        inputs = {"ids": input_ids, "positions": one_batch(batch).positions}
        if not adapters:
            assert self.graphs is not None
            return self.graphs.replay(batch, inputs)
        if self.lora_graphs is None or self.lora_slots is None:
            return None
        if self.lora_graphs.attention.graph_size_for(batch) is None:
            return None  # checked first: assigning slots copies weights
        held = [w.state.adapter for w in work if w.state.adapter is not None]
        where = self.lora_slots.assign(held)
        if where is None:
            return None
        row_slot = np.array(
            [-1 if w.state.adapter is None else where[id(w.state.adapter)] for w in work],
            dtype=np.int64,
        )
        (inputs["lora_slot"],) = to_device([row_slot], self.device)
        return self.lora_graphs.replay(batch, inputs)

    def _replay_drafted(
        self,
        work: list[SeqWork],
        num_extends: int,
        batches: dict[str, AttentionBatch],
        input_ids: torch.Tensor,
    ) -> ModelStep | None:
        """A drafted step through a verify graph: every extend drafted (no prompt
        chunk) and no row longer than the graphs' rows; None: run it eagerly.
        Two pools: each group's batch is padded onto its own pool's scratch page."""
        graphs = self.verify_graphs
        assert graphs is not None
        q = graphs.rows_per_seq
        batch = next(iter(batches.values()))
        if not all(w.draft_len for w in work[:num_extends]):
            return None
        if any(s.q_len > q for s in batch.seqs):
            return None
        if len(batches) == 1:
            scratch = graphs.attention.scratch_page
            padded, ids, _ = pad_verify_batch(
                batch, input_ids, rows_per_seq=q, scratch_page=scratch
            )
            attn_batch: Batches = padded
        else:
            parts = graphs.attention.parts  # type: ignore[attr-defined]  # GroupedVerifyGraphs
            pads = {
                g: pad_verify_batch(
                    b, input_ids, rows_per_seq=q, scratch_page=parts[g].scratch_page
                )
                for g, b in batches.items()
            }
            attn_batch = {g: p[0] for g, p in pads.items()}
            padded, ids, _ = next(iter(pads.values()))
        hidden = graphs.replay(attn_batch, {"ids": ids, "positions": padded.positions})
        if hidden is None:
            return None
        # A sequence's samples: its last draft_len + 1 real rows (one for a decode).
        rows = [
            i * q + r
            for i, (s, w) in enumerate(zip(batch.seqs, work, strict=True))
            if w.sample
            for r in range(s.q_len - 1 - w.draft_len, s.q_len)
        ]
        (index,) = to_device([np.array(rows, dtype=np.int64)], self.device)
        logits = self.model.logits(hidden.index_select(0, index))
        return self._sample(logits, [w for w in work if w.sample], drafted=True)

    def finish(self, step: ModelStep) -> SampleOutput:
        """The step's samples and prompt logprobs on the host: its one wait
        for the device. Under tensor parallelism every rank raises here if
        rank 0's sampling failed (GroupStepFailed)."""
        if step.sample_error is not None:
            error = step.sample_error
            raise GroupStepFailed(f"rank 0 failed sampling: {error!r}") from error
        readback = step.readback or HostCopy(step.device_tensors())
        host = readback.wait()
        n_sample = len(step.sample.device_tensors()) if step.sample is not None else 0
        out = step.sample.from_host(host[:n_sample]) if step.sample is not None else SampleOutput()
        host = host[n_sample:]
        if step.sample_status is not None and host.pop().tolist()[0]:
            raise GroupStepFailed("tensor-parallel rank 0 failed sampling this step")
        at = 0
        for p in step.prompt_logprobs:
            n = len(p.tensors())
            out.prompt_logprobs.append(p.on_host(host[at : at + n]))
            at += n
        for (slot, _), vec in zip(step.embeddings, host[at:], strict=True):
            out.embeddings.append(PooledEmbedding(slot, vec.tolist()))
        return out

    # ------------------------------------------------------------- batch
    def _batch(
        self, work: list[SeqWork], num_extends: int, previous: ModelStep | None = None
    ) -> tuple[dict[str, AttentionBatch], torch.Tensor]:
        """The step's layout from O(batch) numbers and the pages it writes
        (O(tokens)), built with numpy on the host and sent to the device in one
        non-blocking copy from pinned memory (no stream synchronisation). Page
        lists are not read: the page table's rows are (device/page_table.py).
        One batch per layer group (``groups``): the sliding group's writes go
        to its own pages and it reads its own table (the same rows)."""
        page_size, n, table, swa = self.page_size, len(work), self.page_table, self.swa_table
        table.sync()
        if swa is not None:
            swa.sync()
        rows = np.fromiter((w.state.row for w in work), np.int64, n)
        starts = np.fromiter((w.start for w in work), np.int64, n)
        if num_extends:
            q_lens = np.fromiter((len(w.inputs) for w in work), np.int64, n)
            ids = np.fromiter(itertools.chain.from_iterable(w.inputs for w in work), np.int64)
        else:  # decodes only: one input each
            q_lens = np.ones(n, np.int64)
            ids = np.fromiter((w.inputs[0] for w in work), np.int64, n)
        kv_lens = starts + q_lens
        short = table.lengths[rows] * page_size < kv_lens
        if short.any():
            i = int(np.argmax(short))
            raise ValueError(f"slot {work[i].slot}: its pages do not cover {kv_lens[i]} positions")
        first_row = np.cumsum(q_lens) - q_lens
        num_tokens = int(q_lens.sum())
        if num_tokens == n:  # one token per sequence (decodes): its position is its start
            seq_of, positions = np.arange(n), starts
        else:
            seq_of = np.repeat(np.arange(n), q_lens)  # each token's sequence
            positions = np.arange(num_tokens, dtype=np.int64) - first_row[seq_of] + starts[seq_of]
        cells = (rows[seq_of], positions // page_size)
        pages = table.host[cells].astype(np.int64)
        swa_pages = swa.host[cells].astype(np.int64) if swa is not None else pages[:0]
        # Decodes whose input the previous step is still sampling: (row, index
        # among its sampled tokens); their ids are gathered on the device.
        waiting = [(first_row[i], w.pending) for i, w in enumerate(work) if w.pending is not None]
        if waiting and previous is None:
            raise ValueError("a decode input is pending but no previous step was given")
        gather = np.array(waiting, dtype=np.int64).reshape(-1, 2).T
        ids[gather[0]] = 0
        pos_t, pages_t, offsets_t, ids_t, gather_t, swa_pages_t = to_device(
            [positions, pages, positions % page_size, ids, gather, swa_pages], self.device
        )
        if waiting:
            ids_t.index_copy_(0, gather_t[0], previous.tokens.index_select(0, gather_t[1]))
        columns = SeqColumns(first_row, q_lens, kv_lens, rows)
        full = AttentionBatch(
            seqs=ColumnSlices(columns),
            num_extends=num_extends,
            positions=pos_t,
            write_pages=pages_t,
            write_offsets=offsets_t,
            page_size=page_size,
            pages=table,
            columns=columns,
        )
        batches = {"full": full} if "full" in self.groups else {}
        if swa is not None:
            batches["sliding"] = dataclasses.replace(full, write_pages=swa_pages_t, pages=swa)
        return batches, ids_t

    def _lora_batch(self, work: list[SeqWork], seqs: list[SequenceSlice]) -> LoraBatch | None:
        """The step's token rows grouped by adapter; None when all are base rows."""
        if all(w.state.adapter is None for w in work):
            return None
        spans = [(w.state.adapter, s.q_start, s.q_len) for w, s in zip(work, seqs, strict=True)]
        return build_lora_batch(spans, self.device)

    # ------------------------------------------------------------- sample
    def _sample(
        self, logits: torch.Tensor, work: list[SeqWork], drafted: bool = False
    ) -> ModelStep:
        """One batched sampler call; a drafted extend has draft_len + 1 rows.

        Tensor parallelism: rank 0 samples and broadcasts the tokens, every
        rank keeps them on its device (the next step's decode inputs are
        gathered from them, overlap) and the ranks agree. The broadcast has
        one more entry, rank 0's status: had its sampler raised before the
        broadcast, the other ranks would wait in it while rank 0 went on to
        the next step's collectives. Instead rank 0 broadcasts zeros and the
        status, and every rank fails the step in ``finish``."""
        if drafted:
            rows = [row for w in work for row in self._draft_rows(w)]
        else:
            rows = [self._sample_row(w) for w in work]
        if not self.tp.enabled:
            self._inject_fault(work)
            return ModelStep(self.sampler.launch(logits, rows))
        n = len(rows)
        shared = torch.zeros(n + 1, dtype=torch.long, device=self.device)
        step = ModelStep(sample=None, sample_status=shared[n:])
        if self.tp.rank == 0:
            try:
                self._inject_fault(work)
                step.sample = self.sampler.launch(logits, rows)
                shared[:n].copy_(step.sample.tokens)
            except Exception as e:  # raised in finish, on every rank
                step.sample, step.sample_error = None, e
                shared[n] = 1
        if step.sample is None:  # the tokens come from rank 0; the logprobs are its to report
            plain = [SampleRow(r.sampling, LogprobOptions(), (), ()) for r in rows]
            zeros = torch.zeros((n, 1), dtype=torch.float32, device=self.device)
            step.sample = SampleLaunch(shared[:n], [zeros], plain)
        self.tp.broadcast_from_first(shared)
        return step

    def _inject_fault(self, work: list[SeqWork]) -> None:
        token = self.fail_token
        if token is not None and any(token in w.inputs for w in work):
            raise SampleFault(f"the sampler fails on token {token} (--fail-sample-token)")

    def _sample_row(self, w: SeqWork) -> SampleRow:
        """The token lists are copied only for rows whose penalties read them."""
        state, sp = w.state, w.state.sampling
        tokens, n_prompt = state.tokens, state.prompt_len
        eos = self.eos_token_ids
        if state.grammar is not None and state.grammar.constraining and sp.min_new_tokens:
            # The grammar decides where the output may end: min_new_tokens
            # does not mask its end tokens (they may be all it allows); while
            # it waits for a reasoning section's end, min_new_tokens does.
            sp, eos = dataclasses.replace(sp, min_new_tokens=0, stop_token_ids=()), ()
        return SampleRow(
            sampling=sp,
            logprobs=state.logprobs,
            prompt_ids=tokens[:n_prompt] if sp.repetition_penalty != 1.0 else (),
            output_ids=tokens[n_prompt:] if sp.has_penalties else (),
            eos_token_ids=eos,
            num_outputs=len(tokens) - n_prompt,
            grammar=state.grammar,
        )

    def _draft_rows(self, w: SeqWork) -> list[SampleRow]:
        """Row j samples as if drafts d[0..j-1] were accepted: they join the
        output its penalties read, and its output count (min_new_tokens, the
        seeded draw) is j more. A plain entry: its one row."""
        first = self._sample_row(w)
        if not w.draft_len:
            return [first]
        drafts = w.inputs[len(w.inputs) - w.draft_len :]
        penalized = w.state.sampling.has_penalties
        return [first] + [
            dataclasses.replace(
                first,
                output_ids=[*first.output_ids, *drafts[:j]] if penalized else (),
                num_outputs=first.output_count + j,
            )
            for j in range(1, w.draft_len + 1)
        ]
