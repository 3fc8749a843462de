"""The file tier's store (worker_service/device/kv_file_store.py): pages
round-trip bit for bit; a truncated, corrupt, foreign, misnamed or
half-written file is a miss, never bytes; two processes share a folder;
the cap evicts the least recently used files."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from worker_service.device.kv_file_store import HEADER_SIZE, KvFileStore, KvLayout

LAYOUT = KvLayout("toy-model@1", "bfloat16", 16, 2, 2, 8)
# Two layers, K and V, 16 slots, 2 heads of 8 dims, bf16.
PAGE_SHAPE = (2, 2, 16, 2, 8)
PAGE_NBYTES = int(np.prod(PAGE_SHAPE)) * 2


def page_for(key: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(key & 0x7FFF_FFFF)
    return torch.randn(PAGE_SHAPE, generator=g).to(torch.bfloat16)


def page_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def store(tmp_path: Path, max_pages: int = 64, layout: KvLayout = LAYOUT) -> KvFileStore:
    return KvFileStore(tmp_path, layout, PAGE_NBYTES, max_pages * (PAGE_NBYTES + HEADER_SIZE))


def test_round_trip_is_bit_for_bit(tmp_path):
    s = store(tmp_path)
    keys = [1, -1, 2**63 - 1, -(2**63), 123456789]
    for k in keys:
        assert s.write(k, page_bytes(page_for(k)))
    for k in keys:
        got = s.read(k)
        assert got is not None
        back = torch.from_numpy(got).view(torch.bfloat16).reshape(PAGE_SHAPE)
        assert torch.equal(back.view(torch.int16), page_for(k).view(torch.int16))
    assert s.contains([*keys, 99]) == [True] * len(keys) + [False]
    assert sorted(s.stored_hashes().tolist()) == sorted(keys)
    out = np.zeros(PAGE_NBYTES, np.uint8)
    assert s.read_into(keys[0], out) and np.array_equal(out, page_bytes(page_for(keys[0])))


def test_a_missing_page_is_a_miss(tmp_path):
    s = store(tmp_path)
    assert s.read(7) is None and s.misses == 1


def _damaged(tmp_path: Path, damage) -> KvFileStore:
    s = store(tmp_path)
    s.write(5, page_bytes(page_for(5)))
    path = s.path(5)
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(damage(data)))
    return s


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d[: len(d) - 1],  # truncated payload
        lambda d: d[: HEADER_SIZE - 3],  # truncated header
        lambda d: d[:0],  # empty
        lambda d: d + b"\0",  # trailing bytes
    ],
    ids=["truncated-payload", "truncated-header", "empty", "trailing"],
)
def test_a_truncated_or_padded_file_is_a_miss(tmp_path, damage):
    s = _damaged(tmp_path, damage)
    assert s.read(5) is None
    assert not s.path(5).exists()  # unlinked, so a later write replaces it
    assert s.write(5, page_bytes(page_for(5))) and s.read(5) is not None


@pytest.mark.parametrize("offset", [0, 6, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 777, -1])
def test_a_flipped_byte_is_a_miss(tmp_path, offset):
    def flip(d: bytearray) -> bytearray:
        d[offset] ^= 0x10
        return d

    assert _damaged(tmp_path, flip).read(5) is None


def test_another_layout_never_reads_the_pages(tmp_path):
    s = store(tmp_path)
    s.write(5, page_bytes(page_for(5)))
    for other in (
        KvLayout("toy-model@2", "bfloat16", 16, 2, 2, 8),
        KvLayout("toy-model@1", "float16", 16, 2, 2, 8),
        KvLayout("toy-model@1", "bfloat16", 16, 2, 2, 8, tp_rank=1, tp_size=2),
    ):
        assert store(tmp_path, layout=other).read(5) is None
    # A file moved into another layout's folder is refused by its header.
    other = store(tmp_path, layout=KvLayout("toy-model@1", "bfloat16", 16, 2, 2, 8, tp_rank=1))
    os.replace(s.path(5), other.path(5))
    assert other.read(5) is None


def test_a_file_under_another_blocks_name_is_a_miss(tmp_path):
    s = store(tmp_path)
    s.write(5, page_bytes(page_for(5)))
    os.replace(s.path(5), s.path(6))
    assert s.read(6) is None and s.read(5) is None


def test_a_half_written_temporary_file_is_never_read(tmp_path):
    s = store(tmp_path)
    full = page_bytes(page_for(9)).tobytes()
    # A writer that died mid-way leaves its temporary file, never the final name.
    (s.dir / f".tmp-{os.getpid()}-1-dead").write_bytes(full[: len(full) // 2])
    assert s.read(9) is None and s.contains([9]) == [False]
    assert s.stored_hashes().tolist() == []
    old = time.time() - 3600
    os.utime(s.dir / f".tmp-{os.getpid()}-1-dead", (old, old))
    s.evict()
    assert not any(s.dir.iterdir())  # the dead writer's file is gone


def test_the_cap_evicts_the_least_recently_used(tmp_path):
    s = store(tmp_path, max_pages=10)
    t0 = time.time() - 1000
    for k in range(10):
        s.write(k, page_bytes(page_for(k)))
        os.utime(s.path(k), (t0 + k, t0 + k))  # k = 0 oldest
    os.utime(s.path(0), (t0 + 50, t0 + 50))  # read or rewritten lately
    s.write(10, page_bytes(page_for(10)))  # 11 pages: over the cap
    present = {k for k in range(11) if s.path(k).exists()}
    assert present == {0, 3, 4, 5, 6, 7, 8, 9, 10}  # down to 90% of the cap
    assert s.evicted == 2
    size = sum(p.stat().st_size for p in s.dir.iterdir())
    assert size <= s.max_bytes


def test_a_read_renews_recency(tmp_path):
    s = store(tmp_path)
    s.write(1, page_bytes(page_for(1)))
    old = time.time() - 1000
    os.utime(s.path(1), (old, old))
    assert s.read(1) is not None
    assert s.path(1).stat().st_mtime > old + 500


# Two processes (forked by one command the test runs to completion) write
# and read the same keys; a page's bytes follow from its key, so any read
# that returns bytes must return exactly those.
_TWO_WRITERS = """
import multiprocessing, sys
from pathlib import Path
import numpy as np
from worker_service.device.kv_file_store import HEADER_SIZE, KvFileStore, KvLayout

