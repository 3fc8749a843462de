"""Top-k / top-p / min-p filtering and the inverse-CDF draw, plus seeded uniforms.

For the sampling rows of a step (greedy rows never get here):

    probs = softmax(logits / temperature)
    top-k:  keep the tokens whose prob is >= the k-th largest (ties at the
            boundary all stay)
    top-p:  on what top-k kept, keep the smallest most-probable set whose mass
            reaches top_p * (the mass top-k kept), plus the tokens tied with
            its least probable one: rank r (descending) stays while the mass
            strictly before it is < that target (the top token always stays)
    min-p:  drop tokens with prob < min_p * max prob (a ratio, so it does not
            matter whether it is taken before or after renormalising)
    draw:   in token-id order, the first token whose cumulative kept mass
            exceeds u * (total kept mass), for one uniform u per row

Every filter is a threshold on the probability, so the kept set needs no
sorted order, and the draw walks the vocabulary in id order: the same
definition whether the filters come from a sort (the torch kernels, CPU) or
from FlashInfer's threshold-search kernels (CUDA), so for one u both paths
pick the same token, float rounding at a knife edge aside. The filters are the
``Kernels``' (worker_service/kernels/); the draw is ours on every device. On
the CPU, a step whose drawn rows use no filter draws in one C pass a row
(cpu_ops.c temperature_draw, the same definition; sampler.py).

Uniforms: a seeded request's u is a pure function of (seed, step) computed on
the host with SplitMix64 (Steele, Lea & Flood 2014; the generator behind
java.util.SplittableRandom), so its tokens do not depend on the batch around
it, the device, or torch's global RNG.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from worker_service.kernels import Kernels, SamplingFilters

MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """SplitMix64's finaliser (variant 13 of Stafford's mixers)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def splitmix64(state: int, n: int) -> int:
    """The n-th output (n >= 1) of SplitMix64 started from ``state``, without iterating."""
    return _mix64((state + n * GOLDEN_GAMMA) & MASK64)


def seeded_uniform(seed: int, step: int) -> float:
    """u in [0, 1) for the draw at output position ``step`` of a request seeded with ``seed``.

    The seed is mixed first so that nearby seeds give unrelated streams (a raw
    SplitMix64 stream from seed s + gamma is stream s shifted by one step).
    The top 24 bits become the float, so u is exactly representable in float32
    and strictly below 1 there too.
    """
    z = splitmix64(_mix64(seed & MASK64), step + 1)
    return (z >> 40) * 2.0**-24


def filter_arrays(
    top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float], vocab: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The drawn rows' filter parameters in the kernels' form, on the host:
    top_k int64 in [1, V] (<= 0 or >= V: V, no limit), top_p and min_p float32
    clipped to [0, 1] (a min_p above 1 would drop every token)."""
    k = np.array([t if 0 < t < vocab else vocab for t in top_k], np.int64)
    p = np.clip(np.array(top_p, np.float32), 0.0, 1.0)
    m = np.clip(np.array(min_p, np.float32), 0.0, 1.0)
    return k, p, m


def any_filter(host: tuple[np.ndarray, np.ndarray, np.ndarray], vocab: int) -> bool:
    """Whether any drawn row uses top-k, top-p or min-p (``filter_arrays``' output)."""
    k, p, m = host
    return bool((k < vocab).any() or (p < 1).any() or (m > 0).any())


def sampling_filters(
    host: tuple[np.ndarray, np.ndarray, np.ndarray],
    device: Sequence[torch.Tensor],
    vocab: int,
) -> SamplingFilters:
    """``host``: ``filter_arrays``' output; ``device``: the same three arrays on the
    logits' device. Which filters any row uses is read from the host copies, so
    that nothing waits on the device to find out."""
    k, p, m = host
    top_k, top_p, min_p = device
    return SamplingFilters(
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        use_top_k=bool((k < vocab).any()),
        use_top_p=bool((p < 1).any()),
        use_min_p=bool((m > 0).any()),
    )


def draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    filters: SamplingFilters,
    u: torch.Tensor,
    *,
    kernels: Kernels,
) -> torch.Tensor:
    """(S,) int64 tokens drawn from the filtered distributions (see the module docstring).

    logits: (S, V) float32, already processed (bias, penalties, masks).
    temperature: (S,) float32 > 0; u: (S,) float32 uniforms in [0, 1). All on the
    logits' device.
    """
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    kept = kernels.filter_probs(probs, filters) if filters.any else probs
    cum = kept.cumsum(dim=-1)
    total = cum[:, -1:].contiguous()  # searchsorted wants contiguous values
    # Inverse CDF: the first id whose cumulative mass exceeds u * total. Dropped
    # (zero) tokens never raise cum, so they are never the first to exceed it.
    pos = torch.searchsorted(cum, u.unsqueeze(1) * total, right=True)
    # u * total can round up to total itself: the last kept token, the first
    # whose cumulative mass reaches the total, is as far as a draw goes.
    last = torch.searchsorted(cum, total)
    return torch.minimum(pos, last).squeeze(1)
