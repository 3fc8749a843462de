"""Tokenizer files a model ships with, as ``{file name: bytes}``.

The scheduler writes these into a directory and calls
``AutoTokenizer.from_pretrained`` on it, and ``GetTokenizer`` streams them to
the gateway, so tokenizer_config.json must carry the chat template and the
special tokens itself (transformers 5 writes the template to a separate
chat_template.jinja that older readers and the gateway do not look at).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from worker_service.models.config import ModelConfig, UnsupportedModelError

if TYPE_CHECKING:
    from worker_service.weights.gguf_config import GgufMetadata

logger = structlog.get_logger(__name__)

# What AutoTokenizer may read from a model directory.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)

# tokenizer_config.json keys that only describe how the tokenizer was loaded.
_LOAD_TIME_KEYS = ("is_local", "local_files_only", "name_or_path", "_commit_hash")


def hf_tokenizer_files(directory: Path) -> dict[str, bytes]:
    present = [name for name in HF_TOKENIZER_FILES if (directory / name).is_file()]
    files = {name: (directory / name).read_bytes() for name in present}
    if not {"tokenizer.json", "tokenizer.model", "vocab.json"} & files.keys():
        logger.warning("model directory has no tokenizer", directory=str(directory))
    template = _separate_chat_template(files)
    if template is not None and "tokenizer_config.json" in files:
        config = json.loads(files["tokenizer_config.json"])
        if not config.get("chat_template"):
            config["chat_template"] = template
            files["tokenizer_config.json"] = _json_bytes(config)
    return files


def _separate_chat_template(files: dict[str, bytes]) -> str | None:
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"].decode()
    if "chat_template.json" in files:
        return json.loads(files["chat_template.json"]).get("chat_template")
    return None


def gguf_tokenizer_files(path: Path, meta: GgufMetadata, config: ModelConfig) -> dict[str, bytes]:
    """Rebuild HF tokenizer files from the tokenizer embedded in a GGUF file.

    transformers' own GGUF conversion knows the vocabulary formats (gpt2
    byte-level BPE, llama sentencepiece, ...) and llama.cpp's pre-tokenizer
    names; we reuse it and then complete the config it saves.
    """
    if "tokenizer.ggml.tokens" not in meta:
        raise UnsupportedModelError(f"{path.name} embeds no tokenizer (no tokenizer.ggml.tokens)")
    from transformers import AutoTokenizer  # heavy; only needed here

    start = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except ValueError as err:  # e.g. a tokenizer.ggml.model transformers cannot convert
        raise UnsupportedModelError(f"cannot build a tokenizer from {path.name}: {err}") from err
    with tempfile.TemporaryDirectory(prefix="radixserve-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        saved = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
    seconds = round(time.perf_counter() - start, 1)
    logger.info("built tokenizer from GGUF", path=str(path), seconds=seconds)

    tokens: list[str] = meta.get("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return None if token_id is None or token_id >= len(tokens) else tokens[token_id]

    specials = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
    }
    specials = {k: v for k, v in specials.items() if v is not None}

    tok_config: dict[str, Any] = json.loads(saved["tokenizer_config.json"])
    for key in _LOAD_TIME_KEYS:
        tok_config.pop(key, None)
    # transformers 5 names its fast tokenizer "TokenizersBackend", which 4.x
    # (and tools that read this file) do not know; both accept this name.
    tok_config.pop("backend", None)
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config.update(specials)
    for key in ("add_bos_token", "add_eos_token"):
        if (flag := meta.get(f"tokenizer.ggml.{key}")) is not None:
            tok_config[key] = bool(flag)
    tok_config["model_max_length"] = config.max_position_embeddings
    template = gguf_chat_template(meta) or _separate_chat_template(saved)
    if template is not None:
        tok_config["chat_template"] = template

    generation: dict[str, Any] = {}
    if config.bos_token_id is not None:
        generation["bos_token_id"] = config.bos_token_id
    if config.eos_token_ids:
        eos = list(config.eos_token_ids)
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    # general.sampling.* back under generation_config.json's names
    declared = dataclasses.asdict(config.sampling_defaults).items()
    generation |= {name: value for name, value in declared if value is not None}
    return {
        "tokenizer.json": saved["tokenizer.json"],
        "tokenizer_config.json": _json_bytes(tok_config),
        "special_tokens_map.json": _json_bytes(specials),
        "generation_config.json": _json_bytes(generation),
    }


def gguf_chat_template(meta: GgufMetadata) -> str | list[dict[str, str]] | None:
    """The default template, plus named ones (e.g. tool_use) in HF's list form."""
    default = meta.get("tokenizer.chat_template")
    names = meta.get("tokenizer.chat_templates") or []
    named = [
        {"name": name, "template": meta.get(f"tokenizer.chat_template.{name}")}
        for name in names
        if f"tokenizer.chat_template.{name}" in meta
    ]
    if not named:
        return default
    if default is not None:
        named.insert(0, {"name": "default", "template": default})
    return named


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode()
