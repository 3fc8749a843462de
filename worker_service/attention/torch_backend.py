"""Reference attention in plain torch (CPU and GPU): for each sequence, read
its keys and values back from the pages and attend, causally aligned to the
end (query i of a q_len-token extend sits at position kv_len - q_len + i).

Decode rows (one query each) attend together: their keys are gathered into
one zero-padded (rows, max kv_len) batch with a padding mask, and a query
head group shares its key head without copying it (queries viewed as
(rows, kv_heads, group, head_dim)). One attention call per layer instead of
one per sequence: at batch 64 on a CPU the per-sequence loop cost several
times the rest of the step.

An fp8 KV cache (kv_quant.py) is written quantized by ``KvCache.write`` and
read back dequantized (the gather and ``KvCache.read``); the CPU kernel reads
its e4m3 pages in place (a table of the 256 values, the layer's key scale
folded into the scores' factor, the value scale into the softmax's 1 / sum).

With the CPU kernel (cpu_paged_kernel.py) the decode rows, and each query
of an extend of up to KERNEL_MAX_QUERIES tokens (drafted verify rows, short
chunks), attend through it instead, reading the pages in place.

Soft-capped scores and sinks (AttentionSpec.logit_soft_cap, forward's
``sinks``): SDPA takes neither, so with either set the decode batch and the
long extends attend through ``manual_attention`` (explicit scores, cap, mask,
softmax with the sinks in its denominator), and the CPU kernel takes both;
without them every path is the SDPA one above, unchanged.

Pages come from the batch's page table (device/page_table.py): the kernel
reads its host array in place, the gather path indexes its device tensor,
and a long extend reads a view of its row; no page list is copied per step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from worker_service.attention.base import AttentionBackend, AttentionBatch, AttentionSpec
from worker_service.attention.cpu_paged_kernel import DecodeLayout, PagedDecodeKernel
from worker_service.device.kv_cache import KvCache
from worker_service.device.transfer import to_device

# Extends of up to this many tokens attend through the CPU kernel, a kernel row
# per query (each reads the sequence's keys once more); longer ones through
# SDPA. Covers every drafted verify row (at most --speculative-max-draft + 1).
KERNEL_MAX_QUERIES = 16
# The explicit softmax (a soft cap or sinks) materialises its scores: a long
# extend attends in blocks of queries of at most this many scores (256 MiB in
# float32), not (heads, q_len, kv_len) at once (17 GB for 64 heads over 8k x 8k).
MANUAL_BLOCK_SCORES = 2**26


@dataclass(slots=True)
class _DecodeRows:
    rows: torch.Tensor  # (n,) query row of each decode sequence
    width: int  # key positions per row (the longest row; the others padded)
    # (2 * n * width,) rows of a layer's cache viewed as (pages * 2 * page_size,
    # kv_heads, head_dim): every key of every decode row, then every value.
    # The same for all layers, so computed once per step; one index_select of
    # whole (kv_heads, head_dim) rows is several times faster than indexing
    # the 5-D cache by (page, offset) pairs.
    kv_rows: torch.Tensor
    bias: torch.Tensor  # (n, 1, 1, width) 0 at real (in-window) positions, -inf at padding


class TorchAttention(AttentionBackend):
    name = "torch"

    def __init__(self, spec: AttentionSpec, decode_kernel: PagedDecodeKernel | None = None) -> None:
        super().__init__(spec)
        # On CPU, decode rows attend through the compiled kernel, which reads
        # the pages in place; without it, through the gather and SDPA below.
        usable = (
            decode_kernel is not None
            and spec.device.type == "cpu"
            and decode_kernel.supports(spec.dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim)
            # Pages of the model's dtype, or an fp8 cache's (read through its table).
            and spec.kv_cache_dtype in (spec.dtype, torch.float8_e4m3fn)
        )
        self.decode_kernel = decode_kernel if usable else None
        self._layout: DecodeLayout | None = None

    @property
    def _batched_max_q(self) -> int:
        """Longest extend that attends with the step's batched rows (the kernel,
        or without it the decode batch, which takes one-query rows only); the
        rest attend one SDPA call per sequence."""
        return KERNEL_MAX_QUERIES if self.decode_kernel is not None else 1

    def begin_step(self, batch: AttentionBatch) -> None:
        device = self.spec.device
        window = self.spec.sliding_window
        self._batch = batch
        cols, ps = batch.columns, batch.page_size
        kernel_max_q = self._batched_max_q
        # A sequence attending on its own (a long extend) reads its pages as a
        # view of its page-table row, on the device.
        table = batch.pages.table
        self._tables = [
            None if s.q_len <= kernel_max_q else table[s.row, : -(-s.kv_len // ps)].long()
            for s in batch.seqs
        ]
        self._masks: list[torch.Tensor | None] = []
        self._decode, self._layout = None, None
        if self.decode_kernel is not None:
            # Query i of a short extend (a drafted verify row, a short chunk)
            # is a decode row of its own over the first kv_len - q_len + i + 1
            # positions, with the same page-table row.
            short = np.flatnonzero(cols.q_lens <= kernel_max_q)
            counts = cols.q_lens[short]
            if counts.size:
                seq_of = np.repeat(short, counts)
                i = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
                rows = cols.q_starts[seq_of] + i
                lens = cols.kv_lens[seq_of] - cols.q_lens[seq_of] + i + 1
                self._layout = DecodeLayout(rows, lens, cols.rows[seq_of], batch.pages.host)
        else:
            self._decode = self._decode_batch(batch)
        for s in batch.seqs:
            if s.q_len <= kernel_max_q:
                self._masks.append(None)  # attends in the decode batch or the kernel
                continue
            if s.q_len == s.kv_len and window is None:
                self._masks.append(None)  # a whole prompt: plain causal attention
                continue
            q_pos = torch.arange(s.kv_len - s.q_len, s.kv_len, device=device)[:, None]
            k_pos = torch.arange(s.kv_len, device=device)[None, :]
            allowed = k_pos <= q_pos
            if window is not None:
                allowed &= k_pos > q_pos - window
            self._masks.append(allowed)

    def _decode_batch(self, batch: AttentionBatch) -> _DecodeRows | None:
        """Gather indices and padding mask of the step's one-query rows, built
        on the device from their page-table rows."""
        cols = batch.columns
        ones = cols.q_lens == 1
        if not ones.any():
            return None
        page_size, window = batch.page_size, self.spec.sliding_window
        lens = cols.kv_lens[ones]
        width = int(lens.max())
        rows_t, lens_t, table_rows_t = to_device(
            [cols.q_starts[ones], lens, cols.rows[ones]], self.spec.device
        )
        pos = torch.arange(width, device=lens_t.device)
        # Padding positions read the row's last real slot (masked out).
        cells = torch.minimum(pos[None, :], lens_t[:, None] - 1) // page_size
        pages = batch.pages.table[table_rows_t[:, None], cells].long()
        # Row of (page, k or v, offset) in the cache viewed as (-1, kv_heads, head_dim).
        keys = (pages * (2 * page_size) + pos % page_size).reshape(-1)
        kv_rows_t = torch.cat([keys, keys + page_size])
        key_pos = pos[None, :]
        allowed = key_pos < lens_t[:, None]
        if window is not None:
            allowed &= key_pos > lens_t[:, None] - 1 - window
        # An additive mask: torch's CPU flash kernel takes it faster than a boolean one.
        bias = torch.zeros(allowed.shape, device=lens_t.device).masked_fill_(~allowed, -math.inf)
        return _DecodeRows(rows_t, width, kv_rows_t, bias[:, None, None, :])

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        kv: KvCache,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch = self._batch
        cap = self.spec.logit_soft_cap
        manual = cap is not None or sinks is not None
        kv.write(layer, k, v, pages=batch.write_pages, offsets=batch.write_offsets)
        out = torch.empty_like(q)
        groups = self.spec.num_heads // self.spec.num_kv_heads
        if self._layout is not None:
            self.decode_kernel(
                q.contiguous(),
                kv.layers[layer],
                out,
                layout=self._layout,
                window=self.spec.sliding_window,
                scale=self.spec.scale,
                soft_cap=cap,
                sinks=None if sinks is None else sinks.to(torch.float32).contiguous(),
                kv_scales=(kv.scales.k[layer], kv.scales.v[layer]) if kv.quantized else (1.0, 1.0),
            )
        if (d := self._decode) is not None:
            cache = kv.layers[layer]
            n, kv_heads = len(d.rows), cache.shape[-2]
            # An fp8 cache is gathered as bytes (index_select need not take float8).
            raw = cache.view(torch.uint8) if kv.quantized else cache
            flat = raw.view(-1, kv_heads, cache.shape[-1])
            both = flat.index_select(0, d.kv_rows).view(cache.dtype)
            both = both.view(2, n, d.width, kv_heads, -1)
            # (n, width, kv_heads, D) -> (n, kv_heads, width, D)
            keys = kv.dequantize(layer, both[0], 0).to(q.dtype).transpose(1, 2)
            values = kv.dequantize(layer, both[1], 1).to(q.dtype).transpose(1, 2)
            qs = q[d.rows].view(n, kv_heads, groups, -1)
            if manual:
                heads_sinks = None if sinks is None else sinks.view(kv_heads, groups)
                o = manual_attention(qs, keys, values, d.bias, spec=self.spec, sinks=heads_sinks)
            else:
                o = F.scaled_dot_product_attention(
                    qs, keys, values, attn_mask=d.bias.to(q.dtype), scale=self.spec.scale
                )
            out[d.rows] = o.reshape(n, self.spec.num_heads, -1)
        kernel_max_q = self._batched_max_q
        for s, table, mask in zip(batch.seqs, self._tables, self._masks, strict=True):
            if s.q_len <= kernel_max_q:
                continue
            keys, values = kv.read(layer, table, s.kv_len)
            # 4-D (1, heads, len, D): torch's CPU flash kernel takes only batched
            # inputs (3-D ones fall back to the unfused path, ~3x slower here).
            qs = q[s.q_start : s.q_start + s.q_len].transpose(0, 1)[None]
            ks = keys.to(q.dtype).transpose(0, 1)[None]  # (1, H_kv, kv_len, D)
            vs = values.to(q.dtype).transpose(0, 1)[None]
            if groups > 1:
                ks = ks.repeat_interleave(groups, dim=1)
                vs = vs.repeat_interleave(groups, dim=1)
            if manual:
                o = self._manual_extend(qs, ks, vs, mask=mask, sinks=sinks)
            else:
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=self.spec.scale
                )
            out[s.q_start : s.q_start + s.q_len] = o[0].transpose(0, 1)
        return out

    def _manual_extend(
        self,
        qs: torch.Tensor,
        ks: torch.Tensor,
        vs: torch.Tensor,
        *,
        mask: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """One long extend, (1, heads, q_len, D) queries, through the explicit
        softmax in blocks of queries (MANUAL_BLOCK_SCORES); ``mask`` None: causal."""
        heads, q_len, kv_len = qs.shape[1], qs.shape[2], ks.shape[2]
        if mask is None:  # a whole prompt: causal
            mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=qs.device).tril_()
        heads_sinks = None if sinks is None else sinks.view(-1, 1)
        block = max(1, MANUAL_BLOCK_SCORES // (heads * kv_len))
        out = torch.empty_like(qs)
        for a in range(0, q_len, block):
            part = mask[a : a + block]
            bias = torch.zeros(part.shape, device=qs.device).masked_fill_(~part, -math.inf)
            out[:, :, a : a + block] = manual_attention(
                qs[:, :, a : a + block], ks, vs, bias, spec=self.spec, sinks=heads_sinks
            )
        return out


def manual_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    *,
    spec: AttentionSpec,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """SDPA's attention with the soft cap and sinks it lacks, in float32: q
    (..., Lq, D), k and v (..., Lk, D), ``bias`` additive (0 or -inf, broadcast to
    the scores), ``sinks`` broadcast to the scores without their last dim."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * spec.scale
    if spec.logit_soft_cap is not None:
        cap = spec.logit_soft_cap
        scores = torch.tanh(scores / cap) * cap
    scores = scores + bias
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        column = sinks.float()[..., None].expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)
