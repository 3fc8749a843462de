"""Linear layers whose weights stay in GGUF's quantized blocks on the CPU
(c_sources/quant_linear.c, whose header says how it computes): Q4_0, Q4_1,
Q8_0, Q4_K, Q5_K and Q6_K.

A ``QuantWeight`` holds the matrix in GGUF's blocks, the same bytes, with
the 32-weight types' rows interleaved by groups of 8 (``pack`` rearranges
them once: one vector load then feeds 8 output features). ``matmul``
quantizes the activations to int8 per block and multiplies in integers;
``dequantize`` and ``dequantize_rows`` are gguf.quants' dequantization bit
for bit (the float path and embedding lookups). The library is built on
first use (kernels/c_build.py); where it cannot be, ``available()`` is False
and the caller dequantizes at load.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog
import torch

from worker_service.kernels.c_build import CFLAGS, build_threaded, one_openmp_runtime

logger = structlog.get_logger(__name__)

SOURCE = Path(__file__).parent / "c_sources" / "quant_linear.c"
# No fused multiply-adds: the dequantizers are gguf's float32 arithmetic.
FLAGS = (*CFLAGS, "-ffp-contract=off")

# GGUF type name -> (the C source's type code, weights per block, bytes per block)
_TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (0, 32, 18),
    "Q4_1": (1, 32, 20),
    "Q8_0": (2, 32, 34),
    "Q4_K": (3, 256, 144),
    "Q5_K": (4, 256, 176),
    "Q6_K": (5, 256, 210),
}
KERNEL_TYPES: frozenset[str] = frozenset(_TYPES)

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_F32 = torch.float32
_ERRORS = {-1: "unknown type or in_features", -2: "out of memory", -3: "id out of range"}


@dataclass(frozen=True)
class QuantWeight:
    """One resident quantized matrix (out_features, in_features), HF layout."""

    qtype: str
    out_features: int
    in_features: int
    data: torch.Tensor  # uint8 (out_features, row_bytes): GGUF's blocks, rows interleaved

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _type(qtype: str) -> tuple[int, int, int]:
    try:
        return _TYPES[qtype]
    except KeyError:
        raise ValueError(f"no quantized kernel for GGUF type {qtype!r}") from None


def block_size(qtype: str) -> int:
    """Weights per block: 32, or 256 for the K-quants."""
    return _type(qtype)[1]


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one output feature's row of blocks."""
    _, block, size = _type(qtype)
    if in_features <= 0 or in_features % block:
        raise ValueError(f"{qtype} rows hold multiples of {block} weights, not {in_features}")
    return in_features // block * size


def pack(
    qtype: str, blocks: torch.Tensor | np.ndarray, out_features: int, in_features: int
) -> QuantWeight:
    """The kernel's copy (same size, rows interleaved by groups: see the C
    source) of a matrix given as GGUF blocks, uint8 (out_features, row_bytes)
    (any shape of that many bytes; a read-only memory map is fine: it is read
    once)."""
    size = row_bytes(qtype, in_features)
    if isinstance(blocks, np.ndarray):
        blocks = torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8).copy())
    if blocks.dtype != torch.uint8:
        raise ValueError(f"{qtype} blocks must be uint8, not {blocks.dtype}")
    if blocks.numel() != out_features * size:
        raise ValueError(
            f"{blocks.numel()} bytes are not {out_features} rows of {size} ({qtype}, {in_features})"
        )
    return _require().pack(qtype, blocks, out_features, in_features)


