"""The worker's file tier (execution/file_copies.py) moves exactly the bytes:
host pages written to files after the plan's write-backs are read back by
another process's pool (a fresh pool on the same folder) into other host
pages, bit for bit in every layer; a corrupt or missing file is a failed
read, reported by index once all of the plan's reads are done; a new
session drops the old one's reports; the flags go together; a worker
without a file tier refuses a plan with file copies."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from protos import worker_pb2 as pb
from worker_service.config import load_config
from worker_service.device.host_kv_pool import HostKvPool
from worker_service.device.kv_cache import KvCache
from worker_service.device.kv_file_store import KvFileStore, KvLayout
from worker_service.execution.convert import plan_from_proto
from worker_service.execution.file_copies import HostKvFiles
from worker_service.execution.plan import StorageCopies

LAYOUT = KvLayout("m", "bfloat16", 4, 3, 2, 8)


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _kv(seed: int) -> KvCache:
    kv = KvCache(
        num_layers=3,
        num_pages=10,
        page_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.bfloat16,
        device="cpu",
    )
    gen = torch.Generator().manual_seed(seed)
    for layer in kv.layers:
        raw = layer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return kv


def _files(tmp_path, seed: int = 0) -> tuple[KvCache, HostKvPool, HostKvFiles]:
    kv = _kv(seed)
    host = HostKvPool(kv, 6)
    store = KvFileStore(tmp_path, LAYOUT, host.bytes_per_page, 1 << 20)
    return kv, host, HostKvFiles(host, store)


def _copies(writes=((), ()), reads=((), ())) -> StorageCopies:
    return StorageCopies(ids(*writes[0]), ids(*writes[1]), ids(*reads[0]), ids(*reads[1]))


def _stored(files: HostKvFiles, hashes: list[int]) -> None:
    deadline = time.monotonic() + 10
    while not all(files.store.contains(hashes)):
        assert time.monotonic() < deadline, "the writer thread never wrote the files"
        time.sleep(0.01)


def _reports(files: HostKvFiles, n: int) -> list:
    out: list = []
    deadline = time.monotonic() + 10
    while len(out) < n:
        assert time.monotonic() < deadline, "the reads were never reported"
        files.wait_done(0.05)
        out += files.take_done()
    return out


def test_pages_written_after_write_backs_are_read_back_bit_for_bit_elsewhere(tmp_path):
    kv, host, files = _files(tmp_path)
    # The plan: write device pages 7, 2 back to host pages 0, 4; store both.
    host.copy(ids(7, 2), ids(0, 4), ids(), ids())
    files.run(1, _copies(([-5, 2**62], [0, 4])))
    _stored(files, [-5, 2**62])
    assert files.counts().written == 2
    # Another process on the same folder reads them into its host pages 3, 1.
    _, host2, files2 = _files(tmp_path, seed=1)
    assert sorted(files2.store.stored_hashes().tolist()) == [-5, 2**62]
    files2.run(8, _copies(reads=([2**62, -5], [3, 1])))
    [done] = _reports(files2, 1)
    assert (done.step_id, done.failed) == (8, [])
    for device, got in zip(kv.layers, host2.layers, strict=True):
        assert torch.equal(got[3].view(torch.uint8), device[2].view(torch.uint8))
        assert torch.equal(got[1].view(torch.uint8), device[7].view(torch.uint8))
    assert files2.counts().read == 2


def test_a_corrupt_or_missing_file_is_a_failed_read_by_index(tmp_path):
    _, _, files = _files(tmp_path)
    files.run(1, _copies(([11, 12], [0, 1])))
    _stored(files, [11, 12])
    path = files.store.path(12)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    files.run(2, _copies(reads=([11, 12, 13], [2, 3, 4])))
    [done] = _reports(files, 1)
    assert (done.step_id, done.failed) == (2, [1, 2])
    assert files.counts().read == 1 and files.counts().read_failed == 2
    assert not files.store.contains([12])[0]  # a bad file is unlinked


def test_reads_of_two_plans_are_reported_per_plan_and_a_new_session_drops_them(tmp_path):
    _, _, files = _files(tmp_path)
    files.run(1, _copies(([21], [0])))
    _stored(files, [21])
    files.run(2, _copies(reads=([21], [1])))
    files.run(3, _copies(reads=([22], [2])))
    done = _reports(files, 2)
    assert [(d.step_id, d.failed) for d in done] == [(2, []), (3, [0])]
    files.run(4, _copies(reads=([21], [3])))
    files.forget()
    assert files.take_done() == []
    files.wait_done(0.5)  # nothing out: returns at once


def test_a_worker_without_a_file_tier_refuses_file_copies():
    from tests.worker_service.support.host_tier import tiny_runner

    runner, _, _ = tiny_runner(num_pages=4, host_pages=4)
    msg = pb.StepPlan(step_id=1, mode=pb.FORWARD_MODE_IDLE)
    msg.storage_read_hashes.append(5)
    msg.storage_read_host_pages.append(1)
    result = runner.execute(plan_from_proto(msg))
    assert "no file tier (--hicache-file-dir)" in result.error


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--hicache-file-dir", "/x"], "file tier behind the host KV tier; add --enable-hier"),
        (["--enable-hierarchical-cache", "--hicache-file-size", "2"], "add --hicache-file-dir"),
    ],
)
def test_file_tier_flags_go_together(argv, error):
    cfg = load_config(["--enable-hierarchical-cache", "--hicache-file-dir", "/x"], env={})
    assert (cfg.hicache_file_dir, cfg.hicache_file_size) == ("/x", 0.0)
    with pytest.raises(SystemExit, match=error):
        load_config(argv, env={})


def test_serve_passes_the_file_tier_on_to_its_workers():
    from pathlib import Path

    from scheduler_service.config import load_config as scheduler_config
    from scheduler_service.serve import _worker_args
    from worker_service.config import WorkerConfig

    service = scheduler_config(["--worker", "grpc://127.0.0.1:1"])
    worker = WorkerConfig(
        enable_hierarchical_cache=True, hicache_file_dir="/kv", hicache_file_size=2.0
    )
    args = _worker_args(worker, service, 0, Path("/tmp/port"), dist="", port=1)
    at = args.index("--hicache-file-dir")
    assert args[at : at + 4] == ["--hicache-file-dir", "/kv", "--hicache-file-size", "2.0"]
    plain = WorkerConfig(enable_hierarchical_cache=True)
    assert "--hicache-file-dir" not in _worker_args(plain, service, 0, Path("/p"), dist="", port=1)


def test_writes_past_the_backlog_are_dropped_and_close_flushes_the_rest(tmp_path, monkeypatch):
    from worker_service.execution import file_copies

    _, host, files = _files(tmp_path)
    monkeypatch.setattr(file_copies, "MAX_WRITE_BACKLOG_BYTES", 2 * host.bytes_per_page)
    files.run(1, _copies(([31, 32, 33], [0, 1, 2])))  # more than the backlog holds
    assert files.counts().write_failed == 3
    files.run(2, _copies(([34, 35], [3, 4])))
    files.close()
    assert files.store.contains([34, 35]) == [True, True]
    assert files.counts().written == 2


def test_the_runner_files_a_page_written_back_in_the_same_plan(tmp_path):
    """Through the runner: a plan's storage writes read their host pages
    after its write-backs; a later plan's reads fill other host pages with
    the same bytes and the next result reports them."""
    from tests.worker_service.support.host_tier import tiny_runner

    runner, kv, host = tiny_runner(num_pages=4, host_pages=4)
    runner.files = HostKvFiles(host, KvFileStore(tmp_path, LAYOUT, host.bytes_per_page, 1 << 24))
    for layer in kv.layers:  # known bytes in device page 2
        raw = layer[2].view(torch.uint8)
        raw.copy_((torch.arange(raw.numel()) % 251).to(torch.uint8).view(raw.shape))
    msg = pb.StepPlan(step_id=1, mode=pb.FORWARD_MODE_IDLE)
    msg.write_back_device_pages.append(2)
    msg.write_back_host_pages.append(0)
    msg.storage_write_hashes.append(77)
    msg.storage_write_host_pages.append(0)
    assert runner.execute(plan_from_proto(msg)).error == ""
    _stored(runner.files, [77])
    msg = pb.StepPlan(step_id=2, mode=pb.FORWARD_MODE_IDLE)
    msg.storage_read_hashes.append(77)
    msg.storage_read_host_pages.append(3)
    assert runner.execute(plan_from_proto(msg)).error == ""
    [done] = _reports(runner.files, 1)
    assert (done.step_id, done.failed) == (2, [])
    for device, got in zip(kv.layers, host.layers, strict=True):
        assert torch.equal(got[3].view(torch.uint8), device[2].view(torch.uint8))
    runner.files.close()
