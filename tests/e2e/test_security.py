"""TLS on the public API, API keys, and mutual TLS between the scheduler and its
workers, with real processes on loopback (the simulated model)."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from clients.client import AsyncRadixClient, RadixClient
from protos import worker_pb2, worker_pb2_grpc
from tests.e2e.support.certs import Cert, Pki, make_pki
from tests.e2e.support.system import BIN, greedy, process, serve

KEYS = (f"rs-first-{secrets.token_hex(12)}", f"rs-second-{secrets.token_hex(12)}")
SIM = ["--model", "simulated", "--simulated-step-ms", "1"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"# radixserve API keys\n\n  {KEYS[0]}  \n{KEYS[1]}\n")
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The default model's tokenizer: the simulated model has none, the clients need one."""
    path = tmp_path_factory.mktemp("tokenizer")
    subprocess.run(
        [str(BIN / "radixserve"), "export-tokenizer", str(path)], check=True, timeout=180
    )
    return path


def worker_tls(pki: Pki, cert: Cert, ca: Path | None = None) -> list[str]:
    ca = ca or pki.ca
    return ["--worker-tls-ca", str(ca), "--worker-tls-cert", str(cert.cert)] + [
        "--worker-tls-key",
        str(cert.key),
    ]


@pytest.fixture(scope="module")
def system(pki, key_file, tokenizer_dir, tmp_path_factory):
    """A worker serving mutual TLS and a scheduler serving TLS with API keys;
    yields (tmp, worker port, scheduler address)."""
    tmp = tmp_path_factory.mktemp("secure")
    worker = [str(BIN / "radixserve-worker"), *SIM, *worker_tls(pki, pki.server)]
    with process(tmp, "worker", worker) as wport:
        sched = [
            str(BIN / "radixserve-scheduler"),
            "--worker",
            f"grpc://127.0.0.1:{wport}",
            "--tokenizer",
            str(tokenizer_dir),
            "--tls-cert",
            str(pki.server.cert),
            "--tls-key",
            str(pki.server.key),
            "--api-key-file",
            str(key_file),
            *worker_tls(pki, pki.client),
        ]
        with process(tmp, "scheduler", sched) as port:
            yield tmp, wport, f"127.0.0.1:{port}"


def tls_stub(address: str, pki: Pki) -> pb_grpc.SglangSchedulerStub:
    creds = grpc.ssl_channel_credentials(pki.ca.read_bytes())
    return pb_grpc.SglangSchedulerStub(grpc.secure_channel(address, creds))


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def stream_tokens(s: pb_grpc.SglangSchedulerStub, key: str | None, n: int = 5) -> list[int]:
    req = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=[11, 12, 13]),
        sampling_params=greedy(n, ignore_eos=True),
        stream=True,
    )
    responses = s.Generate(req, metadata=bearer(key) if key else None, timeout=60)
    return [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]


