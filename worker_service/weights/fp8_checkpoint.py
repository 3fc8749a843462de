"""Reading an FP8 checkpoint's safetensors: each FP8 projection weight
(F8_E4M3) comes out as one ``Fp8Tensor`` with its scales (found by name in
any shard), the scale tensors themselves are consumed, and every other
tensor comes out as a float tensor of the model's dtype, as today.

Only decoder-layer projections stay FP8 (``*.layers.N.self_attn|mlp.*_proj.weight``);
an FP8 tensor anywhere else (embeddings, the LM head, a norm) is dequantized
here, which is where models keep them anyway. Each scale's shape is checked
against the scheme (a transposed block scale or a per-channel scale in a
per-tensor checkpoint is refused, naming the tensor).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from worker_service.models.config import UnsupportedModelError
from worker_service.models.fp8_linear import BLOCK, FP8, Fp8Tensor, gemm_supported
from worker_service.weights.fp8_scheme import Fp8Scheme

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")
PROJECTION = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.[a-z_]+_proj\.weight$")


def fp8_tensors(
    shards: list[Path], scheme: Fp8Scheme, dtype: torch.dtype, *, skip: set[str]
) -> Iterator[tuple[str, torch.Tensor | Fp8Tensor]]:
    """Every tensor of ``shards`` but ``skip``: FP8 projections as Fp8Tensor,
    the rest float ``dtype``."""
    with ExitStack() as stack:
        files = [stack.enter_context(safe_open(str(s), framework="pt")) for s in shards]
        where = {name: f for f in files for name in f.keys()}  # noqa: SIM118
        for f in files:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name in skip or name.endswith((*SCALE_SUFFIXES, "rotary_emb.inv_freq")):
                    continue
                tensor = f.get_tensor(name)
                if tensor.dtype != FP8:
                    if tensor.dtype.is_floating_point and tensor.element_size() == 1:
                        raise UnsupportedModelError(
                            f"{name} is {tensor.dtype}: FP8 weights are served in E4M3 only"
                        )
                    yield name, tensor.to(dtype)
                    continue
                fp8 = _with_scales(name, tensor, scheme, where)
                yield name, (fp8 if PROJECTION.search(name) else fp8.dequantize(dtype))


def _with_scales(name: str, weight: torch.Tensor, scheme: Fp8Scheme, where: dict) -> Fp8Tensor:
    base = name.removesuffix(".weight")
    scale_name = next(
        (base + s for s in (".weight_scale_inv", ".weight_scale") if base + s in where), None
    )
    if scale_name is None or weight.dim() != 2:
        raise UnsupportedModelError(
            f"{name} is FP8 but has no {base}.weight_scale_inv or .weight_scale"
            if scale_name is None
            else f"{name} is FP8 with shape {tuple(weight.shape)}: only 2-D weights are served"
        )
    scale = where[scale_name].get_tensor(scale_name).float()
    out, inp = weight.shape
    if scheme.weights == "tensor":
        ok, expected, shape = scale.numel() == 1, "one value", ()
    elif scheme.weights == "channel":
        ok = scale.numel() == out and scale.dim() <= 2
        expected, shape = f"({out}, 1)", (out, 1)
    else:
        blocks = (-(-out // BLOCK), -(-inp // BLOCK))
        ok, expected, shape = tuple(scale.shape) == blocks, str(blocks), blocks
    if not ok:
        raise UnsupportedModelError(
            f"{scale_name} has shape {tuple(scale.shape)}; {scheme.method} "
            f"{scheme.weights}-scaled weights of shape {tuple(weight.shape)} need {expected}"
        )
    scale = scale.reshape(shape)
    input_scale = None
    if scheme.activations == "static":
        input_name = base + ".input_scale"
        if input_name not in where:
            raise UnsupportedModelError(
                f"{name}: {scheme.method} with static activations needs {input_name}"
            )
        input_scale = where[input_name].get_tensor(input_name).float()
        if input_scale.numel() != 1:
            raise UnsupportedModelError(
                f"{input_name} has {input_scale.numel()} values; static activations are per tensor"
            )
        input_scale = input_scale.reshape(())
    return Fp8Tensor(
        name=name,
        weight=weight,
        scale=scale,
        granularity=scheme.weights,
        activations=scheme.activations,
        input_scale=input_scale,
        activation_ub=scheme.activation_ub,
    )


def placed(
    stream: Iterable[tuple[str, Any]], *, device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors for a model on ``device``: FP8 projections stay
    FP8 (built there) where FP8 GEMMs run, and are dequantized to ``dtype``
    (fp8 * scales in float32, as transformers does) everywhere else, so the
    CPU runs today's float path on them."""
    fp8_here = gemm_supported(device)
    for name, tensor in stream:
        if isinstance(tensor, Fp8Tensor):
            tensor = replace(tensor, device=device) if fp8_here else tensor.dequantize(dtype)
        yield name, tensor
