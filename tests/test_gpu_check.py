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


def test_the_gpu_check_fits_six_minutes():
    tests_s = int(re.search(r"GPU_TESTS_TIMEOUT:-(\d+)", SCRIPT).group(1))
    bench_s = int(re.search(r"GPU_BENCH_TIMEOUT:-(\d+)", SCRIPT).group(1))
    # what is left covers unpacking the bundle, nvidia-smi and imports
    assert tests_s + bench_s <= 330
