"""Rotary position embeddings with the scalings of the Llama family.

Frequencies follow the Hugging Face definitions (the weights are in HF
layout, rotate-half convention): default, linear (positions / factor),
llama3 (low frequencies scaled by 1/factor, high ones kept, a smooth ramp
between), yarn (NTK-by-parts interpolation plus an attention factor that
scales cos and sin), longrope (Phi-3: per-frequency divisors, the short ones
below original_max_position_embeddings and the long ones from there on, and
an attention factor), and llama.cpp's per-frequency factors from GGUF files.

Longrope by position: transformers switches every position of a sequence to
the long factors once the sequence outgrows the original context (recomputing
nothing already cached); a paged cache cannot re-rotate cached keys, so here
position p uses the short factors below the original context and the long
ones from it on, whatever the batch (vLLM switches the whole batch, which
would make a request's tokens depend on its neighbours). Sequences within
the original context match transformers exactly.
"""

from __future__ import annotations

import math

import torch

from worker_service.kernels import Kernels
from worker_service.models.config import ModelConfig, RopeConfig


def inverse_frequencies(
    rope: RopeConfig, dim: int, max_positions: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq (dim/2,), attention scaling applied to cos and sin)."""
    # float32 arithmetic throughout, as transformers does, so the tables agree
    # to the last bit with the reference implementation.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    scale = 1.0
    kind = rope.scaling_type
    if kind == "linear":
        inv_freq = inv_freq / rope.factor
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, rope)
    elif kind == "yarn":
        inv_freq, scale = _yarn(rope, dim, max_positions)
    elif kind == "longrope":
        inv_freq, scale = _longrope(rope, dim, rope.short_factor)
    if rope.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    return inv_freq, scale


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_ctx = rope.original_max_position_embeddings or 8192
    low_wavelen = old_ctx / rope.low_freq_factor
    high_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    original = rope.original_max_position_embeddings or max_positions

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of extrapolation (high-frequency dims keep theirs)
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    scale = rope.attention_factor
    if scale is None:
        scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, float(scale)


def _longrope(
    rope: RopeConfig, dim: int, factors: tuple[float, ...] | None
) -> tuple[torch.Tensor, float]:
    if factors is None or len(factors) != dim // 2:
        raise ValueError(f"longrope needs {dim // 2} factors per table, got {factors!r}")
    ext = torch.tensor(factors, dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (ext * rope.theta**shape)
    scale = rope.attention_factor
    if scale is None:
        original = rope.original_max_position_embeddings or 1
        factor = rope.factor
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, float(scale)


def _cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, head_dim: int, scale: float):
    freqs = torch.outer(positions, inv_freq)
    # cos / sin of the full-width (freqs, freqs) as transformers computes them,
    # then one half of each: the same float32 values, bit for bit.
    emb = torch.cat((freqs, freqs), dim=-1)
    half = head_dim // 2
    return torch.cat((emb.cos()[:, :half] * scale, emb.sin()[:, :half] * scale), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """RoPE from a precomputed table: ``cos_sin_cache`` (positions, rotary dims:
    head_dim, or its rotating share) float32 holds, per position, the cosines
    then the sines of the rotary dims / 2
    frequencies, the attention scaling multiplied in: the layout FlashInfer's
    RoPE kernel reads, half the size of full-width cos and sin tables."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        kernels: Kernels,
        rope: RopeConfig | None = None,
    ) -> None:
        """``rope``: the layers' own RoPE where it is not ``config.rope`` (Gemma 3's
        sliding layers). A partial rotary RoPE's table covers the rotating dims
        only (its width is what the kernels rotate)."""
        super().__init__()
        self.rope_config = rope or config.rope
        self.head_dim = int(config.head_dim * self.rope_config.partial_rotary_factor)
        self.kernels = kernels
        inv_freq, self.scale = inverse_frequencies(
            self.rope_config, self.head_dim, config.max_position_embeddings
        )
        self.inv_freq = inv_freq
        self.device = device
        self.cos_sin_cache = torch.empty(0)
        self._build(max(config.max_position_embeddings, 1))

    def _build(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float32)
        table = _cos_sin(self.inv_freq, t, self.head_dim, self.scale)
        rope = self.rope_config
        if rope.scaling_type == "longrope" and rope.original_max_position_embeddings:
            start = min(rope.original_max_position_embeddings, n)
            long_freq, scale = _longrope(rope, self.head_dim, rope.long_factor)
            table[start:] = _cos_sin(long_freq, t[start:], self.head_dim, scale)
        self.cos_sin_cache = table.contiguous().to(self.device)

    @property
    def max_positions(self) -> int:
        return int(self.cos_sin_cache.shape[0])

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (T, H, D), k: (T, H_kv, D), rotated at their positions (possibly in
        place), which must be below ``max_positions`` (plans are validated against
        it: no host sync here, so the decode forward can be captured in a CUDA
        graph)."""
        return self.kernels.rope(positions, q, k, self.cos_sin_cache)
