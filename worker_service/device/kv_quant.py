"""The KV cache's storage type (``--kv-cache-dtype``) and the FP8 rules.

``auto`` stores keys and values in the model's dtype. ``fp8_e4m3`` stores
them as float8_e4m3fn with one scale per layer for keys and one for values
(SGLang's and vLLM's per-tensor ``k_scale`` / ``v_scale``): stored =
e4m3(clamp(x / scale, -448, 448)) (round to nearest even; clamped first
because torch's cast turns out-of-range values into NaN, not 448), read =
stored * scale. The scales come from the checkpoint where it carries them
(``checkpoint_kv_scales``: ``...self_attn.k_scale`` / ``v_scale``, the older
single ``kv_scale``, or compressed-tensors' ``k_proj.output_scale`` /
``v_proj.output_scale`` under a ``kv_cache_scheme``), else 1.0, said in the
log, as SGLang does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import structlog
import torch

logger = structlog.get_logger(__name__)

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # config.py's --kv-cache-dtype choices
FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max

# Checkpoint names of KV-cache scales: layer index, which ("k", "v" or "kv": both).
_SCALE_NAME = re.compile(
    r"(?:model\.)?layers\.(\d+)\.self_attn\."
    r"(?:(?:attn\.)?(k|v|kv)_scale|(k|v)_proj\.output_scale)"
)


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV pages hold; anything but KV_CACHE_DTYPES is refused by name."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8_e4m3":
        return FP8_E4M3
    raise SystemExit(
        f"--kv-cache-dtype {kv_cache_dtype} is not implemented; "
        f"use one of {', '.join(KV_CACHE_DTYPES)}"
    )


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float8_e4m3fn of x / scale, saturating at +-448."""
    y = x.float() if scale == 1.0 else x.float() / scale
    return y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)


def dequantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x * scale in ``dtype`` (the product formed in float32)."""
    y = x.float()
    if scale != 1.0:
        y = y.mul_(scale)
    return y.to(dtype)


@dataclass(frozen=True)
class KvScales:
    """Per-layer key and value scales, and where they came from."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    source: str = "default"  # "checkpoint" or "default" (1.0)

    @classmethod
    def ones(cls, num_layers: int) -> KvScales:
        return cls((1.0,) * num_layers, (1.0,) * num_layers)


@dataclass
class KvScaleReader:
    """Takes the KV-cache scale tensors out of a weight stream (the model's
    loader does not know them) and keeps them, by layer."""

    k: dict[int, float] = field(default_factory=dict)
    v: dict[int, float] = field(default_factory=dict)

    def filter(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            m = _SCALE_NAME.fullmatch(name)
            if m is None:
                yield name, tensor
                continue
            layer, which = int(m.group(1)), m.group(2) or m.group(3)
            value = float(tensor.float().reshape(-1).max())
            if not (math.isfinite(value) and value > 0):
                raise SystemExit(
                    f"checkpoint KV-cache scale {name} is {value}: not a positive number"
                )
            if which in ("k", "kv"):
                self.k[layer] = value
            if which in ("v", "kv"):
                self.v[layer] = value

    def scales(self, num_layers: int) -> KvScales:
        """The checkpoint's scales, 1.0 where it has none (logged)."""
        if not self.k and not self.v:
            logger.warning(
                "fp8 KV cache without scales in the checkpoint: k_scale = v_scale = 1.0 "
                "(values beyond +-448 saturate)"
            )
            return KvScales.ones(num_layers)
        missing = [i for i in range(num_layers) if i not in self.k or i not in self.v]
        if missing:
            logger.warning("fp8 KV cache: layers without checkpoint scales use 1.0", layers=missing)
        k = tuple(self.k.get(i, 1.0) for i in range(num_layers))
        v = tuple(self.v.get(i, 1.0) for i in range(num_layers))
        logger.info("fp8 KV cache scales from the checkpoint", k_scale=k, v_scale=v)
        return KvScales(k, v, "checkpoint")
