"""The SMG gateway (`smg`, PyPI smg) in front of radixserve units, and a
streamed chat completion through it (the rolling-restart and core-restart
tests; the units serve the model as "sim")."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.e2e.support.system import free_port
from tests.e2e.support.units import Unit

SMG = Path(sys.executable).parent / "smg"


def start_gateway(
    tmp: Path,
    units: list[Unit],
    probe_tokens: int = 256,
    *,
    extra_args: tuple[str, ...] = (),
    probe_chat: bool = True,
    worker_args: list[str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """`smg` over ``units`` (anything with an ``address``), once it lists the
    model and has served a chat completion of ``probe_tokens`` tokens (any
    length shows it has the units' tokenizer): the process, the caller's to
    stop, and its base URL. ``extra_args``: more smg flags; ``probe_chat``
    False: once it lists the model (a model that cannot chat);
    ``worker_args``: how smg is told its units, instead of ``--worker-urls``
    over ``units`` (e.g. PD mode's ``--prefill``/``--decode``)."""
    port = free_port()
    log = open(tmp / "smg.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port)]
        + (worker_args or ["--worker-urls", *[f"grpc://{u.address}" for u in units]])
        + ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        + ["--shutdown-grace-period-secs", "0", "--worker-startup-check-interval", "1"]
        + list(extra_args),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=2) as r:
                if json.loads(r.read()).get("data"):
                    break
        except (urllib.error.URLError, ConnectionError):
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (tmp / "smg.log").read_text()
        time.sleep(0.3)
    while probe_chat:  # the gateway fetches each unit's tokenizer after it lists the model
        try:
            stream_chat(base, -1, -1, probe_tokens)
            return proc, base
        except urllib.error.HTTPError:
            assert time.monotonic() < deadline, (tmp / "smg.log").read_text()
            time.sleep(0.3)
    return proc, base


def stream_chat(base: str, client: int, rnd: int, max_tokens: int) -> tuple[str, str | None]:
    """One streamed chat completion: (text, finish reason); raises on failure."""
    body = {
        "model": "sim",
        "messages": [{"role": "user", "content": f"Client {client}, question {rnd}: go on."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    text, finish = [], None
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event}")
            for choice in event.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
                finish = choice.get("finish_reason") or finish
    return "".join(text), finish
