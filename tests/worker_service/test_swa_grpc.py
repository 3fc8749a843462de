"""A worker process serving a sliding-window model from two pools, over gRPC:
GetInfo reports the sliding pool (its pages at --swa-full-tokens-ratio of the
full pool's, the window) and the memory both take; plans carry sliding pages
(``new_swa_pages``, ``decode_new_swa_pages``), a cached prefix's early
sliding entry is the null page, a plan with the null page inside a window is
refused by name and changes nothing, and the tokens are transformers'; also
under tensor parallelism (2 gloo ranks sizing both pools from one budget)."""

from __future__ import annotations

import grpc
import pytest

from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from tests.support.hf_reference import hf_greedy
from tests.worker_service.support.tiny_hf_models import COMMON, SLIDING_WINDOW, tiny_model
from tests.worker_service.support.worker_process import (
    PlanStream,
    free_port,
    worker_process,
    worker_processes,
)

# Starts a worker process (tests/support/process_guard.py).
pytestmark = pytest.mark.server

PAGE, PAGES, RATIO = 4, 64, 0.25
GREEDY = pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0)
PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 1, 2, 77, 31, 64, 9]  # 14: pages 0-3
SHARER = PROMPT[:12] + [120, 6]  # 12 cached: its first query (12) sees 5..12


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("swa")
    hf = tiny_model("mistral-sliding", path)
    args = ("--model", str(path), "--page-size", str(PAGE), "--num-pages", str(PAGES))
    with worker_process(path, *args, "--swa-full-tokens-ratio", str(RATIO)) as addr:
        yield hf, addr


def test_get_info_reports_the_sliding_pool(served) -> None:
    _, addr = served
    with grpc.insecure_channel(addr) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).GetInfo(pb.GetInfoRequest())
    swa = int(PAGES * RATIO)
    assert (info.num_pages, info.num_swa_pages, info.swa_window) == (PAGES, swa, SLIDING_WINDOW)
    # Every layer slides: only the sliding pool stores (plus its graph scratch page).
    layer_page = 2 * PAGE * COMMON["num_key_value_heads"] * 16 * 4  # head_dim 16, float32
    assert info.kv_cache_bytes == 3 * (swa + 1) * layer_page


def sliding_plans(streams: list[PlanStream]) -> tuple[list[int], list[int]]:
    """Request a's prompt, a bad then a good join of b on its cached prefix,
    six decodes of both; every rank gets every plan, rank 0's tokens count."""

    def run(plan: pb.StepPlan) -> pb.StepResult:
        for stream in streams:
            stream.send(plan)
        results = [stream.receive() for stream in streams]
        return results[0]

    first = pb.StepPlan(step_id=1, mode=pb.FORWARD_MODE_PREFILL)
    first.joins.add(slot=0, rid="a", sampling=GREEDY, prompt_len=len(PROMPT))
    first.extends.add(
        slot=0, start_pos=0, input_ids=PROMPT, new_pages=[0, 1, 2, 3], new_swa_pages=[1, 2, 3, 4]
    )
    first.extends[0].sample = True
    a = [run(first).token_ids[0]]

    def sharer(step: int, swa_pages: list[int]) -> pb.StepPlan:
        plan = pb.StepPlan(step_id=step, mode=pb.FORWARD_MODE_PREFILL)
        plan.joins.add(
            slot=1, rid="b", sampling=GREEDY, prompt_len=len(SHARER), prefix_ids=SHARER[:12]
        )
        plan.extends.add(
            slot=1, start_pos=12, input_ids=SHARER[12:], new_pages=[0, 1, 2, 4], sample=True
        )
        plan.extends[0].new_swa_pages.extend(swa_pages)
        return plan

    refused = run(sharer(2, [0, 0, 3, 5]))
    assert "null page inside the window of its query at position 12" in refused.error
    joined = run(sharer(3, [0, 2, 3, 5]))  # sliding page 0 freed: out of its window
    assert not joined.error, joined.error
    b = [joined.token_ids[0]]
    for step, pos in enumerate(range(14, 20)):
        plan = pb.StepPlan(step_id=10 + step, mode=pb.FORWARD_MODE_DECODE)
        plan.decode_slots.extend([0, 1])
        plan.decode_positions.extend([pos, pos])
        fresh = pos % PAGE == 0  # 16: a new page in each pool
        plan.decode_new_pages.extend([6, 7] if fresh else [0, 0])
        plan.decode_new_swa_pages.extend([7, 8] if fresh else [0, 0])
        result = run(plan)
        assert not result.error, result.error
        a.append(result.token_ids[0])
        b.append(result.token_ids[1])
    for stream in streams:
        stream.close()
    return a, b


def test_plans_with_sliding_pages_give_transformers_tokens(served) -> None:
    hf, addr = served
    a, b = sliding_plans([PlanStream(addr)])
    assert a == hf_greedy(hf, PROMPT, 7)[0]
    assert b == hf_greedy(hf, SHARER, 7)[0]


def test_two_gloo_ranks_size_the_same_pools_and_give_the_same_tokens(served, tmp_path) -> None:
    """Sized from a memory budget (the ranks agree on the smallest), each rank
    holding half the KV heads."""
    hf, _ = served
    path = tmp_path / "model"
    tiny_model("mistral-sliding", path)
    common = ("--model", str(path), "--page-size", str(PAGE), "--kv-memory", "1MiB")
    tp = ("--tp-size", "2", "--dist-addr", f"127.0.0.1:{free_port()}", "--threads", "1")
    ranks = [(*common, *tp, "--tp-rank", str(r)) for r in (0, 1)]
    with worker_processes(tmp_path, *ranks) as addresses:
        infos = []
        for addr in addresses:
            with grpc.insecure_channel(addr) as channel:
                infos.append(worker_pb2_grpc.WorkerStub(channel).GetInfo(pb.GetInfoRequest()))
        a, b = sliding_plans([PlanStream(addr) for addr in addresses])
    pools = {(i.num_pages, i.num_swa_pages, i.swa_window) for i in infos}
    ((full, swa, window),) = pools  # the same on both ranks
    # All layers slide: 1 MiB of sliding pages (3 layers, 1 KV head a rank,
    # page 4 x head dim 16 float32), and 1 / 0.8 as many full ones.
    layer_page = 2 * PAGE * 1 * 16 * 4
    assert (swa, window) == (int(full * 0.8), SLIDING_WINDOW)
    assert swa * 3 * layer_page <= 1 << 20 < (swa + 2) * 3 * layer_page
    assert a == hf_greedy(hf, PROMPT, 7)[0]
    assert b == hf_greedy(hf, SHARER, 7)[0]
