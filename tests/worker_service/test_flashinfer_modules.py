"""The prebuilt FlashInfer kernels as data (worker_service/attention/flashinfer_modules.py):
the default set covers every configuration the worker sends to FlashInfer (fp16 and
bf16, head dims 64/128/256, any GQA group, with and without a sliding window; bf16
at head dim 256 soft-capped, Gemma 2's), the
module names are FlashInfer's own, the names FlashInfer's real wrappers ask for in a
step are the ones ``needed_modules`` predicts, the image and the bundle build the
default set, and the worker refuses a model whose modules are neither prebuilt nor
compilable by name, before loading it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from tests.worker_service.support.attention_batches import BATCHES, make_batch, spec_for
from tests.worker_service.support.flashinfer_conformance import (
    like_the_runner,
    random_caches,
    random_qkv,
    seed,
)
from worker_service.attention.attention_choice import choose_attention
from worker_service.attention.flashinfer_backend import FlashInferAttention
from worker_service.attention.flashinfer_modules import (
    DEFAULT_DTYPES,
    DEFAULT_HEAD_DIMS,
    MANIFEST_NAME,
    OP_MODULES,
    AttentionModule,
    KernelsNotPrebuilt,
    KernelSource,
    Manifest,
    build_list,
    check_prebuilt,
    needed_modules,
    read_manifest,
)
from worker_service.config import load_config
from worker_service.device.kv_cache import KvCache
from worker_service.models.config import ModelConfig
from worker_service.worker import choose_compute

ROOT = Path(__file__).resolve().parents[2]
COMMON_HEAD_DIMS = (64, 80, 96, 128, 256)


def test_default_set_covers_every_configuration_the_worker_sends_to_flashinfer() -> None:
    built = set(build_list())
    assert {"bfloat16", "float16"} <= set(DEFAULT_DTYPES)
    asked = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for head_dim in COMMON_HEAD_DIMS:
            choice = choose_attention("auto", device_type="cuda", dtype=dtype, head_dim=head_dim)
            if choice.name != "flashinfer":
                continue
            for group in (1, 2, 3, 4, 5, 6, 8, 16):
                for window in (False, True):
                    needed = needed_modules(
                        str(dtype).removeprefix("torch."),
                        head_dim,
                        group=group,
                        sliding_window=window,
                    )
                    assert set(needed) <= built, (dtype, head_dim, group, window)
                    asked += 1
    # bf16 and fp16 at 64, 128 and 256; the rest goes to the torch backend.
    assert asked == 2 * 3 * 8 * 2
    for group in (1, 2, 4, 8):
        for window in (False, True):
            capped = needed_modules(
                "bfloat16", 256, group=group, sliding_window=window, soft_cap=True
            )
            assert set(capped) <= built
    # (decode + FA2 prefill) x window x dims x dtypes, and the soft-capped bf16 x 256
    assert len(built) == 2 * 3 * 2 * 2 + 2 * 2


def test_soft_capped_modules_follow_their_own_knobs() -> None:
    modules = build_list(["bfloat16"], [128], soft_cap_dtypes=["float16"], soft_cap_head_dims=[128])
    capped = [m for m in modules if m.soft_cap]
    assert {(m.kind, m.dtype, m.head_dim) for m in capped} == {
        ("decode", "float16", 128),
        ("prefill", "float16", 128),
    }
    assert all("use_logits_cap_True" in m.name for m in capped)
    assert not [m for m in build_list(soft_cap_head_dims=()) if m.soft_cap]


def test_unbuildable_configurations_are_refused_by_the_build_list() -> None:
    with pytest.raises(ValueError, match="float32"):
        build_list(["float32"], [128])
    with pytest.raises(ValueError, match="head dim 96"):
        build_list(["bfloat16"], [96])


def _flashinfer_uri(module: AttentionModule) -> str:
    """FlashInfer's own name for the module (what its data/aot lookup uses)."""
    modules = pytest.importorskip("flashinfer.jit.attention.modules")
    dt = getattr(torch, module.dtype)
    kv = getattr(torch, module.kv_dtype or module.dtype)
    hd = module.head_dim
    a = (dt, kv, dt, torch.int32, hd, hd, 0, module.sliding_window, module.soft_cap)
    if module.kind == "decode":
        return modules.get_batch_decode_uri(*a)
    base = modules.get_batch_prefill_uri(module.backend, *a, False)
    if module.backend == "fa3":
        return base
    return modules._get_batch_prefill_module_uri(base, "fa2", "equal", "full")


def test_module_names_are_flashinfers() -> None:
    for module in build_list(prefill_backends=("fa2", "fa3"), fp8_kv_dtypes=DEFAULT_DTYPES):
        assert module.name == _flashinfer_uri(module)


