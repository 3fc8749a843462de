"""The C decode chain (models/cpu_decode_chain.py) against the Python forward
it replaces: the same worker, the same requests, the chain on and off; the
tokens and logprobs must be equal bit for bit, on the quantized default model
and on its float (dequantized) copy."""

from __future__ import annotations

import pytest

from tests.worker_service.support.plan_driver import DriverRequest, PlanDriver
from worker_service.config import WorkerConfig
from worker_service.sampling.params import LogprobOptions, SamplingParams
from worker_service.worker import build_worker

pytestmark = pytest.mark.slow


def _requests() -> list[DriverRequest]:
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    top = LogprobOptions(top_logprobs_num=3)
    return [
        DriverRequest([(11 * j) % 30000 + 100 for j in range(40)], 12, logprobs=top),
        DriverRequest([(7 * j) % 30000 + 200 for j in range(70)], 9, arrive=2),
        DriverRequest([(5 * j) % 30000 + 300 for j in range(21)], 10, arrive=1, sampling=sampled),
        # Shares the first request's pages: its decode rows read another's prefix.
        DriverRequest(
            [(11 * j) % 30000 + 100 for j in range(32)] + [9, 8, 7], 6, arrive=4, share_from=0
        ),
    ]


def _run(worker, *, chain: bool):
    model = worker.runner.compute.model
    saved = model.decode_chain
    model.decode_chain = saved if chain else None
    try:
        reqs = _requests()
        PlanDriver(worker.runner, worker.config.page_size, chunk=16).run(reqs)
    finally:
        model.decode_chain = saved
    return [(r.outputs, r.logprob_values, r.top) for r in reqs]


@pytest.mark.parametrize("dequantize", [False, True], ids=["quantized", "float"])
def test_chain_equals_python_forward(dequantize: bool) -> None:
    worker = build_worker(
        WorkerConfig(model="default", threads=2, num_pages=200, dequantize=dequantize)
    )
    chain = worker.runner.compute.model.decode_chain
    assert chain is not None, "the default model on the CPU runs the chain"
    want = _run(worker, chain=False)
    before = chain.steps
    got = _run(worker, chain=True)
    assert chain.steps - before >= 8, "decode steps ran through the chain"
    assert got == want
