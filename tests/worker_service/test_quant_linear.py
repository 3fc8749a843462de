"""The quantized linear (kernels/quant_linear.py, c_sources/quant_linear.c) on
every GGUF type it serves, in each of its three builds: the machine's own
(AVX-512 VNNI here), AVX2 (-mno-avx512f) and portable C (-mno-avx), so that a
CI machine without AVX-512 runs code that was checked.

Two references (support/quant_reference.py):

(a) the kernel's own arithmetic redone in numpy: activations quantized the
    same way (float32, per block, d = amax / 127), weight codes from gguf's
    dequantizer, exact integer dots, float64 scales. The kernel's result
    equals it to float32 rounding: within 1e-5 of the sum of the magnitudes
    of the products it adds (float32's eps is 6e-8; a few hundred additions).
(b) dequantize-then-matmul in float64, the answer the model wants. The
    kernel differs by its int8 activation rounding, which moves each
    activation by at most half its block's step d = amax / 127, so the
    result by at most sum_i |W_oi| * d_block(i) / 2 (``rounding_bound``);
    asserted with the float32 rounding of (a) on top.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from tests.worker_service.support import quant_reference as ref
from worker_service.kernels import quant_linear
from worker_service.kernels.c_build import build_threaded
from worker_service.kernels.quant_linear import QuantLinearLibrary

TYPES = sorted(quant_linear.KERNEL_TYPES)
OUTS = (1, 3, 33, 130)
BLOCKS = (1, 2, 3, 5)
ROWS = (1, 2, 5, 16, 17, 70)
# the kernel's result against (a), relative to the products' magnitudes
ARITHMETIC_RTOL = 1e-5


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, QuantLinearLibrary]:
    """The three builds, each with the vector path its flags leave."""
    assert quant_linear.available(), "gcc is on the CI machine"
    flags = _cpu_flags()
    directory = tmp_path_factory.mktemp("quant_linear")
    libraries = {"native": quant_linear._require()}
    variants = {"portable": ["-mno-avx"]}
    if "avx2" in flags:
        variants["avx2"] = ["-mno-avx512f", "-mno-avxvnni"]
    for name, extra in variants.items():
        path = build_threaded(
            quant_linear.SOURCE, [*quant_linear.FLAGS, *extra], f"ql-{name}", directory
        )
        libraries[name] = QuantLinearLibrary(Path(path))
    return libraries


@pytest.fixture(params=["native", "avx2", "portable"])
def library(request, builds) -> QuantLinearLibrary:
    if request.param not in builds:
        pytest.skip(f"no {request.param} build on this CPU")
    return builds[request.param]


def test_each_build_takes_its_vector_path(builds) -> None:
    flags = _cpu_flags()
    assert builds["portable"].isa == 0
    if "avx2" in builds:
        assert builds["avx2"].isa == 1
    vnni = ({"avx512_vnni", "avx512vl"} <= flags) or "avx_vnni" in flags
    assert builds["native"].isa == (2 if vnni else 1 if "avx2" in flags else 0)


def test_type_sizes_are_gguf_s() -> None:
    assert set(TYPES) == {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
    for qtype in TYPES:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        assert quant_linear.block_size(qtype) == block
        assert quant_linear.row_bytes(qtype, 3 * block) == 3 * size
    with pytest.raises(ValueError, match="no quantized kernel"):
        quant_linear.block_size("Q2_K")
    with pytest.raises(ValueError, match="multiples of 256"):
        quant_linear.row_bytes("Q6_K", 320)


def _case(qtype: str, out: int, blocks: int, rows: int, seed: int):
    k = blocks * quant_linear.block_size(qtype)
    data = ref.random_blocks(qtype, out, k, seed)
    x = np.random.default_rng(seed + 1).standard_normal((rows, k)).astype(np.float32)
    x[:, :3] *= 20  # an outlier per row: blocks of very different steps
    return data, x


def _shapes():
    """Every out x blocks, rows cycling through ROWS, and every row count on 33 x 3."""
    rows = itertools.cycle(ROWS)
    grid = [(out, blocks, next(rows)) for out, blocks in itertools.product(OUTS, BLOCKS)]
    return grid + [(33, 3, r) for r in ROWS] + [(130, 2, 70)]


@pytest.mark.parametrize("qtype", TYPES)
def test_matches_its_arithmetic_and_the_float_product(library, qtype) -> None:
    for i, (out, blocks, rows) in enumerate(_shapes()):
        data, x = _case(qtype, out, blocks, rows, seed=i)
        w = library.pack(qtype, torch.from_numpy(data), out, x.shape[1])
        got = library.matmul(torch.from_numpy(x), w).numpy().astype(np.float64)
        want, magnitude = ref.reference(qtype, data, x)
        where = f"{qtype} out {out} in {x.shape[1]} rows {rows}"
        assert np.all(np.abs(got - want) <= ARITHMETIC_RTOL * magnitude + 1e-30), where
        weight = ref.dequantize(qtype, data).astype(np.float64)
        exact = x.astype(np.float64) @ weight.T
        bound = ref.rounding_bound(qtype, weight, x) + ARITHMETIC_RTOL * magnitude
        assert np.all(np.abs(got - exact) <= bound), where


@pytest.mark.parametrize("qtype", TYPES)
def test_bias_and_a_column_slice_of_a_wider_output(library, qtype) -> None:
    out, rows = 33, 5
    data, x = _case(qtype, out, 2, rows, seed=7)
    bias = np.random.default_rng(3).standard_normal(out).astype(np.float32)
    w = library.pack(qtype, torch.from_numpy(data), out, x.shape[1])
    wide = torch.full((rows, out + 10), -7.0)
    result = library.matmul(
        torch.from_numpy(x), w, bias=torch.from_numpy(bias), out=wide[:, 4 : 4 + out]
    )
    assert result.data_ptr() == wide[:, 4:].data_ptr()
    want, magnitude = ref.reference(qtype, data, x, bias=bias)
    got = wide[:, 4 : 4 + out].numpy().astype(np.float64)
    assert np.all(np.abs(got - want) <= ARITHMETIC_RTOL * magnitude)
    assert torch.all(wide[:, :4] == -7.0) and torch.all(wide[:, 4 + out :] == -7.0)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_gguf_s_bit_for_bit(library, qtype) -> None:
    out = 19  # two interleaved groups of 8 and three rows after them
    data, _ = _case(qtype, out, 3, 1, seed=11)
    w = library.pack(qtype, torch.from_numpy(data), out, 3 * quant_linear.block_size(qtype))
    assert w.data.numel() == data.size  # the same bytes, rearranged
    want = ref.dequantize(qtype, data)
    np.testing.assert_array_equal(library.dequantize_rows(w).numpy(), want)
    ids = torch.tensor([18, 0, 7, 8, 16, 7])
    np.testing.assert_array_equal(library.dequantize_rows(w, ids).numpy(), want[ids.numpy()])
    with pytest.raises(ValueError, match="id out of range"):
        library.dequantize_rows(w, torch.tensor([out]))


def test_module_functions(monkeypatch) -> None:
    """The interface the model codes against (api33.md): pack from numpy
    (a read-only memory map included), matmul, dequantize, dequantize_rows."""
    data, x = _case("Q8_0", 40, 18, 3, seed=5)  # the embedding / LM head's shape, smaller
    data.flags.writeable = False
    w = quant_linear.pack("Q8_0", data, 40, 576)
    assert (w.qtype, w.out_features, w.in_features, w.data.dtype) == ("Q8_0", 40, 576, torch.uint8)
    assert w.nbytes == data.size
    np.testing.assert_array_equal(quant_linear.dequantize(w).numpy(), ref.dequantize("Q8_0", data))
    ids = torch.tensor([[3, 39], [0, 3]])
    rows = quant_linear.dequantize_rows(w, ids)
    np.testing.assert_array_equal(rows.numpy(), ref.dequantize("Q8_0", data)[[3, 39, 0, 3]])
    want, magnitude = ref.reference("Q8_0", data, x)
    got = quant_linear.matmul(torch.from_numpy(x), w).numpy()
    assert np.all(np.abs(got - want) <= ARITHMETIC_RTOL * magnitude)
    with pytest.raises(ValueError, match="bytes are not"):
        quant_linear.pack("Q8_0", data[:, :-1], 40, 576)
    with pytest.raises(ValueError, match="features"):
        quant_linear.matmul(torch.zeros(2, 512), w)
    with pytest.raises(ValueError, match="out must be"):
        quant_linear.matmul(torch.zeros(2, 576), w, out=torch.zeros(40, 2).t())


@pytest.mark.parametrize("qtype", TYPES)
def test_a_nan_or_inf_activation_spoils_its_row_only(qtype) -> None:
    """As in the float product: no codes cast from NaN, no finite garbage."""
    data, x = _case(qtype, 9, 2, 3, seed=4)
    x[0, 5] = np.nan
    x[2, -1] = np.inf
    w = quant_linear.pack(qtype, data, 9, x.shape[1])
    got = quant_linear.matmul(torch.from_numpy(x), w)
    assert torch.isnan(got[0]).all() and torch.isnan(got[2]).all()
    assert torch.isfinite(got[1]).all()


def test_threads_split_work_not_results() -> None:
    data, x = _case("Q4_1", 1536, 18, 9, seed=2)
    w = quant_linear.pack("Q4_1", data, 1536, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant_linear.matmul(torch.from_numpy(x), w)
        torch.set_num_threads(2)
        two = quant_linear.matmul(torch.from_numpy(x), w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output feature is one thread's, same arithmetic


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_largest_codes_and_activations_do_not_saturate(library, qtype) -> None:
    """The 32-weight types' largest codes (4-bit 15, 8-bit +-127) against
    activations that all quantize to +-127: the integer sums the AVX2 path
    keeps in int16 (eight maddubs pairs of a 4-bit block, 30480 at most) reach
    their extremes and must still equal the exact arithmetic."""
    out, k = 16, 128
    data = ref.random_blocks(qtype, out, k, seed=7).reshape(out, k // 32, -1).copy()
    codes = 2 if qtype != "Q4_1" else 4
    if qtype == "Q8_0":
        data[:8, :, codes:] = np.uint8(127)
        data[8:, :, codes:] = np.int8(-127).view(np.uint8)
    else:
        data[:8, :, codes:] = 0xFF  # every nibble 15
        data[8:, :, codes:] = 0x0F  # low nibbles 15, high 0
    data = data.reshape(out, -1)
    x = np.ones((4, k), dtype=np.float32)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3, :16] = -3.0  # the first block's sixteen lows at -127, the rest smaller
    w = library.pack(qtype, torch.from_numpy(data), out, k)
    got = library.matmul(torch.from_numpy(x), w).numpy().astype(np.float64)
    want, magnitude = ref.reference(qtype, data, x)
    assert np.all(np.abs(got - want) <= ARITHMETIC_RTOL * magnitude + 1e-30)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_row_walks_streams_with_the_same_arithmetic(library, qtype, threads) -> None:
    """A one-row product walks several groups' weights side by side (the AVX2
    path's STREAMS); each feature's result must be the one it gets among
    other rows (one group at a time), bit for bit. 149 whole groups and 3
    rows after them: the tasks hold runs of several groups, remainders and
    the ungrouped rows."""
    out, blocks = 149 * 8 + 3, 3
    data, x = _case(qtype, out, blocks, 5, seed=11)
    w = library.pack(qtype, torch.from_numpy(data), out, x.shape[1])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        together = library.matmul(torch.from_numpy(x), w)
        for r in range(x.shape[0]):
            alone = library.matmul(torch.from_numpy(x[r : r + 1]), w)
            assert torch.equal(alone[0], together[r]), f"{qtype} row {r}"
    finally:
        torch.set_num_threads(before)
