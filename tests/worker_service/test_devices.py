"""Device selection, checked on CPU with torch.cuda's calls recorded: an
index-less ``cuda`` becomes an explicit ``cuda:N`` once at start, every thread
that touches CUDA selects it, and a launcher gives each tensor-parallel rank
its own GPU; a sticky CUDA error ends the worker process so it is restarted."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import pytest
import torch

from protos import worker_pb2 as pb
from scheduler_service.config import ServiceConfig
from scheduler_service.serve import _worker_args
from worker_service.config import WorkerConfig, rank_device
from worker_service.device.context import is_sticky_device_error, resolve_device, use_device
from worker_service.rpc.servicer import EXIT_DEVICE_FAILURE, WorkerServicer
from worker_service.worker import build_worker


class RecordedCuda:
    """torch.cuda as far as device selection goes, with torch 2.13's refusal of
    an index-less device; records (thread name, device) per set_device."""

    def __init__(self, count: int = 2, current: int = 0) -> None:
        self.count = count
        self.current = current
        self.selected: list[tuple[str, torch.device]] = []

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return self.current

    def set_device(self, device: torch.device) -> None:
        device = torch.device(device)
        if device.index is None:
            raise ValueError("Expected a torch.device with a specified index")
        self.selected.append((threading.current_thread().name, device))


@pytest.fixture
def cuda(monkeypatch) -> RecordedCuda:
    rec = RecordedCuda()
    for name in ("is_available", "device_count", "current_device", "set_device"):
        monkeypatch.setattr(torch.cuda, name, getattr(rec, name))
    return rec


def test_cuda_without_an_index_becomes_the_current_gpu():
    rec = RecordedCuda(count=2, current=1)
    assert resolve_device("cuda", rec) == torch.device("cuda", 1)
    assert resolve_device("cuda:0", rec) == torch.device("cuda", 0)
    assert resolve_device("cpu", rec) == torch.device("cpu")


@pytest.mark.parametrize(
    ("name", "count", "error"),
    [
        ("cuda", 0, "sees no CUDA device"),
        ("cuda:2", 2, "has 2 GPUs"),
        ("mps", 1, "only cpu and cuda"),
    ],
)
def test_impossible_devices_stop_the_worker_with_a_reason(name, count, error):
    with pytest.raises(SystemExit, match=error):
        resolve_device(name, RecordedCuda(count=count))


def test_use_device_selects_an_explicit_gpu_and_leaves_the_cpu_alone():
    rec = RecordedCuda()
    use_device(torch.device("cpu"), rec)
    use_device(torch.device("cuda", 1), rec)
    assert rec.selected == [(threading.current_thread().name, torch.device("cuda", 1))]
    with pytest.raises(ValueError, match="explicit"):
        use_device(torch.device("cuda"), rec)


def test_build_worker_with_plain_cuda_starts_on_an_explicit_gpu(cuda):
    # Before: torch.cuda.set_device(torch.device("cuda")) raised at start.
    cuda.current = 1
    worker = build_worker(WorkerConfig(model="simulated", device="cuda", num_pages=64))
    assert worker.device == torch.device("cuda", 1)
    assert cuda.selected == [(threading.current_thread().name, torch.device("cuda", 1))]


def test_the_executing_thread_selects_the_workers_gpu(cuda):
    # Before: only the main thread selected it; with cuda:1 the executing thread
    # stayed on GPU 0 and waited on the wrong GPU's stream for its tokens.
    worker = build_worker(WorkerConfig(model="simulated", device="cuda:1", num_pages=64))
    cuda.selected.clear()
    servicer = WorkerServicer(worker)
    plans: queue.SimpleQueue = queue.SimpleQueue()
    results: queue.SimpleQueue = queue.SimpleQueue()
    plans.put(pb.StepPlan(step_id=1, mode=pb.FORWARD_MODE_IDLE))
    plans.put(None)
    thread = threading.Thread(
        target=servicer._run_plans, args=(plans, servicer._stream_gen, results), name="exec"
    )
    thread.start()
    thread.join(10)
    assert results.get().step_id == 1 and results.get() is None
    assert cuda.selected == [("exec", torch.device("cuda", 1))]


def test_each_rank_gets_its_own_gpu_from_the_launcher():
    assert [rank_device("cuda", r, 4) for r in range(4)] == [f"cuda:{r}" for r in range(4)]
    assert rank_device("cuda", 0, 1) == "cuda" and rank_device("cpu", 1, 2) == "cpu"
    assert rank_device("cuda:3", 0, 1) == "cuda:3"
    with pytest.raises(SystemExit, match="every rank on one GPU"):
        rank_device("cuda:1", 0, 2)
    # and radixserve serve passes it on, rank by rank
    worker = WorkerConfig(device="cuda", tp_size=2)
    for rank in (0, 1):
        cmd = _worker_args(worker, ServiceConfig(), rank, Path("p"), dist="h:1", port=5000 + rank)
        assert cmd[cmd.index("--device") + 1] == f"cuda:{rank}"


class BrokenCompute:
    def __init__(self, message: str) -> None:
        self.message = message

    def run(self, work, num_extends):
        raise RuntimeError(self.message)


def _plan_with_a_step() -> pb.StepPlan:
    msg = pb.StepPlan(step_id=1, mode=pb.FORWARD_MODE_PREFILL)
    join = msg.joins.add(slot=0, rid="r", prompt_len=3)
    join.sampling.temperature = 0.0
    msg.extends.add(slot=0, start_pos=0, input_ids=[1, 2, 3], new_pages=[0], sample=True)
    return msg


@pytest.mark.parametrize(
    ("message", "sticky"),
    [
        ("CUDA error: an illegal memory access was encountered", True),
        ("CUDA error: device-side assert triggered", True),
        ("CUDA error: unspecified launch failure", True),
        ("shape mismatch in some op", False),
    ],
)
def test_a_broken_gpu_context_ends_the_worker_process(message, sticky):
    worker = build_worker(WorkerConfig(model="simulated", num_pages=64, page_size=4))
    worker.runner.compute = BrokenCompute(message)
    exits: list[int] = []
    servicer = WorkerServicer(worker, exit_process=exits.append)
    plans: queue.SimpleQueue = queue.SimpleQueue()
    results: queue.SimpleQueue = queue.SimpleQueue()
    plans.put(_plan_with_a_step())
    plans.put(None)
    servicer._run_plans(plans, servicer._stream_gen, results)
    if sticky:
        # restarted by `radixserve serve` / Kubernetes; the scheduler recovers
        assert exits == [EXIT_DEVICE_FAILURE] and results.empty()
    else:
        # an ordinary failure is answered and the worker goes on, state dropped
        assert exits == [] and "failed on the worker" in results.get().error
        assert results.get() is None and not worker.runner.slots


def test_out_of_memory_is_not_a_broken_context():
    assert not is_sticky_device_error(torch.OutOfMemoryError("CUDA error: out of memory"))
    assert is_sticky_device_error(RuntimeError("CUDA error: misaligned address"))
