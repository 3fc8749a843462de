"""One step of the real model: flat batch -> forward -> logits -> tokens.

Only the rows that need logits reach the LM head: the last token of every
sampling request (the last draft_len + 1 of a drafted extend, speculative
decoding: one sampled row each, in one sampler call with the others; the
runner accepts the drafts, sampling/draft_acceptance.py), and the prompt
positions whose logprobs were asked for (the logits at position p score the prompt token at
p + 1). Embedding requests never reach it: their final-norm hidden states are
pooled instead (the last prompt position's, or the mean over the prompt,
summed chunk by chunk in float32) and read back with the chunk that ends the
prompt; a sequence classifier's score head turns its pooled state into the
labels' logits. ``ModelRunner`` (model_runner.py) hands it each step's work in plan
order; it runs a drafted step to its end (``run``), never overlapped, so no
later step gathers its inputs from a drafted step's tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import structlog
import torch

from worker_service.attention.base import (
    AttentionBackend,
    AttentionBatch,
    ColumnSlices,
    SeqColumns,
    SequenceSlice,
)
from worker_service.device.distributed import TensorParallel
from worker_service.device.kv_cache import KvCache
from worker_service.device.page_table import PageTable
from worker_service.device.transfer import to_device
from worker_service.execution.cuda_graphs import DecodeGraphs
from worker_service.execution.model_runner import SeqWork
from worker_service.lora.batch import LoraBatch, build_lora_batch
from worker_service.models.layers import ScoreHead
from worker_service.models.llama import LlamaForCausalLM
from worker_service.sampling.logprobs import token_logprobs
from worker_service.sampling.params import LogprobOptions
from worker_service.sampling.rows import (
    PooledEmbedding,
    PromptLogprobs,
    SampleOutput,
    SampleRow,
)
from worker_service.sampling.sampler import SampleLaunch, Sampler

logger = structlog.get_logger(__name__)

# Prompt rows per LM-head call when scoring prompt logprobs: 1024 rows of a
# 128k vocabulary are 0.5 GB of float32 logits; a whole 8k-token chunk at once
# would be 4 GB.
PROMPT_LOGIT_ROWS = 1024


@dataclass(slots=True)
class _PromptSpan:
    work: SeqWork
    start: int  # first prompt position reported
    end: int  # exclusive
    rows: list[int]  # hidden rows of positions max(start, 1) - 1 .. end - 2


@dataclass
class ModelStep:
    """A model step queued on the device (ModelCompute.launch)."""

    sample: SampleLaunch | None
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    embeddings: list[PooledEmbedding] = field(default_factory=list)

    @property
    def tokens(self) -> torch.Tensor:
        if self.sample is None:
            raise ValueError("this step samples nothing")
        return self.sample.tokens


class ModelCompute:
    """One step of the real model (see the module docstring)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        attn: AttentionBackend,
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
        # The requests' page ids on the device; ModelRunner applies each plan's
        # page deltas to it, the step reads it (O(batch) host work, no page lists).
        self.page_table = PageTable(device)

    def capture_decode_graphs(self) -> None:
        """Capture decode forwards (model + LM head) in CUDA graphs, one per batch
        size the attention backend offers; decode-only steps then replay them."""
        largest = max(self.attn.graph_sizes)
        buffers = {
            "ids": torch.zeros(largest, dtype=torch.long, device=self.device),
            "positions": torch.zeros(largest, dtype=torch.long, device=self.device),
        }

        def forward(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            hidden = self.model(inputs["ids"], inputs["positions"], attn=self.attn, kv=self.kv)
            return self.model.logits(hidden)

        self.graphs = DecodeGraphs(self.attn, forward, buffers, self.page_size)
        self.graphs.capture()

    def run(self, work: list[SeqWork], num_extends: int) -> SampleOutput:
        return self.finish(self.launch(work, num_extends, previous=None))

    def launch(
        self, work: list[SeqWork], num_extends: int, previous: ModelStep | None
    ) -> ModelStep:
        """Queue the step: layout up, attention planned, forward, LM head and
        sampling on the device; the host does not wait (but for prompt
        logprobs, read back here). Decode inputs still PENDING are gathered on
        the device from ``previous``'s sampled tokens."""
        device = self.device
        batch, input_ids = self._batch(work, num_extends, previous)
        lora = self._lora_batch(work, batch.seqs)
        # The graphs hold the base model only: a step with adapter rows runs eagerly.
        if self.graphs is not None and num_extends == 0 and lora is None:
            logits = self.graphs.replay(batch, {"ids": input_ids, "positions": batch.positions})
            if logits is not None:  # every row of a decode step samples
                return ModelStep(self._sample(logits, work))
        self.attn.begin_step(batch)
        hidden = self.model(input_ids, batch.positions, attn=self.attn, kv=self.kv, lora=lora)

        drafted = any(w.draft_len for w in work[:num_extends])
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
            step.sample = self._sample(logits, [w for w in work if w.sample], drafted)
        for span in self._prompt_spans(work, batch.seqs):
            step.prompt_logprobs.append(self._prompt_logprobs(span, hidden))
        for s, w in zip(batch.seqs, work[:num_extends], strict=False):
            if w.state.pooling:
                pooled = _pool(w, hidden[s.q_start : s.q_start + s.q_len], self.model.score)
                if pooled is not None:
                    step.embeddings.append(pooled)
        return step

    def finish(self, step: ModelStep) -> SampleOutput:
        """The step's samples on the host: its one wait for the device."""
        out = step.sample.result() if step.sample is not None else SampleOutput()
        out.prompt_logprobs = step.prompt_logprobs
        out.embeddings = step.embeddings
        return out

    # ------------------------------------------------------------- batch
    def _batch(
        self, work: list[SeqWork], num_extends: int, previous: ModelStep | None = None
    ) -> tuple[AttentionBatch, torch.Tensor]:
        """The step's layout from O(batch) numbers and the pages it writes
        (O(tokens)), built with numpy on the host and sent to the device in one
        non-blocking copy from pinned memory (no stream synchronisation). Page
        lists are not read: the page table's rows are (device/page_table.py)."""
        page_size, n, table = self.page_size, len(work), self.page_table
        table.sync()
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
        pages = table.host[rows[seq_of], positions // page_size].astype(np.int64)
        # Decodes whose input the previous step is still sampling: (row, index
        # among its sampled tokens); their ids are gathered on the device.
        waiting = [(first_row[i], w.pending) for i, w in enumerate(work) if w.pending is not None]
        if waiting and previous is None:
            raise ValueError("a decode input is pending but no previous step was given")
        gather = np.array(waiting, dtype=np.int64).reshape(-1, 2).T
        ids[gather[0]] = 0
        pos_t, pages_t, offsets_t, ids_t, gather_t = to_device(
            [positions, pages, positions % page_size, ids, gather], self.device
        )
        if waiting:
            ids_t.index_copy_(0, gather_t[0], previous.tokens.index_select(0, gather_t[1]))
        columns = SeqColumns(first_row, q_lens, kv_lens, rows)
        batch = AttentionBatch(
            seqs=ColumnSlices(columns),
            num_extends=num_extends,
            positions=pos_t,
            write_pages=pages_t,
            write_offsets=offsets_t,
            page_size=page_size,
            pages=table,
            columns=columns,
        )
        return batch, ids_t

    def _lora_batch(self, work: list[SeqWork], seqs: list[SequenceSlice]) -> LoraBatch | None:
        """The step's token rows grouped by adapter; None when all are base rows."""
        if all(w.state.adapter is None for w in work):
            return None
        spans = [(w.state.adapter, s.q_start, s.q_len) for w, s in zip(work, seqs, strict=True)]
        return build_lora_batch(spans, self.device)

    def _prompt_spans(self, work: list[SeqWork], seqs: list[SequenceSlice]) -> list[_PromptSpan]:
        """Which prompt positions this step scores, and the hidden rows they need."""
        spans: list[_PromptSpan] = []
        for w, s in zip(work, seqs, strict=True):
            state = w.state
            if not state.wants_prompt_logprobs or w.start >= state.prompt_len:
                continue
            end_known = w.start + len(w.inputs)  # positions < end_known are in this chunk
            if w.next_token is not None:
                end_known += 1  # and the next prompt token is given
            start = max(state.logprobs.logprob_start_len, w.start + 1 if w.start else 0)
            end = min(end_known, state.prompt_len)
            if end <= start:
                continue
            scored = range(max(start, 1), end)  # position 0 has no logprob
            rows = [s.q_start + (p - 1 - w.start) for p in scored]
            spans.append(_PromptSpan(w, start, end, rows))
        return spans

    # ------------------------------------------------------------- sample
    def _sample(
        self, logits: torch.Tensor, work: list[SeqWork], drafted: bool = False
    ) -> SampleLaunch:
        """One batched sampler call; a drafted extend has draft_len + 1 rows."""
        if drafted:
            rows = [row for w in work for row in self._draft_rows(w)]
        else:
            rows = [self._sample_row(w) for w in work]
        if self.tp.rank == 0:
            launched = self.sampler.launch(logits, rows)
        else:  # the tokens come from rank 0; the logprobs are rank 0's to report
            n = len(rows)
            tokens = torch.zeros(n, dtype=torch.long, device=self.device)
            plain = [SampleRow(r.sampling, LogprobOptions(), (), ()) for r in rows]
            zeros = torch.zeros((n, 1), dtype=torch.float32, device=self.device)
            launched = SampleLaunch(tokens, [zeros], plain)
        if self.tp.enabled:
            # Every rank keeps the tokens on its device: the next step's decode
            # inputs are gathered from them (overlap), and all ranks agree.
            self.tp.broadcast_from_first(launched.tokens)
        return launched

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

    def _prompt_logprobs(self, span: _PromptSpan, hidden: torch.Tensor) -> PromptLogprobs:
        """The span's logprobs, PROMPT_LOGIT_ROWS rows of the LM head at a time:
        a long prompt's full float32 logits (rows x vocabulary) would not fit."""
        w, state = span.work, span.work.state
        lp = state.logprobs
        first = max(span.start, 1)
        targets = np.array(
            [
                state.tokens[p] if p < w.start + len(w.inputs) else w.next_token
                for p in range(first, span.end)
            ],
            dtype=np.int64,
        )
        head = [math.nan] if span.start == 0 else []
        out = PromptLogprobs(w.slot, span.start, head)
        rows = np.array(span.rows, dtype=np.int64)
        for at in range(0, len(rows), PROMPT_LOGIT_ROWS):
            index, ids = to_device(
                [rows[at : at + PROMPT_LOGIT_ROWS], targets[at : at + PROMPT_LOGIT_ROWS]],
                self.device,
            )
            logits = self.model.logits(hidden.index_select(0, index))
            scored = token_logprobs(
                logits, ids, top_n=lp.top_logprobs_num, token_ids=lp.token_ids_logprob
            )
            out.logprobs += scored.logprobs
            if lp.top_logprobs_num:
                out.top_ids += [i for ids_ in scored.top_ids for i in ids_]
                out.top_logprobs += [x for lps in scored.top_logprobs for x in lps]
            if lp.token_ids_logprob:
                out.ids_logprobs += [x for lps in scored.ids_logprobs for x in lps]
        return out


def _pool(w: SeqWork, rows: torch.Tensor, score: ScoreHead | None) -> PooledEmbedding | None:
    """An embedding request's chunk (``rows``: its final-norm hidden states):
    the vector once the chunk ends the prompt, else None (a mean's running
    sum kept in float32 on the device, as the chunk sizes vary). A
    classifier's vector is its ``score`` head's logits at the last token
    (SGLang's ``score_and_pool``; the worker refuses any other pooling)."""
    state = w.state
    end = w.start + len(w.inputs)
    if state.pooling == "mean":
        part = rows.float().sum(dim=0)
        state.pooled = part if state.pooled is None else state.pooled + part
    if end != state.prompt_len:
        return None
    if state.pooling == "mean":
        vec = state.pooled / state.prompt_len
        state.pooled = None
    elif score is not None:
        vec = score(rows[-1])
    else:
        vec = rows[-1].float()
    if state.normalize:
        vec = torch.nn.functional.normalize(vec, dim=0)
    return PooledEmbedding(w.slot, vec.tolist())
