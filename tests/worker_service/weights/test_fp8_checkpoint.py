"""FP8 checkpoints: which quantization_configs start (and as what), which
are refused at start by name, the scale tensors' shape checks at load, and
the cuts tensor parallelism and fused projections make to FP8 weights and
their scales (each cut dequantizes to the same cut of the whole)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.worker_service.support.fp8_checkpoints import (
    FORMS,
    compressed_tensors,
    rewrite,
    write_fp8_checkpoint,
)
from tests.worker_service.support.fp8_quant import quantize
from worker_service.device.distributed import TensorParallel
from worker_service.models import fp8_linear
from worker_service.models.config import UnsupportedModelError
from worker_service.models.fp8_linear import Fp8Matrix, Fp8Tensor
from worker_service.models.layers import FusedColumnLinear, RowLinear
from worker_service.models.quantized import QuantizedTensor, fuse_rows
from worker_service.weights import open_model
from worker_service.weights.fp8_checkpoint import placed
from worker_service.weights.fp8_scheme import Fp8Scheme, read_scheme

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
}
QWEN3_MOE = LLAMA | {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "head_dim": 16,
    "norm_topk_prob": True,
}


def config_dir(tmp_path: Path, cfg: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize(
    ("form", "scheme"),
    [
        ("fp8-block", Fp8Scheme("fp8", "block", "dynamic")),
        ("fp8-tensor", Fp8Scheme("fp8", "tensor", "dynamic")),
        ("fp8-tensor-static", Fp8Scheme("fp8", "tensor", "static")),
        ("fbgemm-channel", Fp8Scheme("fbgemm_fp8", "channel", "dynamic", 1200.0)),
        ("ct-channel", Fp8Scheme("compressed-tensors", "channel", "dynamic")),
        ("ct-tensor-static", Fp8Scheme("compressed-tensors", "tensor", "static")),
    ],
)
def test_supported_forms_are_read_as_their_scheme(form, scheme):
    assert read_scheme(FORMS[form].quantization_config) == scheme


def ct(**change) -> dict:
    cfg = compressed_tensors("channel", static=False)
    group = cfg["config_groups"]["group_0"]
    for key, value in change.items():
        if key in ("weights", "input_activations"):
            group[key] = None if value is None else group[key] | value
        else:
            cfg[key] = value
    return cfg


REFUSED = [
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "mxfp4"}, "'mxfp4'"),
    ({"quant_method": "something-new"}, "'something-new'"),
    ({"load_in_8bit": True}, "quant_method None"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
    ({"quant_method": "fp8", "weight_block_size": [1, 128]}, r"weight_block_size \[1, 128\]"),
    (
        {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
        "activation_scheme 'static'",
    ),
    ({"quant_method": "fp8", "activation_scheme": "mx"}, "activation_scheme 'mx'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "ue8m0"),
    (ct(format="int-quantized"), "format 'int-quantized'"),
    (ct(format="nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized'"),
    (ct(weights={"type": "int"}), "weights type 'int'"),
    (ct(weights={"strategy": "group", "group_size": 128}), "strategy 'group'"),
    (ct(weights={"strategy": "block"}), "strategy 'block'"),
    (ct(input_activations=None), "weight-only"),
    (ct(input_activations={"strategy": "group"}), "strategy 'group'"),
    (ct(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
]


@pytest.mark.parametrize(("qc", "named"), REFUSED, ids=[n for _, n in REFUSED])
def test_unserved_quantization_configs_are_refused_at_start_by_name(tmp_path, qc, named):
    path = config_dir(tmp_path, LLAMA | {"quantization_config": qc})
    with pytest.raises(UnsupportedModelError, match=named) as err:
        open_model(path)
    message = str(err.value)
    assert message.startswith("quantization_config")
    assert "radixserve loads fp8 (weight_block_size [128, 128]" in message  # what is served


@pytest.mark.parametrize(
    ("cfg", "named"),
    [
        (QWEN3_MOE, "Qwen3MoeForCausalLM: quantization_config fp8 .* dense models"),
        (
            LLAMA | {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"},
            "Phi3ForCausalLM: quantization_config fp8 .* llama family only",
        ),
    ],
)
def test_fp8_is_refused_for_the_families_it_is_not_wired_into(tmp_path, cfg, named):
    qc = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(UnsupportedModelError, match=named):
        open_model(config_dir(tmp_path, cfg | {"quantization_config": qc}))


def test_a_float_checkpoint_still_names_a_quantization_config_its_family_does_not_read(tmp_path):
    # GPT-OSS's published MXFP4 config: refused by the FP8 reader by name.
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    with pytest.raises(UnsupportedModelError, match="quantization_config: quant_method 'mxfp4'"):
        open_model(config_dir(tmp_path, LLAMA | {"quantization_config": qc}))


def tensors_of(path: Path) -> dict:
    return dict(open_model(path).tensors(torch.float32))


def test_projections_come_out_fp8_with_their_scales_and_the_rest_float(tmp_path):
    write_fp8_checkpoint(tmp_path, "fp8-tensor-static")
    got = tensors_of(tmp_path)
    q = got["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, Fp8Tensor) and isinstance(q, QuantizedTensor)
    assert q.weight.dtype == torch.float8_e4m3fn and q.granularity == "tensor"
    assert q.input_scale is not None and q.input_scale.shape == ()
    assert not any(n.endswith(("_scale", "_scale_inv")) for n in got)  # consumed
    assert got["model.embed_tokens.weight"].dtype == torch.float32
    # On the CPU the loader hands the layers float weights: fp8 * scale.
    cpu = dict(placed(got.items(), device=torch.device("cpu"), dtype=torch.bfloat16))
    want = (q.weight.float() * q.scale).to(torch.bfloat16)
    assert torch.equal(cpu["model.layers.0.self_attn.q_proj.weight"], want)


def test_an_fp8_lm_head_is_dequantized_by_the_reader(tmp_path):
    write_fp8_checkpoint(tmp_path, "fp8-block")
    head, scale = quantize(torch.randn(256, 256), "block")

    def fp8_head(t: dict) -> None:
        t["lm_head.weight"], t["lm_head.weight_scale_inv"] = head, scale

    rewrite(tmp_path, fp8_head)
    got = tensors_of(tmp_path)["lm_head.weight"]
    want = head.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert isinstance(got, torch.Tensor) and torch.equal(got, want)


GATE = "model.layers.0.mlp.gate_proj"


@pytest.mark.parametrize(
    ("form", "change", "named"),
    [
        # gate_proj is (384, 256): its 128x128 blocks are a (3, 2) grid.
        (
            "fp8-block",
            lambda t: t.update(
                {f"{GATE}.weight_scale_inv": t[f"{GATE}.weight_scale_inv"].t().contiguous()}
            ),
            r"gate_proj.weight_scale_inv has shape \(2, 3\).*need \(3, 2\)",
        ),
        (
            "fbgemm-channel",
            lambda t: t.update({f"{GATE}.weight_scale": t[f"{GATE}.weight_scale"][:7]}),
            r"gate_proj.weight_scale has shape \(7, 1\).*need \(384, 1\)",
        ),
        (
            "fp8-tensor",
            lambda t: t.update({f"{GATE}.weight_scale_inv": torch.ones(384, 1)}),
            "tensor-scaled weights .* need one value",
        ),
        ("fp8-tensor", lambda t: t.pop(f"{GATE}.weight_scale_inv"), "has no .*weight_scale_inv"),
        ("fp8-tensor-static", lambda t: t.pop(f"{GATE}.input_scale"), "needs .*input_scale"),
        (
            "fp8-tensor",
            lambda t: t.update({f"{GATE}.weight": t[f"{GATE}.weight"].to(torch.float8_e5m2)}),
            "float8_e5m2: FP8 weights are served in E4M3 only",
        ),
    ],
    ids=["transposed-block", "short-channel", "channel-as-tensor", "no-scale", "no-input", "e5m2"],
)
def test_scales_that_do_not_fit_the_scheme_are_refused_naming_the_tensor(
    tmp_path, form, change, named
):
    write_fp8_checkpoint(tmp_path, form)
    rewrite(tmp_path, change)
    with pytest.raises(UnsupportedModelError, match=named):
        tensors_of(tmp_path)


def fp8(granularity: str, out: int = 384, inp: int = 256, *, static: bool = False) -> Fp8Tensor:
    g = torch.Generator().manual_seed(out + inp)
    w = torch.randn(out, inp, generator=g) * torch.linspace(0.1, 4, out)[:, None]
    q, scale = quantize(w, granularity)
    if granularity == "channel":
        scale = scale.reshape(out, 1)
    activations = "static" if static else "dynamic"
    input_scale = torch.tensor(0.01 * out) if static else None
    return Fp8Tensor("w", q, scale, granularity, activations, input_scale)


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_row_and_column_cuts_dequantize_to_the_same_cut_of_the_whole(granularity):
    t = fp8(granularity, 384, 384)
    whole = t.dequantize()
    assert torch.equal(t.rows(128, 256).dequantize(), whole[128:256])
    assert torch.equal(t.rows(256, 384).columns(128, 384).dequantize(), whole[256:, 128:])
    pieces = t.split([128, 256])
    assert torch.equal(pieces[1].dequantize(), whole[128:])
    # A last partial block keeps its scale row.
    odd = fp8(granularity, 200, 300)
    assert torch.equal(
        odd.rows(128, 200).columns(256, 300).dequantize(), odd.dequantize()[128:, 256:]
    )


@pytest.mark.parametrize(("lo", "hi", "what"), [(64, 128, "output rows"), (0, 192, "output rows")])
def test_tensor_parallel_cuts_inside_a_block_are_refused_by_name(lo, hi, what):
    with pytest.raises(UnsupportedModelError, match=f"cuts its {what} at \\[{lo}, {hi}\\)"):
        fp8("block").rows(lo, hi)
    with pytest.raises(UnsupportedModelError, match="input columns at \\[0, 64\\)"):
        fp8("block").columns(0, 64)
    # Per-tensor and per-channel scales cut anywhere.
    assert fp8("channel").rows(lo, hi).scale.shape == (hi - lo, 1)


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fused_parts_keep_their_own_scales(granularity):
    q, k, v = fp8(granularity, 256), fp8(granularity, 128), fp8(granularity, 128)
    matrix = fuse_rows([q, k, v])  # on the CPU: the dequantized matrix
    want = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    assert torch.equal(matrix.dequantize(), want)
    fused = q.concat_rows([k, v])
    assert torch.equal(fused.dequantize(), want)
    if granularity == "tensor":  # three scalars become one scale per row
        assert fused.granularity == "channel" and fused.scale.shape == (512, 1)


def test_static_parts_fuse_under_their_largest_input_scale():
    parts = [fp8("tensor", n, static=True) for n in (256, 128, 128)]
    assert parts[0].concat_rows(parts[1:]).input_scale == torch.tensor(2.56)


def test_block_parts_that_are_not_whole_blocks_of_rows_are_refused_when_fused():
    with pytest.raises(UnsupportedModelError, match=r"64 rows .* not a multiple of 128"):
        fp8("block", 64).concat_rows([fp8("block", 128)])


def column_and_row_layers(rank: int) -> tuple[FusedColumnLinear, RowLinear]:
    tp = TensorParallel(rank=rank, size=2)
    on = {"bias": False, "tp": tp, "dtype": torch.float32, "device": torch.device("cpu")}
    parts = {"q_proj": 256, "k_proj": 256, "v_proj": 512}
    return FusedColumnLinear(256, parts, **on), RowLinear(512, 256, **on)


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_its_cut_of_the_weights_and_scales(granularity, rank, monkeypatch):
    """The layers' load (models/layers.py) with FP8 parts where FP8 GEMMs
    run (the device gate opened on the CPU): each rank's matrix is its rows
    (q, k, v parts each cut) or columns of the dequantized whole."""
    monkeypatch.setattr(fp8_linear, "gemm_supported", lambda device: True)
    column, row = column_and_row_layers(rank)
    whole = {
        name: fp8(granularity, n, 256)
        for name, n in {"q_proj": 256, "k_proj": 256, "v_proj": 512}.items()
    }
    for name, t in whole.items():
        column.load(name, "weight", replace(t, device=torch.device("cpu")))
    down = fp8(granularity, 256, 512)
    row.load("weight", replace(down, device=torch.device("cpu")))
    assert isinstance(column.quantized, Fp8Matrix) and isinstance(row.quantized, Fp8Matrix)
    want = torch.cat(
        [
            t.dequantize()[rank * n // 2 : (rank + 1) * n // 2]
            for t, n in ((t, t.shape[0]) for t in whole.values())
        ]
    )
    assert torch.equal(column.quantized.dequantize(), want)
    assert torch.equal(
        row.quantized.dequantize(), down.dequantize()[:, rank * 256 : (rank + 1) * 256]
    )


def test_a_tensor_parallel_cut_inside_a_block_is_refused_by_the_layer(monkeypatch):
    monkeypatch.setattr(fp8_linear, "gemm_supported", lambda device: True)
    tp = TensorParallel(rank=1, size=2)
    layer = FusedColumnLinear(
        256, {"k_proj": 128}, bias=False, tp=tp, dtype=torch.float32, device=torch.device("cpu")
    )
    with pytest.raises(
        UnsupportedModelError, match=r"w: tensor parallelism cuts its output rows at \[64, 128\)"
    ):
        layer.load("k_proj", "weight", fp8("block", 128, 256))
