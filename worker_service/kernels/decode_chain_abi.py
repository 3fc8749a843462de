"""The C decode chain's interface (c_sources/decode_chain.c): the structs it
reads, mirrored field for field as ctypes structures, and its library, built
on first use (kernels/c_build.py). models/cpu_decode_chain.py fills them."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import structlog

from worker_service.kernels.c_build import CFLAGS, build_threaded, one_openmp_runtime

logger = structlog.get_logger(__name__)

SOURCE = Path(__file__).parent / "c_sources" / "decode_chain.c"
MAX_PARTS = 4
KIND_FLOAT, KIND_QUANT = 0, 1

_P, _I32, _I64, _F = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class ChainPart(ctypes.Structure):
    _fields_ = [
        ("kind", _I32),
        ("qtype", _I32),
        ("weight", _P),
        ("out_features", _I64),
        ("col", _I64),
    ]


class ChainLinear(ctypes.Structure):
    _fields_ = [
        ("nparts", _I32),
        ("bias_after", _I32),
        ("parts", ChainPart * MAX_PARTS),
        ("bias", _P),
        ("out_total", _I64),
        ("in_features", _I64),
    ]


class ChainLayer(ctypes.Structure):
    _fields_ = [
        ("qkv", ChainLinear),
        ("o", ChainLinear),
        ("gate_up", ChainLinear),
        ("down", ChainLinear),
        ("post_norm", _P),
        ("next_norm", _P),
        ("cache", _P),
    ]


class ChainModel(ctypes.Structure):
    _fields_ = [
        ("skinny", _P),
        ("quant", _P),
        ("add_rmsnorm", _P),
        ("rope", _P),
        ("silu", _P),
        ("attn", _P),
        ("attn_parallel", _I32),
        ("threads_skinny", _I32),
        ("threads_quant", _I32),
        ("threads_ops", _I32),
        ("threads_attn", _I32),
        ("num_layers", _I32),
        ("hidden", _I32),
        ("heads", _I32),
        ("kv_heads", _I32),
        ("head_dim", _I32),
        ("inter", _I32),
        ("page_size", _I32),
        ("window", _I32),
        ("eps", _F),
        ("scale", _F),
        ("layers", ctypes.POINTER(ChainLayer)),
        ("quant_row", _P),
        ("quant_part", _P),
        ("attn_range", _P),
        ("team", _I32),
        ("block_of", _I32 * 8),
        ("attn_piece", _P),
        ("attn_piece_floats", _P),
    ]


class ChainStep(ctypes.Structure):
    _fields_ = [
        ("rows", _I64),
        ("positions", _P),
        ("write_pages", _P),
        ("write_offsets", _P),
        ("attn_rows", _P),
        ("attn_lens", _P),
        ("attn_indptr", _P),
        ("page_ids", _P),
        ("cos_sin", _P),
        ("x", _P),
        ("residual", _P),
        ("qkv", _P),
        ("q", _P),
        ("attn_out", _P),
        ("gate_up", _P),
        ("act", _P),
        ("tmp", _P),
        ("acts", _P),
        ("acts_bytes", _I64),
    ]


def address(fn: Any) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


@functools.cache
def load_library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build_threaded(SOURCE, [*CFLAGS], "decode_chain")))
    except (RuntimeError, OSError) as e:
        logger.warning("C decode chain unavailable; the Python forward runs", error=str(e))
        return None
    lib.decode_chain_openmp.restype = ctypes.c_int
    lib.decode_chain.restype = ctypes.c_int
    lib.decode_chain.argtypes = [ctypes.POINTER(ChainModel), ctypes.POINTER(ChainStep)]
    if lib.decode_chain_openmp() and not one_openmp_runtime("C decode chain"):
        return None
    return lib
