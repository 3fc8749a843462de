"""Refusing, by name, the config.json fields a family does not implement.

A family lists the fields it reads (``implemented``) and the ones that do not
change inference (``inert``: training-only knobs, bookkeeping). Any other
field present in config.json refuses the model at start: running a model
whose config asks for something we do not compute would serve it half-right.
``required_values`` pins fields whose other values we do not implement
(e.g. ``hidden_act``). A field that is null or an empty list or object is
accepted whatever its name (it asks for nothing); false and 0 are not, since
for an unknown field we cannot tell whether they are its default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from worker_service.models.config import UnsupportedModelError

# What every transformers config.json may carry without changing inference.
COMMON_INERT = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "initializer_range",
        "attention_dropout",
        "output_router_logits",
        "router_aux_loss_coef",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "tie_word_embeddings",
        "vocab_size",
        "max_position_embeddings",
        "id2label",
        "label2id",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "tokenizer_class",
        "_name_or_path",
        "name_or_path",
        "auto_map",
        "task_specific_params",
        "problem_type",
        "pretraining_tp",
    }
)


# The model's shape: every family reads these.
SHAPE_FIELDS = frozenset(
    {
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
    }
)


def _harmless(value: Any) -> bool:
    return value is None or (isinstance(value, (list, dict, str)) and not value)


def check_fields(
    architecture: str,
    cfg: Mapping[str, Any],
    *,
    implemented: Iterable[str],
    inert: Iterable[str] = (),
    required_values: Mapping[str, tuple[Any, ...]] | None = None,
) -> None:
    """Raise UnsupportedModelError naming every field of ``cfg`` outside
    ``implemented``, ``inert`` and COMMON_INERT that is not harmless, and
    every field in ``required_values`` whose value is not one of its own."""
    known = COMMON_INERT | set(implemented) | set(inert)
    unknown = sorted(k for k, v in cfg.items() if k not in known and not _harmless(v))
    wrong = [
        f"{k}={cfg[k]!r} (supported: {', '.join(map(repr, allowed))})"
        for k, allowed in (required_values or {}).items()
        if k in cfg and cfg[k] not in allowed
    ]
    if unknown or wrong:
        parts = []
        if unknown:
            parts.append(f"config fields not implemented: {', '.join(unknown)}")
        if wrong:
            parts.append("; ".join(wrong))
        raise UnsupportedModelError(f"{architecture}: {'; '.join(parts)}")