def test_fp8_kv_modules_follow_their_own_knobs() -> None:
    assert not [m for m in build_list() if m.kv_dtype]  # not in the default set (its size)
    modules = build_list(["bfloat16"], [64], fp8_kv_dtypes=["bfloat16"], fp8_kv_head_dims=[128])
    fp8 = [m for m in modules if m.kv_dtype]
    assert {(m.kind, m.dtype, m.head_dim, m.sliding_window) for m in fp8} == {
        (kind, "bfloat16", 128, window) for kind in ("decode", "prefill") for window in (0, 1)
    }
    assert all("_dtype_q_bf16_dtype_kv_e4m3_dtype_o_bf16_" in m.name for m in fp8)
    assert needed_modules("bfloat16", 128, group=2, sliding_window=True, kv_dtype="bfloat16") == (
        needed_modules("bfloat16", 128, group=2, sliding_window=True)
    )


class _Recorder:
    """Wraps the harness's module specs and notes FlashInfer's name for each
    module the real wrappers ask for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import flashinfer.decode
        import flashinfer.jit.attention.modules as m
        import flashinfer.prefill

        self.names: set[str] = set()
        prefill = flashinfer.prefill._gen_batch_prefill_primary_module
        decode = flashinfer.decode.gen_batch_decode_module

        def prefill_spec(backend: str, *args: object) -> object:
            base = m.get_batch_prefill_uri(backend, *args)
            self.names.add(m._get_batch_prefill_module_uri(base, backend, "equal", "full"))
            return prefill(backend, *args)

        def decode_spec(*args: object) -> object:
            self.names.add(m.get_batch_decode_uri(*args))
            return decode(*args)

        monkeypatch.setattr(flashinfer.prefill, "_gen_batch_prefill_primary_module", prefill_spec)
        monkeypatch.setattr(flashinfer.decode, "gen_batch_decode_module", decode_spec)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 128), (4, 2, 256)])  # groups 1, 4, 2
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("soft_cap", [None, 30.0])
@pytest.mark.parametrize("fp8_kv", [False, True])
def test_wrappers_ask_for_exactly_the_needed_modules(
    fi_cpu, monkeypatch, dtype, heads, window, soft_cap, fp8_kv
):
    recorder = _Recorder(monkeypatch)
    gen = seed("modules", dtype, heads, window)
    spec = dataclasses.replace(spec_for(heads, 16, window, dtype, "cpu"), logit_soft_cap=soft_cap)
    kv, _ = random_caches(spec, 32, gen)
    if fp8_kv:
        spec = dataclasses.replace(spec, kv_dtype=torch.float8_e4m3fn)
        kv = KvCache(
            num_layers=1, num_pages=32, page_size=16, num_kv_heads=heads[1], head_dim=heads[2],
            dtype=torch.float8_e4m3fn, device="cpu", compute_dtype=dtype,
        )  # fmt: skip
    fi = FlashInferAttention(spec, workspace_bytes=2**20)
    batch = like_the_runner(make_batch(*BATCHES["mixed"], 16, 32, gen))
    fi.begin_step(batch)
    fi.forward(0, *random_qkv(spec, batch.num_tokens, gen), kv=kv)
    needed = needed_modules(
        str(dtype).removeprefix("torch."),
        heads[2],
        group=heads[0] // heads[1],
        sliding_window=window is not None,
        soft_cap=soft_cap is not None,
        kv_dtype="float8_e4m3fn" if fp8_kv else None,
    )
    assert recorder.names == {m.name for m in needed}


# ---- the manifest and the start-time check --------------------------------------------


def _prebuilt_dir(tmp_path: Path, modules: list[AttentionModule], ops=OP_MODULES) -> Path:
    aot = tmp_path / "aot"
    for name in [m.name for m in modules] + list(ops):
        (aot / name).mkdir(parents=True)
        (aot / name / f"{name}.so").write_bytes(b"\x7fELF")
    manifest = Manifest("0.7.2.post1", "9.0a", tuple(modules), tuple(ops))
    (aot / MANIFEST_NAME).write_text(manifest.to_json())
    return aot


def test_manifest_round_trips_and_refuses_a_renamed_entry(tmp_path) -> None:
    aot = _prebuilt_dir(tmp_path, build_list())
    manifest = read_manifest(aot)
    assert manifest is not None and manifest.attention == tuple(build_list())
    assert manifest.summary() == (
        "bfloat16, float16 x head dims 64, 128, 256 for 9.0a; soft-capped bfloat16 x head dims 256"
    )
    text = (aot / MANIFEST_NAME).read_text().replace("head_dim_qk_64_", "head_dim_qk_65_", 1)
    with pytest.raises(ValueError, match="is not"):
        Manifest.from_json(text)
    (aot / MANIFEST_NAME).write_text(text)
    with pytest.raises(KernelsNotPrebuilt, match="rebuild the kernels"):
        read_manifest(aot)


def test_check_passes_what_is_prebuilt_and_names_what_is_not(tmp_path) -> None:
    # The bundle as it was: bf16, head dims 64 and 128.
    old = build_list(["bfloat16"], [64, 128])
    aot = _prebuilt_dir(tmp_path, old)
    source = KernelSource((aot,), read_manifest(aot), can_compile=False)
    check_prebuilt(
        needed_modules("bfloat16", 128, group=4, sliding_window=False), OP_MODULES, source
    )

    fp16 = needed_modules("float16", 128, group=1, sliding_window=True)
    with pytest.raises(KernelsNotPrebuilt) as refused:
        check_prebuilt(fp16, OP_MODULES, source)
    message = str(refused.value)
    for module in fp16:
        assert module.name in message and module.describe() in message
    assert "bfloat16 x head dims 64, 128 for 9.0a" in message  # what it has
    assert 'FI_DTYPES="bfloat16 float16"' in message
    assert "--attention-backend torch" in message and "--kernels torch" not in message

    heard: list[str] = []
    compiling = KernelSource((aot,), read_manifest(aot), can_compile=True)
    check_prebuilt(fp16, OP_MODULES, compiling, log=heard.append)
    assert len(heard) == 1 and fp16[0].name in heard[0]


def test_a_listed_module_whose_file_is_gone_is_missing(tmp_path) -> None:
    aot = _prebuilt_dir(tmp_path, build_list())
    needed = needed_modules("float16", 256, group=2, sliding_window=False)
    (aot / needed[1].name / f"{needed[1].name}.so").unlink()
    source = KernelSource((aot,), read_manifest(aot), can_compile=False)
    with pytest.raises(KernelsNotPrebuilt, match=needed[1].name):
        check_prebuilt(needed, OP_MODULES, source)
    # Another AOT directory (an installed flashinfer-jit-cache) may hold it.
    cache = _prebuilt_dir(tmp_path / "jit-cache", needed[1:], ops=())
    (cache / MANIFEST_NAME).unlink()
    check_prebuilt(
        needed, OP_MODULES, KernelSource((aot, cache), read_manifest(aot), can_compile=False)
    )
    # Missing op modules point at --kernels torch.
    (aot / "norm" / "norm.so").unlink()
    with pytest.raises(KernelsNotPrebuilt, match="--kernels torch"):
        check_prebuilt(needed[:1], ["norm"], source)


def _model(head_dim: int, **kw) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=4 * head_dim,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=kw.pop("num_kv_heads", 4),
        head_dim=head_dim,
        vocab_size=96,
        **kw,
    )


@pytest.fixture
def aot_dirs(monkeypatch) -> list[Path]:
    """FlashInfer's AOT directories as the worker reads them (flashinfer.jit.env),
    pointed at what a test puts there; JIT compiling off, as in the image."""
    env = pytest.importorskip("flashinfer.jit.env")
    dirs: list[Path] = []
    monkeypatch.setattr(env, "FLASHINFER_AOT_DIRS", dirs)
    monkeypatch.setenv("FLASHINFER_DISABLE_JIT", "1")
    return dirs


def test_worker_refuses_an_fp16_model_the_prebuilt_kernels_lack(tmp_path, aot_dirs) -> None:
    """The worker's start path on a CUDA device (deciding needs none) with the bundle
    as it was (bf16, head dims 64 and 128): an fp16 model is refused by name before
    any weight is read; the torch backend and kernels need nothing prebuilt."""
    aot_dirs.append(_prebuilt_dir(tmp_path, build_list(["bfloat16"], [64, 128])))
    cuda = torch.device("cuda")
    bf16 = load_config(["--device", "cuda"], env={})
    chosen = choose_compute(bf16, _model(128), tp_size=1, device=cuda, dtype=torch.bfloat16)
    assert chosen.attention == "flashinfer" and chosen.model_kernels.name == "flashinfer"
    cfg = load_config(["--device", "cuda", "--dtype", "float16"], env={})
    with pytest.raises(SystemExit) as refused:
        choose_compute(cfg, _model(128), tp_size=1, device=cuda, dtype=torch.float16)
    needed = needed_modules("float16", 128, group=1, sliding_window=False)
    assert all(m.name in str(refused.value) for m in needed)
    assert "--attention-backend torch" in str(refused.value)
    cfg = load_config(["--attention-backend", "torch", "--kernels", "torch"], env={})
    chosen = choose_compute(cfg, _model(128), tp_size=1, device=cuda, dtype=torch.float16)
    assert chosen.attention == "torch" and chosen.model_kernels.name == "torch"
    # The default set serves it.
    aot_dirs[0] = _prebuilt_dir(tmp_path / "new", build_list())
    fp16 = load_config(["--device", "cuda", "--dtype", "float16"], env={})
    chosen = choose_compute(fp16, _model(128), tp_size=1, device=cuda, dtype=torch.float16)
    assert chosen.attention == "flashinfer" and chosen.model_kernels.name == "flashinfer"


def test_worker_refuses_an_fp8_kv_cache_the_prebuilt_kernels_lack(tmp_path, aot_dirs) -> None:
    """The default set has no fp8-KV modules: --kv-cache-dtype fp8_e4m3 on CUDA is
    refused at start naming them, the knobs that build them and the way out; a
    set built with them serves it."""
    aot_dirs.append(_prebuilt_dir(tmp_path, build_list()))
    cuda = torch.device("cuda")
    cfg = load_config(["--device", "cuda", "--kv-cache-dtype", "fp8_e4m3"], env={})
    with pytest.raises(SystemExit) as refused:
        choose_compute(cfg, _model(128), tp_size=1, device=cuda, dtype=torch.bfloat16)
    message = str(refused.value)
    needed = needed_modules(
        "bfloat16", 128, group=1, sliding_window=False, kv_dtype="float8_e4m3fn"
    )
    assert len(needed) == 2 and all(m.name in message for m in needed)
    assert "fp8 e4m3 KV cache" in message
    assert 'FI_FP8KV_DTYPES="bfloat16" FI_FP8KV_HEAD_DIMS="128"' in message
    assert "--kv-cache-dtype auto" in message
    aot_dirs[0] = _prebuilt_dir(tmp_path / "fp8", build_list(fp8_kv_dtypes=["bfloat16"]))
    chosen = choose_compute(cfg, _model(128), tp_size=1, device=cuda, dtype=torch.bfloat16)
    assert chosen.attention == "flashinfer" and chosen.spec.kv_dtype == torch.float8_e4m3fn
    manifest = read_manifest(aot_dirs[0])
    assert manifest is not None and manifest.attention == tuple(
        build_list(fp8_kv_dtypes=["bfloat16"])
    )
    assert manifest.summary().endswith("; fp8 KV bfloat16 x head dims 128")


def test_worker_sends_fp32_and_head_dims_80_96_to_the_torch_backend(tmp_path, aot_dirs) -> None:
    aot_dirs.append(_prebuilt_dir(tmp_path, build_list()))
    cfg = load_config(["--device", "cuda"], env={})
    cuda = torch.device("cuda")
    cases = [(128, torch.float32), (96, torch.bfloat16), (80, torch.float16), (256, torch.float16)]
    chosen = {
        (hd, dt): choose_compute(cfg, _model(hd), tp_size=1, device=cuda, dtype=dt)
        for hd, dt in cases
    }
    assert [c.attention for c in chosen.values()] == ["torch", "torch", "torch", "flashinfer"]
    # fp32: FlashInfer's norm / RoPE / SiLU take fp16 and bf16 only; its sampling
    # filters take float32 probabilities whatever the model.
    fp32 = chosen[128, torch.float32]
    assert fp32.model_kernels.name == "torch" and fp32.sampler_kernels.name == "flashinfer"
    explicit = load_config(["--device", "cuda", "--attention-backend", "flashinfer"], env={})
    with pytest.raises(SystemExit, match="--dtype bfloat16 or float16"):
        choose_compute(explicit, _model(128), tp_size=1, device=cuda, dtype=torch.float32)
    with pytest.raises(SystemExit, match="head dim 96"):
        choose_compute(explicit, _model(96), tp_size=1, device=cuda, dtype=torch.bfloat16)
    with pytest.raises(SystemExit, match="--kernels auto or torch"):
        choose_compute(
            load_config(["--device", "cuda", "--kernels", "flashinfer"], env={}),
            _model(128),
            tp_size=1,
            device=cuda,
            dtype=torch.float32,
        )


def test_the_image_and_the_bundle_build_the_default_set() -> None:
    dockerfile = (ROOT / "docker" / "Dockerfile.cuda").read_text()
    (dtypes,) = re.findall(r'^ARG FI_DTYPES="([^"]*)"$', dockerfile, re.M)
    (dims,) = re.findall(r'^ARG FI_HEAD_DIMS="([^"]*)"$', dockerfile, re.M)
    assert tuple(dtypes.split()) == DEFAULT_DTYPES
    assert tuple(map(int, dims.split())) == DEFAULT_HEAD_DIMS
    assert re.search(r'FI_DTYPES="\$\{FI_DTYPES\}" FI_HEAD_DIMS="\$\{FI_HEAD_DIMS\}"', dockerfile)
    bundle = (ROOT / "scripts" / "build_flashinfer_bundle.sh").read_text()
    # Unset there: flashinfer_aot.py then builds flashinfer_modules.py's defaults.
    assert "export FI_HEAD_DIMS=${FI_HEAD_DIMS:-}" in bundle
    assert "export FI_DTYPES=${FI_DTYPES:-}" in bundle
