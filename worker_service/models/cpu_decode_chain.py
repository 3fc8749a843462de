"""The decoder stack of a CPU decode step in one C call (kernels/c_sources/
decode_chain.c, whose header says what it runs): the same C ops as the
Python forward, in the same order, without Python between them.

At one row the Python around the ops (module calls, argument checks, ctypes
conversions, allocations) costs more than a quantized layer's matmuls; the
chain takes it out of the step. It runs a step when everything in it is what
the chain knows (``DecodeChain.build`` checks the model once,
``DecodeChain.run`` the step): a Llama-shaped stack (LlamaAttention without q/k
norms or sinks, LlamaMLP, LlamaDecoderLayer, RMSNorm; the families whose
hooks change nothing else, e.g. Qwen2 with its q/k/v bias), the C small ops,
float32 on one rank, every projection either packed for the C decode linear
or GGUF blocks for the quantized kernel, the torch attention backend with the
C decode kernel reading a float32 cache; a step whose rows all attend
through that kernel (decode and short verify rows), at most
``cpu_linear.SKINNY_MAX_ROWS`` of them, without LoRA rows. Anything else takes
the Python forward, which stays the reference: tests compare the two bit for
bit.

Where every projection is GGUF blocks the chain runs its team path: one
OpenMP region for the whole stack, each op split over the team (output
features, attention tasks, rows) with a barrier between dependent ops,
instead of a region per op (about 150 a step). On the 2-core machine a
one-row quantized step took 10.0 ms against 11.0 ms op by op on two threads
(benchmarks/worker_decode_cpu.py --ab-chain-team); no gain at 16 rows.
"""

from __future__ import annotations

import ctypes
from typing import Any

import structlog
import torch
from torch import nn

from worker_service.attention.torch_backend import TorchAttention
from worker_service.kernels import quant_linear
from worker_service.kernels.decode_chain_abi import (
    KIND_FLOAT,
    KIND_QUANT,
    MAX_PARTS,
    ChainLayer,
    ChainLinear,
    ChainModel,
    ChainPart,
    ChainStep,
    address,
    load_library,
)
from worker_service.models import cpu_linear

logger = structlog.get_logger(__name__)


class _Unfit(Exception):
    """The model (or a part of it) is not what the chain runs."""


def _quant_weight(matrix: object) -> tuple[Any, int] | None:
    """The kernel's QuantWeight behind a GGUF matrix and its C type code
    (duck-typed: the weights package's GgufMatrix holds one as ``weight``),
    else None."""
    weight = getattr(matrix, "weight", None)
    if isinstance(weight, quant_linear.QuantWeight):
        return weight, quant_linear.type_code(weight.qtype)
    return None


