"""Render helm/radixserve with the real helm binary and look inside the result."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "helm" / "radixserve"
LOCAL_HELM = ROOT / ".cache" / "tools" / "helm"  # scripts/ensure_helm.sh puts it here
NAMESPACE = "llm"
RELEASE = "rs"

# The value sets CI renders: name -> values file under the chart's ci/.
VALUE_SETS = {
    "default": "default-values.yaml",
    "cpu": "cpu-values.yaml",
    "tp2-replicas3": "tp2-replicas3-values.yaml",
    "secure-no-gateway": "secure-no-gateway-values.yaml",
    "pd": "pd-values.yaml",
}


def helm_binary() -> str:
    if LOCAL_HELM.exists():
        return str(LOCAL_HELM)
    found = shutil.which("helm")
    if found is None:
        raise RuntimeError("no helm binary: run scripts/ensure_helm.sh (make test does)")
    return found


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [helm_binary(), *args], capture_output=True, text=True, check=check, timeout=120
    )


def values_args(value_set: str | None, sets: dict | None) -> list[str]:
    args = []
    if value_set is not None:
        args += ["-f", str(CHART / "ci" / VALUE_SETS[value_set])]
    for key, value in (sets or {}).items():
        args += ["--set", f"{key}={value}"]
    return args


def template_text(value_set: str | None = None, sets: dict | None = None) -> str:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    return helm(*args, *values_args(value_set, sets)).stdout


def render(value_set: str | None = None, sets: dict | None = None) -> list[dict]:
    return [d for d in yaml.safe_load_all(template_text(value_set, sets)) if d]


def render_error(sets: dict) -> str:
    """helm template's error output for values the chart must reject."""
    args = ["template", RELEASE, str(CHART), *values_args(None, sets)]
    result = helm(*args, check=False)
    assert result.returncode != 0, f"helm accepted {sets}"
    return result.stderr


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict], kind: str, name: str) -> dict:
    for d in of_kind(docs, kind):
        if d["metadata"]["name"] == name:
            return d
    raise KeyError(f"no {kind} {name}")


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def component(workload: dict) -> str:
    return pod_labels(workload)["app.kubernetes.io/component"]


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def matches(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels / matchExpressions, or a Service's plain
    map) against a pod's labels."""
    plain = (
        selector if "matchLabels" not in selector and "matchExpressions" not in selector else None
    )
    if plain is not None:
        return all(labels.get(k) == v for k, v in plain.items())
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        present = expr["key"] in labels
        value = labels.get(expr["key"])
        op = expr["operator"]
        if op == "In" and value not in expr["values"]:
            return False
        if op == "NotIn" and value in expr["values"]:
            return False
        if (op == "Exists" and not present) or (op == "DoesNotExist" and present):
            return False
    return True


def flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def flag_value(args: list[str], flag: str) -> str:
    (value,) = flag_values(args, flag)
    return value


def config_env(docs: list[dict]) -> dict[str, str]:
    (cm,) = [
        d for d in of_kind(docs, "ConfigMap") if not d["metadata"]["name"].endswith("-dashboard")
    ]
    return dict(cm["data"])


def policy_for(docs: list[dict], workload: dict) -> dict:
    """The one NetworkPolicy that selects ``workload``'s pods."""
    (policy,) = [
        p
        for p in of_kind(docs, "NetworkPolicy")
        if matches(p["spec"]["podSelector"], pod_labels(workload))
    ]
    return policy


def allowed(policy: dict, port: str, labels: dict) -> bool:
    """Whether ``policy`` lets pods with ``labels`` in on ``port``."""
    for rule in policy["spec"]["ingress"]:
        ports = [p["port"] for p in rule.get("ports", [])]
        if ports and port not in ports:
            continue
        if "from" not in rule:
            return True
        if any(
            "podSelector" in peer
            and "namespaceSelector" not in peer
            and matches(peer["podSelector"], labels)
            for peer in rule["from"]
        ):
            return True
    return False
