"""What a model declares for its clients beyond its shape: the pad and BOS
token ids and the author's sampling defaults, from a Hugging Face directory
(tokenizer_config.json, tokenizer.json, generation_config.json) or from GGUF
metadata (tokenizer.ggml.*, general.sampling.*: llama.cpp writes the latter
from generation_config.json)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker_service.models.config import ModelConfig, SamplingDefaults, UnsupportedModelError

# generation_config.json keys read as sampling defaults: SGLang's
# (ModelConfig.get_default_sampling_params) and max_new_tokens.
GENERATION_KEYS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "max_new_tokens": int,
}
# llama.cpp's names for them (gguf.Keys.General.SAMPLING_*).
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def sampling_defaults(declared: dict[str, Any]) -> SamplingDefaults:
    """The numeric sampling fields among ``declared`` (field name -> value);
    anything else (a null, a string) is not a default."""
    values: dict[str, Any] = {}
    for name, kind in GENERATION_KEYS.items():
        value = declared.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values[name] = kind(value)
    return SamplingDefaults(**values)


def gguf_sampling_defaults(get: Callable[[str], Any]) -> SamplingDefaults:
    """From GGUF metadata (``get(key)`` -> value or None). The file holds
    float32: 7 significant digits give back what was written (0.7, not
    0.699999988)."""
    declared = {name: get(key) for key, name in GGUF_SAMPLING_KEYS.items()}
    return sampling_defaults(
        {k: float(f"{v:.7g}") if isinstance(v, float) else v for k, v in declared.items()}
    )


def with_hf_declarations(config: ModelConfig, directory: Path) -> ModelConfig:
    """``config`` (from config.json) with the pad and BOS ids the tokenizer
    declares (config.json's, then generation_config.json's, where it declares
    none) and generation_config.json's sampling defaults."""
    generation = _json(directory / "generation_config.json")
    tokenizer_config = _json(directory / "tokenizer_config.json")
    pad = _token_id(directory, tokenizer_config, "pad_token")
    if pad is None:
        pad = config.pad_token_id
    if pad is None:
        pad = generation.get("pad_token_id")
    bos = config.bos_token_id
    if bos is None:
        bos = generation.get("bos_token_id")
    if bos is None:
        bos = _token_id(directory, tokenizer_config, "bos_token")
    return dataclasses.replace(
        config,
        pad_token_id=pad if isinstance(pad, int) else None,
        bos_token_id=bos if isinstance(bos, int) else None,
        sampling_defaults=sampling_defaults(generation),
    )


def _token_id(directory: Path, tokenizer_config: dict[str, Any], name: str) -> int | None:
    """The id of the special token ``tokenizer_config[name]`` (a string or an
    AddedToken dict): from the config's added_tokens_decoder, else from
    tokenizer.json's vocabulary."""
    token = tokenizer_config.get(name)
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    for token_id, added in (tokenizer_config.get("added_tokens_decoder") or {}).items():
        if isinstance(added, dict) and added.get("content") == token:
            return int(token_id)
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer  # only for the rare config without added_tokens_decoder

    return Tokenizer.from_file(str(path)).token_to_id(token)


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UnsupportedModelError(f"{path} is not valid JSON: {err}") from err
    return data if isinstance(data, dict) else {}
