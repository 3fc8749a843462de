"""The fp8 KV cache (--kv-cache-dtype fp8_e4m3) on the CPU: the quantize and
dequantize rules (saturation at +-448, the per-layer scales), the page pools
sized at 1 byte an element (one pool and the sliding-window split), the torch
attention backend over an fp8 cache (exactly the float path over the
dequantized values; within a stated tolerance of the unquantized cache), the
checkpoint's KV scales read into a real worker and applied, and unsupported
values refused by name."""

from __future__ import annotations

import zlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.worker_service.support.attention_batches import BATCHES, make_batch, spec_for
from tests.worker_service.support.tiny_hf_models import tiny_model
from tests.worker_service.support.worker_factory import worker_for
from worker_service.attention.torch_backend import TorchAttention
from worker_service.config import WorkerConfig, load_config
from worker_service.device.distributed import TensorParallel
from worker_service.device.kv_cache import KvCache
from worker_service.device.kv_quant import (
    FP8_E4M3,
    KV_CACHE_DTYPES,
    KvScaleReader,
    KvScales,
    dequantize_fp8,
    kv_storage_dtype,
    quantize_fp8,
)
from worker_service.device.kv_sizing import size_kv_pools

# ---- the rules -------------------------------------------------------------------------


def test_quantize_saturates_and_rounds_to_e4m3() -> None:
    x = torch.tensor([1000.0, -1000.0, 448.0, 464.0, 0.3, 1.0, -2.75, 0.0])
    stored = quantize_fp8(x, 1.0)
    assert stored.dtype == torch.float8_e4m3fn
    # 464 lies halfway between 448 and e4m3's next step (480, NaN in the fn
    # variant): saturated, not NaN; 0.3 rounds to the nearest e4m3, 0.3125.
    assert stored.float().tolist() == [448.0, -448.0, 448.0, 448.0, 0.3125, 1.0, -2.75, 0.0]
    assert not torch.isnan(quantize_fp8(torch.tensor([1e30, float("inf")]), 1.0).float()).any()


def test_scales_divide_on_store_and_multiply_on_read() -> None:
    x = torch.tensor([3.0, 1000.0, -0.3])
    stored = quantize_fp8(x, 2.0)
    assert stored.float().tolist() == [1.5, 448.0, -0.15625]
    assert dequantize_fp8(stored, 2.0, torch.float32).tolist() == [3.0, 896.0, -0.3125]
    assert dequantize_fp8(stored, 2.0, torch.bfloat16).dtype == torch.bfloat16
    # Within e4m3's half step (2^-4 relative) in its normal, unsaturated range.
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(4096, generator=gen) * 50
    back = dequantize_fp8(quantize_fp8(y, 0.25), 0.25, torch.float32)
    normal = (y.abs() > 2**-6 * 0.25) & (y.abs() <= 448 * 0.25)
    assert normal.sum() > 3000
    assert ((back - y).abs()[normal] <= y.abs()[normal] * 2**-4).all()


def test_unsupported_kv_cache_dtypes_are_refused_by_name() -> None:
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("fp8_e4m3", torch.float32) == FP8_E4M3
    for name in ("fp8_e5m2", "int8", "fp8"):
        with pytest.raises(SystemExit, match=f"--kv-cache-dtype {name} is not implemented"):
            kv_storage_dtype(name, torch.float32)
    # The flag takes exactly the implemented values.
    assert load_config(["--kv-cache-dtype", "fp8_e4m3"], env={}).kv_cache_dtype == "fp8_e4m3"
    assert load_config([], env={}).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        load_config(["--kv-cache-dtype", "fp8_e5m2"], env={})
    (spec,) = WorkerConfig.__dataclass_fields__["kv_cache_dtype"].metadata.values()
    assert tuple(spec.choices) == KV_CACHE_DTYPES


# ---- the pools -------------------------------------------------------------------------


def _pools(dtype: torch.dtype, windows: list[int | None]):
    return size_kv_pools(
        windows,
        max_context=4096,
        swa_memory=True,
        swa_ratio=0.5,
        num_pages=None,
        kv_memory="64MiB",
        page_size=16,
        num_kv_heads=2,
        head_dim=64,
        dtype=dtype,
        tp=TensorParallel(),
        device=torch.device("cpu"),
    )


def test_a_budget_holds_2x_the_bf16_pages_and_4x_the_fp32_pages_in_fp8() -> None:
    one_pool = [None] * 4
    fp8, bf16, fp32 = (_pools(d, one_pool) for d in (FP8_E4M3, torch.bfloat16, torch.float32))
    # 64 MiB / (4 layers x 2 x 16 x 2 x 64 elements) at 1, 2 and 4 bytes.
    assert (fp8.num_pages, bf16.num_pages, fp32.num_pages) == (4096, 2048, 1024)
    split = [None, 8, 8, 8]  # three sliding layers, window 8: two pools
    fp8, bf16 = _pools(FP8_E4M3, split), _pools(torch.bfloat16, split)
    assert fp8.num_swa_pages and fp8.swa_layers == bf16.swa_layers
    # 64 MiB / (4096 B x (1 full + 0.5 x 3 sliding layers)) pages; bf16: 8192 B.
    assert (fp8.num_pages, fp8.num_swa_pages) == (6553, 3276)
    assert (bf16.num_pages, bf16.num_swa_pages) == (3276, 1638)
    assert (
        KvCache.bytes_per_page(
            num_layers=1, page_size=16, num_kv_heads=2, head_dim=64, dtype=FP8_E4M3
        )
        == 16 * 2 * 2 * 64
    )


