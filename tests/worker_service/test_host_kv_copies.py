"""The host tier's copies on the CPU move exactly the bytes: pages written back
to the host pool and loaded into other device pages are the same bytes in
every layer, for every KV dtype the pool stores (fp8 included, whose scales
never change), a host page written back twice keeps the later copy, and a
write-back reads its device page before a load of the same plan overwrites
it. Through the runner: a plan's write-backs, then its loads, then its
forward, on the default model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protos import worker_pb2 as pb
from tests.worker_service.support.host_tier import tiny_runner
from worker_service.device.host_kv_pool import HostKvPool, host_pages, keep_last_writes, refusal
from worker_service.device.kv_cache import KvCache
from worker_service.device.kv_quant import FP8_E4M3
from worker_service.execution.convert import plan_from_proto


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _random_kv(dtype: torch.dtype, *, layers: int = 3, pages: int = 10) -> KvCache:
    kv = KvCache(
        num_layers=layers,
        num_pages=pages,
        page_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=dtype,
        device="cpu",
    )
    gen = torch.Generator().manual_seed(0)
    for layer in kv.layers:  # random bytes: every bit pattern, NaNs included
        raw = layer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return kv


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_E4M3])
def test_write_back_then_load_restores_every_layer_bit_for_bit(dtype):
    kv = _random_kv(dtype)
    before = [_bytes(layer).clone() for layer in kv.layers]
    pool = HostKvPool(kv, 6)
    assert pool.bytes_per_page == 3 * 2 * 4 * 2 * 8 * kv.layers[0].element_size()
    assert pool.copy(ids(7, 2, 5), ids(0, 4, 1), ids(), ids()) is None  # CPU: done now
    for layer in kv.layers:
        _bytes(layer).zero_()
    pool.copy(ids(), ids(), ids(1, 0, 4), ids(3, 8, 9))
    for layer, old in zip(kv.layers, before, strict=True):
        got = _bytes(layer)
        assert torch.equal(got[3], old[5]) and torch.equal(got[8], old[7])
        assert torch.equal(got[9], old[2])
        untouched = [p for p in range(10) if p not in (3, 8, 9)]
        assert not got[untouched].any()  # nothing else written
    assert len(pool.take_timings()) == 2 and pool.take_timings() == []


def test_a_host_page_written_twice_keeps_the_later_copy():
    kv = _random_kv(torch.float32)
    before = [_bytes(layer).clone() for layer in kv.layers]
    pool = HostKvPool(kv, 4)
    pool.copy(ids(1, 2, 3, 4), ids(0, 1, 0, 2), ids(0), ids(9))
    for layer, old in zip(kv.layers, before, strict=True):
        assert torch.equal(_bytes(layer)[9], old[3])
    src, dst = keep_last_writes(ids(1, 2, 3, 4, 5), ids(0, 1, 0, 2, 1))
    assert src.tolist() == [3, 4, 5] and dst.tolist() == [0, 2, 1]


def test_a_write_back_reads_its_page_before_a_load_of_the_same_plan_overwrites_it():
    """The scheduler may free a page by planning its write-back and hand it to
    a load of the same plan."""
    kv = _random_kv(torch.float32)
    before = [_bytes(layer).clone() for layer in kv.layers]
    pool = HostKvPool(kv, 4)
    pool.copy(ids(6), ids(2), ids(), ids())  # host page 2 holds device page 6
    pool.copy(ids(4), ids(0), ids(2), ids(4))  # page 4 out to host 0, host 2 into page 4
    pool.copy(ids(), ids(), ids(0), ids(1))
    for layer, old in zip(kv.layers, before, strict=True):
        got = _bytes(layer)
        assert torch.equal(got[4], old[6]) and torch.equal(got[1], old[4])


def test_sizing_and_what_is_refused():
    assert host_pages(device_pages=100, bytes_per_page=1000, ratio=2.0, size_gib=0) == 200
    assert host_pages(device_pages=100, bytes_per_page=1 << 20, ratio=2.0, size_gib=0.5) == 512
    sliding = KvCache(
        num_layers=2,
        num_pages=4,
        page_size=4,
        num_kv_heads=1,
        head_dim=4,
        dtype=torch.float32,
        device="cpu",
        swa_layers=frozenset({0}),
        num_swa_pages=4,
    )
    assert "sliding-window" in refusal(sliding)
    with pytest.raises(ValueError, match="sliding-window"):
        HostKvPool(sliding, 4)


def _plan(step_id: int, *, wb=((), ()), ld=((), ())) -> pb.StepPlan:
    msg = pb.StepPlan(step_id=step_id, mode=pb.FORWARD_MODE_IDLE)
    msg.write_back_device_pages.extend(wb[0])
    msg.write_back_host_pages.extend(wb[1])
    msg.load_host_pages.extend(ld[0])
    msg.load_device_pages.extend(ld[1])
    return msg


def test_through_the_runner_on_the_default_model():
    """A prefill's pages written back by an IDLE plan, device pages scrambled,
    loaded into other pages by the plan of a request that joins with them as
    its cached prefix: the pages are bit for bit the prefill's in every layer,
    and the request's first token is the one computing the prompt gives."""
    runner, kv, _ = tiny_runner(num_pages=12, host_pages=8)
    page = kv.page_size
    prompt = [(i * 37) % 1000 + 5 for i in range(2 * page + 3)]

    def prefill(step_id: int, slot: int, pages: list[int]) -> pb.StepPlan:
        msg = pb.StepPlan(step_id=step_id, mode=pb.FORWARD_MODE_PREFILL)
        msg.joins.add(slot=slot, rid=f"r{slot}", prompt_len=len(prompt))
        msg.extends.add(slot=slot, start_pos=0, input_ids=prompt, new_pages=pages, sample=True)
        return msg

    first = runner.execute(plan_from_proto(prefill(1, 0, [0, 1, 2])))
    assert not first.error
    cached = [_bytes(layer)[[0, 1]].clone() for layer in kv.layers]  # the two full pages
    assert not runner.execute(plan_from_proto(_plan(2, wb=([0, 1], [5, 3])))).error
    for layer in kv.layers:
        _bytes(layer)[:3].zero_()
    leave = _plan(3)
    leave.leaves.append(0)
    assert not runner.execute(plan_from_proto(leave)).error
    # The prefix (2 pages) loaded into pages 7, 4; the rest computed into page 9.
    msg = _plan(4, ld=([5, 3], [7, 4]))
    msg.mode = pb.FORWARD_MODE_PREFILL
    msg.joins.add(slot=1, rid="again", prompt_len=len(prompt), prefix_ids=prompt[: 2 * page])
    msg.extends.add(
        slot=1, start_pos=2 * page, input_ids=prompt[2 * page :], new_pages=[7, 4, 9], sample=True
    )
    again = runner.execute(plan_from_proto(msg))
    assert not again.error, again.error
    for layer, old in zip(kv.layers, cached, strict=True):
        assert torch.equal(_bytes(layer)[[7, 4]], old)
    assert again.token_ids == first.token_ids
    runner.check_integrity()
