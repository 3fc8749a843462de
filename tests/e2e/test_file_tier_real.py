"""The file KV tier end to end on the default model: a unit (worker and
scheduler processes) with --hicache-file-dir serves a long prompt and
writes its pages to files; a second unit started on the same folder (a
restarted worker: nothing in its device or host pool) learns the stored
blocks at session open, reads the prefix from the files instead of
computing it, and answers with the same greedy tokens. A third unit finds
one of the files corrupted: that read is a miss (counted), the prefix from
there on is computed, and the answer is still the same."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.metrics import scrape
from tests.e2e.support.system import free_port, greedy, separate, stub

pytestmark = pytest.mark.slow

PAGE = 16
NEW_TOKENS = 8
# Past the prefetch threshold (256 tokens, SGLang's) with pages to spare.
PROMPT = [1] + [random.Random(5).randrange(100, 40000) for _ in range(419)]


def _unit(tmp_path: Path, name: str, files: Path, writes: int = 0) -> tuple[list[int], dict]:
    """One unit's greedy answer to PROMPT and its metrics, once it wrote
    ``writes`` files (its writer thread files pages after the plan's answer)."""
    sched_metrics, worker_metrics = free_port(), free_port()
    worker = ["--model", "default", "--dequantize", "--num-pages", "128"]
    worker += ["--page-size", str(PAGE), "--threads", "1", "--log-level", "warning"]
    worker += ["--metrics-port", str(worker_metrics), "--enable-hierarchical-cache"]
    worker += ["--hicache-file-dir", str(files), "--hicache-file-size", "1"]
    scheduler = ["--metrics-port", str(sched_metrics), "--log-level", "warning"]
    scheduler += ["--no-speculative-ngram"]
    workdir = tmp_path / name
    workdir.mkdir()
    with separate(workdir, worker, scheduler, env={"RADIXSERVE_CHECK_INTEGRITY": "1"}) as address:
        req = pb.GenerateRequest(
            request_id=name,
            tokenized=pb.TokenizedInput(input_ids=PROMPT),
            sampling_params=greedy(NEW_TOKENS, ignore_eos=True),
        )
        (resp,) = list(stub(address).Generate(req, timeout=600))
        tokens = list(resp.complete.output_ids)
        deadline = time.monotonic() + 60
        while True:
            metrics = scrape(sched_metrics) | scrape(worker_metrics)
            written = metrics["radixserve_worker_hicache_file_writes_total"]
            if written >= writes or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    return tokens, metrics


def test_a_restarted_unit_reads_the_prefix_from_files_and_a_corrupt_file_is_a_miss(tmp_path):
    files = tmp_path / "kv-files"
    first, m1 = _unit(tmp_path, "first", files, writes=len(PROMPT) // PAGE)
    assert m1["radixserve_worker_hicache_file_writes_total"] >= len(PROMPT) // PAGE, m1
    assert m1["radixserve_worker_hicache_file_reads_total"] == 0
    stored = sorted(files.rglob("*.kv"))
    assert len(stored) >= len(PROMPT) // PAGE

    again, m2 = _unit(tmp_path, "again", files)
    assert again == first
    assert m2["radixserve_worker_hicache_file_reads_total"] >= 256 // PAGE, m2
    assert m2["radixserve_worker_hicache_file_read_failures_total"] == 0
    assert m2["radixserve_hicache_loaded_tokens_total"] >= 256

    # Flip a payload byte of every third stored file (by name: hashes, so
    # pages all over the prefix): those reads miss, the pages before the
    # first of them are still used, the rest is computed.
    for path in sorted(files.rglob("*.kv"))[::3]:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    third, m3 = _unit(tmp_path, "third", files)
    assert third == first
    assert m3["radixserve_worker_hicache_file_read_failures_total"] >= 1, m3
