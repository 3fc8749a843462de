"""FlashInfer's kernel modules as data: which ones a model needs, which ones the
prebuilt set holds (the manifest the AOT build writes beside them), and the check
the worker runs at start against it.

FlashInfer compiles one module per attention configuration (dtype, head dim,
sliding window or not, logit soft cap or not, kernel) and looks for it in
``flashinfer/data/aot/<name>/`` before compiling. Where it may not compile
(``FLASHINFER_DISABLE_JIT``: the CUDA image and the offline bundle, which carry
no compiler) a missing module fails at its first use, which is decode graph
capture at start, with a message that names neither the model's setting nor a
way out. ``check_prebuilt`` refuses such a
configuration before the weights are loaded, naming the missing modules and what
to do.

What runs where (flashinfer_backend.py): prefill is the FA2 prefill module;
decode is FlashInfer's CUDA-core decode module for GQA groups below
``TENSOR_CORE_DECODE_GROUP`` and the FA2 prefill module on tensor cores from it
on. FlashInfer's FA2 kernels are right for head dims that are multiples of 64 only
(FA2 prefill: 80 or 96 give an illegal memory access, flashinfer-ai/flashinfer#4299;
the CUDA-core decode kernel reduces over HEAD_DIM / 8 lanes with a power-of-two
shuffle tree, wrong for 10 or 12 lanes), and have no fp32 (attention_choice.py picks
the torch backend for those). 512 is left out of the prebuilt set for its size.

Soft-capped modules (``use_logits_cap_True``) are built only where a served
model soft-caps its attention logits: Gemma 2, bf16 (its trained dtype; fp16
overflows its activations) at head dim 256 (2B and 9B; 27B's 128 is a build
knob away: FI_SOFTCAP_HEAD_DIMS), with and without its sliding window: four
modules, about 4.8 MiB.

FP8 KV-cache modules (``kv_dtype`` e4m3: --kv-cache-dtype fp8_e4m3, bf16 or
fp16 queries and output; FlashInfer's FA2 templates take a KV dtype apart from
the query's, and only fp8 queries need its FA3 fp8 path) are a module per (query
dtype, head dim, window) like the others, decode and FA2 prefill: four per head
dim. They are not in the default set: estimated at their float twins' sizes
(unmeasured: no GPU in the session that added them) one head dim adds about
2 x (0.45 + 1.9) = 4.7 MiB, past the bundle's 64 MiB next to the default set's
61.5; ``FI_FP8KV_DTYPES="bfloat16" FI_FP8KV_HEAD_DIMS="128"`` builds them (the
CUDA image has the room), and a worker that needs them where they are neither
prebuilt nor compilable is refused at start by name with that fix.

Sizes (sm_90a, CUDA 13.0 nvcc, built here): a decode module 0.45 MiB, an FA2
prefill module 1.7-1.95 MiB, whatever the head dim; the default set adds about
18.7 MiB to the bundle, about 57 of its 64 MiB, and the soft-capped four about
4.8 more, about 61.5 (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

# What the worker's FlashInfer paths can run, and the prebuilt set by default.
FLASHINFER_DTYPES = ("bfloat16", "float16")
FLASHINFER_HEAD_DIMS = (64, 128, 256)
DEFAULT_DTYPES = FLASHINFER_DTYPES
DEFAULT_HEAD_DIMS = FLASHINFER_HEAD_DIMS
# The soft-capped modules' dtypes and head dims (module docstring: Gemma 2).
DEFAULT_SOFTCAP_DTYPES = ("bfloat16",)
DEFAULT_SOFTCAP_HEAD_DIMS = (256,)
# FlashInferKernels' modules: one each, every dtype and head dim inside; the
# model's ops, and the sampler's filters.
MODEL_OP_MODULES = ("norm", "rope", "silu_and_mul")
# GeGLU (Gemma's MLP activation): built beside them, needed only by a model
# whose hidden_act is gelu_pytorch_tanh (model_op_modules).
GEGLU_OP_MODULE = "gelu_tanh_and_mul"
SAMPLER_OP_MODULES = ("sampling",)
OP_MODULES = (*MODEL_OP_MODULES, GEGLU_OP_MODULE, *SAMPLER_OP_MODULES)


def model_op_modules(hidden_act: str) -> tuple[str, ...]:
    """The FlashInferKernels modules a model with this MLP activation loads."""
    if hidden_act == "gelu_pytorch_tanh":
        return ("norm", "rope", GEGLU_OP_MODULE)
    return MODEL_OP_MODULES


# Decode on tensor cores (the FA2 prefill kernel at q_len 1) from this GQA group
# on: it pays off for wide groups, and the CUDA-core kernel only has groups
# 1, 2, 3, 4, 6, 8 and 16.
TENSOR_CORE_DECODE_GROUP = 4
MANIFEST_NAME = "radixserve_kernels.json"
BUNDLE_LIMIT_MIB = 64  # what a device run carries (Makefile's fi-bundle)

_DTYPE_TAGS = {"bfloat16": "bf16", "float16": "f16"}
# FP8 KV caches (--kv-cache-dtype fp8_e4m3): the modules' KV dtype, FlashInfer's tag.
FP8_KV_DTYPE = "float8_e4m3fn"
_KV_DTYPE_TAGS = _DTYPE_TAGS | {FP8_KV_DTYPE: "e4m3"}
# Not in the default set: the bundle has no room (module docstring); FI_FP8KV_DTYPES
# and FI_FP8KV_HEAD_DIMS build them.
DEFAULT_FP8KV_DTYPES: tuple[str, ...] = ()
DEFAULT_FP8KV_HEAD_DIMS: tuple[int, ...] = (128,)


@dataclass(frozen=True, order=True)
class AttentionModule:
    """One FlashInfer attention module: ``kind`` "decode" (the CUDA-core decode
    kernel) or "prefill" (``backend`` fa2: prefill and tensor-core decode; fa3:
    Hopper prefill, only built when asked for)."""

    kind: str
    dtype: str
    head_dim: int
    sliding_window: bool
    backend: str = "fa2"
    soft_cap: bool = False  # built for a logit soft cap (FlashInfer's use_logits_soft_cap)
    kv_dtype: str | None = None  # what the pages hold (None: ``dtype``; FP8_KV_DTYPE)

    @property
    def name(self) -> str:
        """FlashInfer's module name (its URI; tests pin it against FlashInfer's)."""
        t = _DTYPE_TAGS[self.dtype]
        kv = _KV_DTYPE_TAGS[self.kv_dtype or self.dtype]
        body = (
            f"dtype_q_{t}_dtype_kv_{kv}_dtype_o_{t}_dtype_idx_i32_"
            f"head_dim_qk_{self.head_dim}_head_dim_vo_{self.head_dim}_posenc_0_"
            f"use_swa_{self.sliding_window}_use_logits_cap_{self.soft_cap}"
        )
        if self.kind == "decode":
            return f"batch_decode_with_kv_cache_{body}"
        suffix = "_sm90" if self.backend == "fa3" else "_kv_stride_equal"
        return f"batch_prefill_with_kv_cache_{body}_f16qk_False{suffix}"

    def describe(self) -> str:
        kernel = "decode" if self.kind == "decode" else f"prefill {self.backend}"
        window = ", sliding window" if self.sliding_window else ""
        cap = ", logit soft cap" if self.soft_cap else ""
        fp8 = ", fp8 e4m3 KV cache" if self.kv_dtype else ""
        return f"{self.dtype} head dim {self.head_dim}{window}{cap}{fp8} ({kernel})"


def needed_modules(
    dtype: str,
    head_dim: int,
    *,
    group: int,
    sliding_window: bool,
    soft_cap: bool = False,
    kv_dtype: str | None = None,
) -> list[AttentionModule]:
    """The attention modules FlashInferAttention loads for one spec (per rank;
    a model with layer groups needs each group's); ``kv_dtype``: the pages'
    dtype where it is not ``dtype`` (an fp8 KV cache)."""
    kv = None if kv_dtype in (None, dtype) else kv_dtype
    kinds = ["prefill"] + (["decode"] if group < TENSOR_CORE_DECODE_GROUP else [])
    return [
        AttentionModule(kind, dtype, head_dim, sliding_window, soft_cap=soft_cap, kv_dtype=kv)
        for kind in kinds
    ]


def build_list(
    dtypes: Iterable[str] = DEFAULT_DTYPES,
    head_dims: Iterable[int] = DEFAULT_HEAD_DIMS,
    prefill_backends: Iterable[str] = ("fa2",),
    *,
    soft_cap_dtypes: Iterable[str] = DEFAULT_SOFTCAP_DTYPES,
    soft_cap_head_dims: Iterable[int] = DEFAULT_SOFTCAP_HEAD_DIMS,
    fp8_kv_dtypes: Iterable[str] = DEFAULT_FP8KV_DTYPES,
    fp8_kv_head_dims: Iterable[int] = DEFAULT_FP8KV_HEAD_DIMS,
) -> list[AttentionModule]:
    """The attention modules a prebuilt set holds: for every dtype and head dim,
    with and without a sliding window, the decode and FA2 prefill modules (every
    GQA group: both are needed by some), plus FA3 prefill if asked for; then the
    same (FA2 only) soft-capped for the soft-cap dtypes and head dims; then
    decode and FA2 prefill over an fp8 e4m3 KV cache for the fp8-KV query
    dtypes and head dims, window or not (none by default)."""
    backends = tuple(prefill_backends)
    if "fa2" not in backends:
        raise ValueError("the FA2 prefill modules are always needed (decode on tensor cores)")
    modules = []
    for dtype, head_dim in _checked(dtypes, head_dims):
        for window in (False, True):
            modules.append(AttentionModule("decode", dtype, head_dim, window))
            modules += [AttentionModule("prefill", dtype, head_dim, window, b) for b in backends]
    for dtype, head_dim in _checked(soft_cap_dtypes, soft_cap_head_dims):
        for window in (False, True):
            modules += [
                AttentionModule(kind, dtype, head_dim, window, soft_cap=True)
                for kind in ("decode", "prefill")
            ]
    for dtype, head_dim in _checked(fp8_kv_dtypes, fp8_kv_head_dims):
        for window in (False, True):
            modules += [
                AttentionModule(kind, dtype, head_dim, window, kv_dtype=FP8_KV_DTYPE)
                for kind in ("decode", "prefill")
            ]
    return modules


def _checked(dtypes: Iterable[str], head_dims: Iterable[int]) -> list[tuple[str, int]]:
    dims = tuple(head_dims)
    pairs = []
    for dtype in dtypes:
        if dtype not in _DTYPE_TAGS:
            raise ValueError(f"FlashInfer has no {dtype} attention kernels ({FLASHINFER_DTYPES})")
        for head_dim in dims:
            if head_dim not in FLASHINFER_HEAD_DIMS:
                raise ValueError(
                    f"head dim {head_dim}: FlashInfer's FA2 kernels take {FLASHINFER_HEAD_DIMS}"
                )
            pairs.append((dtype, head_dim))
    return pairs


@dataclass(frozen=True)
class Manifest:
    """What a prebuilt set holds (written by scripts/flashinfer_aot.py as
    ``<aot dir>/radixserve_kernels.json``)."""

    flashinfer: str
    cuda_arch: str
    attention: tuple[AttentionModule, ...]
    ops: tuple[str, ...]

    def names(self) -> set[str]:
        return {m.name for m in self.attention} | set(self.ops)

    def summary(self) -> str:
        plain = [m for m in self.attention if not m.soft_cap and not m.kv_dtype]
        capped = [m for m in self.attention if m.soft_cap]
        fp8 = [m for m in self.attention if m.kv_dtype]
        text = f"{_shapes(plain)} for {self.cuda_arch}"
        text += f"; soft-capped {_shapes(capped)}" if capped else ""
        return text + (f"; fp8 KV {_shapes(fp8)}" if fp8 else "")

    def to_json(self) -> str:
        data = {
            "flashinfer": self.flashinfer,
            "cuda_arch": self.cuda_arch,
            "attention": [asdict(m) | {"name": m.name} for m in self.attention],
            "ops": list(self.ops),
        }
        return json.dumps(data, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        attention = []
        for entry in data["attention"]:
            module = AttentionModule(
                entry["kind"],
                entry["dtype"],
                int(entry["head_dim"]),
                bool(entry["sliding_window"]),
                entry.get("backend", "fa2"),
                bool(entry.get("soft_cap", False)),
                entry.get("kv_dtype"),
            )
            if entry.get("name", module.name) != module.name:
                raise ValueError(f"manifest entry {entry['name']} is not {module.name}")
            attention.append(module)
        return cls(data["flashinfer"], data["cuda_arch"], tuple(attention), tuple(data["ops"]))


def _shapes(modules: Sequence[AttentionModule]) -> str:
    dtypes = sorted({m.dtype for m in modules})
    dims = sorted({m.head_dim for m in modules})
    return f"{', '.join(dtypes) or 'no dtypes'} x head dims {', '.join(map(str, dims)) or 'none'}"


@dataclass(frozen=True)
class KernelSource:
    """Where FlashInfer finds kernels on this machine."""

    aot_dirs: tuple[Path, ...]
    manifest: Manifest | None  # the first AOT dir's, if it has one
    can_compile: bool  # JIT not disabled and nvcc present

    def has(self, name: str) -> bool:
        return any((d / name / f"{name}.so").is_file() for d in self.aot_dirs)


def read_manifest(aot_dir: Path) -> Manifest | None:
    path = aot_dir / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        return Manifest.from_json(path.read_text())
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise KernelsNotPrebuilt(
            f"{path} is not a kernel manifest ({e}): rebuild the kernels"
        ) from None


def can_jit_compile(env: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """FlashInfer compiles a missing module unless FLASHINFER_DISABLE_JIT is set
    (to anything: it tests the string), with nvcc from PATH or CUDA_HOME."""
    if env.get("FLASHINFER_DISABLE_JIT"):
        return False
    cuda_home = Path(env.get("CUDA_HOME") or env.get("CUDA_PATH") or "/usr/local/cuda")
    return shutil.which("nvcc") is not None or (cuda_home / "bin" / "nvcc").is_file()


def flashinfer_kernel_source() -> KernelSource:
    """This machine's: FlashInfer's AOT directories (the package's data/aot first)."""
    from flashinfer.jit import env

    dirs = tuple(Path(d) for d in env.FLASHINFER_AOT_DIRS)
    return KernelSource(dirs, read_manifest(dirs[0]) if dirs else None, can_jit_compile())


class KernelsNotPrebuilt(SystemExit):
    """The worker stops at start: a module it needs is neither prebuilt nor compilable."""


def check_prebuilt(
    attention: Sequence[AttentionModule],
    ops: Sequence[str],
    source: KernelSource,
    *,
    log: Callable[[str], None] | None = None,
) -> None:
    """Refuse (``KernelsNotPrebuilt``) when a needed module is missing and cannot be
    compiled; ``log`` hears when missing ones will be compiled at first use."""
    missing_attention = [m for m in attention if not _prebuilt(m.name, source)]
    missing_ops = [name for name in ops if not _prebuilt(name, source)]
    if not (missing_attention or missing_ops):
        return
    names = [m.name for m in missing_attention] + missing_ops
    if source.can_compile:
        if log is not None:
            log(f"FlashInfer compiles at first use (minutes each): {', '.join(names)}")
        return
    where = ", ".join(str(d) for d in source.aot_dirs)
    has = source.manifest.summary() if source.manifest else "no radixserve manifest"
    lines = [f"FlashInfer kernels this model needs are not prebuilt in {where} ({has})"]
    lines.append("and cannot be compiled here (FLASHINFER_DISABLE_JIT is set or there is no nvcc):")
    lines += [f"  {m.describe()}: {m.name}" for m in missing_attention]
    lines += [f"  {name} (FlashInfer's {name} kernels)" for name in missing_ops]
    fixes = []
    if missing_attention:
        plain = [m for m in missing_attention if not m.soft_cap and not m.kv_dtype]
        capped = [m for m in missing_attention if m.soft_cap]
        fp8 = [m for m in missing_attention if m.kv_dtype]
        knobs = []
        if plain:
            dtypes = " ".join(sorted({m.dtype for m in plain} | set(DEFAULT_DTYPES)))
            dims = sorted({m.head_dim for m in plain} | set(DEFAULT_HEAD_DIMS))
            knobs.append(f'FI_DTYPES="{dtypes}" FI_HEAD_DIMS="{" ".join(map(str, dims))}"')
        if capped:
            dtypes = " ".join(sorted({m.dtype for m in capped} | set(DEFAULT_SOFTCAP_DTYPES)))
            dims = sorted({m.head_dim for m in capped} | set(DEFAULT_SOFTCAP_HEAD_DIMS))
            knobs.append(
                f'FI_SOFTCAP_DTYPES="{dtypes}" FI_SOFTCAP_HEAD_DIMS="{" ".join(map(str, dims))}"'
            )
        if fp8:
            dtypes = " ".join(sorted({m.dtype for m in fp8} | set(DEFAULT_FP8KV_DTYPES)))
            dims = sorted({m.head_dim for m in fp8} | set(DEFAULT_FP8KV_HEAD_DIMS))
            knobs.append(
                f'FI_FP8KV_DTYPES="{dtypes}" FI_FP8KV_HEAD_DIMS="{" ".join(map(str, dims))}"'
            )
        fixes.append(
            f"rebuild the kernels with {' '.join(knobs)} "
            "(scripts/build_flashinfer_bundle.sh, or docker/Dockerfile.cuda's build args)"
        )
        if fp8:
            fixes.append("start with --kv-cache-dtype auto")
        fixes.append("start with --attention-backend torch (slower; no CUDA graphs)")
    if missing_ops:
        fixes.append("start with --kernels torch")
    lines.append("Either " + "; or ".join(fixes) + ".")
    raise KernelsNotPrebuilt("\n".join(lines))


def _prebuilt(name: str, source: KernelSource) -> bool:
    """Listed in the manifest with its file beside it, or in another AOT directory
    (an installed flashinfer-jit-cache); without a manifest, anywhere on disk."""
    files = [d / name / f"{name}.so" for d in source.aot_dirs]
    if source.manifest is None or not files:
        return any(f.is_file() for f in files)
    listed = name in source.manifest.names() and files[0].is_file()
    return listed or any(f.is_file() for f in files[1:])
