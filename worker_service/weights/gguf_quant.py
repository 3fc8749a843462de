"""GGUF linear weights kept in their blocks: the reader's QuantizedTensor.

When quantized serving is on (``serve_quantized``: a float32 CPU worker
without ``--dequantize``, and the quantized matmul kernel built), the reader
yields every projection, embedding and LM head stored in a type the kernel
multiplies (kernels/quant_linear.py: KERNEL_TYPES) as a ``GgufBlocks``: the
raw block bytes, rows = output features, never dequantized. Everything else
(norms, biases, routers, float tensors, MoE experts) stays float.

Cutting a matrix: rows are whole rows of blocks, so column-parallel shards,
fused checkpoint tensors and llama.cpp's Q/K row permutation are row moves;
a row-parallel shard cuts every row's blocks and must fall on a block
boundary (``check_quantized`` refuses other shapes at start).

Memory: slices are views of the file's memory map; ``matrix()`` copies the
bytes once into memory of their own (the map stays the file's page cache).
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import gguf
import numpy as np
import structlog
import torch

from worker_service.models.config import UnsupportedModelError

logger = structlog.get_logger(__name__)

KERNEL_MODULE = "worker_service.kernels.quant_linear"
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
# The HF names (after ``model.layers.N.``) of the projections the layers take
# quantized; a router or anything else reads float.
QUANTIZED_PROJECTIONS = frozenset(
    {
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.qkv_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.gate_up_proj",
        "mlp.down_proj",
    }
)
# Row-parallel projections: tensor parallelism cuts their input features.
ROW_PARALLEL = frozenset({"self_attn.o_proj", "mlp.down_proj"})
QUANTIZED_GLOBALS = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


def kernels() -> ModuleType | None:
    """The quantized matmul kernel's module, or None where it is absent or its
    C library cannot be built here."""
    try:
        module = importlib.import_module(KERNEL_MODULE)
    except ImportError:
        return None
    return module if module.available() else None


def serve_quantized(
    *, kind: str, device: torch.device, dtype: torch.dtype, dequantize: bool
) -> bool:
    """Whether a model's GGUF blocks stay quantized (module docstring); says why not."""
    if kind != "gguf":
        return False
    if dequantize:
        logger.info("GGUF weights dequantized to float", why="--dequantize")
        return False
    if device.type != "cpu":
        logger.info("GGUF weights dequantized to float", why=f"no quantized kernel on {device}")
        return False
    if dtype != torch.float32:
        logger.info("GGUF weights dequantized to float", why=f"dtype {dtype} (quantized: float32)")
        return False
    if kernels() is None:
        logger.warning(
            "GGUF weights dequantized to float",
            why="the quantized matmul kernel cannot be built here (no C compiler?)",
        )
        return False
    return True


def projection_kind(hf_name: str) -> str | None:
    """ "column", "row" or "table" for a weight the layers take quantized; None otherwise."""
    if hf_name in QUANTIZED_GLOBALS:
        return "table"
    parts = hf_name.split(".")
    if len(parts) != 6 or parts[:2] != ["model", "layers"] or parts[-1] != "weight":
        return None
    module = ".".join(parts[3:5])
    if module not in QUANTIZED_PROJECTIONS:
        return None
    return "row" if module in ROW_PARALLEL else "column"


def block_shape(qtype: str) -> tuple[int, int]:
    """(weights per block, bytes per block)."""
    size, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    return size, nbytes


@dataclass(frozen=True)
class GgufBlocks:
    """A GGUF matrix (out, in) as its blocks: ``blocks`` uint8 (out, row bytes)."""

    name: str
    qtype: str
    blocks: np.ndarray
    in_features: int

    @property
    def fmt(self) -> str:
        return f"gguf:{self.qtype}"

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.in_features)

    def rows(self, lo: int, hi: int) -> GgufBlocks:
        return GgufBlocks(self.name, self.qtype, self.blocks[lo:hi], self.in_features)

    def columns(self, lo: int, hi: int) -> GgufBlocks:
        size, nbytes = block_shape(self.qtype)
        if lo % size or hi % size:
            raise UnsupportedModelError(
                f"{self.name} ({self.qtype}, blocks of {size}) cannot be cut at input features "
                f"{lo}:{hi} for tensor parallelism; serve it with --dequantize"
            )
        part = self.blocks[:, lo // size * nbytes : hi // size * nbytes]
        return GgufBlocks(self.name, self.qtype, part, hi - lo)

    def split(self, sizes: Sequence[int], dim: int = 0) -> list[GgufBlocks]:
        if dim != 0:
            raise ValueError("GGUF blocks split by rows only")
        bounds = np.cumsum([0, *sizes])
        return [self.rows(int(a), int(b)) for a, b in itertools.pairwise(bounds)]

    def concat_rows(self, others: Sequence[GgufBlocks]) -> GgufBlocks:
        blocks = np.concatenate([self.blocks, *(o.blocks for o in others)])
        return GgufBlocks(self.name, self.qtype, blocks, self.in_features)

    def matrix(self) -> GgufMatrix:
        module = kernels()
        if module is None:
            raise RuntimeError("the quantized matmul kernel is not available")
        # The one copy out of the memory map (a concatenation already owns its bytes).
        owned = self.blocks.base is None and self.blocks.flags.c_contiguous
        blocks = self.blocks if owned else np.array(self.blocks, copy=True, order="C")
        out_features = self.blocks.shape[0]
        weight = module.pack(self.qtype, torch.from_numpy(blocks), out_features, self.in_features)
        return GgufMatrix(module, weight)

    def dequantize(self) -> torch.Tensor:
        values = gguf.quants.dequantize(self.blocks, gguf.GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


class GgufMatrix:
    """A resident quantized matrix multiplied by the kernel (a QuantizedTable)."""

    def __init__(self, module: ModuleType, weight: object) -> None:
        self.module = module
        self.weight = weight
        self.out_features: int = weight.out_features  # type: ignore[attr-defined]
        self.in_features: int = weight.in_features  # type: ignore[attr-defined]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        out = self.module.matmul(x.float().contiguous(), self.weight)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.module.dequantize_rows(self.weight, ids)

    def dequantize(self) -> torch.Tensor:
        return self.module.dequantize(self.weight)

    @property
    def nbytes(self) -> int:
        data = self.weight.data  # type: ignore[attr-defined]
        return data.numel() * data.element_size()