class DecodeChain:
    """The C description of one model's stack, built once after loading."""

    def __init__(self, model: nn.Module, lib: ctypes.CDLL, kernels: Any) -> None:
        cfg = model.config
        layers = model.layers
        self._keep: list[Any] = []  # what the C structs point into
        self._lib = lib
        self._model = model
        self._kernels = kernels
        self.hidden = cfg.hidden_size
        self.inter = layers[0].mlp.down_proj.weight.shape[1]
        attn0 = layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = (
            attn0.num_heads,
            attn0.num_kv_heads,
            attn0.head_dim,
        )
        self.qkv_width = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.has_float = False
        self._struct_skinny = 0
        self._skinny_threads = 1
        structs = (ChainLayer * len(layers))()
        for i, layer in enumerate(layers):
            s = structs[i]
            attn, mlp = layer.self_attn, layer.mlp
            s.qkv = self._linear(attn.qkv_proj, column=True)
            s.o = self._linear(attn.o_proj, column=False)
            s.gate_up = self._linear(mlp.gate_up_proj, column=True)
            s.down = self._linear(mlp.down_proj, column=False)
            s.post_norm = self._norm(layer.post_attention_layernorm)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
            s.next_norm = self._norm(nxt)
        self._layers = structs
        self._struct = ChainModel(
            add_rmsnorm=address(kernels._lib.add_rmsnorm),
            rope=address(kernels._lib.rope),
            silu=address(kernels._lib.silu_and_mul),
            threads_ops=kernels.threads,
            num_layers=len(layers),
            hidden=self.hidden,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            inter=self.inter,
            eps=float(layers[0].post_attention_layernorm.eps),
            layers=structs,
        )
        self._bound: tuple[int, ...] | None = None  # (attention kernel, cache pointers) bound
        self.steps = 0  # steps the chain ran (tests, logs)
        # The team path (one OpenMP region a step) where every projection is
        # GGUF blocks; False: op by op (benchmarks/worker_decode_cpu.py's A/B).
        self.use_team = True
        self.team_threads = 0

    # ----------------------------------------------------------- build
    @classmethod
    def build(cls, model: nn.Module) -> DecodeChain | None:
        """The chain for ``model`` (its weights loaded and packed), or None
        (logged) where it is not a model the chain runs."""
        lib = load_library()
        if lib is None:
            return None
        try:
            kernels = cls._check_model(model)
            return cls(model, lib, kernels)
        except _Unfit as e:
            logger.info("decode steps run the Python forward", reason=str(e))
            return None

    @staticmethod
    def _check_model(model: nn.Module) -> Any:
        from worker_service.kernels.cpu_kernels import CpuKernels
        from worker_service.models.layers import RMSNorm
        from worker_service.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
        from worker_service.models.rope import RotaryEmbedding

        kernels = getattr(model, "kernels", None)
        if not isinstance(kernels, CpuKernels):
            raise _Unfit("not the C small ops")
        if model.dtype != torch.float32 or model.tp.enabled:
            raise _Unfit("not float32 on one rank")
        if not model.layers or getattr(model, "lm_head", None) is None:
            raise _Unfit("no layers or no LM head")
        if type(model.norm) is not RMSNorm:
            raise _Unfit("a final norm of another kind")
        rope = model.rope
        if type(rope) is not RotaryEmbedding or rope.head_dim != model.config.head_dim:
            raise _Unfit("a RoPE of another kind, or partial rotary")
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(layer) is not LlamaDecoderLayer or type(mlp) is not LlamaMLP:
                raise _Unfit(f"a {type(layer).__name__} / {type(mlp).__name__} layer")
            if type(attn).forward is not LlamaAttention.forward or type(attn).qk is not (
                LlamaAttention.qk
            ):
                raise _Unfit(f"{type(attn).__name__} attention")
            if attn.q_norm is not None or attn.sinks is not None:
                raise _Unfit("q/k norms or sinks")
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(type(n) is not RMSNorm for n in norms):
                raise _Unfit("norms of another kind")
        return kernels

    def _norm(self, norm: nn.Module) -> int:
        weight = norm.weight.detach()
        if weight.dtype != torch.float32 or not weight.is_contiguous():
            raise _Unfit("a norm weight that is not contiguous float32")
        return weight.data_ptr()

    def _linear(self, proj: nn.Module, *, column: bool) -> ChainLinear:
        out = ChainLinear()
        bias = getattr(proj, "bias", None)
        quantized = getattr(proj, "quantized", None)
        if quantized is not None:
            parts = getattr(quantized, "parts", [quantized])
            if len(parts) > MAX_PARTS:
                raise _Unfit("more fused parts than the chain takes")
            col = 0
            for i, part in enumerate(parts):
                found = _quant_weight(part)
                if found is None:
                    raise _Unfit(f"a {type(part).__name__} matrix")
                weight, code = found
                out.parts[i] = ChainPart(
                    KIND_QUANT, code, weight.data.data_ptr(), weight.out_features, col
                )
                self._keep.append(weight.data)
                col += weight.out_features
            out.nparts = len(parts)
            out.out_total = quantized.out_features
            out.in_features = quantized.in_features
            out.bias_after = 1
        else:
            packed = getattr(proj, "packed", None)
            if packed is None or packed.skinny is None or packed.kernel is None:
                raise _Unfit("a projection not packed for the C decode linear")
            if self.has_float and address(packed.kernel._lib.skinny_linear) != self._struct_skinny:
                raise _Unfit("two C decode linear builds")
            self._struct_skinny = address(packed.kernel._lib.skinny_linear)
            self._skinny_threads = packed.kernel.threads
            self.has_float = True
            out.parts[0] = ChainPart(
                KIND_FLOAT, 0, packed.skinny.data_ptr(), packed.out_features, 0
            )
            self._keep.append(packed.skinny)
            out.nparts = 1
            out.out_total = packed.out_features
            out.in_features = proj.weight.shape[1]
            # A column linear passes its bias to the C kernel, a row linear adds
            # it after the (one-rank) all-reduce: as in models/layers.py.
            out.bias_after = 0 if column else 1
        if bias is not None:
            b = bias.detach()
            if b.dtype != torch.float32 or not b.is_contiguous():
                raise _Unfit("a bias that is not contiguous float32")
            out.bias = b.data_ptr()
            self._keep.append(b)
        return out

    def _bind(self, attn: Any, kv: Any) -> bool:
        """Point the struct at this worker's attention kernel and caches (once)."""
        kernel = attn.decode_kernel
        caches = kv.layers
        key = (id(kernel), *(c.data_ptr() for c in caches))
        if self._bound == key:
            return True
        if len(caches) != len(self._model.layers) or any(
            c.dtype != torch.float32 or not c.is_contiguous() for c in caches
        ):
            return False
        m = self._struct
        if self.has_float:
            m.skinny = self._struct_skinny
            m.threads_skinny = self._skinny_threads
        found = quant_linear.team_addresses()
        if found is not None:
            m.quant = found["ql_matmul"]
        m.threads_quant = torch.get_num_threads()
        self.team_threads = 0
        if found is not None and not self.has_float:
            # Every projection is GGUF blocks: one OpenMP region for the stack.
            m.quant_row, m.quant_part = found["ql_quantize_row"], found["ql_matmul_part"]
            m.attn_range = address(kernel._fn)
            m.attn_piece = address(kernel.piece)
            m.attn_piece_floats = address(kernel.piece_floats)
            for code, block in quant_linear.block_codes().items():
                m.block_of[code] = block
            self.team_threads = torch.get_num_threads() if self._lib.decode_chain_openmp() else 1
        if kernel._parallel is not None:
            m.attn, m.attn_parallel = address(kernel._parallel), 1
        else:
            m.attn, m.attn_parallel = address(kernel._fn), 0
        m.threads_attn = kernel.threads
        spec = attn.spec
        m.page_size = spec.page_size
        m.window = spec.sliding_window or 0
        m.scale = float(spec.scale)
        for i, cache in enumerate(caches):
            self._layers[i].cache = cache.data_ptr()
        self._bound = key
        return True

    # ------------------------------------------------------------ step
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, kv: Any
    ) -> torch.Tensor | None:
        """The stack's final-normed hidden states for this step, or None where
        the step is not one the chain runs (the caller runs the Python forward)."""
        n = input_ids.shape[0]
        if self._model.lora.batch is not None:
            return None
        if type(attn) is not TorchAttention or attn.decode_kernel is None:
            return None
        layout = attn._layout
        if layout is None or layout.num_rows != n or attn._decode is not None:
            return None
        if any(t is not None for t in attn._tables) or attn.spec.logit_soft_cap is not None:
            return None
        if self.has_float and n > cpu_linear.SKINNY_MAX_ROWS:
            return None
        if not self._bind(attn, kv):
            return None
        model = self._model
        residual = model.embed_tokens(input_ids)
        if residual.dtype != torch.float32:
            return None
        residual = residual.contiguous()
        x = model.layers[0].input_layernorm(residual).contiguous()
        batch = attn._batch
        positions = positions.contiguous()
        pages, offsets = batch.write_pages.contiguous(), batch.write_offsets.contiguous()
        cos_sin = model.rope.cos_sin_cache
        if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous():
            return None
        new = x.new_empty
        scratch = {
            "qkv": new((n, self.qkv_width)),
            "q": new((n, self.heads * self.head_dim)),
            "attn_out": new((n, self.heads * self.head_dim)),
            "gate_up": new((n, 2 * self.inter)),
            "act": new((n, self.inter)),
            "tmp": new((n, self.hidden)),
        }
        acts_bytes = 0
        self._struct.team = self.team_threads if self.use_team else 0
        if self._struct.team > 0:
            acts_bytes = quant_linear.scratch_bytes(n, max(self.hidden, self.inter))
            scratch["acts"] = x.new_empty((2 * acts_bytes // 4 + 16,))
        step = ChainStep(
            rows=n,
            positions=positions.data_ptr(),
            write_pages=pages.data_ptr(),
            write_offsets=offsets.data_ptr(),
            attn_rows=layout.rows.ctypes.data,
            attn_lens=layout.lens.ctypes.data,
            attn_indptr=layout.indptr.ctypes.data,
            page_ids=layout.pages.ctypes.data,
            cos_sin=cos_sin.data_ptr(),
            x=x.data_ptr(),
            residual=residual.data_ptr(),
            acts_bytes=acts_bytes,
            **{k: v.data_ptr() for k, v in scratch.items()},
        )
        status = self._lib.decode_chain(ctypes.byref(self._struct), ctypes.byref(step))
        if status != 0:
            raise RuntimeError(f"the C decode chain failed (status {status})")
        self.steps += 1
        return x
