"""A prefill unit and a decode unit of the default model (float path) on
loopback, for the prefill/decode disaggregation tests and benchmarks."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.support.system import free_port
from tests.e2e.support.units import Unit

WORKER_ARGS = ["--dequantize", "--log-level", "warning"]


def pd_units(tmp: Path, extra: list[str] = ()) -> tuple[Unit, Unit, int]:
    """(prefill, decode, bootstrap port), not started; ``extra``: scheduler
    flags both get (they check integrity after every step)."""
    bport = free_port()
    common = ["--log-level", "warning", "--check-integrity", *extra]
    prefill_args = ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port"]
    prefill = Unit(tmp, "prefill", WORKER_ARGS, [*common, *prefill_args, str(bport)])
    decode = Unit(tmp, "decode", WORKER_ARGS, [*common, "--disaggregation-mode", "decode"])
    return prefill, decode, bport
