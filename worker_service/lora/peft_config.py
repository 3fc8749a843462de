"""A PEFT ``adapter_config.json`` read and checked: what radixserve serves is
plain LoRA on the attention and MLP projections (rank r, scale alpha / r, or
alpha / sqrt(r) with rsLoRA). Everything else PEFT can describe (DoRA, biases,
per-layer ranks, extra trained modules, ...) is refused by name, so an adapter
is never served silently wrong."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections an adapter may target, in the model's order.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Checkpoints that fuse projections (Phi-3) have adapters on the fused module:
# one A for the parts and B's rows the parts' outputs in this order, the same
# deltas as an adapter per part with that A and its rows of B (adapter.py
# splits them so).
FUSED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the problem."""


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    use_rslora: bool
    # As in the file: a list of module names (or "all-linear"), or one regex
    # matched against whole module paths.
    target_modules: tuple[str, ...] | str
    exclude_modules: tuple[str, ...] | str | None = None

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _falsy(value: Any) -> bool:
    return value in (None, False, "none", "", [], {}, 0)


# Config fields that change the computation in ways this worker does not
# implement: field -> why it is refused (when set to anything but its default).
_REFUSED = {
    "use_dora": "DoRA (use_dora) is not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "rank_pattern": "per-layer ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-layer alphas (alpha_pattern) are not supported",
    "layers_to_transform": "layers_to_transform (a subset of layers) is not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D weights) is not supported",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
    "trainable_token_indices": "trainable_token_indices is not supported",
    "target_parameters": "target_parameters is not supported",
    "megatron_config": "megatron_config is not supported",
}


def read_lora_config(directory: Path, max_rank: int = 0) -> LoraConfig:
    """The adapter's LoRA config; ``max_rank`` > 0 refuses higher ranks."""
    if not directory.is_dir():
        raise AdapterError(f"adapter directory {str(directory)!r} does not exist")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{CONFIG_FILE} is missing from {str(directory)!r}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{CONFIG_FILE} does not parse: {e}") from e
    if not isinstance(raw, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    peft_type = str(raw.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"not a LoRA adapter (peft_type {raw.get('peft_type')!r})")
    for key, why in _REFUSED.items():
        if not _falsy(raw.get(key)):
            raise AdapterError(why)
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"bias {raw.get('bias')!r} is not supported (only 'none')")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"rank r must be a positive integer, got {rank!r}")
    if max_rank > 0 and rank > max_rank:
        raise AdapterError(f"rank {rank} is above the limit of {max_rank} (--max-lora-rank)")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, int | float):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}")
    return LoraConfig(
        rank=rank,
        alpha=float(alpha),
        use_rslora=bool(raw.get("use_rslora", False)),
        target_modules=_module_spec(raw.get("target_modules"), "target_modules"),
        exclude_modules=(
            None
            if _falsy(raw.get("exclude_modules"))
            else _module_spec(raw["exclude_modules"], "exclude_modules")
        ),
    )


def _module_spec(value: Any, field: str) -> tuple[str, ...] | str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise AdapterError(f"{field} must be a list of module names or a regex, got {value!r}")


def _matches(spec: tuple[str, ...] | str, path: str) -> bool:
    """PEFT's rule: a regex must match the whole module path; a list entry
    matches a path equal to it or ending in '.' + it."""
    if isinstance(spec, str):
        return re.fullmatch(spec, path) is not None
    return any(path == name or path.endswith("." + name) for name in spec)


def resolve_targets(config: LoraConfig, module_paths: dict[str, str]) -> set[str]:
    """The paths of ``module_paths`` (model module path -> projection name)
    the adapter targets. A list naming anything else (embed_tokens, lm_head,
    a typo) is refused rather than ignored: the adapter was trained on it."""
    spec, exclude = config.target_modules, config.exclude_modules
    if spec == "all-linear" or (isinstance(spec, tuple) and "all-linear" in spec):
        # PEFT's shorthand: every linear layer but the output head.
        spec = LORA_MODULES
    if isinstance(spec, tuple):
        known = (*LORA_MODULES, *FUSED_MODULES)
        unknown = [n for n in spec if n.rsplit(".", 1)[-1] not in known]
        if unknown:
            raise AdapterError(
                f"unsupported target modules {unknown} (supported: {', '.join(known)})"
            )
        # A model without some projections (a mixture-of-experts MLP has no
        # gate/up/down of its own) refuses adapters trained on them.
        present = set(module_paths.values())
        absent = [n for n in spec if n.rsplit(".", 1)[-1] not in present]
        if absent:
            raise AdapterError(
                f"target modules {absent} are not LoRA targets of this model (its MLP is a "
                f"mixture of experts, which LoRA does not reach); it takes "
                f"{', '.join(m for m in LORA_MODULES if m in present)}"
            )
    chosen = {
        path
        for path in module_paths
        if _matches(spec, path) and (exclude is None or not _matches(exclude, path))
    }
    if not chosen:
        raise AdapterError(f"target_modules {spec!r} match no projection of the model")
    return chosen
