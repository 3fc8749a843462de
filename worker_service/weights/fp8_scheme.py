"""Which Hugging Face ``quantization_config`` a checkpoint may carry: the FP8
weight formats we load, everything else refused at start by name.

Served (``Fp8Scheme``), all E4M3 weights with float32 (or bf16) scales that
multiply the FP8 values back to the weight:

- ``fp8`` with ``weight_block_size`` [128, 128] (transformers' FineGrainedFP8,
  DeepSeek's layout): ``weight_scale_inv`` per 128x128 block, activations
  quantized per token and 128-column group at run time (``dynamic``).
- ``fp8`` without ``weight_block_size`` (AutoFP8 / vLLM's form): one
  ``weight_scale`` (or ``weight_scale_inv``) per tensor; activations
  ``dynamic`` (per token) or ``static`` (the checkpoint's ``input_scale``).
- ``fbgemm_fp8``: ``weight_scale`` per output channel, activations per token
  (their scale capped by ``activation_scale_ub``).
- ``compressed-tensors`` float8 (llm-compressor's FP8 / FP8_DYNAMIC): one
  config group of 8-bit float weights with strategy ``tensor`` or ``channel``;
  input activations 8-bit float per ``token`` (dynamic) or per ``tensor``
  (static ``input_scale``).

Transformers' FineGrainedFP8 defaults an absent ``weight_block_size`` to
[128, 128]; vLLM and SGLang read absent as per-tensor, and the AutoFP8
checkpoints that omit it are per-tensor, so we follow them. The scale tensors'
shapes are checked against the scheme at load (fp8_checkpoint.py), so a
checkpoint read the other way is refused, not mis-scaled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker_service.models.config import UnsupportedModelError

BLOCK = 128

SUPPORTED = (
    "fp8 (weight_block_size [128, 128] with dynamic activations, or no weight_block_size: "
    "per-tensor weight scales, activation_scheme dynamic or static), fbgemm_fp8 (per-channel), "
    "compressed-tensors float8 (weights strategy tensor or channel, 8-bit float input "
    "activations per token or per tensor)"
)

# The families whose projections load through the layers' per-part load
# (models/layers.py): the only ones FP8 tensors are wired into.
FP8_FAMILIES = frozenset({"llama"})


@dataclass(frozen=True)
class Fp8Scheme:
    method: str  # the quant_method, for messages
    weights: str  # "tensor" | "channel" | "block"
    activations: str  # "dynamic" | "static"
    # Per-token activation scales are capped at this amax (fbgemm_fp8's
    # activation_scale_ub); None: uncapped.
    activation_ub: float | None = None


def refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"quantization_config: {what}; radixserve loads {SUPPORTED}")


def read_scheme(qc: Any) -> Fp8Scheme | None:
    """The FP8 scheme of a config.json's ``quantization_config`` (None when it
    has none); raises UnsupportedModelError naming what is not served."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise refuse(f"expected an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8(qc)
    if method == "fbgemm_fp8":
        return Fp8Scheme(
            method, "channel", "dynamic", activation_ub=float(qc.get("activation_scale_ub", 1200.0))
        )
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise refuse(f"quant_method {method!r} is not supported")


def _fp8(qc: dict[str, Any]) -> Fp8Scheme:
    activations = str(qc.get("activation_scheme", "dynamic")).lower()
    if activations not in ("dynamic", "static"):
        raise refuse(f"fp8 activation_scheme {activations!r} is not supported")
    if (fmt := qc.get("scale_fmt", "float")) != "float":
        raise refuse(f"fp8 scale_fmt {fmt!r} is not supported (float32 scales only)")
    if (experts := qc.get("expert_dtype", "fp8")) != "fp8":
        raise refuse(f"fp8 expert_dtype {experts!r} is not supported")
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme("fp8", "tensor", activations)
    if list(block) != [BLOCK, BLOCK]:
        raise refuse(f"fp8 weight_block_size {list(block)} is not supported (only [128, 128])")
    if activations != "dynamic":
        raise refuse("fp8 with weight_block_size and activation_scheme 'static' is not supported")
    return Fp8Scheme("fp8", "block", "dynamic")


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Scheme:
    method = "compressed-tensors"
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise refuse(f"{method} format {fmt!r} is not supported (float-quantized only)")
    if qc.get("kv_cache_scheme"):
        raise refuse(f"{method} kv_cache_scheme is not supported (see --kv-cache-dtype)")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise refuse(f"{method} with {len(groups)} config_groups is not supported (one only)")
    group = groups[0]
    if list(group.get("targets") or []) != ["Linear"]:
        raise refuse(f"{method} targets {group.get('targets')!r} are not supported (['Linear'])")
    weights = group.get("weights") or {}
    _float8(method, "weights", weights)
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel") or weights.get("dynamic"):
        raise refuse(f"{method} weights strategy {strategy!r} is not supported (tensor, channel)")
    acts = group.get("input_activations")
    if not acts:
        raise refuse(f"{method} weight-only float8 (no input_activations) is not supported")
    _float8(method, "input_activations", acts)
    kind = (acts.get("strategy"), bool(acts.get("dynamic")))
    if kind == ("token", True):
        return Fp8Scheme(method, strategy, "dynamic")
    if kind == ("tensor", False):
        return Fp8Scheme(method, strategy, "static")
    raise refuse(
        f"{method} input_activations strategy {kind[0]!r} with dynamic={kind[1]} is not "
        "supported (token dynamic, tensor static)"
    )


def _float8(method: str, part: str, args: dict[str, Any]) -> None:
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise refuse(
            f"{method} {part} type {args.get('type')!r} num_bits {args.get('num_bits')!r} is "
            "not supported (float, 8)"
        )
    if args.get("symmetric") is False:
        raise refuse(f"{method} asymmetric {part} are not supported")