def test_tls_client_streams_and_a_plaintext_client_is_refused(system, pki):
    _, _, address = system
    assert len(stream_tokens(tls_stub(address, pki), KEYS[0])) == 5
    plain = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(address))
    with pytest.raises(grpc.RpcError) as err:
        plain.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer(KEYS[0]), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_every_key_works_and_others_are_unauthenticated(system, pki):
    tmp, _, address = system
    s = tls_stub(address, pki)
    for key in KEYS:
        assert len(stream_tokens(s, key)) == 5
        assert s.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer(key)).vocab_size > 0
    for metadata in (
        None,
        bearer("not-a-key"),
        bearer(KEYS[0][:-1]),
        (("authorization", KEYS[0]),),
    ):
        with pytest.raises(grpc.RpcError) as err:
            list(s.Generate(pb.GenerateRequest(), metadata=metadata, timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "missing or invalid API key" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            s.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert KEYS[0] not in err.value.details()
    # Probes carry no key: health stays open.
    creds = grpc.ssl_channel_credentials(pki.ca.read_bytes())
    health = health_pb2_grpc.HealthStub(grpc.secure_channel(address, creds))
    for name in ("", "sglang.grpc.scheduler.SglangScheduler"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    log = (tmp / "scheduler.log").read_text()
    assert "API keys required" in log and "call refused" in log
    assert all(key not in log for key in KEYS)


def test_the_worker_refuses_clients_without_a_certificate_from_its_ca(system, pki):
    _, wport, address = system
    assert len(stream_tokens(tls_stub(address, pki), KEYS[1])) == 5  # the scheduler got in
    target = f"127.0.0.1:{wport}"
    ca = pki.ca.read_bytes()
    other = pki.other_client
    channels = {
        "plaintext": grpc.insecure_channel(target),
        "no client certificate": grpc.secure_channel(target, grpc.ssl_channel_credentials(ca)),
        "certificate from another CA": grpc.secure_channel(
            target,
            grpc.ssl_channel_credentials(ca, other.key.read_bytes(), other.cert.read_bytes()),
        ),
    }
    for what, channel in channels.items():
        with pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, what
    good = grpc.ssl_channel_credentials(
        ca, pki.client.key.read_bytes(), pki.client.cert.read_bytes()
    )
    stub = worker_pb2_grpc.WorkerStub(grpc.secure_channel(target, good))
    assert stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10).model.name == "simulated"


def scheduler_run(tmp: Path, wport: int, *flags: str, wait_s: float) -> tuple[int | None, str]:
    """Start a scheduler, give it ``wait_s``; (its exit status or None if still
    running, its output). It must not have started serving."""
    log, port_file = tmp / "bad-scheduler.log", tmp / "bad-scheduler.port"
    cmd = [str(BIN / "radixserve-scheduler"), "--worker", f"grpc://127.0.0.1:{wport}"]
    cmd += ["--port", "0", "--port-file", str(port_file), *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            status = proc.poll()
            if status is None:
                proc.kill()
                proc.wait()
    assert not port_file.exists()
    return status, log.read_text()


def test_a_scheduler_that_does_not_trust_the_worker_stops_at_once(system, pki, tmp_path):
    _, wport, _ = system
    t0 = time.monotonic()
    status, out = scheduler_run(
        tmp_path, wport, *worker_tls(pki, pki.client, ca=pki.other_ca), wait_s=60
    )
    assert status == 1 and time.monotonic() - t0 < 60
    assert "TLS with worker" in out and "CERTIFICATE_VERIFY_FAILED" in out


def test_a_scheduler_with_a_certificate_from_another_ca_never_serves(system, pki, tmp_path):
    # TLS 1.3 only shows the client a closed connection, which could be a worker
    # still starting behind a proxy: the scheduler keeps waiting, never serving.
    _, wport, _ = system
    status, out = scheduler_run(tmp_path, wport, *worker_tls(pki, pki.other_client), wait_s=10)
    assert status is None and "waiting for worker" in out


def test_bad_security_flags_are_clear_startup_errors(tmp_path, pki):
    empty = tmp_path / "empty-keys"
    empty.write_text("# no key yet\n\n")
    cmd = [str(BIN / "radixserve-scheduler"), "--worker", "grpc://127.0.0.1:1", "--port", "0"]
    cases = [
        (["--tls-cert", str(pki.server.cert)], 2, "--tls-cert --tls-key go together"),
        (["--worker-tls-ca", str(pki.ca)], 2, "go together"),
        (["--api-key-file", str(tmp_path / "missing")], 2, "no such file"),
        (["--api-key-file", str(empty)], 1, "holds no key"),
    ]
    for flags, status, needle in cases:
        out = subprocess.run(cmd + flags, capture_output=True, text=True, timeout=60)
        assert out.returncode == status and needle in out.stderr, (flags, out.stderr)
    worker = [
        str(BIN / "radixserve-worker"),
        "--model",
        "simulated",
        "--worker-tls-ca",
        str(pki.ca),
    ]
    out = subprocess.run(worker, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "go together" in out.stderr


def test_python_clients_with_tls_and_a_key(system, pki):
    _, _, address = system
    client = RadixClient(address, tls_ca=str(pki.ca), api_key=KEYS[0])
    result = client.generate([5, 6, 7], max_new_tokens=4, ignore_eos=True)
    assert len(result.token_ids) == 4 and client.health()
    client.close()

    async def run() -> int:
        aclient = AsyncRadixClient(address, tls_ca=pki.ca.read_bytes(), api_key=KEYS[1])
        events = [e async for e in aclient.stream([5, 6, 7], max_new_tokens=4, ignore_eos=True)]
        await aclient.close()
        return sum(len(e.token_ids) for e in events)

    assert asyncio.run(run()) == 4
    keyless = RadixClient(address, tls_ca=str(pki.ca))
    with pytest.raises(grpc.RpcError) as err:
        keyless.generate([5, 6, 7], max_new_tokens=4)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_cli_with_tls_ca_and_api_key(system, pki):
    _, _, address = system
    cli = [str(BIN / "radixserve-client"), "--server", address, "--tls-ca", str(pki.ca)]
    gen = ["generate", "Once upon a time", "--stream", "--max-new-tokens", "4"]
    env = {**os.environ, "RADIXSERVE_API_KEY": KEYS[1]}
    ok = subprocess.run(cli + gen, capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
    env.pop("RADIXSERVE_API_KEY")
    flag = subprocess.run(
        cli[:3] + ["--api-key", KEYS[0]] + cli[3:] + gen,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert flag.returncode == 0 and flag.stdout.strip(), flag.stderr
    denied = subprocess.run(cli + gen, capture_output=True, text=True, timeout=120, env=env)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr


def test_serve_with_worker_mutual_tls_public_tls_and_keys(pki, key_file, tmp_path):
    args = [
        "--model",
        "simulated",
        *worker_tls(pki, pki.server),
        "--worker-tls-server-name",
        "localhost",
        "--tls-cert",
        str(pki.server.cert),
        "--tls-key",
        str(pki.server.key),
        "--api-key-file",
        str(key_file),
    ]
    with serve(tmp_path, *args) as address:
        assert len(stream_tokens(tls_stub(address, pki), KEYS[1], n=6)) == 6
        with pytest.raises(grpc.RpcError) as err:
            stream_tokens(tls_stub(address, pki), None)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert all(key not in (tmp_path / "serve.log").read_text() for key in KEYS)