def test_the_cache_stores_fp8_and_reads_back_dequantized() -> None:
    scales = KvScales((0.5, 4.0), (2.0, 0.25), "checkpoint")
    kv = KvCache(
        num_layers=2, num_pages=4, page_size=4, num_kv_heads=2, head_dim=8,
        dtype=FP8_E4M3, device="cpu", compute_dtype=torch.float32, scales=scales,
    )  # fmt: skip
    assert all(t.dtype == FP8_E4M3 for t in kv.layers) and kv.quantized
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(6, 2, 8, generator=gen) * 9, torch.randn(6, 2, 8, generator=gen)
    pages, offsets = torch.tensor([2, 2, 2, 2, 0, 0]), torch.tensor([0, 1, 2, 3, 0, 1])
    kv.write(1, k, v, pages=pages, offsets=offsets)
    assert torch.equal(kv.layers[1][pages, 0, offsets].float(), quantize_fp8(k, 4.0).float())
    keys, values = kv.read(1, torch.tensor([2, 0]), 6)
    assert keys.dtype == torch.float32
    assert torch.equal(keys, dequantize_fp8(quantize_fp8(k, 4.0), 4.0, torch.float32))
    assert torch.equal(values, dequantize_fp8(quantize_fp8(v, 0.25), 0.25, torch.float32))


# ---- the torch backend -----------------------------------------------------------------

# fp8 KV vs the unquantized cache on N(0, 1) keys and values: e4m3 keeps 3
# mantissa bits (2^-4 relative rounding); an output over few keys averages
# little of it. Measured over these six cases: max |diff| 0.137, mean 0.011.
FP8_ATTENTION_MAX, FP8_ATTENTION_MEAN = 0.25, 0.02


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("window", [None, 24])
def test_torch_attention_over_fp8_is_the_float_path_over_its_values(kind, window) -> None:
    heads, page_size, num_pages = (8, 2, 64), 16, 32
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind} {window}".encode()))
    spec = spec_for(heads, page_size, window, torch.float32, "cpu")
    fp8_spec = spec_for(heads, page_size, window, torch.float32, "cpu")
    fp8_spec = type(spec)(**{**fp8_spec.__dict__, "kv_dtype": FP8_E4M3})
    shape = dict(
        num_layers=1, num_pages=num_pages, page_size=page_size, num_kv_heads=2, head_dim=64
    )
    scales = KvScales((1.5,), (0.75,))
    fp8 = KvCache(**shape, dtype=FP8_E4M3, device="cpu", compute_dtype=torch.float32, scales=scales)
    exact, dequantized = (KvCache(**shape, dtype=torch.float32, device="cpu") for _ in "ab")
    for cache in (fp8.layers[0], exact.layers[0]):
        cache.zero_()
    history = torch.randn(exact.layers[0].shape, generator=gen)
    exact.layers[0].copy_(history)
    fp8.layers[0][:, 0] = quantize_fp8(history[:, 0], 1.5)
    fp8.layers[0][:, 1] = quantize_fp8(history[:, 1], 0.75)
    batch = make_batch(*BATCHES[kind], page_size, num_pages, gen)
    q = torch.randn(batch.num_tokens, 8, 64, generator=gen)
    k, v = (
        torch.randn(batch.num_tokens, 2, 64, generator=gen),
        torch.randn(batch.num_tokens, 2, 64, generator=gen),
    )
    outs = []
    for attn_spec, kv in ((fp8_spec, fp8), (spec, exact)):
        attn = TorchAttention(attn_spec)
        attn.begin_step(batch)
        outs.append(attn.forward(0, q, k, v, kv=kv))
    # The same float path over the fp8 cache's values, written after this step.
    dequantized.layers[0][:, 0] = dequantize_fp8(fp8.layers[0][:, 0], 1.5, torch.float32)
    dequantized.layers[0][:, 1] = dequantize_fp8(fp8.layers[0][:, 1], 0.75, torch.float32)
    attn = TorchAttention(spec)
    attn.begin_step(batch)
    # Writing k, v again into the float copy stores what the fp8 step stored only if
    # they are its dequantized values.
    k_read = dequantize_fp8(quantize_fp8(k, 1.5), 1.5, torch.float32)
    v_read = dequantize_fp8(quantize_fp8(v, 0.75), 0.75, torch.float32)
    again = attn.forward(0, q, k_read, v_read, kv=dequantized)
    torch.testing.assert_close(outs[0], again, rtol=1e-6, atol=1e-6)
    diff = (outs[0] - outs[1]).abs()
    assert diff.max() <= FP8_ATTENTION_MAX and diff.mean() <= FP8_ATTENTION_MEAN
    assert not torch.equal(outs[0], outs[1])  # quantized indeed


