"""Run a rendered container as a local process, the way the kubelet would start
it: the same command and arguments, its environment resolved from the
ConfigMap, the downward API and Secrets, `$(VAR)` references expanded, and
cluster DNS names pointed at loopback. Probes run as the kubelet runs them."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helm.support.chart import config_env

BIN = Path(sys.executable).parent
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    return _VAR.sub(lambda m: env.get(m[1], m[0]), text)


def _cpu(quantity: str) -> int:
    """resourceFieldRef of a CPU quantity with the default divisor: whole cores, rounded up."""
    q = str(quantity)
    return math.ceil(int(q[:-1]) / 1000 if q.endswith("m") else float(q))


def container_env(
    docs: list[dict],
    pod: dict,
    container: dict,
    pod_name: str,
    namespace: str,
    secrets: dict[str, dict[str, str]],
) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_env(docs) if "configMapRef" in source else {})
    labels = dict(pod["metadata"]["labels"])
    if pod_name[-1].isdigit():  # a StatefulSet pod: the ordinal label
        labels["apps.kubernetes.io/pod-index"] = pod_name.rsplit("-", 1)[1]
    fields = {"metadata.name": pod_name, "metadata.namespace": namespace}
    fields.update({f"metadata.labels['{k}']": v for k, v in labels.items()})
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        ref = var["valueFrom"]
        if "fieldRef" in ref:
            env[var["name"]] = fields[ref["fieldRef"]["fieldPath"]]
        elif "resourceFieldRef" in ref:
            kind, resource = ref["resourceFieldRef"]["resource"].split(".")
            env[var["name"]] = str(_cpu(container["resources"][kind][resource]))
        elif "secretKeyRef" in ref:
            env[var["name"]] = secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
        else:
            raise AssertionError(f"unhandled env source {ref}")
    return env


_CLUSTER_DNS = re.compile(r"[A-Za-z0-9.-]+\.svc\.cluster\.local")


def remount(text: str, mounts: dict[str, str]) -> str:
    for mount_path, local in mounts.items():
        if text == mount_path or text.startswith(mount_path + "/"):
            return local + text[len(mount_path) :]
    return text


def local_command(container: dict, env: dict[str, str], mounts: dict[str, str]) -> list[str]:
    """The container's command line with this machine's executables, cluster
    DNS names pointed at loopback, and volume mount paths at local folders."""
    args = [expand(a, env) for a in container.get("command", []) + container.get("args", [])]
    args = [remount(_CLUSTER_DNS.sub("127.0.0.1", a), mounts) for a in args]
    # After remounting: this machine's own paths (e.g. a checkout under /tmp)
    # are not the pod's mount paths.
    executable = BIN / args[0]
    args[0] = str(executable if executable.exists() else args[0])
    return args


def start(
    command: list[str], env: dict[str, str], log: Path, mounts: dict[str, str]
) -> subprocess.Popen:
    """Start it with only the pod's environment (plus PATH, locale and
    PYTHONPATH, so that a checkout run with PYTHONPATH runs its own code)."""
    keep = ("PATH", "LANG", "LC_ALL", "PYTHONPATH")
    base = {k: os.environ[k] for k in keep if k in os.environ}
    local_env = {k: remount(v, mounts) for k, v in env.items()}
    full = {**base, **local_env, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, env=full, stdout=log.open("w"), stderr=subprocess.STDOUT)


def grpc_probe(port: int, service: str = "") -> bool:
    """A kubelet gRPC probe: grpc.health.v1 Check of ``service`` on the port."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_probe(port: int, path: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return 200 <= resp.status < 400
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def probe(container: dict, kind: str = "startupProbe") -> bool:
    spec = container[kind]
    if "grpc" in spec:
        return grpc_probe(int(spec["grpc"]["port"]), spec["grpc"].get("service", ""))
    port = spec["httpGet"]["port"]
    if isinstance(port, str):
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == port)
    return http_probe(int(port), spec["httpGet"]["path"])


def wait_probe(
    proc: subprocess.Popen, container: dict, log: Path, timeout_s: float, kind: str
) -> None:
    """Poll a probe as the kubelet does (the startup probe up to its own limit)."""
    spec = container[kind]
    limit = timeout_s
    if kind == "startupProbe":
        limit = min(timeout_s, spec["periodSeconds"] * spec["failureThreshold"])
    deadline = time.monotonic() + limit
    while not probe(container, kind):
        if proc.poll() is not None:
            raise AssertionError(
                f"{container['name']} exited {proc.returncode}:\n{log.read_text()}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"{container['name']} failed its {kind}:\n{log.read_text()}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM and a grace period, as a pod deletion does."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
