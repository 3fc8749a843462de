"""The small ops on the CPU in C (c_sources/cpu_ops.c): one ctypes call per op
instead of the handful of torch ops (and allocations) of ``TorchKernels``.

For float32 and the layouts the model hands them (contiguous rows; q and k
as views of the fused projection, rows apart); anything else goes to the
torch ops this class inherits, as does the sampler's filter. RoPE and the
products are the torch arithmetic bit for bit; RMSNorm's sum and SiLU's exp
differ from torch's within a few float32 ulp (the C source says how). In
place where ``base.Kernels`` allows it: ``add_rmsnorm`` returns its x and
residual arguments, overwritten; ``rope`` rotates q and k where they lie.

Gemma's RMSNorm runs the C RMSNorm with ``1 + weight`` formed in float32 per
call (a hidden-size vector): for float32 rows that is transformers'
arithmetic. GeGLU (``gelu_tanh_and_mul``) is C too, within a few ulp of
torch's tanh GELU (the C source says how).

``load_cpu_kernels`` builds the library (kernels/c_build.py) and returns None
where it cannot (no compiler, a failed build): the torch kernels run then.

``load_skinny_linear``: the decode step's projections (c_sources/skinny_linear.c,
whose header says why), used by models/cpu_linear.py for steps of few rows.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import structlog
import torch

from worker_service.kernels.c_build import CFLAGS, build_threaded, one_openmp_runtime
from worker_service.kernels.torch_kernels import TorchKernels

logger = structlog.get_logger(__name__)

SOURCE = Path(__file__).parent / "c_sources" / "cpu_ops.c"
LINEAR_SOURCE = Path(__file__).parent / "c_sources" / "skinny_linear.c"
# No fused multiply-adds: RoPE and the products stay torch's arithmetic.
FLAGS = (*CFLAGS, "-ffp-contract=off")

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "add_rmsnorm": [_P, _P, _P, _I64, _INT, _F, _INT],
    "rmsnorm": [_P, _P, _P, _I64, _INT, _F, _INT],
    "rope": [_P, _I64, _P, _I64, _INT, _P, _I64, _INT, _INT, _P, _INT],
    "silu_and_mul": [_P, _P, _I64, _INT, _INT],
    "gelu_tanh_and_mul": [_P, _P, _I64, _INT, _INT],
    "token_logprobs": [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _INT],
    "temperature_draw": [_P, _I64, _I64, _P, _I64, _P, _P, _P, _P],
    "temperature_draw_scratch_floats": [_I64],
}


def _rows_of(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()


def _heads_of(x: torch.Tensor) -> bool:
    """(T, H, D) float32 whose heads are contiguous within a token (a view of
    the fused projection's output qualifies: its tokens are a stride apart)."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 3
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
    )


