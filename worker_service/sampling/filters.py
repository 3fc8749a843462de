"""Top-k / top-p / min-p filtering and the inverse-CDF draw, plus seeded uniforms.

For the sampling rows of a step (greedy rows never get here):

    probs = softmax(logits / temperature)
    sort probs descending, once per row (stable: ties keep the lower id first)
    top-k:  keep the k most probable tokens
    top-p:  on the top-k distribution renormalised, keep the smallest prefix
            whose mass reaches top_p: rank r stays while the mass strictly
            before it is < top_p (the top token always stays)
    min-p:  drop tokens with prob < min_p * max prob (a ratio, so it does not
            matter whether it is taken before or after renormalising)
    draw:   renormalise what is left and pick the token where the cumulative
            mass first exceeds u * kept mass, for one uniform u per row

All three filters keep a prefix of the sorted order, so each row's kept set is
just a length ``n_keep``, and one cumulative sum serves top-p, the
renormalisation and the draw: nothing is masked or re-sorted.

Uniforms: a seeded request's u is a pure function of (seed, step) computed on
the host with SplitMix64 (Steele, Lea & Flood 2014; the generator behind
java.util.SplittableRandom), so its tokens do not depend on the batch around
it, the device, or torch's global RNG.
"""

from __future__ import annotations

import torch

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


def kept_count(
    sorted_p: torch.Tensor,
    cum: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """(S,) int64 in [1, V]: how many of the most probable tokens each row keeps.

    sorted_p: (S, V) probabilities sorted descending; cum: their cumulative sum.
    top_k: (S,) int64, <= 0 means no limit; top_p, min_p: (S,) float32.
    Tokens whose probability underflowed to 0 are never kept: they cannot be
    drawn, and keeping them would let a rounding edge pick one.
    """
    vocab = sorted_p.shape[1]
    n_k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(1, vocab)
    mass_k = cum.gather(1, (n_k - 1).unsqueeze(1))
    # top_p >= 1 keeps everything; comparing against the float mass could drop
    # a tail token through rounding, so that case gets an infinite threshold.
    thr = torch.where(top_p.unsqueeze(1) >= 1.0, torch.inf, top_p.unsqueeze(1) * mass_k)
    # Rank r >= 1 is kept while cum[r - 1] < thr; rank 0 always is.
    n_p = 1 + (cum[:, :-1] < thr).sum(dim=1)
    n_m = (sorted_p >= min_p.unsqueeze(1) * sorted_p[:, :1]).sum(dim=1)
    n_pos = (sorted_p > 0).sum(dim=1)
    n = torch.minimum(torch.minimum(n_k, n_p), torch.minimum(n_m, n_pos))
    return n.clamp(min=1)


def draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """(S,) int64 tokens drawn from the filtered, renormalised distributions.

    logits: (S, V) float32, already processed (bias, penalties, masks).
    temperature: (S,) float32 > 0; top_k: (S,) int64; top_p, min_p: (S,) float32;
    u: (S,) float32 uniforms in [0, 1). All on the logits' device.
    """
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    sorted_p, sorted_ids = probs.sort(dim=-1, descending=True, stable=True)
    cum = sorted_p.cumsum(dim=-1)
    n_keep = kept_count(sorted_p, cum, top_k, top_p, min_p)
    kept_mass = cum.gather(1, (n_keep - 1).unsqueeze(1))
    # Inverse CDF: the first rank whose cumulative mass exceeds u * kept mass.
    # Zero-probability ranks never raise cum, so they are never the first to
    # exceed it; the clamp catches u * mass rounding up to the mass itself.
    pos = torch.searchsorted(cum, u.unsqueeze(1) * kept_mass, right=True).squeeze(1)
    pos = torch.minimum(pos, n_keep - 1)
    return sorted_ids.gather(1, pos.unsqueeze(1)).squeeze(1)
