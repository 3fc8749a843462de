"""FP8 (E4M3) projection weights with their scales: as read from a checkpoint
(``Fp8Tensor``: sliced for tensor parallelism, dequantized on the CPU) and as
a layer's resident matrix on CUDA (``Fp8Matrix``: FP8 GEMMs through torch's
``_scaled_mm``).

Scales multiply: weight = fp8 * scale, with the scale per tensor (a scalar),
per output channel ((out, 1)) or per 128x128 block ((ceil(out/128),
ceil(in/128)), block (i, j) covering rows 128i.. and columns 128j..).

On CUDA the activations are quantized to E4M3 as the checkpoint says:
``static`` with its per-tensor ``input_scale``; ``dynamic`` per token (per
token and 128-column group for block weights), scale = amax / 448. The GEMM
is cuBLAS's scaled matmul: tensorwise (both scalars), rowwise (per-token x
per-channel, bf16 out) or blockwise 1x128 x 128x128 (sm90); what it needs
is checked when the matrix is built.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog
import torch

from worker_service.models.config import UnsupportedModelError
from worker_service.models.quantized import DenseMatrix, QuantizedMatrix

logger = structlog.get_logger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
BLOCK = 128
# The smallest activation scale (an all-zero row would divide by zero).
MIN_SCALE = 1e-12


def _refuse(message: str) -> UnsupportedModelError:
    return UnsupportedModelError(message)


@dataclass(frozen=True)
class Fp8Tensor:
    """One checkpoint projection weight in FP8 with its scales, HF layout
    (out, in): a ``QuantizedTensor`` (models/quantized.py), cut for tensor
    parallelism and fused by rows; ``device`` is where ``matrix()`` puts it
    (set by the loader where FP8 GEMMs run)."""

    name: str
    weight: torch.Tensor  # float8_e4m3fn (out, in)
    scale: torch.Tensor  # float32: () per tensor, (out, 1) per channel, blocks
    granularity: str  # "tensor" | "channel" | "block"
    activations: str  # "dynamic" | "static"
    input_scale: torch.Tensor | None = None  # () float32 when static
    activation_ub: float | None = None
    device: torch.device | None = None

    fmt = "fp8"

    @property
    def shape(self) -> tuple[int, int]:
        out, inp = self.weight.shape
        return out, inp

    def rows(self, lo: int, hi: int) -> Fp8Tensor:
        """Output features [lo, hi)."""
        scale = self.scale
        if self.granularity == "channel":
            scale = scale[lo:hi]
        elif self.granularity == "block":
            _aligned(self.name, "output rows", lo, hi, full=self.weight.shape[0])
            scale = scale[lo // BLOCK : -(-hi // BLOCK)]
        return replace(self, weight=self.weight[lo:hi], scale=scale)

    def columns(self, lo: int, hi: int) -> Fp8Tensor:
        """Input features [lo, hi)."""
        scale = self.scale
        if self.granularity == "block":
            _aligned(self.name, "input columns", lo, hi, full=self.weight.shape[1])
            scale = scale[:, lo // BLOCK : -(-hi // BLOCK)]
        return replace(self, weight=self.weight[:, lo:hi], scale=scale)

    def split(self, sizes: Sequence[int], dim: int = 0) -> list[Fp8Tensor]:
        if dim != 0:
            raise ValueError("an FP8 tensor splits by rows only")
        starts = [0, *itertools.accumulate(sizes)]
        return [self.rows(a, b) for a, b in itertools.pairwise(starts)]

    def concat_rows(self, others: Sequence[Any]) -> Fp8Tensor:
        """This tensor's rows, then ``others``': per-tensor parts of different
        scales become per-channel (each part's scalar over its rows, exact);
        block parts need all but the last to be whole blocks of rows; static
        activations take the parts' largest ``input_scale`` (vLLM and SGLang
        do the same: one quantized input for the fused matmul, none clipped)."""
        parts: list[Fp8Tensor] = [self, *others]
        kinds = {p.granularity for p in parts}
        if "block" in kinds and kinds != {"block"}:
            raise _refuse(f"{self.name}: block-scaled parts fused with other scales")
        if kinds == {"block"}:
            for p in parts[:-1]:
                if p.weight.shape[0] % BLOCK:
                    raise _refuse(
                        f"{p.name}: {p.weight.shape[0]} rows (this rank's) are not a multiple "
                        f"of {BLOCK}, so its 128x128 scale blocks cannot be fused with the "
                        "next part's"
                    )
            scale = torch.cat([p.scale for p in parts])
            granularity = "block"
        else:
            scale = torch.cat([p.scale.reshape(-1, 1).expand(p.shape[0], 1) for p in parts])
            granularity = "channel"
        input_scale = None
        if self.activations == "static":
            input_scale = torch.stack([_input_scale(p) for p in parts]).max()
        return replace(
            self,
            weight=torch.cat([p.weight for p in parts]),
            scale=scale,
            granularity=granularity,
            input_scale=input_scale,
        )

    def matrix(self) -> QuantizedMatrix:
        """An ``Fp8Matrix`` on ``device`` where FP8 GEMMs run, else the
        dequantized float32 matrix."""
        if self.device is None or not gemm_supported(self.device):
            return DenseMatrix(self.dequantize())
        out, inp = self.shape
        # cuBLAS's scaled matmul takes K and N in multiples of 16, blockwise K in 128s.
        if out % 16 or inp % (BLOCK if self.granularity == "block" else 16):
            logger.warning("FP8 weight dequantized: no FP8 GEMM for its shape", name=self.name)
            return DenseMatrix(self.dequantize())
        return self.fp8_matrix(self.device)

    def fp8_matrix(self, device: torch.device) -> Fp8Matrix:
        """This weight as an FP8 GEMM's operand on ``device`` (the CPU's
        ``_scaled_mm`` runs the per-tensor and rowwise forms too: tests)."""
        return Fp8Matrix(
            weight=self.weight.to(device).contiguous(),
            scale=self.scale.float().to(device).contiguous(),
            granularity=self.granularity,
            activations=self.activations,
            input_scale=None if self.input_scale is None else self.input_scale.to(device),
            activation_ub=self.activation_ub,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """fp8 * scale in float32, then ``dtype`` (transformers' dequantize)."""
        return (self.weight.float() * expand_scale(self)).to(dtype)


def _input_scale(t: Fp8Tensor) -> torch.Tensor:
    if t.input_scale is None:
        raise _refuse(f"{t.name}: static activations but no input_scale")
    return t.input_scale.float().reshape(())


def _aligned(name: str, what: str, lo: int, hi: int, *, full: int) -> None:
    if lo % BLOCK or (hi % BLOCK and hi != full):
        raise _refuse(
            f"{name}: tensor parallelism cuts its {what} at [{lo}, {hi}), which splits a "
            f"128x128 scale block; a tensor-parallel size whose shard sizes are multiples of "
            f"{BLOCK} serves it"
        )


def expand_scale(t: Fp8Tensor | Fp8Matrix) -> torch.Tensor:
    """The scale broadcast to the weight's shape (float32)."""
    scale = t.scale.float()
    if t.granularity != "block":
        return scale  # () or (out, 1) broadcast as they are
    out, inp = t.weight.shape
    full = scale.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    return full[:out, :inp]


# ------------------------------------------------------------ CUDA matrix


def quantize_per_token(
    x: torch.Tensor, *, group: int | None = None, ub: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 x, float32 scales): per row, or per row and ``group`` columns
    (scales (rows, cols / group)); amax capped at ``ub`` when given."""
    xf = x.float()
    view = xf if group is None else xf.unflatten(-1, (-1, group))
    amax = view.abs().amax(dim=-1, keepdim=True)
    if ub is not None:
        amax = amax.clamp(max=ub)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    q = (view / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if group is None:
        return q, scale
    return q.flatten(-2), scale.squeeze(-1)


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


@dataclass
class Fp8Matrix:
    """A layer's resident FP8 matrix on CUDA (its parts fused, this rank's
    shard): a ``QuantizedMatrix`` (models/quantized.py)."""

    weight: torch.Tensor  # fp8 (out, in)
    scale: torch.Tensor  # float32: () tensor, (out, 1) channel, blocks
    granularity: str
    activations: str
    input_scale: torch.Tensor | None
    activation_ub: float | None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def nbytes(self) -> int:
        extra = 0 if self.input_scale is None else self.input_scale.nbytes
        return self.weight.nbytes + self.scale.nbytes + extra

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * expand_scale(self)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, in) -> (n, out) in x's dtype, through an FP8 GEMM."""
        rows = x.shape[0]
        w_t = self.weight.t()  # column-major (in, out): what cuBLAS wants as mat2
        if self.granularity == "block":
            xq, xs = quantize_per_token(x, group=BLOCK)
            # The 1x128 scales go in outer-dim-major (column-major) as cuBLAS reads them.
            out = torch._scaled_mm(
                xq,
                w_t,
                scale_a=xs.t().contiguous().t(),
                scale_b=self.scale.t(),
                out_dtype=torch.bfloat16,
            )
            return out.to(x.dtype)
        if self.activations == "static":
            assert self.input_scale is not None
            xq, xs = quantize_static(x, self.input_scale), self.input_scale
        else:
            xq, xs = quantize_per_token(x, ub=self.activation_ub)
        if self.granularity == "tensor" and xs.dim() == 0:
            return torch._scaled_mm(xq, w_t, scale_a=xs, scale_b=self.scale, out_dtype=x.dtype)
        # Rowwise: (rows, 1) activation scales x (1, out) weight scales; cuBLAS
        # writes it in bf16 only (the CPU's takes any).
        scale_a = xs.reshape(-1, 1).expand(rows, 1).contiguous()
        scale_b = self.scale.reshape(1, -1).expand(1, self.out_features).contiguous()
        out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        out = torch._scaled_mm(xq, w_t, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        return out.to(x.dtype)


def gemm_supported(device: torch.device) -> bool:
    """Whether this device runs FP8 GEMMs (CUDA, compute capability 8.9+)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)
