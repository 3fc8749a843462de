"""A RoPE parameter dict of config.json (transformers 5's ``rope_parameters``,
or a merged ``rope_theta`` + ``rope_scaling``) read strictly: a RoPE type or a
key we do not implement refuses the model by name, as config_fields does for
the top-level fields (a silently dropped key would rotate half-right)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker_service.models.config import RopeConfig, UnsupportedModelError

# The keys each RoPE type reads (models/rope.py computes them).
_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset(
        {"factor", "beta_fast", "beta_slow", "attention_factor", "original_max_position_embeddings"}
    ),
    "longrope": frozenset(
        {
            "factor",
            "short_factor",
            "long_factor",
            "attention_factor",
            "original_max_position_embeddings",
        }
    ),
}
_ALWAYS = frozenset({"rope_type", "type", "rope_theta"})


def rope_of(
    architecture: str, params: Mapping[str, Any], *, max_positions: int | None = None
) -> RopeConfig:
    """``max_positions``: longrope's factor where the dict has none
    (max_position_embeddings / original_max_position_embeddings, as
    transformers computes it)."""
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind not in _KEYS:
        raise UnsupportedModelError(
            f"{architecture}: RoPE type {kind!r} is not supported (supported: {sorted(_KEYS)})"
        )
    partial = params.get("partial_rotary_factor")
    partial = 1.0 if partial is None else float(partial)
    if not 0.0 < partial <= 1.0:
        raise UnsupportedModelError(f"{architecture}: partial_rotary_factor={partial!r}")
    unknown = sorted(
        k
        for k, v in params.items()
        if k not in _ALWAYS | _KEYS[kind] | {"partial_rotary_factor"} and v is not None
    )
    if unknown:
        raise UnsupportedModelError(
            f"{architecture}: RoPE {kind!r} fields not implemented: {', '.join(unknown)}"
        )
    if kind == "longrope" and not (params.get("short_factor") and params.get("long_factor")):
        raise UnsupportedModelError(f"{architecture}: longrope needs short_factor and long_factor")
    theta = float(params.get("rope_theta", 10000.0))
    if kind == "default":
        return RopeConfig(theta=theta, partial_rotary_factor=partial)
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None and kind == "longrope" and max_positions and original:
        factor = max_positions / original
    attention = params.get("attention_factor")

    def factors(key: str) -> tuple[float, ...] | None:
        value = params.get(key)
        return None if value is None else tuple(float(f) for f in value)

    return RopeConfig(
        theta=theta,
        scaling_type=kind,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast", 32.0)),
        beta_slow=float(params.get("beta_slow", 1.0)),
        attention_factor=None if attention is None else float(attention),
        short_factor=factors("short_factor"),
        long_factor=factors("long_factor"),
        partial_rotary_factor=partial,
    )
