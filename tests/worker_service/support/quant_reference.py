"""The quantized linear's numpy reference (kernels/quant_linear.py): random
valid GGUF blocks, and the kernel's arithmetic redone independently.

The weights' integer codes come from gguf.quants' own dequantizer (the
layout's reference) run on copies of the blocks whose float scales are set to
1 and 0: with d = 1 and the min 0 it yields the integer weight codes times the
integer sub-block scales (offsets applied: q - 8, q - 32); with d = 0 and the
min 1 it yields the per-weight min codes (-m_j for Q4_K/Q5_K, 1 for Q4_1).
The activations are quantized as the kernel does (float32, blocks of 32, or
256 for the K-quants: d = amax / 127, codes rint(x * 127 / amax)); the dots
are exact int64 sums, the scale products float64.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, quants

# GGUF type -> (weights per block, bytes per block, offset of d, offset of the min or None)
LAYOUT: dict[str, tuple[int, int, int, int | None]] = {
    "Q4_0": (32, 18, 0, None),
    "Q4_1": (32, 20, 0, 2),
    "Q8_0": (32, 34, 0, None),
    "Q4_K": (256, 144, 0, 2),
    "Q5_K": (256, 176, 0, 2),
    "Q6_K": (256, 210, 208, None),
}
QUANTIZABLE = ("Q4_0", "Q4_1", "Q8_0")  # gguf has quantizers for these


def random_blocks(qtype: str, out_features: int, in_features: int, seed: int) -> np.ndarray:
    """uint8 (out_features, row_bytes) of valid blocks: gguf's quantizer on
    random floats where it has one, else random codes with float16 scales."""
    rng = np.random.default_rng(seed)
    block, size, d_at, min_at = LAYOUT[qtype]
    if qtype in QUANTIZABLE:
        w = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.05
        w += rng.standard_normal((out_features, 1)).astype(np.float32) * 0.02
        return quants.quantize(w, GGMLQuantizationType[qtype])
    nb = in_features // block
    blocks = rng.integers(0, 256, (out_features, nb, size), dtype=np.uint8)
    d = rng.uniform(0.0005, 0.004, (out_features, nb)).astype(np.float16)
    blocks[..., d_at : d_at + 2] = d[..., None].view(np.uint8)
    if min_at is not None:
        dmin = rng.uniform(0.0, 0.003, (out_features, nb)).astype(np.float16)
        blocks[..., min_at : min_at + 2] = dmin[..., None].view(np.uint8)
    return blocks.reshape(out_features, nb * size)


def dequantize(qtype: str, blocks: np.ndarray) -> np.ndarray:
    return quants.dequantize(blocks, GGMLQuantizationType[qtype])


def _with_scales(qtype: str, blocks: np.ndarray, d: float, m: float) -> np.ndarray:
    _, size, d_at, min_at = LAYOUT[qtype]
    b = blocks.reshape(blocks.shape[0], -1, size).copy()
    b[..., d_at : d_at + 2] = np.array([d], np.float16).view(np.uint8)
    if min_at is not None:
        b[..., min_at : min_at + 2] = np.array([m], np.float16).view(np.uint8)
    return b.reshape(blocks.shape)


def _scales(qtype: str, blocks: np.ndarray, at: int | None) -> np.ndarray:
    _, size, _, _ = LAYOUT[qtype]
    b = blocks.reshape(blocks.shape[0], -1, size)
    if at is None:
        return np.zeros(b.shape[:2])
    return b[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float64)


def quantize_activations(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes int64 (rows, nb, block), d float32 (rows, nb)), the kernel's way."""
    rows, k = x.shape
    xb = x.astype(np.float32).reshape(rows, k // block, block)
    amax = np.abs(xb).max(axis=-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    d = (amax / np.float32(127)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int64)
    return q, d


def reference(
    qtype: str, blocks: np.ndarray, x: np.ndarray, bias: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """(y, magnitude): the kernel's result in float64, and the sum of the
    magnitudes of the products it adds (float32 rounding is relative to it)."""
    block, _, d_at, min_at = LAYOUT[qtype]
    n = blocks.shape[0]
    codes = dequantize(qtype, _with_scales(qtype, blocks, 1.0, 0.0)).astype(np.int64)
    mins = dequantize(qtype, _with_scales(qtype, blocks, 0.0, 1.0)).astype(np.int64)
    dw = _scales(qtype, blocks, d_at)  # (n, nb)
    dm = _scales(qtype, blocks, min_at)
    xq, dx = quantize_activations(x, block)
    nb = xq.shape[1]
    codes = codes.reshape(n, nb, block)
    mins = mins.reshape(n, nb, block)
    scale = dw[None] * dx.astype(np.float64)[:, None, :]  # (rows, n, nb)
    min_scale = dm[None] * dx.astype(np.float64)[:, None, :]
    dots = np.einsum("obi,rbi->rob", codes, xq)  # exact int64
    min_dots = np.einsum("obi,rbi->rob", mins, xq)
    y = (scale * dots).sum(-1) + (min_scale * min_dots).sum(-1)
    # per product: the kernel may add a block's products in any grouping
    magnitude = (np.abs(scale) * np.einsum("obi,rbi->rob", np.abs(codes), np.abs(xq))).sum(-1)
    magnitude += (np.abs(min_scale) * np.abs(min_dots)).sum(-1)
    if bias is not None:
        y = y + bias
        magnitude = magnitude + np.abs(bias)
    return y, magnitude


def rounding_bound(qtype: str, weight: np.ndarray, x: np.ndarray) -> np.ndarray:
    """(rows, out) bound on |x . W^T - kernel|: each activation moves by at most
    half its block's step d = amax / 127, so the product moves by at most
    sum_i |W_oi| * d_block(i) / 2."""
    block = LAYOUT[qtype][0]
    _, dx = quantize_activations(x, block)
    step = np.repeat(dx.astype(np.float64), block, axis=1) / 2  # (rows, k)
    return step @ np.abs(weight.astype(np.float64)).T
