"""The default model loaded in-process with its GGUF blocks kept quantized
(or dequantized, the float path), for the quantized serving tests.

``needs_kernel`` skips a test where the quantized matmul kernel cannot be
built (no C compiler): the worker dequantizes there.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from worker_service.device.distributed import TensorParallel
from worker_service.kernels import quant_linear
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.registry import build_model
from worker_service.weights import ModelSource, open_model

needs_kernel = pytest.mark.skipif(
    not quant_linear.available(), reason="the quantized matmul kernel cannot be built here"
)


def load_default(*, quantized: bool) -> LlamaForCausalLM:
    """The default model on the CPU in float32; ``quantized``: its blocks kept."""
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
