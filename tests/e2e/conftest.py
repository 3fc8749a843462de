"""One `radixserve serve` of the default model for all end-to-end tests, an
SMG gateway in front of it for the tests of the OpenAI API, and the default
model's tokenizer for simulated units that the gateway serves chat through."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.smg_gateway import SMG
from tests.e2e.support.system import BIN, free_port, serve, stub


@pytest.fixture(scope="session")
def smollm2_address(tmp_path_factory):
    # --dequantize: the float path, which the tests here compare with transformers
    # token for token (the quantized path: tests/worker_service/test_quantized_default.py).
    args = ("--log-level", "warning", "--dequantize")
    with serve(tmp_path_factory.mktemp("serve"), *args) as address:
        yield address


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The default model's tokenizer, exported once a module (test_security.py
    exports its own)."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    cmd = [str(BIN / "radixserve"), "export-tokenizer", str(path)]
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    return path


@pytest.fixture(scope="session")
def gateway(smollm2_address, tmp_path_factory):
    if not SMG.exists() and shutil.which("smg") is None:
        pytest.fail("the smg gateway is not installed (make setup installs it)")
    port, metrics = free_port(), free_port()
    log = open(tmp_path_factory.mktemp("smg") / "smg.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            str(SMG if SMG.exists() else "smg"),
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            f"grpc://{smollm2_address}",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics),
            "--shutdown-grace-period-secs",
            "0",
            "--worker-startup-check-interval",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if urllib.request.urlopen(base + "/readiness", timeout=2).status == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"smg did not become ready: {Path(log.name).read_text()}")
            time.sleep(0.3)
        model = stub(smollm2_address).GetModelInfo(pb.GetModelInfoRequest()).served_model_name
        yield base, model
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