class CpuKernels(TorchKernels):
    name = "cpu"

    def __init__(self, library: Path, threads: int) -> None:
        lib = ctypes.CDLL(str(library))
        for fn_name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, fn_name)
            fn.restype = None
            fn.argtypes = argtypes
        lib.temperature_draw_scratch_floats.restype = ctypes.c_int64
        self._lib = lib
        self.library = library
        self.threads = max(1, threads)

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not (_rows_of(x) and _rows_of(weight)):
            return super().rmsnorm(x, weight, eps)
        dim = x.shape[-1]
        out = torch.empty_like(x)
        self._lib.rmsnorm(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
            self.threads,
        )  # fmt: skip
        return out

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (_rows_of(x) and _rows_of(residual) and _rows_of(weight)):
            return super().add_rmsnorm(x, residual, weight, eps)
        if x.shape != residual.shape:
            raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
        dim = x.shape[-1]
        self._lib.add_rmsnorm(
            x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.numel() // dim, dim, eps,
            self.threads,
        )  # fmt: skip
        return x, residual

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not (_rows_of(gate_up) and gate_up.shape[-1] % 2 == 0):
            return super().gelu_tanh_and_mul(gate_up)
        inter = gate_up.shape[-1] // 2
        out = gate_up.new_empty((*gate_up.shape[:-1], inter))
        self._lib.gelu_tanh_and_mul(
            gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter,
            self.threads,
        )  # fmt: skip
        return out

    def gemma_rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not _rows_of(x):
            return super().gemma_rmsnorm(x, weight, eps)
        return self.rmsnorm(x, 1.0 + weight.float(), eps)

    def gemma_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (_rows_of(x) and _rows_of(residual)):
            return super().gemma_add_rmsnorm(x, residual, weight, eps)
        return self.add_rmsnorm(x, residual, 1.0 + weight.float(), eps)

    def rope(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ok = (
            _heads_of(q)
            and _heads_of(k)
            and q.shape[0] == k.shape[0] == positions.shape[0]
            and q.shape[2] == k.shape[2] == cos_sin_cache.shape[1]
            and positions.dtype == torch.int64
            and positions.is_contiguous()
            and _rows_of(cos_sin_cache)
        )
        if not ok:
            return super().rope(positions, q, k, cos_sin_cache)
        self._lib.rope(
            positions.data_ptr(), q.shape[0],
            q.data_ptr(), q.stride(0), q.shape[1],
            k.data_ptr(), k.stride(0), k.shape[1],
            q.shape[2], cos_sin_cache.data_ptr(), self.threads,
        )  # fmt: skip
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not (_rows_of(gate_up) and gate_up.shape[-1] % 2 == 0):
            return super().silu_and_mul(gate_up)
        inter = gate_up.shape[-1] // 2
        out = gate_up.new_empty((*gate_up.shape[:-1], inter))
        self._lib.silu_and_mul(
            gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter,
            self.threads,
        )  # fmt: skip
        return out

    def token_logprobs(
        self, logits: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logprobs of ids (N, K), logsumexp (N, 1)) of float32 CPU logits
        (N, V) with unit column stride, NaN for an id outside [0, V); None
        for anything else (the caller's torch ops run then)."""
        if not (
            logits.dtype == torch.float32
            and logits.device.type == "cpu"
            and logits.dim() == 2
            and logits.stride(1) == 1
            and ids.dim() == 2
            and ids.shape[0] == logits.shape[0]
        ):
            return None
        ids = ids.to(dtype=torch.long).contiguous()
        rows, vocab = logits.shape
        out = torch.empty(ids.shape, dtype=torch.float32)
        lse = torch.empty((rows, 1), dtype=torch.float32)
        self._lib.token_logprobs(
            logits.data_ptr(), rows, vocab, logits.stride(0), ids.data_ptr(), ids.shape[1],
            out.data_ptr(), lse.data_ptr(), self.threads,
        )  # fmt: skip
        return out, lse

    def temperature_draw(
        self, logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor
    ) -> torch.Tensor | None:
        """(S,) int64 tokens drawn from softmax(logits[rows] / temperature) by
        inverse CDF at u (filters.draw without filters, within a few ulp of
        its probabilities), for float32 CPU logits (N, V) with unit column
        stride; None for anything else, or when a row has a NaN or an
        infinite maximum (the caller's torch ops run then, with their rules)."""
        if not (
            logits.dtype == torch.float32
            and logits.device.type == "cpu"
            and logits.dim() == 2
            and logits.stride(1) == 1
        ):
            return None
        rows = rows.to(dtype=torch.long).contiguous()
        temperature = temperature.to(dtype=torch.float32).contiguous()
        u = u.to(dtype=torch.float32).contiguous()
        n, vocab = rows.numel(), logits.shape[1]
        if temperature.numel() != n or u.numel() != n or vocab == 0:
            return None
        out = torch.empty(n, dtype=torch.long)
        scratch = torch.empty(self._lib.temperature_draw_scratch_floats(vocab), dtype=torch.float32)
        self._lib.temperature_draw(
            logits.data_ptr(), logits.stride(0), vocab, rows.data_ptr(), n,
            temperature.data_ptr(), u.data_ptr(), scratch.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        if n and bool((out < 0).any()):
            return None
        return out


def load_cpu_kernels(threads: int | None = None) -> CpuKernels | None:
    """The C small ops for ``threads`` (default: torch's count), built if
    needed; None (and a warning) where they cannot be built."""
    threads = torch.get_num_threads() if threads is None else threads
    try:
        kernels = CpuKernels(build_threaded(SOURCE, [*FLAGS], "cpu_ops"), threads)
    except (RuntimeError, OSError) as e:
        logger.warning("C small ops unavailable; the torch ops run", error=str(e))
        return None
    one_openmp_runtime("C small ops")
    return kernels


class SkinnyLinear:
    """x . W^T (+ bias) for float32 rows against a weight packed by ``pack``."""

    BLOCK = 16  # output features per packed block, as in the C source

    def __init__(self, library: Path, threads: int) -> None:
        lib = ctypes.CDLL(str(library))
        lib.skinny_pack.restype = None
        lib.skinny_pack.argtypes = [_P, _P, _I64, _I64]
        lib.skinny_linear.restype = None
        lib.skinny_linear.argtypes = [_P, _I64, _I64, _P, _I64, _P, _P, _INT]
        self._lib = lib
        self.library = library
        self.threads = max(1, threads)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """(out, in) float32 into blocks of 16 output features, 64-byte aligned."""
        n, k = weight.shape
        size = -(-n // self.BLOCK) * self.BLOCK * k
        base = torch.empty(size + 16, dtype=torch.float32)
        start = (-base.data_ptr() % 64) // 4
        packed = base[start : start + size]
        w = weight.detach().contiguous()
        self._lib.skinny_pack(w.data_ptr(), packed.data_ptr(), n, k)
        return packed

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        x = x.contiguous()
        rows, k = x.shape
        if packed.numel() != -(-out_features // self.BLOCK) * self.BLOCK * k:
            raise ValueError(
                f"a packed weight of {packed.numel()} floats is not ({out_features}, {k})"
            )
        y = x.new_empty((rows, out_features))
        self._lib.skinny_linear(
            x.data_ptr(), rows, k, packed.data_ptr(), out_features,
            None if bias is None else bias.contiguous().data_ptr(), y.data_ptr(), self.threads,
        )  # fmt: skip
        return y


@functools.cache
def load_skinny_linear(threads: int) -> SkinnyLinear | None:
    """The decode-step linear for ``threads``, built if needed; None (and a
    warning) where it cannot be built."""
    try:
        kernel = SkinnyLinear(build_threaded(LINEAR_SOURCE, [*CFLAGS], "skinny_linear"), threads)
    except (RuntimeError, OSError) as e:
        logger.warning("C decode linear unavailable; oneDNN runs every step", error=str(e))
        return None
    one_openmp_runtime("C decode linear")
    return kernel
