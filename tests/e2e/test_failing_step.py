"""A worker that answers a step with an error (the simulated model raising on
a poison token, as a model that crashes on some input would): the scheduler
treats it as a worker loss, retries the request a bounded number of times,
then fails that request alone with the worker's error and serves on.
Before, the core stopped and every call, then and later, got INTERNAL."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common.simulated_model import SIMULATED_VOCAB, expected_output
from tests.e2e.support.streams import run_streams
from tests.e2e.support.system import BIN, free_port, greedy, process, scrape_metric, stub

pytestmark = pytest.mark.slow

POISON = 999


def test_a_step_the_worker_fails_is_retried_then_fails_only_its_request(tmp_path: Path):
    worker = [str(BIN / "radixserve-worker"), "--model", "simulated"]
    worker += ["--simulated-step-ms", "5", "--simulated-fail-token", str(POISON)]
    with process(tmp_path, "worker", worker) as wport:
        metrics = free_port()
        sched = [str(BIN / "radixserve-scheduler"), "--worker", f"grpc://127.0.0.1:{wport}"]
        sched += ["--metrics-port", str(metrics), "--log-level", "info"]
        with process(tmp_path, "scheduler", sched) as sport:
            address = f"127.0.0.1:{sport}"
            poison = pb.GenerateRequest(
                request_id="poison",
                tokenized=pb.TokenizedInput(input_ids=[5, POISON, 6]),
                sampling_params=greedy(8),
            )
            with pytest.raises(grpc.RpcError) as info:
                list(stub(address).Generate(poison, timeout=60))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            details = info.value.details()
            assert "the worker failed the steps holding this request 3 times" in details
            assert f"fails on token {POISON}" in details
            assert scrape_metric(metrics, "radixserve_worker_losses_total") == 3
            # the service lives on, with the right tokens
            prompts = [[i + 20, 7, 3, 1] for i in range(6)]
            reqs = [
                pb.GenerateRequest(
                    request_id=f"after-{i}",
                    tokenized=pb.TokenizedInput(input_ids=p),
                    sampling_params=greedy(40, ignore_eos=True),
                    stream=True,
                )
                for i, p in enumerate(prompts)
            ]
            results = asyncio.run(run_streams(address, reqs))
            for (tokens, reason), prompt in zip(results, prompts, strict=True):
                assert reason == "length", reason
                assert tokens == expected_output(prompt, 40, SIMULATED_VOCAB)
            assert scrape_metric(metrics, "radixserve_worker_losses_total") == 3
            assert scrape_metric(metrics, "radixserve_worker_recoveries_total") == 3
    log = (tmp_path / "scheduler.log").read_text()
    assert "requests failed after repeated step failures" in log
    assert "internal error in the scheduler core" not in log
