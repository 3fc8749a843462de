"""benchmarks/soak.py keeps working: a short run against a real server
(radixserve serve, simulated worker), and its pure helpers."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOAK = ROOT / "benchmarks" / "soak.py"


def _support():
    # benchmarks/ is a directory of scripts, not a package
    spec = importlib.util.spec_from_file_location("soak_support", SOAK.parent / "soak_support.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_duration():
    parse = _support().parse_duration
    assert [parse(t) for t in ("90", "30s", "10m", "1h", "1.5m")] == [90, 30, 600, 3600, 90]


def test_growth_report_compares_after_warm_up_with_the_end():
    report = _support().growth_report
    mib = 2**20
    samples = [(t, {"api": (50 + t) * mib, "core": 100 * mib}) for t in (0.0, 10.0, 20.0)]
    ok, lines = report(samples, warm_t=10.0, max_growth=0.05)  # api: 60 -> 70 MiB
    assert not ok and any("api" in line and "+16.7%" in line for line in lines)
    ok, _ = report(samples, warm_t=10.0, max_growth=0.2)
    assert ok


def test_growth_report_compares_peaks_so_a_garbage_collector_sawtooth_is_not_growth():
    report = _support().growth_report
    mib = 2**20
    saw = [94, 100, 106] * 6  # a collection every third sample, no growth
    samples = [(10.0 * i, {"core": v * mib}) for i, v in enumerate(saw)]
    ok, lines = report(samples, warm_t=0.0, max_growth=0.05)
    assert ok and "+0.0%" in lines[1]
    rising = [(10.0 * i, {"core": (v + 2 * i) * mib}) for i, v in enumerate(saw)]
    ok, lines = report(rising, warm_t=0.0, max_growth=0.05)
    assert not ok  # the same sawtooth on a leak of 0.2 MiB/s


@pytest.mark.slow
@pytest.mark.server  # soak.py starts a server
def test_a_short_soak_passes_and_prints_its_table():
    # 15 s is too short for a memory verdict (the pools are still warming at
    # 20% of it), so the growth limit is loose here; 10-minute runs use 5%.
    args = ["--duration", "15s", "--streams", "8", "--sample-s", "3", "--max-growth", "0.25"]
    proc = subprocess.run(
        [sys.executable, str(SOAK), *args], capture_output=True, text=True, timeout=150
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    header = out.splitlines()[0].split()
    assert header[:6] == ["time_s", "done", "tok/s", "running", "waiting", "used_tok"]
    assert {"api", "core", "worker0"} <= set(header[6:])
    rows = [line for line in out.splitlines()[2:] if line.split() and line.split()[0].isdigit()]
    assert len(rows) >= 4  # every 3 s over 15 s, then the drain
    assert "errors 0, token-count mismatches 0" in out
    assert "after FlushCache" in out and out.rstrip().endswith("RESULT: PASS")
