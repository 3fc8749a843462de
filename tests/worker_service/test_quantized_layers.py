"""The layers' quantized hook (models/layers.py, models/quantized.py) with GGUF
blocks (weights/gguf_quant.py): each layer's output equals the same layer
loaded with the dequantized float weights, within the kernel's rounding of
the activations to int8 per block.

Tolerance, elementwise: the kernel rounds each activation to a code of its
block (32 or 256 weights) of at most half a step, amax / 254, off; output j
is then off by at most sum_i |w_ji| * amax(block of i) / 254 (taken with the
256-wide block's amax, which bounds the 32-wide one), plus 1e-4 relative for
float sums. Measured on random inputs: the error's rms is ~0.7% of the
output's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.worker_service.support.quant_reference import random_blocks
from tests.worker_service.support.quantized_models import needs_kernel
from worker_service.device.distributed import TensorParallel
from worker_service.models.config import UnsupportedModelError
from worker_service.models.layers import FusedColumnLinear, RowLinear, VocabEmbedding
from worker_service.models.quantized import StackedMatrix, is_placeholder, quantized_bytes
from worker_service.weights.gguf_quant import GgufBlocks

pytestmark = needs_kernel

CPU = torch.device("cpu")
ROUNDING_BLOCK = 256  # every in_features below is a multiple of it


class LocalShards(TensorParallel):
    """Rank ``rank`` of ``size`` without the collectives: the shard's own
    outputs (the collectives are the float path's, tested with gloo ranks)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return x


def blocks(name: str, qtype: str, out_features: int, in_features: int, seed: int) -> GgufBlocks:
    return GgufBlocks(
        name, qtype, random_blocks(qtype, out_features, in_features, seed), in_features
    )


def assert_near(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``got`` = the quantized layer's x @ w^T, ``want`` the float layer's."""
    assert got.shape == want.shape
    amax = x.reshape(x.shape[0], -1, ROUNDING_BLOCK).abs().amax(dim=-1, keepdim=True)
    step = (amax / 254).expand(-1, -1, ROUNDING_BLOCK).reshape(x.shape)
    bound = step @ w.abs().T + 1e-4 * want.abs() + 1e-6
    over = (got - want).abs() - bound
    assert float(over.max()) <= 0, f"{int((over > 0).sum())} outputs past the rounding bound"


def column(parts: dict[str, int], tp: TensorParallel, in_features: int) -> FusedColumnLinear:
    return FusedColumnLinear(in_features, parts, bias=True, tp=tp, dtype=torch.float32, device=CPU)


@pytest.mark.parametrize("rank", [0, 1])
def test_fused_parts_of_mixed_types_and_a_float_part(rank: int) -> None:
    """q Q4_K, k Q6_K, v float (an F16 tensor in a file): one output, each part
    its slice; a column-parallel shard takes rows of blocks."""
    tp = LocalShards(rank=rank, size=2)
    parts = {"q_proj": 128, "k_proj": 64, "v_proj": 64}
    q = blocks("q", "Q4_K", 128, 256, 1)
    k = blocks("k", "Q6_K", 64, 256, 2)
    v = torch.randn(64, 256)
    bias = torch.randn(256)
    quantized, floats = column(parts, tp, 256), column(parts, tp, 256)
    for name, tensor in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
        quantized.load(name, "weight", tensor)
        dense = tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize()
        floats.load(name, "weight", dense)
    for name, piece in zip(parts, bias.split(list(parts.values())), strict=True):
        quantized.load(name, "bias", piece)
        floats.load(name, "bias", piece)
    assert isinstance(quantized.quantized, StackedMatrix)
    assert is_placeholder(quantized.weight) and quantized.weight.shape == floats.weight.shape
    assert quantized.weight.untyped_storage().nbytes() == 4
    w = floats.weight
    # One row, a few, and a long step (the kernel's prefill path).
    for x in (torch.randn(1, 256), torch.randn(5, 256), torch.randn(300, 256)):
        assert_near(quantized(x), floats(x), x, w)
    assert float((quantized(x) - floats(x)).abs().max()) > 0  # the kernel's own arithmetic


def test_parts_of_one_type_are_one_matrix() -> None:
    tp = TensorParallel()
    layer = column({"gate_proj": 64, "up_proj": 64}, tp, 64)
    layer.bias = None
    layer.load("gate_proj", "weight", blocks("g", "Q4_1", 64, 64, 3))
    assert layer.quantized is None  # not before the last part
    layer.load("up_proj", "weight", blocks("u", "Q4_1", 64, 64, 4))
    assert not isinstance(layer.quantized, StackedMatrix)
    assert quantized_bytes(layer) == 128 * 2 * 20  # 128 rows of two Q4_1 blocks


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q5_K"])
def test_row_parallel_shards_sum_to_the_whole(qtype: str) -> None:
    in_features = 512
    whole = blocks("blk.0.ffn_down.weight", qtype, 48, in_features, 5)
    dense = whole.dequantize()
    x = torch.randn(3, in_features)
    partials = []
    for rank in (0, 1):
        tp = LocalShards(rank=rank, size=2)
        quantized = RowLinear(in_features, 48, bias=False, tp=tp, dtype=torch.float32, device=CPU)
        floats = RowLinear(in_features, 48, bias=False, tp=tp, dtype=torch.float32, device=CPU)
        quantized.load("weight", whole)
        floats.load("weight", dense)
        shard = x[:, quantized.lo : quantized.hi]
        assert_near(quantized(shard), floats(shard), shard, floats.weight)
        partials.append(quantized(shard))
    assert_near(partials[0] + partials[1], x @ dense.T, x, dense)


def test_a_row_parallel_cut_inside_a_block_is_refused_by_name() -> None:
    tp = LocalShards(rank=1, size=2)
    layer = RowLinear(256, 8, bias=False, tp=tp, dtype=torch.float32, device=CPU)
    with pytest.raises(UnsupportedModelError, match=r"blk\.3\.attn_output.*Q4_K.*--dequantize"):
        layer.load("weight", blocks("blk.3.attn_output.weight", "Q4_K", 8, 256, 6))


@pytest.mark.parametrize(("rank", "size"), [(0, 1), (3, 4)])
def test_embedding_rows_and_lm_head(rank: int, size: int) -> None:
    """The last of 4 vocabulary shards has padding rows the table lacks:
    their embeddings are zero and their logits too, as on the float path."""
    vocab, dim = 90, 256  # padded to 92: the last shard holds rows 69..89 and 2 padding
    tp = LocalShards(rank=rank, size=size)
    table = blocks("token_embd.weight", "Q8_0", vocab, dim, 7)
    quantized = VocabEmbedding(vocab, dim, tp=tp, dtype=torch.float32, device=CPU)
    floats = VocabEmbedding(vocab, dim, tp=tp, dtype=torch.float32, device=CPU)
    quantized.load(table)
    floats.load(table.dequantize())
    ids = torch.tensor([[0, 5, 70], [89, 69, 3]])
    # Rows are gguf's dequantization exactly: lookups need no tolerance.
    torch.testing.assert_close(quantized(ids), floats(ids), rtol=0, atol=0)
    hidden = torch.randn(4, dim)
    got, want = quantized.logits(hidden), floats.logits(hidden)
    assert_near(got, want, hidden, floats.weight)
    if size > 1:
        assert got.shape[-1] == 23 and bool((got[:, -2:] == 0).all())


def test_blocks_cut_and_permuted_as_rows() -> None:
    whole = blocks("w", "Q4_1", 12, 64, 8)
    dense = whole.dequantize()
    a, b = whole.split([4, 8])
    assert torch.equal(b.dequantize(), dense[4:])
    assert torch.equal(a.concat_rows([b]).dequantize(), dense)
    assert torch.equal(whole.columns(32, 64).dequantize(), dense[:, 32:])
    assert np.shares_memory(whole.rows(2, 5).blocks, whole.blocks)  # a view until matrix()
