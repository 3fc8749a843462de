"""The worker's sampler: one call per step turns the last-position logits of every
sampling request into its next token, plus the logprobs it asked for.

Pipeline, batched over the rows (one row per request that samples this step):

1. logprobs come from the RAW logits (see logprobs.py);
2. a copy of the logits gets bias, penalties and min-new masking (processors.py);
3. greedy rows (temperature < 1e-6 or top_k == 1) take the argmax (ties: the
   lowest id, as ``torch.argmax`` returns the first maximum);
4. the other rows are filtered and drawn by inverse CDF (filters.py) with one
   uniform per row: from (seed, outputs so far) for seeded rows, from the
   sampler's own generator otherwise. The filters run on the sampler's
   ``Kernels`` (FlashInfer's top-k / top-p kernels on CUDA, a sort on the CPU:
   the same definition); the uniforms and the draw are ours everywhere.

When every row is greedy, needs no processing and asks for no logprobs beyond
the chosen token's, the step is one argmax and one logsumexp over the raw
logits: no copy, no softmax, no sort.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from worker_service.device.transfer import to_device, to_host
from worker_service.kernels import Kernels, select_kernels
from worker_service.sampling import filters, grammar, logprobs, processors
from worker_service.sampling.logprobs import logprob_tensors
from worker_service.sampling.rows import SampleOutput, SampleRow


def _is_plain_greedy(row: SampleRow) -> bool:
    lp = row.logprobs
    return (
        row.sampling.is_greedy
        and not processors.needs_processing(row)
        and lp.top_logprobs_num <= 0
        and not lp.token_ids_logprob
    )


class Sampler:
    """Stateless between steps except for the generator used by unseeded rows."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        seed: int | None = None,
        kernels: Kernels | None = None,
    ) -> None:
        """``seed`` seeds the generator for unseeded rows (tests); None draws fresh
        entropy. ``kernels``: None picks them for the device (select_kernels)."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        logprobs.prepare(self.device)
        self.kernels = kernels or select_kernels(self.device)
        self.bitmask_backend = grammar.bitmask_backend(self.device.type)
        # A private CPU generator: never torch's global RNG (which model code or
        # other requests may consume), and its draws are device independent.
        self._generator = torch.Generator(device="cpu")
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleOutput:
        """Next token and logprobs for each row.

        logits: (B, V') on the sampler's device, V' >= vocab_size; columns past
        vocab_size (a padded embedding) are ignored, also for logprobs.
        """
        return self.launch(logits, rows).result()

    def launch(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleLaunch:
        """Queue the sampling on the device and return at once: the tokens are
        on the device (``tokens``) for whatever is queued next; ``result()``
        is the step's one wait, for everything the host needs."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} for {len(rows)} rows")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns < vocab {self.vocab_size}")
        if not rows:
            return SampleLaunch(torch.empty(0, dtype=torch.long, device=logits.device), [], [])
        # bf16 -> fp32 is exact, so the argmax (ties included) and logprob_tensors
        # (which computes in fp32 chunk by chunk) need no fp32 copy of the logits.
        raw = logits[:, : self.vocab_size]
        # A grammar still waiting for the end of a reasoning section masks nothing.
        constrained = [
            i for i, r in enumerate(rows) if r.grammar is not None and r.grammar.constraining
        ]
        if not constrained and all(_is_plain_greedy(r) for r in rows):
            chosen = raw.argmax(dim=-1)
        else:
            raw = raw.float()
            if constrained:
                # Structured generation: what the grammar forbids is -inf before
                # anything else, so the logprobs reported for these rows are of
                # the distribution the token is drawn from (the allowed tokens).
                raw = raw.clone()
                self._apply_grammars(raw, rows, constrained)
            chosen = self._choose(raw, rows)
        return self._with_logprobs(raw, chosen, rows)

    def _apply_grammars(
        self, raw: torch.Tensor, rows: list[SampleRow], constrained: list[int]
    ) -> None:
        bitmask = grammar.allocate_bitmask(len(rows), raw.shape[1])
        for i in constrained:
            rows[i].grammar.fill(bitmask, i)
        grammar.apply_bitmask(raw, bitmask, constrained, backend=self.bitmask_backend)

    def _choose(self, raw: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Process the logits, then argmax the greedy rows and draw the others."""
        processed = processors.process_logits(raw, rows)
        greedy = [i for i, r in enumerate(rows) if r.sampling.is_greedy]
        drawn = [i for i, r in enumerate(rows) if not r.sampling.is_greedy]
        if not drawn:
            return processed.argmax(dim=-1)
        dev = raw.device
        chosen = torch.empty(len(rows), dtype=torch.long, device=dev)
        specs = [rows[i].sampling for i in drawn]
        k, p, m = host = filters.filter_arrays(
            [s.top_k for s in specs],
            [s.top_p for s in specs],
            [s.min_p for s in specs],
            raw.shape[1],
        )
        temperatures = np.array([s.temperature for s in specs], np.float32)
        uniforms = self._uniforms([rows[i] for i in drawn]).numpy()
        # Indices and parameters go up in one pinned, non-blocking copy per dtype.
        g, d, top_k = to_device([np.array(greedy, np.int64), np.array(drawn, np.int64), k], dev)
        tokens = None
        if dev.type == "cpu" and not filters.any_filter(host, raw.shape[1]):
            tokens = self._cpu_draw(processed, d, temperatures, uniforms)
        if tokens is None:
            temperature, top_p, min_p, u = to_device([temperatures, p, m, uniforms], dev)
            tokens = filters.draw(
                processed.index_select(0, d),
                temperature=temperature,
                filters=filters.sampling_filters(host, (top_k, top_p, min_p), raw.shape[1]),
                u=u,
                kernels=self.kernels,
            )
        if greedy:
            chosen[g] = processed.index_select(0, g).argmax(dim=-1)
        chosen[d] = tokens
        return chosen

    def _cpu_draw(
        self,
        processed: torch.Tensor,
        drawn: torch.Tensor,
        temperatures: np.ndarray,
        uniforms: np.ndarray,
    ) -> torch.Tensor | None:
        """The drawn rows' tokens from the C draw (temperature only, float32 CPU
        logits), or None where it does not apply (no compiler, a NaN or
        infinite row): filters.draw then runs, with its rules."""
        ops = logprobs.cpu_ops()
        if ops is None:
            return None
        return ops.temperature_draw(
            processed, drawn, torch.from_numpy(temperatures), torch.from_numpy(uniforms)
        )

    def _uniforms(self, rows: list[SampleRow]) -> torch.Tensor:
        """(S,) float32 on the CPU: one u in [0, 1) per drawn row."""
        unseeded = [r for r in rows if r.sampling.seed is None]
        fresh = iter(torch.rand(len(unseeded), generator=self._generator).tolist())
        u = [
            next(fresh)
            if r.sampling.seed is None
            else filters.seeded_uniform(r.sampling.seed, r.output_count)
            for r in rows
        ]
        return torch.tensor(u, dtype=torch.float32)

    def _with_logprobs(
        self, raw: torch.Tensor, chosen: torch.Tensor, rows: list[SampleRow]
    ) -> SampleLaunch:
        """Chosen, top-n and requested-id logprobs from the raw logits, in one pass."""
        # Column 0 is the chosen token, then each row's requested ids padded
        # with -1 (which logprob_tensors turns into NaN, then we slice it off).
        width = max(len(r.logprobs.token_ids_logprob) for r in rows)
        if width:
            host_ids = np.full((len(rows), 1 + width), -1, dtype=np.int64)
            for i, r in enumerate(rows):
                req = r.logprobs.token_ids_logprob
                host_ids[i, 1 : 1 + len(req)] = req
            (ids,) = to_device([host_ids], raw.device)
            ids[:, 0] = chosen
        else:
            ids = chosen.view(-1, 1)
        top_n = max(max(r.logprobs.top_logprobs_num for r in rows), 0)
        lp = logprob_tensors(raw, ids, top_n=top_n)
        tensors = [lp.logprobs, lp.top_ids, lp.top_logprobs] if top_n else [lp.logprobs]
        return SampleLaunch(chosen, tensors, rows)


class SampleLaunch:
    """A step's sampling, queued on the device."""

    def __init__(
        self, tokens: torch.Tensor, tensors: list[torch.Tensor], rows: list[SampleRow]
    ) -> None:
        self.tokens = tokens  # (B,) int64 on the device: the sampled ids
        self._tensors = tensors  # logprobs (B, 1 + ids), then top ids and logprobs
        self._rows = rows
        self._result: SampleOutput | None = None

    def result(self) -> SampleOutput:
        """Everything back on the host, after the step's one wait for the device."""
        if self._result is None:
            self._result = self.from_host(to_host(*self.device_tensors()))
        return self._result

    def device_tensors(self) -> list[torch.Tensor]:
        """What ``from_host`` reads, on the device (nothing for an empty step)."""
        return [self.tokens, *self._tensors] if self._rows else []

    def from_host(self, host: Sequence[torch.Tensor]) -> SampleOutput:
        """The step's samples from ``device_tensors()`` copied to the host."""
        rows = self._rows
        if not rows:
            return SampleOutput()
        chosen_h, lp_h, *top = host
        if top:
            top_ids, top_lps = top[0].tolist(), top[1].tolist()
        else:
            top_ids = top_lps = [[] for _ in rows]
        lp_rows = lp_h.tolist()
        out = SampleOutput(token_ids=chosen_h.tolist(), logprobs=[row[0] for row in lp_rows])
        for i, r in enumerate(rows):
            n = max(r.logprobs.top_logprobs_num, 0)
            out.top_ids.append(top_ids[i][:n])
            out.top_logprobs.append(top_lps[i][:n])
            out.ids_logprobs.append(lp_rows[i][1 : 1 + len(r.logprobs.token_ids_logprob)])
        return out