class QuantLinearLibrary:
    """The built C library (one build: the machine's vector path, or the one
    its flags chose)."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        lib.ql_isa.restype = _INT
        lib.ql_isa.argtypes = []
        lib.ql_matmul.restype = _INT
        lib.ql_matmul.argtypes = [_INT, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _INT]
        lib.ql_scratch_bytes.restype = _I64
        lib.ql_scratch_bytes.argtypes = [_I64, _I64]
        lib.ql_pack.restype = _INT
        lib.ql_pack.argtypes = [_INT, _P, _P, _I64, _I64]
        lib.ql_dequantize_rows.restype = _INT
        lib.ql_dequantize_rows.argtypes = [_INT, _P, _I64, _I64, _P, _I64, _P, _INT]
        self._lib = lib
        self.library = library
        # 2: AVX-512 VNNI (or AVX-VNNI), 1: AVX2, 0: portable C
        self.isa: int = lib.ql_isa()

    def pack(
        self, qtype: str, blocks: torch.Tensor, out_features: int, in_features: int
    ) -> QuantWeight:
        src = blocks.detach().to("cpu").contiguous()
        data = torch.empty((out_features, row_bytes(qtype, in_features)), dtype=torch.uint8)
        code = self._lib.ql_pack(
            _TYPES[qtype][0], src.data_ptr(), data.data_ptr(), out_features, in_features
        )
        if code:
            raise ValueError(f"ql_pack: {_ERRORS.get(code, code)}")
        return QuantWeight(qtype, out_features, in_features, data)

    def matmul(
        self,
        x: torch.Tensor,
        w: QuantWeight,
        *,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # checks that cost little: this runs once per projection per step
        if x.dtype != _F32 or not x.is_cpu or x.dim() != 2:
            raise ValueError(f"x must be 2-D float32 on the CPU, not {x.dtype} {tuple(x.shape)}")
        rows, k = x.shape
        n = w.out_features
        if k != w.in_features:
            raise ValueError(f"x has {k} features; the {w.qtype} weight takes {w.in_features}")
        if x.stride(1) != 1:
            x = x.contiguous()
        if out is None:
            out = torch.empty((rows, n))
        elif out.dtype != _F32 or not out.is_cpu or out.shape != (rows, n) or out.stride(1) != 1:
            raise ValueError(
                f"out must be float32 ({rows}, {n}) on the CPU with unit column stride, "
                f"not {out.dtype} {tuple(out.shape)} {out.stride()}"
            )
        if bias is not None:
            if bias.shape != (n,) or bias.dtype != _F32 or not bias.is_cpu:
                raise ValueError(f"bias must be float32 ({n},) on the CPU")
            bias = bias.contiguous()
        code = self._lib.ql_matmul(
            _TYPES[w.qtype][0], x.data_ptr(), rows, x.stride(0), k, w.data.data_ptr(), n,
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
            torch.get_num_threads(),
        )  # fmt: skip
        if code:
            raise RuntimeError(f"ql_matmul: {_ERRORS.get(code, code)}")
        return out

    def dequantize_rows(self, w: QuantWeight, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` of ``w`` dequantized (all of them without ids)."""
        count = w.out_features if ids is None else ids.numel()
        out = torch.empty((count, w.in_features), dtype=torch.float32)
        if ids is not None:
            ids = ids.to(torch.int64).contiguous()
        code = self._lib.ql_dequantize_rows(
            _TYPES[w.qtype][0], w.data.data_ptr(), w.out_features, w.in_features,
            None if ids is None else ids.data_ptr(), count, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if code:
            raise ValueError(f"ql_dequantize_rows: {_ERRORS.get(code, code)}")
        return out


@functools.cache
def _library() -> QuantLinearLibrary | None:
    try:
        library = QuantLinearLibrary(build_threaded(SOURCE, [*FLAGS], "quant_linear"))
    except (RuntimeError, OSError) as e:
        logger.warning("C quantized linear unavailable", error=str(e))
        return None
    one_openmp_runtime("C quantized linear")
    return library


def available() -> bool:
    """Whether the C library is built here (else: dequantize at load)."""
    return _library() is not None


def _require() -> QuantLinearLibrary:
    library = _library()
    if library is None:
        raise RuntimeError("the C quantized linear could not be built here (see the warning)")
    return library


def matmul(
    x: torch.Tensor,
    w: QuantWeight,
    *,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (n, in_features) float32 -> (n, out_features) float32 (+ bias), into
    ``out`` when given: a column slice of a wider output is fine (unit column
    stride, any row stride)."""
    return _require().matmul(x, w, bias=bias, out=out)


def dequantize(w: QuantWeight) -> torch.Tensor:
    """(out_features, in_features) float32: gguf.quants.dequantize exactly."""
    return _require().dequantize_rows(w)


def dequantize_rows(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """(len(ids), in_features) float32: rows ``ids`` dequantized (embedding
    lookups from a quantized table)."""
    return _require().dequantize_rows(w, ids.reshape(-1))


def type_code(qtype: str) -> int:
    """The C source's code for GGUF type ``qtype`` (what ql_matmul takes)."""
    return _type(qtype)[0]


def team_addresses() -> dict[str, int] | None:
    """The addresses the CPU decode chain calls: ql_matmul (its op-by-op path)
    and the pieces its team path splits (ql_quantize_row, ql_matmul_part);
    None where the library is not built."""
    library = _library()
    if library is None:
        return None
    names = ("ql_matmul", "ql_quantize_row", "ql_matmul_part")
    return {n: ctypes.cast(getattr(library._lib, n), ctypes.c_void_p).value or 0 for n in names}


def scratch_bytes(rows: int, in_features: int) -> int:
    """Bytes of one activation buffer ql_quantize_row fills for (rows, in_features)."""
    return int(_require()._lib.ql_scratch_bytes(rows, in_features))


def block_codes() -> dict[int, int]:
    """Each C type code's block size (what the chain's team quantizes for)."""
    return {code: block for code, block, _ in _TYPES.values()}
