"""GGUF files served with their blocks kept (weights/gguf_quant.py) on tiny
files written as llama.cpp's converter writes them: the whole model against
the same file dequantized, the refusals at start, and --dequantize."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.worker_service.support.quantized_models import needs_kernel
from tests.worker_service.support.worker_factory import worker_for
from tests.worker_service.weights.support.gguf_build import write_model_gguf
from tests.worker_service.weights.support.tiny_checkpoints import tiny_model
from worker_service.device.distributed import TensorParallel
from worker_service.models.config import UnsupportedModelError
from worker_service.models.layers import FusedColumnLinear, RowLinear, VocabEmbedding
from worker_service.models.quantized import StackedMatrix, quantized_bytes
from worker_service.models.registry import build_model
from worker_service.weights import open_model
from worker_service.weights.gguf_quant import GgufBlocks

pytestmark = needs_kernel

# Every projection quantized, in three types (q and k mixed within the fused
# qkv, the llama Q/K rows permuted by the converter), the LM head too.
TYPES = {
    "attn_q": QType.Q4_1,
    "attn_k": QType.Q8_0,
    "attn_v": QType.Q4_0,
    "attn_output": QType.Q8_0,
    "ffn_gate": QType.Q4_0,
    "ffn_up": QType.Q4_0,
    "ffn_down": QType.Q4_1,
    "token_embd": QType.Q8_0,
    "output.": QType.Q4_1,
}


def load(path: Path, *, quantized: bool):
    source = open_model(path)
    model = build_model(source.config, tp=TensorParallel(), dtype=torch.float32, device="cpu")
    model.load_weights(source.tensors(torch.float32, keep_quantized=quantized))
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    hf = tiny_model("llama-untied")
    path = tmp_path_factory.mktemp("q") / "tiny.gguf"
    write_model_gguf(path, hf.config, hf.state_dict(), types=TYPES)
    return path


def test_every_projection_is_kept_in_its_blocks(tiny_gguf: Path) -> None:
    model = load(tiny_gguf, quantized=True)
    layer = model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv.quantized, StackedMatrix)  # Q4_1 | Q8_0 | Q4_0
    assert [type(p).__name__ for p in qkv.quantized.parts] == ["GgufMatrix"] * 3
    assert not isinstance(layer.mlp.gate_up_proj.quantized, StackedMatrix)  # Q4_0 both
    for module in model.modules():
        if isinstance(module, (FusedColumnLinear, RowLinear, VocabEmbedding)):
            assert module.quantized is not None, module
    # The file's block bytes: nothing was dequantized and kept.
    blocks = sum(
        t.n_bytes
        for t in open_model(tiny_gguf).files._reader.tensors  # type: ignore[attr-defined]
        if t.tensor_type.name in {"Q4_0", "Q4_1", "Q8_0"}
    )
    assert quantized_bytes(model) == blocks


def test_each_matrix_is_the_float_paths_weight(tiny_gguf: Path) -> None:
    """Every quantized layer holds exactly the float path's matrix (the Q/K rows
    un-permuted as rows of blocks, q/k/v and gate/up in order), and multiplies
    by it within the activations' rounding (~0.5% rms here; the model-level
    accuracy is the default model's NLL, test_quantized_default.py: this
    tiny random model amplifies any difference through its layers)."""
    quantized, floats = load(tiny_gguf, quantized=True), load(tiny_gguf, quantized=False)
    float_modules = dict(floats.named_modules())
    checked = 0
    for name, module in quantized.named_modules():
        if getattr(module, "quantized", None) is None:
            continue
        matrix = module.quantized
        weight = float_modules[name].weight
        assert torch.equal(matrix.dequantize(), weight[: matrix.out_features]), name
        x = torch.randn(4, matrix.in_features)
        want = x @ weight[: matrix.out_features].T
        rel = (matrix.matmul(x) - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
        assert float(rel) < 0.02, (name, float(rel))
        checked += 1
    assert checked == 2 * 4 + 2  # four per layer, the embedding and the LM head


def test_a_type_without_a_kernel_is_refused_at_start_and_dequantize_serves_it(
    tmp_path: Path,
) -> None:
    hf = tiny_model("llama-tied")
    path = tmp_path / "q5.gguf"
    write_model_gguf(path, hf.config, hf.state_dict(), types={"ffn_down": QType.Q5_0})
    with pytest.raises(UnsupportedModelError) as refused:
        worker_for(path, num_pages=16)
    message = str(refused.value)
    assert "Q5_0" in message and "blk.0.ffn_down.weight" in message
    assert "--dequantize" in message and "Q4_K" in message  # the fix, and what has kernels
    worker = worker_for(path, num_pages=16, dequantize=True)
    assert worker.weight_bytes > 0


def test_row_parallel_shards_off_block_boundaries_are_refused_at_start(tmp_path: Path) -> None:
    hf = tiny_model("llama-tied")
    path = tmp_path / "q40.gguf"
    write_model_gguf(path, hf.config, hf.state_dict(), types={"attn_output": QType.Q4_0})
    files = open_model(path).files
    files.check_quantized(frozenset({"Q4_0"}), 2)  # type: ignore[attr-defined]  # 64 = 2 x 32
    with pytest.raises(
        UnsupportedModelError, match=r"blk\.0\.attn_output.*4 tensor-parallel.*--dequantize"
    ):
        files.check_quantized(frozenset({"Q4_0"}), 4)  # type: ignore[attr-defined]


def test_a_quantized_worker_counts_its_blocks_not_float(tiny_gguf: Path) -> None:
    quantized = worker_for(tiny_gguf, num_pages=16)
    floats = worker_for(tiny_gguf, num_pages=16, dequantize=True)
    assert quantized.weight_bytes < floats.weight_bytes / 3


def test_split_of_blocks_is_rows() -> None:
    """Phi-3's fused qkv tensor is split by rows in the model's loader."""
    hf = tiny_model("llama-tied")
    del hf
    whole = GgufBlocks(
        "x", "Q8_0", torch.arange(6 * 34, dtype=torch.uint8).numpy().reshape(6, 34), 32
    )
    a, b, c = whole.split([1, 2, 3])
    assert [p.shape for p in (a, b, c)] == [(1, 32), (2, 32), (3, 32)]
