"""The chart's start-up commands are the CLI's: every rendered command line
parses with the real argument parsers, and the CPU install's scheduler, worker,
gateway and helm test pod run as processes on loopback, started, probed and
stopped as the kubelet would, and serve a generation."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from smg.launch_router import parse_router_args

from clients.cli import build_parser as client_parser
from scheduler_service import config as scheduler_config
from tests.e2e.support import certs
from tests.e2e.support.system import free_port
from tests.helm.support import pods
from tests.helm.support.chart import (
    NAMESPACE,
    VALUE_SETS,
    component,
    config_env,
    container,
    of_kind,
    render,
    workloads,
)
from worker_service import config as worker_config

SECRETS = {
    "radixserve-api-keys": {
        "api-keys": "key-one-5f2c9a\nkey-two-81d0e3\n",
        "client-key": "key-two-81d0e3\n",  # as `kubectl create secret --from-file` leaves it
    },
}


def _pod_name(w: dict) -> str:
    name = w["metadata"]["name"]
    return f"{name}-0" if w["kind"] == "StatefulSet" else f"{name}-abc12"


def _env(docs: list[dict], w: dict) -> dict[str, str]:
    return pods.container_env(
        docs, w["spec"]["template"], container(w), _pod_name(w), NAMESPACE, SECRETS
    )


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_rendered_commands_parse_with_the_real_parsers(value_set, monkeypatch, tmp_path):
    docs = render(value_set)
    for w in workloads(docs):
        c, env = container(w), _env(docs, w)
        # Secret mounts hold files the parsers check are readable.
        mounts = {}
        for m in c.get("volumeMounts", []):
            local = tmp_path / m["name"]
            local.mkdir(exist_ok=True)
            for name in ("tls.crt", "tls.key", "ca.crt", "api-keys", "token"):
                (local / name).write_text("placeholder\n")
            mounts[m["mountPath"]] = str(local)
        args = [pods.remount(pods.expand(a, env), mounts) for a in c["args"]]
        if component(w) == "scheduler":
            assert c["command"] == ["radixserve-scheduler"]
            for key in [k for k in os.environ if k.startswith("RADIXSERVE_")]:
                monkeypatch.delenv(key)
            for key, value in env.items():
                monkeypatch.setenv(key, value)
            cfg = scheduler_config.load_config(args)
            assert cfg.api.port == int(c["ports"][0]["containerPort"])
            assert cfg.log_format == "json" and cfg.scheduler.schedule_policy == "lpm"
            assert cfg.limits.max_queued_requests == 1024
            assert cfg.engine.worker_recovery_timeout_s == 120
            assert cfg.api.drain_timeout_s == 60
        elif component(w) == "worker":
            assert c["command"] == ["radixserve-worker"]
            cfg = worker_config.load_config(args, env)
            assert cfg.tp_rank == 0 and cfg.tp_size == int(env["RADIXSERVE_WORKER_TP_SIZE"])
            assert cfg.device == env["RADIXSERVE_WORKER_DEVICE"]
            assert cfg.drain_timeout_s == 75  # preStop 5 + the scheduler's drain 60 + 10
        else:
            assert c["command"] == ["smg"] and args[0] == "launch"
            parsed = parse_router_args(args[1:])
            assert parsed.port == int(c["ports"][0]["containerPort"])
    for pod in of_kind(docs, "Pod"):
        (c,) = pod["spec"]["containers"]
        if c["command"] == ["python", "-c"]:  # disaggregated: a completion through the gateway
            compile(c["args"][0], "test-generate", "exec")
            continue
        assert c["command"] == ["radixserve-client"]
        client_parser().parse_args(c["args"])


def _ports() -> dict:
    keys = ("port", "metricsPort", "healthPort")
    ports = {f"{c}.{k}": free_port() for c in ("scheduler", "worker") for k in keys}
    ports |= {"gateway.port": free_port(), "gateway.metricsPort": free_port()}
    return ports


@contextmanager
def run_release(tmp: Path, value_set: str, sets: dict, secret_dirs: dict[str, Path]):
    """Start the value set's pods in order (worker, scheduler, gateway), each
    once its predecessor passed its startup probe; yields the rendering and
    the processes by component."""
    docs = render(value_set, sets)
    started = {}
    with ExitStack() as stack:
        for kind in ("worker", "scheduler", "gateway"):
            found = [w for w in workloads(docs) if component(w) == kind]
            if not found:
                continue
            (w,) = found
            c, env = container(w), _env(docs, w)
            volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
            mounts = {}
            for m in c["volumeMounts"]:
                secret = volumes[m["name"]].get("secret")
                local = secret_dirs[secret["secretName"]] if secret else tmp / f"{kind}-{m['name']}"
                local.mkdir(exist_ok=True)
                mounts[m["mountPath"]] = str(local)
            log = tmp / f"{kind}.log"
            proc = pods.start(pods.local_command(c, env, mounts), env, log, mounts)
            stack.callback(pods.stop, proc)
            pods.wait_probe(proc, c, log, 240, "startupProbe")
            # Ready before the next one starts, as a client would wait.
            pods.wait_probe(proc, c, log, 60, "readinessProbe")
            started[kind] = (proc, c, log)
        yield docs, started


def run_test_pod(docs: list[dict], tmp: Path, secret_dirs: dict[str, Path], **env_override):
    """The helm test pod's command, as the pod would run it."""
    (pod,) = of_kind(docs, "Pod")
    (c,) = pod["spec"]["containers"]
    env = pods.container_env(docs, pod, c, pod["metadata"]["name"], NAMESPACE, SECRETS)
    env.update(env_override)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {}
    for m in c["volumeMounts"]:
        secret = volumes[m["name"]].get("secret")
        mounts[m["mountPath"]] = str(secret_dirs[secret["secretName"]] if secret else tmp)
    base = {k: os.environ[k] for k in ("PATH", "LANG") if k in os.environ}
    env = {k: pods.remount(v, mounts) for k, v in env.items()}
    return subprocess.run(
        pods.local_command(c, env, mounts),
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def cpu_release(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("release")
    ports = _ports()
    with run_release(tmp, "cpu", ports, {}) as (docs, started):
        yield docs, ports, started, tmp


@pytest.mark.server  # the release's processes
def test_probes_pass_on_every_component(cpu_release):
    _, _, started, _ = cpu_release
    assert set(started) == {"worker", "scheduler", "gateway"}
    for proc, c, _ in started.values():
        assert proc.poll() is None
        assert pods.probe(c, "readinessProbe") and pods.probe(c, "livenessProbe")


@pytest.mark.server  # the release's processes
def test_helm_test_pod_streams_a_generation(cpu_release):
    docs, _, _, tmp = cpu_release
    result = run_test_pod(docs, tmp, {})
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.server  # the release's processes
def test_gateway_serves_the_openai_api(cpu_release):
    _, ports, started, _ = cpu_release
    base = f"http://127.0.0.1:{ports['gateway.port']}"
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as resp:
        models = [m["id"] for m in json.loads(resp.read())["data"]]
    body = {
        "model": models[0],
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 0,
    }
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        reply = json.loads(resp.read())
    assert "Paris" in reply["choices"][0]["text"]
    # Cache-aware routing: the gateway follows the scheduler's radix cache.
    log = started["scheduler"][2].read_text()
    assert "KV event subscriber joined" in log


@pytest.mark.server  # the release's processes
def test_metrics_ports_serve_prometheus_text(cpu_release):
    _, ports, _, _ = cpu_release
    for key, expected in (
        ("scheduler.metricsPort", "radixserve_requests_running"),
        ("worker.metricsPort", "radixserve_worker_requests_active"),
        ("gateway.metricsPort", "smg_"),
    ):
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[key]}/metrics", timeout=10) as resp:
            assert expected in resp.read().decode(), key


@pytest.mark.server  # the release's processes
def test_settings_reach_the_processes_from_the_configmap(cpu_release):
    docs, _, started, _ = cpu_release
    assert config_env(docs)["RADIXSERVE_LOG_FORMAT"] == "json"
    # JSON log lines show RADIXSERVE_LOG_FORMAT / RADIXSERVE_WORKER_LOG_FORMAT were read.
    for kind in ("worker", "scheduler"):
        lines = [line for line in started[kind][2].read_text().splitlines() if line.startswith("{")]
        assert lines and all("event" in json.loads(line) for line in lines), kind


@pytest.fixture(scope="module")
def secure_release(tmp_path_factory):
    """The TLS + API key + mutual TLS value set, its Secrets made here; the
    built-in model instead of the model image (no init container locally)."""
    tmp = tmp_path_factory.mktemp("secure")
    pki = certs.make_pki(tmp)
    ca = (pki.ca, pki.ca.with_suffix(".key"))
    worker_ext = certs.SERVER_EXT.replace("DNS:localhost", "DNS:radixserve-worker")
    worker_cert = certs.make_cert(tmp, "radixserve-worker", ca, worker_ext)
    dirs = {
        "radixserve-public-tls": (pki.server, pki.ca),
        "radixserve-worker-mtls": (worker_cert, pki.ca),
    }
    secret_dirs = {}
    for name, (cert, ca_cert) in dirs.items():
        d = tmp / name
        d.mkdir()
        shutil.copy(cert.cert, d / "tls.crt")
        shutil.copy(cert.key, d / "tls.key")
        shutil.copy(ca_cert, d / "ca.crt")
        secret_dirs[name] = d
    keys = tmp / "radixserve-api-keys"
    keys.mkdir()
    for key, value in SECRETS["radixserve-api-keys"].items():
        (keys / key).write_text(value)
    secret_dirs["radixserve-api-keys"] = keys
    token = tmp / "radixserve-worker-token"
    token.mkdir()
    (token / "token").write_text("worker-token-3a9f1c\n")
    secret_dirs["radixserve-worker-token"] = token
    ports = _ports()
    sets = {**ports, "model.source": "builtin", "model.path": ""}
    with run_release(tmp, "secure-no-gateway", sets, secret_dirs) as (docs, started):
        yield docs, ports, started, tmp, secret_dirs


@pytest.mark.server  # the release's processes
def test_secure_release_serves_tls_and_keys_and_probes_stay_plaintext(secure_release):
    docs, ports, started, tmp, secret_dirs = secure_release
    assert set(started) == {"worker", "scheduler"}
    for _, c, _ in started.values():  # kubelet probes: plaintext health port
        assert pods.probe(c, "readinessProbe") and pods.probe(c, "livenessProbe")
    result = run_test_pod(docs, tmp, secret_dirs)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    refused = run_test_pod(docs, tmp, secret_dirs, RADIXSERVE_API_KEY="not-a-key")
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    # Neither the public port nor the worker answers plaintext gRPC.
    assert not pods.grpc_probe(ports["scheduler.port"])
    assert not pods.grpc_probe(ports["worker.port"])
    for kind in ("worker", "scheduler"):
        log = started[kind][2].read_text()
        assert "key-one" not in log and "key-two" not in log  # keys are never logged