# ---- checkpoint scales in a real worker --------------------------------------------------

K_SCALES, V_SCALES = (0.5, 2.0), (0.25, 3.0)


@pytest.fixture(scope="module")
def scaled_checkpoint(tmp_path_factory):
    """A tiny Llama checkpoint carrying per-layer k_scale / v_scale tensors."""
    path = tmp_path_factory.mktemp("scaled")
    tiny_model("llama2-linear-rope", path)
    tensors = load_file(path / "model.safetensors")
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(K_SCALES[i])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(V_SCALES[i])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_a_worker_reads_the_checkpoints_kv_scales_and_applies_them(scaled_checkpoint) -> None:
    worker = worker_for(
        scaled_checkpoint, kv_cache_dtype="fp8_e4m3", num_pages=None, kv_memory="4MiB"
    )
    kv = worker.runner.compute.kv
    assert kv.scales == KvScales(K_SCALES, V_SCALES, "checkpoint")
    assert kv.dtype == FP8_E4M3 and kv.compute_dtype == torch.float32
    assert worker.runner.compute.attn.decode_kernel is not None  # it reads e4m3 pages
    gen = torch.Generator().manual_seed(2)
    k, v = (
        torch.randn(3, kv.num_kv_heads, kv.head_dim, generator=gen),
        torch.randn(3, kv.num_kv_heads, kv.head_dim, generator=gen),
    )
    pages, offsets = torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0])
    kv.write(1, k, v, pages=pages, offsets=offsets)
    assert torch.equal(kv.layers[1][pages, 0, offsets].float(), (k / 2.0).to(FP8_E4M3).float())
    assert torch.equal(kv.layers[1][pages, 1, offsets].float(), (v / 3.0).to(FP8_E4M3).float())
    # The same budget in float32 pages: a quarter as many; each cache within the
    # budget but for its CUDA-graph scratch page.
    auto = worker_for(scaled_checkpoint, num_pages=None, kv_memory="4MiB")
    assert auto.runner.compute.kv.dtype == torch.float32  # the scales do not stop it loading
    assert (worker.num_pages, auto.num_pages) == (2048, 512)
    fp32_page = 2 * 2 * 16 * 2 * 16 * 4  # layers x k/v x page x kv heads x head dim x bytes
    assert worker.kv_cache_bytes == 2049 * fp32_page // 4
    assert auto.kv_cache_bytes == 513 * fp32_page


def test_scales_read_under_each_checkpoint_naming() -> None:
    reader = KvScaleReader()
    stream = [
        ("model.layers.0.self_attn.k_proj.output_scale", torch.tensor([0.5])),  # compressed-tensors
        ("model.layers.0.self_attn.v_proj.output_scale", torch.tensor([0.25])),
        ("model.layers.1.self_attn.kv_scale", torch.tensor(2.0)),  # older: one for both
        ("model.layers.2.self_attn.attn.k_scale", torch.tensor(4.0)),
        ("model.layers.0.self_attn.k_proj.weight", torch.zeros(2, 2)),
    ]
    kept = [name for name, _ in reader.filter(stream)]
    assert kept == ["model.layers.0.self_attn.k_proj.weight"]
    assert reader.scales(3) == KvScales((0.5, 2.0, 4.0), (0.25, 2.0, 1.0), "checkpoint")
    assert KvScaleReader().scales(2) == KvScales((1.0, 1.0), (1.0, 1.0), "default")
    with pytest.raises(SystemExit, match="not a positive number"):
        list(KvScaleReader().filter([("layers.0.self_attn.k_scale", torch.tensor(0.0))]))


def test_a_sliding_window_worker_gets_both_pools_4x_in_fp8(tmp_path) -> None:
    """A float32 model's two pools (every layer sliding: the sliding pool takes
    the budget, the full pool is its bookkeeping at 1 / ratio) from one budget."""
    tiny_model("mistral-sliding", tmp_path)
    kw = {"num_pages": None, "kv_memory": "3MiB", "swa_full_tokens_ratio": 0.5}
    fp8 = worker_for(tmp_path, kv_cache_dtype="fp8_e4m3", **kw)
    auto = worker_for(tmp_path, **kw)
    # fp32: 3 MiB / (0.5 x 3 layers x (2 x 16 x 2 kv heads x 16) x 4 bytes) = 512 full pages.
    assert (auto.num_pages, auto.num_swa_pages) == (512, 256)
    assert (fp8.num_pages, fp8.num_swa_pages) == (2048, 1024)
    assert fp8.runner.compute.kv.dtype == FP8_E4M3
