"""Settings declared once (common/settings.py): flags and environment defaults
generated from the dataclass fields, one boolean rule, nested sections, old
flag names accepted with a warning, and the README's table kept current."""

from __future__ import annotations

import argparse
import runpy
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.settings import Deprecated, add_flags, build, flatten, parse_bool, section, setting
from scheduler_service.config import ServiceConfig, load_config
from worker_service.config import load_config as load_worker_config

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Inner:
    depth: int = setting(2, "how deep", deprecated=(Deprecated("--flat", 0, "use --depth 0"),))
    name: str | None = setting(None, "a name")


@dataclass(frozen=True)
class Outer:
    fast: bool = setting(False, "go fast")
    ratio: float = setting(0.5, "a ratio", flag="--the-ratio")
    fixed: int = setting(7, flag=None)
    inner: Inner = section(Inner, "inner things")
    plain: int = 3  # not a setting at all


def parse(argv: list[str], env: dict[str, str] | None = None) -> Outer:
    p = argparse.ArgumentParser(prog="t")
    add_flags(p, Outer, env or {}, "T_")
    return build(Outer, p.parse_args(argv))


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "Yes", "on"])
def test_true_spellings(text):
    assert parse_bool(text) is True


@pytest.mark.parametrize("text", ["", "0", "false", "FALSE", "no", "off"])
def test_false_spellings(text):
    assert parse_bool(text) is False


def test_anything_else_is_not_a_boolean():
    with pytest.raises(ValueError, match="not a boolean"):
        parse_bool("maybe")


def test_defaults_environment_and_flags_in_that_order():
    assert parse([]) == Outer()
    env = {"T_FAST": "yes", "T_THE_RATIO": "0.25", "T_DEPTH": "5", "T_NAME": "x"}
    got = parse([], env)
    assert (got.fast, got.ratio, got.inner.depth, got.inner.name) == (True, 0.25, 5, "x")
    got = parse(["--no-fast", "--the-ratio", "2", "--depth", "1"], env)
    assert (got.fast, got.ratio, got.inner.depth) == (False, 2.0, 1)
    assert got.fixed == 7 and got.plain == 3


def test_an_empty_variable_leaves_an_optional_setting_unset():
    assert parse([], {"T_NAME": ""}).inner.name is None


def test_a_bad_environment_value_stops_with_its_name():
    with pytest.raises(SystemExit, match="T_FAST='sure'"):
        parse([], {"T_FAST": "sure"})
    with pytest.raises(SystemExit, match="T_DEPTH"):
        parse([], {"T_DEPTH": "deep"})


def test_a_deprecated_flag_still_works_and_warns(capsys):
    assert parse(["--flat"]).inner.depth == 0
    assert "t: warning: --flat is deprecated; use --depth 0" in capsys.readouterr().err
    assert parse([], {"T_FLAT": "1"}).inner.depth == 0
    assert "T_FLAT is deprecated" in capsys.readouterr().err
    assert parse([], {"T_FLAT": "0"}).inner.depth == 2


def test_flatten_reports_declared_settings_only():
    flat = flatten(Outer())
    assert flat == {"fast": False, "ratio": 0.5, "fixed": 7, "depth": 2, "name": None}


def test_the_scheduler_keeps_its_old_flag_and_variable_names(monkeypatch):
    for name in ("RADIXSERVE_ENABLE_MIXED_CHUNK", "RADIXSERVE_OVERLAP_DEPTH"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(
        [
            "--worker",
            "grpc://w:1",
            "--disable-overlap",
            "--priority-scheduling-preemption-threshold",
            "3",
            "--chunked-prefill-size",
            "-1",
            "--worker-recovery-timeout",
            "-5",
        ]
    )
    assert cfg.engine.overlap_depth == 0
    assert cfg.scheduler.priority_preemption_threshold == 3
    assert cfg.scheduler.chunked_prefill_size is None
    assert cfg.engine.worker_recovery_timeout_s == 0.0
    # The old parser took FALSE for "on"; one rule now.
    monkeypatch.setenv("RADIXSERVE_ENABLE_MIXED_CHUNK", "FALSE")
    assert not load_config(["--worker", "grpc://w:1"]).scheduler.enable_mixed_chunk


def test_one_default_per_knob():
    # The command line and the core agree (they used to differ: lpm vs fcfs, 2 vs 1).
    cfg = load_config(["--worker", "grpc://w:1"])
    assert cfg == ServiceConfig(workers=("grpc://w:1",))
    assert cfg.scheduler.schedule_policy == "lpm" and cfg.engine.overlap_depth == 2


def test_the_worker_reads_its_own_prefix_and_the_tls_names():
    env = {"RADIXSERVE_WORKER_CUDA_GRAPHS": "false", "RADIXSERVE_WORKER_PAGE_SIZE": "4"}
    cfg = load_worker_config([], env)
    assert not cfg.cuda_graphs and cfg.page_size == 4
    assert not load_worker_config(["--no-cuda-graphs"], {}).cuda_graphs
    with pytest.raises(SystemExit):
        load_worker_config([], {"RADIXSERVE_WORKER_TLS_CA": "/no/such/file"})


def test_the_readme_table_is_current():
    table = runpy.run_path(str(ROOT / "scripts" / "settings_table.py"))["table"]()
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- settings table:")
    start = readme.index("\n", start) + 1
    end = readme.index("<!-- end of the settings table -->")
    assert readme[start:end] == table, "run python scripts/settings_table.py into README.md"
