"""A unit restarted under load behind the SMG gateway drops no request.

Two units (scheduler + simulated worker each, the default model's tokenizer
so the gateway can serve chat) behind `smg`; 32 clients stream chat
completions back to back. Mid-load one unit gets SIGTERM (scheduler and
worker together, as a rolling restart does) and is started again on the same
ports. Its streams in flight finish during its drain; calls it refuses while
draining end UNAVAILABLE, which the gateway retries on the other unit; calls
that find it down meet a refused connection, which the gateway retries too.
Every request must succeed with the text of an undisturbed run.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.support.smg_gateway import start_gateway, stream_chat
from tests.e2e.support.units import Unit

pytestmark = pytest.mark.slow

CLIENTS = 32
ROUNDS = 2  # requests per client, back to back
# About 6 s a request: the streams in flight at the SIGTERM need longer than a
# worker's old 2 s stop grace (and the scheduler's old 5 s) to finish.
MAX_TOKENS = 256
RESTART_AFTER_S = 1.5  # into the disturbed run: the first round is under way
WORKER = ["--model", "simulated", "--simulated-vocab", "49152", "--simulated-step-ms", "20"]
WORKER += ["--log-level", "warning"]


def _load(base: str) -> dict[tuple[int, int], object]:
    """CLIENTS clients, ROUNDS requests each: (client, round) -> result or error."""
    results: dict[tuple[int, int], object] = {}
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(ROUNDS):
            try:
                result: object = stream_chat(base, c, r, MAX_TOKENS)
            except Exception as e:  # every failure is counted and shown
                result = e
            with lock:
                results[(c, r)] = result

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(client, range(CLIENTS)))
    return results


def test_a_unit_restarted_mid_load_behind_the_gateway_drops_no_request(tmp_path, tokenizer_dir):
    sched = ["--tokenizer", str(tokenizer_dir), "--served-model-name", "sim"]
    sched += ["--log-level", "info"]
    units = [Unit(tmp_path, f"unit{i}", WORKER, sched) for i in range(2)]
    gateway = None
    try:
        for u in units:
            u.start()
        gateway, base = start_gateway(tmp_path, units, MAX_TOKENS)
        baseline = _load(base)
        failed = {k: v for k, v in baseline.items() if not isinstance(v, tuple)}
        assert not failed, failed

        restarted = threading.Event()
        figures: dict[str, float] = {}
        victim = units[1]

        def restart() -> None:
            time.sleep(RESTART_AFTER_S)
            t0 = time.monotonic()
            victim.sigterm()
            figures["exit_s"], *codes = victim.wait(60)
            figures["codes"] = codes
            victim.start()
            figures["down_s"] = time.monotonic() - t0
            restarted.set()

        t0 = time.monotonic()
        threading.Thread(target=restart, daemon=True).start()
        disturbed = _load(base)
        elapsed = time.monotonic() - t0
        assert restarted.wait(60), "the unit did not come back"
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(10)
        for u in units:
            u.sigterm()
        for u in units:
            try:
                u.wait(30)
            except subprocess.TimeoutExpired:
                u.kill()
    failures = {k: repr(v) for k, v in disturbed.items() if not isinstance(v, tuple)}
    different = [k for k, v in disturbed.items() if isinstance(v, tuple) and v != baseline[k]]
    log = victim.log.read_text()
    drained = [json.loads(line) for line in log.splitlines() if '"event": "drained"' in line]
    refused = len(re.findall(r'"code": "UNAVAILABLE"', log))
    served = [u.log.read_text().count('"event": "request finished"') for u in units]
    print(
        f"\nrequests {len(disturbed)}, failed {len(failures)}, different {len(different)}; "
        f"drain {drained}; refused while draining {refused}; unit exit {figures['exit_s']:.2f} s, "
        f"down {figures['down_s']:.2f} s; whole run {elapsed:.1f} s; finished per unit {served}"
    )
    assert figures["codes"] == [0, 0]
    assert not failures, failures
    assert not different, different
    assert len(disturbed) == CLIENTS * ROUNDS
    assert all(finish == "length" for _, finish in disturbed.values())
    # the restart really was mid-load: the drain had streams to finish
    assert drained and drained[0]["in_flight"] > 0 and drained[0]["ended"] == 0, drained
