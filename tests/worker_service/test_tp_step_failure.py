"""A step that fails on one tensor-parallel rank fails on every rank, at
once: rank 0's sampler raising (--fail-sample-token), or a plan only rank 0
refuses (an adapter loaded on rank 1 alone). Before, rank 0 answered with
an error while rank 1 waited in the step's collectives for ever (and rank
0's next collective would have met the wrong one). 2 gloo ranks on CPU.

After the failure the group serves on: a new session (the scheduler's
recovery) re-prefills the requests that were not at fault, and their
tokens are those of a run without the fault."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from tests.support.lora_adapters import ATTENTION, make_adapter
from tests.worker_service.support.group_plans import BoundedStreams, GroupDriver, GroupRequest
from tests.worker_service.support.tiny_hf_models import tiny_model
from tests.worker_service.support.worker_process import free_port, worker_processes

# Starts worker processes (tests/support/process_guard.py).
pytestmark = pytest.mark.server

PAGE = 16
POISON = 233
NEW = 10
STEP_TIMEOUT_S = 30  # a step takes well under a second; a hung rank never answers


def _requests() -> list[GroupRequest]:
    return [
        GroupRequest([7, 8, 9, 10, 11, 12], NEW),
        GroupRequest([250, 3], NEW),
        GroupRequest(list(range(40, 70)), NEW, join_at=2),
    ]


def _session(addresses: list[str], reqs: list[GroupRequest], first_step_id: int):
    streams = BoundedStreams(addresses)
    try:
        return GroupDriver(streams, PAGE, first_step_id).run(reqs, STEP_TIMEOUT_S)
    finally:
        streams.close()


def _fails_on_every_rank(addresses: list[str], reqs: list[GroupRequest], fault: GroupRequest):
    """Run ``reqs`` with ``fault`` joining at step 4: that step fails on
    every rank (within the timeout); a new session then finishes the others."""
    t0 = time.monotonic()
    failed_at, results = _session(addresses, [*reqs, fault], first_step_id=100)
    assert results is not None and failed_at == fault.join_at
    assert all(r.error for r in results), [r.error for r in results]
    assert time.monotonic() - t0 < 4 * STEP_TIMEOUT_S
    survivors = [GroupRequest(r.prompt, r.max_new, outputs=r.outputs) for r in reqs]
    assert all(0 < len(s.outputs) < NEW for s in survivors[:2])
    _, error = _session(addresses, survivors, first_step_id=200)
    assert error is None
    return results, [s.outputs for s in survivors]


def test_a_step_failing_on_one_rank_fails_on_all_and_the_others_serve_on(tmp_path: Path):
    hf = tiny_model("llama3-rope-scaling", tmp_path)
    adapter = make_adapter(tmp_path / "adapters", "a", 4, ATTENTION, seed=5, base=hf)
    common = ("--model", str(tmp_path), "--page-size", str(PAGE), "--num-pages", "64")
    common += ("--threads", "1", "--fail-sample-token", str(POISON))
    tp = ("--tp-size", "2", "--dist-addr", f"127.0.0.1:{free_port()}")
    ranks = [(*common, *tp, "--tp-rank", str(r)) for r in (0, 1)]
    with worker_processes(tmp_path, *ranks) as addresses:
        reference = _requests()
        _, error = _session(addresses, reference, first_step_id=1)
        assert error is None
        expected = [r.outputs for r in reference]

        # Rank 0's sampler raises in the step where the poisoned prompt joins.
        poisoned = GroupRequest([5, POISON, 6], NEW, join_at=4)
        results, outputs = _fails_on_every_rank(addresses, _requests(), poisoned)
        assert "fails on token 233" in results[0].error
        assert "rank 0 failed sampling" in results[1].error
        assert outputs == expected

        # A plan only rank 0 refuses: the adapter was loaded on rank 1 alone.
        with grpc.insecure_channel(addresses[1]) as channel:
            request = pb.LoadAdapterRequest(name="a", path=str(adapter))
            load = worker_pb2_grpc.WorkerStub(channel).LoadAdapter(request)
        assert not load.error, load.error
        with_adapter = GroupRequest([5, 6, 7], NEW, join_at=4, adapter="a")
        results, outputs = _fails_on_every_rank(addresses, _requests(), with_adapter)
        assert "adapter" in results[0].error
        assert "rank(s) [0] could not run it" in results[1].error
        assert outputs == expected
