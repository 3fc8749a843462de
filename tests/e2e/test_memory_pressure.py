"""Memory pressure with the real default model: a page pool far smaller than
the load needs forces requests to be retracted and resumed, and every
output is still what the same request gives alone on a roomy server.

Priority preemption (priority in SamplingParams.custom_params) is tested end
to end in tests/e2e/test_priority_and_routing_key.py, and in the core with
outputs checked against the simulated worker's oracle:
tests/scheduler_service/core/test_scheduler.py::test_priority_preempts_and_the_preempted_request_resumes.
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common.simulated_model import simulated_token
from tests.e2e.support.metrics import scrape
from tests.e2e.support.system import free_port, greedy, separate, stub, used_tokens, wait_until

pytestmark = pytest.mark.slow

REQUESTS = 16
MAX_NEW = 16
# Page size 16: a request (a 4-8 token prompt + 16 new tokens) ends on its
# second page; the pool holds four of them, the load needs 32 pages.
NUM_PAGES = 8
# Admission charges running requests new_token_ratio x their remaining
# tokens (0.7 x this at the start); at 0.3 it overcommits the pool enough to
# retract on every run (1-4 times in the core with the simulated worker,
# whatever the arrival order or overlap depth), not only on some timings.
CONSERVATIVENESS = "0.3"


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    # distinct first tokens: no prefix sharing, so every page is a request's own
    return [
        [1000 + i] + [rng.randrange(100, 49000) for _ in range(rng.randint(3, 7))]
        for i in range(REQUESTS)
    ]


async def _all(address: str, ids: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    async def one(s, i: int, prompt: list[int]) -> list[int]:
        req = pb.GenerateRequest(
            request_id=f"mp{i}",
            tokenized=pb.TokenizedInput(input_ids=prompt),
            sampling_params=greedy(max_new, ignore_eos=True),
        )
        (r,) = [r async for r in s.Generate(req, timeout=240)]
        return list(r.complete.output_ids)

    async with grpc.aio.insecure_channel(address) as ch:
        s = pb_grpc.SglangSchedulerStub(ch)
        return await asyncio.gather(*(one(s, i, p) for i, p in enumerate(ids)))


def test_retracted_requests_resume_with_identical_greedy_outputs(tmp_path, smollm2_address):
    ids = prompts()
    t0 = time.monotonic()
    # The roomy server (1 GiB of KV) runs them all at once: no retraction.
    reference = asyncio.run(_all(smollm2_address, ids))
    t_ref = time.monotonic() - t0
    assert all(len(out) == MAX_NEW for out in reference)

    metrics = free_port()
    worker = ["--model", "default", "--num-pages", str(NUM_PAGES), "--threads", "1"]
    worker += ["--dequantize"]  # the float path, as the smollm2 fixture serves it
    with separate(
        tmp_path,
        [*worker, "--log-level", "warning"],
        ["--metrics-port", str(metrics), "--schedule-conservativeness", CONSERVATIVENESS]
        + ["--log-level", "warning"],
        env={"RADIXSERVE_CHECK_INTEGRITY": "1"},  # the page invariant after every step
    ) as address:
        s = stub(address)
        baseline = used_tokens(s)
        before = scrape(metrics)["radixserve_retractions_total"]
        t1 = time.monotonic()
        squeezed = asyncio.run(_all(address, ids))
        t_small = time.monotonic() - t1
        m = scrape(metrics)
        # pages go back once idle (the radix cache's unlocked pages are not "used")
        wait_until(lambda: used_tokens(s) == baseline, what="used pages back to baseline")
        loads = s.GetLoads(pb.GetLoadsRequest(include=["core"])).loads[0]

    print(
        f"reference {t_ref:.1f} s, {NUM_PAGES}-page pool {t_small:.1f} s, "
        f"retractions {m['radixserve_retractions_total'] - before:.0f}"
    )
    assert m["radixserve_retractions_total"] > before
    assert m["radixserve_kv_pages_total"] == NUM_PAGES
    assert loads.num_running_reqs == 0 and loads.num_waiting_reqs == 0
    for i, (got, want) in enumerate(zip(squeezed, reference, strict=True)):
        assert got == want, f"request {i} differs after retraction"


def test_many_retractions_with_the_simulated_worker_keep_outputs_exact(tmp_path):
    """The real model above can afford one or two retractions in its time
    (after one, new_token_ratio jumps near 1 and decays over 600 steps, so
    admission stops overcommitting); here 32 requests of 256 new tokens on a
    pool for two of them retract again and again, with the page invariant
    checked after every step and each output against the simulated model's
    oracle."""
    rng = random.Random(11)
    ids = [[rng.randrange(32000) for _ in range(rng.randint(8, 24))] for _ in range(32)]
    metrics = free_port()
    worker = ["--model", "simulated", "--simulated-step-ms", "1", "--num-pages", "40"]
    with separate(
        tmp_path,
        [*worker, "--log-level", "warning"],
        ["--metrics-port", str(metrics), "--log-level", "warning"],
        env={"RADIXSERVE_CHECK_INTEGRITY": "1"},
    ) as address:
        s = stub(address)
        baseline = used_tokens(s)
        t0 = time.monotonic()
        outputs = asyncio.run(_all(address, ids, max_new=256))
        elapsed = time.monotonic() - t0
        retractions = scrape(metrics)["radixserve_retractions_total"]
        wait_until(lambda: used_tokens(s) == baseline, what="used pages back to baseline")
    print(f"simulated: 32 requests in {elapsed:.1f} s, retractions {retractions:.0f}")
    # 6 in the core with the simulated worker at any seed, overlap depth or
    # arrival order; the real processes' timing may shift a few
    assert retractions >= 3
    for prompt, out in zip(ids, outputs, strict=True):
        context, want = list(prompt), []
        for _ in range(256):
            want.append(simulated_token(context, 32000))
            context.append(want[-1])
        assert out == want
