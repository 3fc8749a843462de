"""scripts/gpu_check.sh, the one command a lent GPU machine runs: it must run
every gpu-marked test and fit the time a device run gets."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "scripts" / "gpu_check.sh").read_text()


def test_every_file_with_gpu_tests_is_run_by_the_gpu_check():
    listed = set(re.search(r"^GPU_TESTS=\(([^)]*)\)", SCRIPT, re.M).group(1).split())
    marked = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"^\s*(@pytest\.mark\.gpu|pytestmark = .*gpu)", p.read_text(), re.M)
    }
    assert marked and listed == marked


def test_the_gpu_check_fits_the_device_window_with_margin():
    """A device run is at most 10 minutes a command and 15 minutes in all, the
    machine's start included: every step has its own timeout, and together
    they stay under 7 minutes, which leaves the start and a rerun of one step."""
    facts_s = int(re.search(r"GPU_FACTS_TIMEOUT:-(\d+)", SCRIPT).group(1))
    tests_s = int(re.search(r"GPU_TESTS_TIMEOUT:-(\d+)", SCRIPT).group(1))
    bench_s = int(re.search(r"GPU_BENCH_TIMEOUT:-(\d+)", SCRIPT).group(1))
    fact_s = float(re.search(r"gpu_facts\.py --fact-timeout-s (\d+)", SCRIPT).group(1))
    assert fact_s < facts_s
    # what is left covers unpacking the bundle, nvidia-smi and imports
    assert facts_s + tests_s + bench_s <= 420


def test_the_gpu_check_prints_the_interop_facts_first():
    facts = SCRIPT.index("scripts/gpu_facts.py --fact")
    assert facts < SCRIPT.index("pytest -m gpu -q") < SCRIPT.index("scripts/gpu_decode_bench.py \\")
