"""Reference attention in plain torch (CPU and GPU): for each sequence, read
its keys and values back from the pages and attend, causally aligned to the
end (query i of a q_len-token extend sits at position kv_len - q_len + i)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_service.attention.base import AttentionBackend, AttentionBatch
from worker_service.kv_cache import KvCache


class TorchAttention(AttentionBackend):
    name = "torch"

    def begin_step(self, batch: AttentionBatch) -> None:
        device = self.spec.device
        window = self.spec.sliding_window
        self._batch = batch
        self._tables = [
            torch.tensor(s.page_table, dtype=torch.long, device=device) for s in batch.seqs
        ]
        self._masks: list[torch.Tensor | None] = []
        for s in batch.seqs:
            if s.q_len == 1 and (window is None or s.kv_len <= window):
                self._masks.append(None)
                continue
            q_pos = torch.arange(s.kv_len - s.q_len, s.kv_len, device=device)[:, None]
            k_pos = torch.arange(s.kv_len, device=device)[None, :]
            allowed = k_pos <= q_pos
            if window is not None:
                allowed &= k_pos > q_pos - window
            self._masks.append(allowed)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KvCache
    ) -> torch.Tensor:
        batch = self._batch
        kv.write(layer, batch.write_pages, batch.write_offsets, k, v)
        out = torch.empty_like(q)
        groups = self.spec.num_heads // self.spec.num_kv_heads
        for s, table, mask in zip(batch.seqs, self._tables, self._masks, strict=True):
            keys, values = kv.read(layer, table, s.kv_len)
            qs = q[s.q_start : s.q_start + s.q_len].transpose(0, 1)  # (H, q_len, D)
            ks = keys.to(q.dtype).transpose(0, 1)  # (H_kv, kv_len, D)
            vs = values.to(q.dtype).transpose(0, 1)
            if groups > 1:
                ks = ks.repeat_interleave(groups, dim=0)
                vs = vs.repeat_interleave(groups, dim=0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.spec.scale)
            out[s.q_start : s.q_start + s.q_len] = o.transpose(0, 1)
        return out
