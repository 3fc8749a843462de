"""GGUF files: metadata -> ModelConfig, quantized tensors -> HF tensors.

The reader memory-maps the file, so opening costs a metadata parse (~2 s for
the default model, mostly its token list) and each tensor is read only when
``tensors()`` reaches it: dequantized to float, or, with ``keep_quantized``,
the projections, embedding and LM head stored in a type the quantized kernel
takes yielded as their blocks (weights/gguf_quant.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import structlog
import torch
from gguf import GGMLQuantizationType as QType

from worker_service.models.config import ModelConfig, UnsupportedModelError
from worker_service.weights import gguf_names, gguf_quant
from worker_service.weights.gguf_config import GgufMetadata, gguf_model_config
from worker_service.weights.tokenizer_files import gguf_tokenizer_files

logger = structlog.get_logger(__name__)

# Dequantization is gguf's (numpy, bit-exact with llama.cpp and with what
# transformers loads). These are covered by our tests; the other block types
# gguf registers are accepted too, as they go through the same code.
TESTED_TYPES = frozenset({QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_1})


def dequantizable_types() -> frozenset[QType]:
    # gguf keeps its block codecs in a private registry; fall back to the
    # tested set should a future release rename it.
    registry = getattr(gguf.quants, "_type_traits", None) or {}
    return TESTED_TYPES | {QType.F32, QType.F16} | frozenset(registry)


class GgufWeights:
    """The tensors and tokenizer of one .gguf file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._reader = gguf.GGUFReader(path)
        except (ValueError, OSError) as err:
            raise UnsupportedModelError(f"{path} is not a readable GGUF file: {err}") from err
        self.meta = GgufMetadata(self._reader, str(path))
        self._arch = self.meta.get("general.architecture")
        self._check_tensors()
        tensors = {t.name: t for t in self._reader.tensors}
        freqs = tensors.get(gguf_names.ROPE_FREQS)
        freq_factors = None if freqs is None else _dequantize(freqs)
        rope_tensors = {
            name: _dequantize(tensors[name]) for name in gguf_names.ROPE_TENSORS if name in tensors
        }
        embedding = tensors.get("token_embd.weight")
        vocab_rows = 0 if embedding is None else int(embedding.shape[-1])
        self.config: ModelConfig = gguf_model_config(
            self.meta, tensors, vocab_rows, freq_factors, rope_tensors=rope_tensors
        )

    def _check_tensors(self) -> None:
        """Refuse a file we cannot load fully before anything is dequantized."""
        allowed = dequantizable_types()
        tensors = self._reader.tensors
        bad_types = [(t.tensor_type.name, t.name) for t in tensors if t.tensor_type not in allowed]
        if bad_types:
            kinds = sorted({kind for kind, _ in bad_types})
            raise UnsupportedModelError(
                f"{self.path.name}: tensors stored as {kinds} (e.g. {bad_types[0][1]}) cannot be "
                f"dequantized; supported types: {sorted(t.name for t in allowed)}"
            )
        unknown = [
            t.name
            for t in tensors
            if t.name not in gguf_names.ROPE_TENSORS
            and gguf_names.hf_name(t.name, self._arch) is None
        ]
        if unknown:
            raise UnsupportedModelError(
                f"{self.path.name}: {len(unknown)} tensors have no Hugging Face counterpart "
                f"in radixserve's {self._arch!r} model, e.g. {unknown[:3]}"
            )

    def _quantized_tensors(self) -> list[tuple[gguf.ReaderTensor, str, str]]:
        """(tensor, HF name, layer kind) of each block-typed tensor the layers
        take quantized (kept so, or refused where its type has no kernel)."""
        found = []
        for tensor in self._reader.tensors:
            qtype = tensor.tensor_type.name
            name = gguf_names.hf_name(tensor.name, self._arch)
            if qtype in gguf_quant.FLOAT_TYPES or name is None or len(tensor.shape) != 2:
                continue
            if (kind := gguf_quant.projection_kind(name)) is not None:
                found.append((tensor, name, kind))
        return found

    def check_quantized(self, kernel_types: frozenset[str], tp_size: int) -> None:
        """Refuse, before loading, what quantized serving cannot take: a block
        type without a kernel, a row-parallel cut inside a block."""
        kept = self._quantized_tensors()
        no_kernel = [(t.tensor_type.name, t.name) for t, _, _ in kept]
        no_kernel = [(qtype, name) for qtype, name in no_kernel if qtype not in kernel_types]
        if no_kernel:
            kinds = sorted({qtype for qtype, _ in no_kernel})
            names = [name for _, name in no_kernel]
            raise UnsupportedModelError(
                f"{self.path.name}: tensors stored as {kinds} have no quantized CPU kernel "
                f"({len(names)} tensors, e.g. {names[:3]}); kernels exist for "
                f"{sorted(kernel_types)}; serve this file with --dequantize (float weights)"
            )
        for tensor, _, kind in kept:
            if kind != "row" or tp_size == 1:
                continue
            size, _ = gguf_quant.block_shape(tensor.tensor_type.name)
            in_features = int(tensor.shape[0])
            if in_features % (tp_size * size):
                raise UnsupportedModelError(
                    f"{self.path.name}: {tensor.name} ({tensor.tensor_type.name}, {in_features} "
                    f"input features in blocks of {size}) cannot be split into {tp_size} "
                    "tensor-parallel shards on block boundaries; serve it with --dequantize"
                )

    def tensors(
        self, dtype: torch.dtype, *, keep_quantized: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | gguf_quant.GgufBlocks]]:
        permuted = self._arch in gguf_names.PERMUTED_ARCHITECTURES
        cfg = self.config
        kept: set[str] = set()
        if keep_quantized:
            module = gguf_quant.kernels()
            assert module is not None  # serve_quantized checked it
            kept = {
                t.name
                for t, _, _ in self._quantized_tensors()
                if t.tensor_type.name in module.KERNEL_TYPES
            }
        experts_said = False
        for tensor in self._reader.tensors:
            if tensor.name in gguf_names.ROPE_TENSORS:
                continue  # folded into config.rope
            name = gguf_names.hf_name(tensor.name, self._arch)
            assert name is not None  # _check_tensors refused the others
            if tensor.name in kept:
                yield name, _blocks(tensor, name, cfg, permuted=permuted)
                continue
            if keep_quantized and not experts_said and len(tensor.shape) == 3:
                logger.info(
                    "MoE experts dequantized to float (the quantized kernel takes 2-D "
                    "projections only)",
                    example=tensor.name,
                    type=tensor.tensor_type.name,
                )
                experts_said = True
            array = _dequantize(tensor)
            if gguf_names.is_shifted_norm(tensor.name, self._arch):
                array = array - np.float32(1.0)
            heads = gguf_names.rotary_heads(tensor.name, cfg.num_heads, cfg.num_kv_heads)
            if permuted and heads is not None:
                array = gguf_names.unpermute_rotary_rows(array, heads)
            experts = cfg.moe.num_experts if cfg.moe is not None else 0
            if split := gguf_names.per_expert_names(tensor.name, experts):
                if array.shape[0] != len(split):
                    raise UnsupportedModelError(
                        f"{tensor.name} stacks {array.shape[0]} experts, the metadata says "
                        f"{len(split)}"
                    )
                for expert_name, rows in zip(split, array, strict=True):
                    yield expert_name, _to_torch(rows).to(dtype)
                continue
            yield name, _to_torch(array).to(dtype)

    def tokenizer_files(self) -> dict[str, bytes]:
        return gguf_tokenizer_files(self.path, self.meta, self.config)


def _blocks(
    tensor: gguf.ReaderTensor, name: str, cfg: ModelConfig, *, permuted: bool
) -> gguf_quant.GgufBlocks:
    """A 2-D quantized tensor's blocks, rows in HF order (a view of the map,
    or a copy when llama.cpp's Q/K rows are put back)."""
    blocks = tensor.data
    heads = gguf_names.rotary_heads(tensor.name, cfg.num_heads, cfg.num_kv_heads)
    if permuted and heads is not None:
        blocks = gguf_names.unpermute_rotary_rows(blocks, heads)
    in_features = int(tensor.shape[0])
    return gguf_quant.GgufBlocks(name, tensor.tensor_type.name, blocks, in_features)


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """float32 in HF (numpy) order: ggml lists dimensions innermost first."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return values.reshape(shape)


def _to_torch(array: np.ndarray) -> torch.Tensor:
    # F32 tensors come back as read-only views of the memory map; copy those so
    # the caller owns writable memory and the map can be closed.
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, copy=True, order="C")
    return torch.from_numpy(array)
