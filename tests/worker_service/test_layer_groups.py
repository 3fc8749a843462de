"""Layer groups (worker_service/attention/layer_groups.py): a model whose layers
differ in window gets one backend per group, each with its own spec; every
layer of a grouped step equals the plain softmax with that layer's window
(support/attention_reference.py), through the torch backend with and without
the CPU kernel and the FlashInfer backend on the CPU harness, at page sizes 1
and 16 on mixed batches; the worker builds the groups from ModelConfig's layer
types, keeps a single-window model on one backend, and sends sink models to
the torch backend on CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.worker_service.support.attention_batches import make_batch
from tests.worker_service.support.attention_reference import (
    Features,
    random_sinks,
    reference_attention,
)
from tests.worker_service.support.flashinfer_conformance import like_the_runner
from worker_service.attention.base import AttentionSpec
from worker_service.attention.cpu_paged_kernel import load_paged_decode
from worker_service.attention.flashinfer_modules import (
    MANIFEST_NAME,
    OP_MODULES,
    AttentionModule,
    Manifest,
    build_list,
    needed_modules,
)
from worker_service.attention.layer_groups import (
    FULL,
    SLIDING,
    GroupedAttention,
    GroupedGraphAttention,
    LayerGroups,
    group_attention,
    layer_groups,
)
from worker_service.attention.torch_backend import TorchAttention
from worker_service.config import load_config
from worker_service.device.kv_cache import KvCache
from worker_service.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from worker_service.worker import _attention, choose_compute

CPU = torch.device("cpu")
HEADS = (4, 2, 64)
WINDOW = 8
WINDOWS = [WINDOW, None, WINDOW, None]  # Gemma 2 / GPT-OSS: alternating
EXTENDS = [(40, 40), (20, 53), (3, 30)]
DECODES = [1, 9, 33, 70]


def test_groups_come_from_the_layers_windows() -> None:
    assert layer_groups([None, None]) is None
    assert layer_groups([WINDOW] * 3) is None
    groups = layer_groups(WINDOWS)
    assert groups == LayerGroups((SLIDING, FULL, SLIDING, FULL), {FULL: None, SLIDING: WINDOW})
    base = AttentionSpec(*HEADS, 16, None, torch.float32, CPU, logit_soft_cap=3.0)
    specs = groups.specs(base)
    assert specs[SLIDING] == dataclasses.replace(base, sliding_window=WINDOW)
    assert specs[FULL] == base
    with pytest.raises(ValueError, match="one window per model"):
        layer_groups([4, 8, None])


def grouped_case(page_size: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_pages = 512 // page_size
    batch = make_batch(EXTENDS, DECODES, page_size, num_pages, gen)
    kv = KvCache(
        num_layers=len(WINDOWS),
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=HEADS[1],
        head_dim=HEADS[2],
        dtype=dtype,
        device=CPU,
    )
    for layer in kv.layers:
        layer.copy_(torch.randn(layer.shape, generator=gen).to(dtype))
    t = batch.num_tokens
    qkv = [
        (torch.randn(t, h, HEADS[2], generator=gen) * s).to(dtype)
        for h, s in ((HEADS[0], 2), (HEADS[1], 1), (HEADS[1], 1))
    ]
    return batch, kv, qkv, random_sinks(HEADS[0], gen)


def check_every_layer(attn, batch, kv, qkv, sinks, features: Features, tol: float) -> None:
    attn.begin_step({FULL: batch, SLIDING: batch})
    for layer, window in enumerate(WINDOWS):
        out = attn.forward(layer, *qkv, kv=kv, sinks=sinks)
        want = dataclasses.replace(features, window=window)
        expected = reference_attention(batch, qkv[0].float(), kv, layer, features=want, sinks=sinks)
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("with_kernel", [False, True], ids=["gather", "kernel"])
@pytest.mark.parametrize("sinks", [False, True], ids=["no_sinks", "sinks"])
def test_grouped_torch_attention_equals_each_layers_reference(page_size, with_kernel, sinks):
    batch, kv, qkv, sink_logits = grouped_case(page_size, torch.float32)
    features = Features(soft_cap=5.0, scale=0.2, sinks=sinks)
    base = AttentionSpec(
        *HEADS, page_size, None, torch.float32, CPU, logit_soft_cap=5.0, softmax_scale=0.2
    )
    groups = layer_groups(WINDOWS)
    kernel = load_paged_decode(*HEADS, 1) if with_kernel else None
    backends = {g: TorchAttention(s, kernel) for g, s in groups.specs(base).items()}
    attn = group_attention(backends, groups)
    assert type(attn) is GroupedAttention  # the torch backend has no CUDA graphs
    check_every_layer(attn, batch, kv, qkv, sink_logits if sinks else None, features, 2e-5)


@pytest.mark.usefixtures("fi_cpu")
@pytest.mark.parametrize("page_size", [1, 16])
def test_grouped_flashinfer_attention_equals_each_layers_reference(page_size):
    from worker_service.attention.flashinfer_backend import FlashInferAttention

    batch, kv, qkv, _ = grouped_case(page_size, torch.bfloat16)
    batch = like_the_runner(batch)
    base = AttentionSpec(*HEADS, page_size, None, torch.bfloat16, CPU, logit_soft_cap=5.0)
    groups = layer_groups(WINDOWS)
    full = FlashInferAttention(groups.specs(base)[FULL], workspace_bytes=2**20)
    sliding = FlashInferAttention(groups.specs(base)[SLIDING], workspace=full.workspace)
    attn = group_attention({FULL: full, SLIDING: sliding}, groups)
    assert isinstance(attn, GroupedGraphAttention)
    check_every_layer(attn, batch, kv, qkv, None, Features(soft_cap=5.0), 3e-2)


def test_a_batch_for_some_groups_only_is_refused() -> None:
    batch, _, _, _ = grouped_case(16, torch.float32)
    groups = layer_groups(WINDOWS)
    base = AttentionSpec(*HEADS, 16, None, torch.float32, CPU)
    attn = group_attention({g: TorchAttention(s) for g, s in groups.specs(base).items()}, groups)
    with pytest.raises(ValueError, match="batches for"):
        attn.begin_step({FULL: batch})


# ---- the worker's choice ------------------------------------------------------------------


def _model(**kw) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=256,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=kw.pop("head_dim", 64),
        vocab_size=96,
        **kw,
    )


ALTERNATING = (SLIDING_ATTENTION, FULL_ATTENTION) * 2


def test_worker_builds_one_backend_per_group_and_one_for_a_single_window() -> None:
    cfg = load_config(["--attention-backend", "torch", "--page-size", "16"], env={})
    single = choose_compute(
        cfg, _model(sliding_window=32), tp_size=1, device=CPU, dtype=torch.float32
    )
    assert single.groups is None and single.spec.sliding_window == 32
    assert type(_attention(cfg, single)) is TorchAttention

    mcfg = _model(
        sliding_window=32, layer_types=ALTERNATING, attn_logit_softcap=50.0, attn_scale=0.1
    )
    grouped = choose_compute(cfg, mcfg, tp_size=1, device=CPU, dtype=torch.float32)
    assert grouped.groups is not None
    assert [s.sliding_window for s in grouped.specs] == [None, 32]
    assert {(s.logit_soft_cap, s.softmax_scale) for s in grouped.specs} == {(50.0, 0.1)}
    attn = _attention(cfg, grouped)
    assert isinstance(attn, GroupedAttention) and attn.name == "torch"
    assert [attn._of_layer[i].spec.sliding_window for i in range(4)] == [32, None, 32, None]


def test_worker_runs_a_sink_model_on_the_torch_backend_on_cuda() -> None:
    cfg = load_config(["--device", "cuda", "--kernels", "torch"], env={})
    mcfg = _model(sliding_window=32, layer_types=ALTERNATING, attention_sinks=True)
    cuda = torch.device("cuda")
    chosen = choose_compute(cfg, mcfg, tp_size=1, device=cuda, dtype=torch.bfloat16)
    assert chosen.attention == "torch"
    cfg = load_config(["--device", "cuda", "--attention-backend", "flashinfer"], env={})
    with pytest.raises(SystemExit, match="sinks"):
        choose_compute(cfg, mcfg, tp_size=1, device=cuda, dtype=torch.bfloat16)


def test_a_soft_capped_grouped_model_needs_each_groups_capped_modules(tmp_path, monkeypatch):
    """Gemma 2's shape on CUDA: FlashInfer, both groups' soft-capped modules
    (with and without the window) required at start, refused by name where the
    prebuilt set lacks them."""
    env = pytest.importorskip("flashinfer.jit.env")
    dirs: list = []
    monkeypatch.setattr(env, "FLASHINFER_AOT_DIRS", dirs)
    monkeypatch.setenv("FLASHINFER_DISABLE_JIT", "1")

    def prebuilt(name: str, modules: list[AttentionModule]):
        aot = tmp_path / name
        for n in [m.name for m in modules] + list(OP_MODULES):
            (aot / n).mkdir(parents=True)
            (aot / n / f"{n}.so").write_bytes(b"\x7fELF")
        manifest = Manifest("0.7.2.post1", "9.0a", tuple(modules), OP_MODULES)
        (aot / MANIFEST_NAME).write_text(manifest.to_json())
        return aot

    gemma2 = _model(
        head_dim=256, sliding_window=32, layer_types=ALTERNATING, attn_logit_softcap=50.0
    )
    cfg = load_config(["--device", "cuda"], env={})
    cuda = torch.device("cuda")
    dirs.append(prebuilt("uncapped", build_list(soft_cap_head_dims=())))
    with pytest.raises(SystemExit) as refused:
        choose_compute(cfg, gemma2, tp_size=1, device=cuda, dtype=torch.bfloat16)
    needed = {
        m.name
        for window in (False, True)
        for m in needed_modules("bfloat16", 256, group=2, sliding_window=window, soft_cap=True)
    }
    assert len(needed) == 4 and all(name in str(refused.value) for name in needed)
    assert 'FI_SOFTCAP_HEAD_DIMS="256"' in str(refused.value)
    dirs[0] = prebuilt("default", build_list())
    chosen = choose_compute(cfg, gemma2, tp_size=1, device=cuda, dtype=torch.bfloat16)
    assert chosen.attention == "flashinfer" and chosen.groups is not None
