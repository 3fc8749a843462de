"""FlashInfer conformance, the mutation tests: each breaks one thing our backend
hands FlashInfer's wrappers (an argument's order, dtype, value or placement) and
requires the comparison of test_flashinfer_conformance.py
(support/flashinfer_conformance.py) to fail, so that check has teeth; the soft
cap's mutations run it on soft-capped attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.worker_service.support import flashinfer_reference as reference
from tests.worker_service.support.attention_batches import BATCHES, make_batch, spec_for
from tests.worker_service.support.flashinfer_conformance import (
    backends,
    compare_step,
    eager_outputs,
    graph_setup,
    like_the_runner,
    random_caches,
    random_qkv,
    seed,
)
from tests.worker_service.support.flashinfer_reference import KernelContractError
from worker_service.attention import flashinfer_backend as backend
from worker_service.attention.base import (
    AttentionBatch,
)
from worker_service.attention.flashinfer_backend import FlashInferAttention
from worker_service.device.kv_cache import KvCache

flashinfer = pytest.importorskip(
    "flashinfer",
    reason="flashinfer-python is not installed (make setup installs it without CUDA deps)",
)


# ---- mutations: the comparison fails when one thing we hand FlashInfer is wrong --------

MUTATION_HEADS = (8, 2, 64)  # GQA group 4
MUTATION_WINDOW = 24  # shorter than the longer sequences of the "mixed" batch
SOFT_CAP = 1.0  # scaled scores of random data are about 1: the cap bends them
Args = list[Any]
Kwargs = dict[str, Any]


def alter_call(
    mp: pytest.MonkeyPatch, owner: Any, name: str, change: Callable[[Args, Kwargs], None]
) -> None:
    """``owner.name`` receives the arguments our backend passes after ``change``
    (which edits them in place)."""
    real = getattr(owner, name)

    def altered(self: Any, *args: Any, **kwargs: Any) -> Any:
        args_, kwargs_ = list(args), dict(kwargs)
        change(args_, kwargs_)
        return real(self, *args_, **kwargs_)

    mp.setattr(owner, name, altered)


def prefill_plan(change: Callable[[Args, Kwargs], None]) -> Callable[[pytest.MonkeyPatch], None]:
    return lambda mp: alter_call(mp, flashinfer.BatchPrefillWithPagedKVCacheWrapper, "plan", change)


def decode_plan(change: Callable[[Args, Kwargs], None]) -> Callable[[pytest.MonkeyPatch], None]:
    return lambda mp: alter_call(mp, flashinfer.BatchDecodeWithPagedKVCacheWrapper, "plan", change)


def both_plans(change: Callable[[Args, Kwargs], None]) -> Callable[[pytest.MonkeyPatch], None]:
    def apply(mp: pytest.MonkeyPatch) -> None:
        prefill_plan(change)(mp)
        decode_plan(change)(mp)

    return apply


def swap(i: int, j: int) -> Callable[[Args, Kwargs], None]:
    def change(a: Args, kw: Kwargs) -> None:
        a[i], a[j] = a[j], a[i]

    return change


def edit(i: int, f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Args, Kwargs], None]:
    """Argument ``i`` becomes ``f`` of it, in the same kind of memory."""

    def change(a: Args, kw: Kwargs) -> None:
        new = f(a[i])
        if reference.PLACEMENT.is_device(a[i]) and not reference.PLACEMENT.is_device(new):
            new = reference.PLACEMENT.mark_device(new)
        if reference.PLACEMENT.is_pinned(a[i]) and not reference.PLACEMENT.is_pinned(new):
            new = reference.PLACEMENT.mark_pinned(new)
        a[i] = new

    return change


def move(i: int, to: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Args, Kwargs], None]:
    def change(a: Args, kw: Kwargs) -> None:
        a[i] = to(a[i])

    return change


def edit_kw(key: str, f: Callable[[Any], Any]) -> Callable[[Args, Kwargs], None]:
    def change(a: Args, kw: Kwargs) -> None:
        kw[key] = f(kw[key])

    return change


def on_device(t: torch.Tensor) -> torch.Tensor:
    return reference.PLACEMENT.mark_device(t.clone())


def pinned(t: torch.Tensor) -> torch.Tensor:
    return reference.PLACEMENT.mark_pinned(t.clone())


def pageable(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


def layout_hnd(mp: pytest.MonkeyPatch) -> None:
    for cls in (
        flashinfer.BatchPrefillWithPagedKVCacheWrapper,
        flashinfer.BatchDecodeWithPagedKVCacheWrapper,
    ):
        alter_call(mp, cls, "__init__", move(1, lambda _: "HND"))


def keys_into_value_slots(mp: pytest.MonkeyPatch) -> None:
    real = backend.kv_rows
    mp.setattr(backend, "kv_rows", lambda p, o, ps: real(p, o, ps) + ps)


def decode_queries_shifted(mp: pytest.MonkeyPatch) -> None:
    for cls in (flashinfer.BatchDecodeWithPagedKVCacheWrapper,):
        alter_call(mp, cls, "run", edit(0, lambda q: q.roll(1, 0)))


def graph_batch_unpadded(mp: pytest.MonkeyPatch) -> None:
    real = backend.paged_layout
    mp.setattr(backend, "paged_layout", lambda cols, ps, pad_to=0: real(cols, ps))


def graph_rows_moved_after_capture(mp: pytest.MonkeyPatch) -> None:
    """A per-step tensor where the captured KV write reads a fixed one."""
    real = FlashInferAttention.begin_graph_step

    def moved(self: FlashInferAttention, batch: AttentionBatch, size: int) -> None:
        real(self, batch, size)
        self._rows_now = self._rows_now.clone()

    mp.setattr(FlashInferAttention, "begin_graph_step", moved)


MISMATCH = r"Mismatched elements|KV cache differs"


@dataclass(frozen=True)
class Mutation:
    apply: Callable[[pytest.MonkeyPatch], None]
    raises: type[BaseException]
    match: str
    tensor_cores: bool | None = None  # decode kernel: None = ours (tensor cores for group 4)
    graphs: bool = False  # run the graph scenario instead of one eager step
    soft_cap: float | None = None  # the eager scenario's attention soft-capped


MUTATIONS = {
    "prefill qo_indptr and kv_indptr swapped": Mutation(
        prefill_plan(swap(0, 1)), ValueError, "does not match qo_indptr"
    ),
    "prefill kv indices int64": Mutation(
        prefill_plan(edit(2, lambda t: t.long())), KernelContractError, "compiled for torch.int32"
    ),
    "decode kv indices int64 (CUDA-core kernel)": Mutation(
        decode_plan(edit(1, lambda t: t.long())),
        KernelContractError,
        "compiled for torch.int32",
        tensor_cores=False,
    ),
    "decode kv indices int64 (tensor-core kernel)": Mutation(
        decode_plan(edit(1, lambda t: t.long())), KernelContractError, "compiled for torch.int32"
    ),
    "prefill qo_indptr on the device": Mutation(
        prefill_plan(move(0, on_device)), KernelContractError, "device memory"
    ),
    "prefill kv_indptr on the device": Mutation(
        prefill_plan(move(1, on_device)), KernelContractError, "device memory"
    ),
    "decode last_page_len on the device": Mutation(
        decode_plan(move(2, on_device)), KernelContractError, "device memory"
    ),
    "prefill kv_indptr in pageable host memory": Mutation(
        prefill_plan(move(1, pageable)), KernelContractError, "pageable"
    ),
    "decode indices in pageable host memory": Mutation(
        decode_plan(move(1, pageable)), KernelContractError, "pageable"
    ),
    "prefill last_page_len + 1": Mutation(
        prefill_plan(edit(3, lambda t: t + 1)), AssertionError, MISMATCH
    ),
    "decode last_page_len - 1": Mutation(
        decode_plan(edit(2, lambda t: t - 1)), AssertionError, MISMATCH, tensor_cores=False
    ),
    "window_left = W (one too many keys)": Mutation(
        both_plans(edit_kw("window_left", lambda w: w + 1)), AssertionError, MISMATCH
    ),
    "window_left = -1 (no window)": Mutation(
        both_plans(edit_kw("window_left", lambda w: -1)), AssertionError, MISMATCH
    ),
    "q planned as fp16 for bf16 data": Mutation(
        both_plans(edit_kw("q_data_type", lambda _: torch.float16)),
        ValueError,
        "does not match the q_data_type",
    ),
    "sm_scale doubled": Mutation(
        both_plans(edit_kw("sm_scale", lambda s: 2 * s)), AssertionError, MISMATCH
    ),
    "soft cap left out of the plans": Mutation(
        both_plans(edit_kw("logits_soft_cap", lambda _: None)),
        AssertionError,
        MISMATCH,
        soft_cap=SOFT_CAP,
    ),
    "soft cap doubled": Mutation(
        both_plans(edit_kw("logits_soft_cap", lambda c: 2 * c)),
        AssertionError,
        MISMATCH,
        soft_cap=SOFT_CAP,
        tensor_cores=False,
    ),
    "prefill not causal": Mutation(
        prefill_plan(edit_kw("causal", lambda c: False)), AssertionError, MISMATCH
    ),
    "layout 'HND' for our NHD cache": Mutation(layout_hnd, KernelContractError, "heads/page_size"),
    "keys written into the value slots": Mutation(keys_into_value_slots, AssertionError, MISMATCH),
    "decode queries off by one row": Mutation(decode_queries_shifted, AssertionError, MISMATCH),
    "graph batch not padded to its size": Mutation(
        graph_batch_unpadded, ValueError, "batch size should be fixed", graphs=True
    ),
    "graph plan given host indices": Mutation(
        decode_plan(move(1, pinned)), KernelContractError, "non_blocking=False", graphs=True
    ),
    "graph KV rows moved after capture": Mutation(
        graph_rows_moved_after_capture, AssertionError, MISMATCH, graphs=True
    ),
}


def eager_scenario(tensor_cores: bool | None, soft_cap: float | None = None) -> None:
    page_size = 16
    gen = seed("mutation")
    num_pages = 512 // page_size
    batch = like_the_runner(make_batch(*BATCHES["mixed"], page_size, num_pages, gen))
    fi, ref = backends(MUTATION_HEADS, page_size, MUTATION_WINDOW, tensor_cores, soft_cap=soft_cap)
    fi_kv, ref_kv = random_caches(fi.spec, num_pages, gen)
    compare_step(fi, ref, batch, fi_kv, ref_kv, gen, layers=1)


def graph_scenario(monkeypatch: pytest.MonkeyPatch) -> None:
    page_size = 16
    spec = spec_for(MUTATION_HEADS, page_size, MUTATION_WINDOW, torch.bfloat16, "cpu")
    gen = seed("graph mutation")
    num_pages = 512 // page_size
    graphs, graph_kv = graph_setup(monkeypatch, spec, num_pages, gen, sizes=(4,), layers=1)
    _, kv_heads, head_dim = MUTATION_HEADS
    eager_kv = KvCache(
        num_layers=1,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=spec.dtype,
        device="cpu",
    )
    eager_kv.layers[0].copy_(graph_kv.layers[0])
    eager, _ = backends(MUTATION_HEADS, page_size, MUTATION_WINDOW)
    batch = like_the_runner(make_batch([], [40, 3, 17], page_size, num_pages, gen))
    qkv = random_qkv(spec, 3, gen)
    out = graphs.replay(batch, dict(zip("qkv", qkv, strict=True)))
    expected = eager_outputs(eager, batch, qkv, eager_kv)
    assert torch.equal(graph_kv.layers[0][:-1], eager_kv.layers[0][:-1]), "KV cache differs"
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)


@pytest.mark.usefixtures("fi_cpu")
@pytest.mark.parametrize(("graphs", "soft_cap"), [(False, None), (True, None), (False, SOFT_CAP)])
@pytest.mark.parametrize("tensor_cores", [None, False])
def test_mutation_scenarios_pass_unmutated(monkeypatch, graphs, tensor_cores, soft_cap) -> None:
    """The scenarios below fail only because of their mutation."""
    if graphs:
        graph_scenario(monkeypatch)
    else:
        eager_scenario(tensor_cores, soft_cap)


@pytest.mark.usefixtures("fi_cpu")
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_caught(monkeypatch, name: str) -> None:
    m = MUTATIONS[name]
    m.apply(monkeypatch)
    with pytest.raises(m.raises, match=m.match):
        if m.graphs:
            graph_scenario(monkeypatch)
        else:
            eager_scenario(m.tensor_cores, m.soft_cap)


@pytest.mark.usefixtures("fi_cpu")
def test_cuda_core_decode_needs_a_supported_group() -> None:
    """GQA group 5 has no CUDA-core decode kernel; our default (tensor cores from
    group 4 on) never asks for one."""
    gen = seed("group 5")
    batch = make_batch([], [9, 33], 16, 16, gen)
    for tensor_cores in (None, False):
        fi, ref = backends((10, 2, 64), 16, None, tensor_cores)
        fi_kv, ref_kv = random_caches(fi.spec, 16, gen)
        if tensor_cores is None:
            compare_step(fi, ref, batch, fi_kv, ref_kv, gen, layers=1)
        else:
            with pytest.raises(KernelContractError, match="GQA group 5"):
                compare_step(fi, ref, batch, fi_kv, ref_kv, gen, layers=1)