LAYOUT = KvLayout("toy-model@1", "bfloat16", 16, 2, 2, 8)
NBYTES = int(sys.argv[2])

def page(k):
    return np.random.default_rng(k).integers(0, 256, NBYTES, dtype=np.uint8)

def hammer(seed, q):
    s = KvFileStore(Path(sys.argv[1]), LAYOUT, NBYTES, 24 * (NBYTES + HEADER_SIZE))
    rng = np.random.default_rng(seed)
    bad = hits = 0
    for _ in range(400):
        k = int(rng.integers(0, 40))
        if rng.random() < 0.5:
            s.write(k, page(k))
        else:
            got = s.read(k)
            if got is not None:
                hits += 1
                bad += not np.array_equal(got, page(k))
    q.put((bad, hits))

if __name__ == "__main__":
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=hammer, args=(i, q)) for i in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(bad == 0 for bad, _ in results), results
    assert sum(h for _, h in results) > 0, results
    s = KvFileStore(Path(sys.argv[1]), LAYOUT, NBYTES, 24 * (NBYTES + HEADER_SIZE))
    for k in s.stored_hashes().tolist():
        got = s.read(k)
        assert got is not None and np.array_equal(got, page(k)), k
    print("ok", results)
"""


def test_two_processes_share_a_folder(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", _TWO_WRITERS, str(tmp_path), str(PAGE_NBYTES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0 and "\nok [" in "\n" + out.stdout, out.stdout + out.stderr
    s = store(tmp_path)
    assert not [p for p in s.dir.iterdir() if p.name.startswith(".tmp-")]
