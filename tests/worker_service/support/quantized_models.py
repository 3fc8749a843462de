"""The default model loaded in-process with its GGUF blocks kept quantized
(or dequantized, the float path), for the quantized serving tests.

``kernel_module`` is the quantized matmul kernel's module where it is built
here, else the torch stand-in (quant_linear_standin.py); ``use_kernels``
points weights/gguf_quant.py at it for one test.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.worker_service.support import quant_linear_standin
from worker_service.device.distributed import TensorParallel
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.registry import build_model
from worker_service.weights import ModelSource, gguf_quant, open_model


def kernel_module() -> ModuleType:
    return gguf_quant.kernels() or quant_linear_standin


def use_kernels(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = kernel_module()
    monkeypatch.setattr(gguf_quant, "kernels", lambda: module)
    return module


def load_default(*, quantized: bool) -> LlamaForCausalLM:
    """The default model on the CPU in float32; ``quantized``: its blocks kept
    (call ``use_kernels`` first)."""
    source = default_source()
    cpu = torch.device("cpu")
    model = build_model(source.config, tp=TensorParallel(), dtype=torch.float32, device=cpu)
    model.load_weights(source.tensors(torch.float32, keep_quantized=quantized))
    return model


@functools.cache
def default_source() -> ModelSource:
    return open_model(None)


@functools.cache
def default_tokenizer() -> PreTrainedTokenizerBase:
    files = default_source().tokenizer_files()
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp)
