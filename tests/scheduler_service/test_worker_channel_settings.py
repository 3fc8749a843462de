"""The worker-channel settings: defaults, and a keepalive below a second refused
with a message (flag and environment alike)."""

from __future__ import annotations

import pytest

from scheduler_service.config import load_config


def test_defaults_and_flags(monkeypatch):
    monkeypatch.delenv("RADIXSERVE_WORKER_KEEPALIVE", raising=False)
    cfg = load_config(["--worker", "grpc://h:1"])
    assert cfg.engine.worker_keepalive_s == 10.0
    assert cfg.engine.worker_step_timeout_s == 0.0
    assert cfg.security.worker_token_file is None
    cfg = load_config(
        ["--worker", "grpc://h:1", "--worker-keepalive", "2", "--worker-step-timeout", "30"]
    )
    assert (cfg.engine.worker_keepalive_s, cfg.engine.worker_step_timeout_s) == (2.0, 30.0)


def test_a_keepalive_below_a_second_is_refused(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        load_config(["--worker", "grpc://h:1", "--worker-keepalive", "0.5"])
    assert "0.5 is below the least allowed, 1" in capsys.readouterr().err
    monkeypatch.setenv("RADIXSERVE_WORKER_KEEPALIVE", "0.2")
    with pytest.raises(SystemExit, match=r"0\.2 is below the least allowed"):
        load_config(["--worker", "grpc://h:1"])
