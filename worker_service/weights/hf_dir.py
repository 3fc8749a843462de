"""Hugging Face model directories: config.json + *.safetensors (+ tokenizer).

Checkpoints are either one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``; both are read one tensor at a time through
safetensors' memory map.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open

from worker_service.models.config import ModelConfig, UnsupportedModelError
from worker_service.models.fp8_linear import Fp8Tensor
from worker_service.models.registry import config_from_hf, family_of
from worker_service.weights.declarations import with_hf_declarations
from worker_service.weights.fp8_checkpoint import fp8_tensors
from worker_service.weights.fp8_scheme import FP8_FAMILIES, Fp8Scheme, read_scheme
from worker_service.weights.tokenizer_files import hf_tokenizer_files

logger = structlog.get_logger(__name__)

INDEX_FILE = "model.safetensors.index.json"


class HfDirectory:
    """The tensors and tokenizer of one Hugging Face model directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        config_file = directory / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"no config.json in {directory}: a Hugging Face model directory needs config.json "
                "and *.safetensors (for a GGUF model, pass the .gguf file itself)"
            )
        raw = _read_json(config_file)
        # Read for every family here (weights/fp8_scheme.py): the FP8 forms
        # pass, any other quantization_config is refused by name. Families
        # do not all check their fields (the Llama family's reader reads what
        # it needs), and one that did not would load the weights unscaled.
        self.fp8 = read_scheme(raw.get("quantization_config"))
        if self.fp8 is not None:
            raw = {k: v for k, v in raw.items() if k != "quantization_config"}
        try:
            config = config_from_hf(raw)
        except KeyError as err:
            raise UnsupportedModelError(f"{config_file} lacks the field {err}") from err
        if self.fp8 is not None:
            _check_fp8_family(config, self.fp8)
        config = _with_generation_eos(config, directory / "generation_config.json")
        self.config = with_hf_declarations(config, directory)
        self.shards = _shard_files(directory)

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | Fp8Tensor]]:
        """Float tensors of ``dtype``; in an FP8 checkpoint, its projections as
        Fp8Tensor (the layers dequantize them where no FP8 GEMM runs)."""
        tied = self.config.tie_word_embeddings
        if self.fp8 is not None:
            skip = {"lm_head.weight"} if tied else set()
            yield from fp8_tensors(self.shards, self.fp8, dtype, skip=skip)
            return
        for shard in self.shards:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    # Older checkpoints save the tied head and RoPE buffers too;
                    # neither is a weight the model loads.
                    if (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
                        continue
                    yield name, f.get_tensor(name).to(dtype)

    def tokenizer_files(self) -> dict[str, bytes]:
        return hf_tokenizer_files(self.directory)


def _check_fp8_family(config: ModelConfig, scheme: Fp8Scheme) -> None:
    family = family_of(config.architecture).name
    if family not in FP8_FAMILIES or config.moe is not None:
        raise UnsupportedModelError(
            f"{config.architecture}: quantization_config {scheme.method} (FP8 weights) is served "
            f"for the dense models of the {', '.join(sorted(FP8_FAMILIES))} family only "
            "(Llama, Mistral, Qwen2, Qwen3)"
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UnsupportedModelError(f"{path} is not valid JSON: {err}") from err


def _with_generation_eos(config: ModelConfig, generation_file: Path) -> ModelConfig:
    """Chat models often list their end-of-turn token only in
    generation_config.json; stop on those too (config.json's first stays first)."""
    if not generation_file.is_file():
        return config
    eos = _read_json(generation_file).get("eos_token_id")
    extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    merged = list(config.eos_token_ids)
    merged += [int(e) for e in extra if int(e) not in merged]
    return dataclasses.replace(config, eos_token_ids=tuple(merged))


def _shard_files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = _read_json(index).get("weight_map", {})
        # dict.fromkeys keeps the index's order and drops repeats.
        shards = [directory / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(s.name) for s in shards if not s.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are not in {directory}: {missing}")
        return shards
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(
            f"no *.safetensors (nor {INDEX_FILE}) in {directory}; radixserve reads safetensors "
            "checkpoints only (convert pytorch_model.bin with transformers' save_pretrained)"
        )
    return shards
