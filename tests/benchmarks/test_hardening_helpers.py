"""benchmarks/hardening_round.py's pure helpers: the table and its JSON
summary line, and the RSS growth judgement (the round itself needs the
default model, the gateway and half an hour: docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _module(name: str):
    sys.path.insert(0, str(BENCH))  # the programs import their siblings by name
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def test_the_table_wraps_and_the_summary_is_one_json_line():
    report = _module("hardening_report")
    rows = [
        report.Row("kills", "SIGKILL the core " * 8, "served again 2.9 s after", True),
        report.Row("floods", "grammars", "32 calls", False, ["probe failed: UNAVAILABLE"]),
    ]
    text = report.table(rows, width=40)
    assert "PROBLEM: probe failed" in text and all(len(x) < 120 for x in text.splitlines())
    line = report.summary(rows, {"startup_s": 40.0})
    assert "\n" not in line
    got = json.loads(line)
    assert got["held"] is False and got["did_not_hold"] == ["floods: grammars"]
    assert got["startup_s"] == 40.0 and len(got["results"]) == 2


def test_rss_growth_flags_a_process_that_grows_past_both_limits():
    checks = _module("hardening_checks")
    mib = 2**20
    history = [
        ("a", {"api:1": 100 * mib, "worker:2": 3000 * mib}),
        ("b", {"api:1": 180 * mib, "worker:2": 3100 * mib, "worker:3": 10 * mib}),
        ("c", {"api:1": 260 * mib, "worker:2": 3200 * mib}),
    ]
    problems, lines = checks.rss_growth(history, limit=0.5, floor_mib=100)
    assert problems == ["api:1 RSS grew +160% (100 -> 260 MiB)"]
    assert any("[100, 180, 260]" in x for x in lines)
    assert not any(x.startswith("worker:3") for x in lines)  # seen once: no figure
