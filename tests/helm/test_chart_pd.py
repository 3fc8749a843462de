"""Prefill/decode disaggregation (disaggregation.*): prefill and decode units,
each scheduler told its mode, the prefill ones serving the bootstrap port on
their own Service, the gateway in --pd-disaggregation mode naming each prefill
unit with that port, prefill workers let through to decode workers; the chart
refuses what the schedulers refuse; an install without it renders as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from smg.launch_router import parse_router_args

from tests.helm.support.chart import (
    CHART,
    NAMESPACE,
    VALUE_SETS,
    allowed,
    component,
    container,
    flag_value,
    flag_values,
    helm,
    matches,
    named,
    of_kind,
    pod_labels,
    policy_for,
    render,
    render_error,
    template_text,
    workloads,
)
from worker_service import config as worker_config

VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
FULL = "rs-radixserve"
MODE = "radixserve.io/disaggregation-mode"
ON = {"disaggregation.enabled": "true"}


def _host(unit: str) -> str:
    return f"{FULL}-scheduler-{unit}.{NAMESPACE}.svc.cluster.local"


def _of(docs: list[dict], name: str) -> list[dict]:
    return [w for w in workloads(docs) if component(w) == name]


def test_prefill_and_decode_units_with_their_modes():
    docs = render("pd")
    assert [s["metadata"]["name"] for s in _of(docs, "scheduler")] == [
        f"{FULL}-scheduler-{u}" for u in ("p0", "p1", "d0")
    ]
    for unit, mode in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        sched = named(docs, "Deployment", f"{FULL}-scheduler-{unit}")
        sts = named(docs, "StatefulSet", f"{FULL}-worker-{unit}")
        assert pod_labels(sched)[MODE] == pod_labels(sts)[MODE] == mode
        assert sts["spec"]["replicas"] == 2
        args = container(sched)["args"]
        assert flag_value(args, "--disaggregation-mode") == mode
        assert flag_value(args, "--disaggregation-bootstrap-timeout") == "300"
        assert flag_value(args, "--disaggregation-waiting-timeout") == "300"
        ports = {p["name"]: p["containerPort"] for p in container(sched)["ports"]}
        svc = named(docs, "Service", f"{FULL}-scheduler-{unit}")
        svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
        if mode == "prefill":
            assert flag_value(args, "--disaggregation-bootstrap-port") == "8998"
            assert ports["bootstrap"] == 8998
            assert svc_ports["bootstrap"]["port"] == 8998
            assert svc_ports["bootstrap"]["targetPort"] == "bootstrap"
        else:
            assert "--disaggregation-bootstrap-port" not in args
            assert "bootstrap" not in ports and "bootstrap" not in svc_ports
        # Both units hold the one worker token (the KV push is authenticated with it).
        for w in (sched, sts):
            assert flag_value(container(w)["args"], "--worker-token-file").endswith("/token")
            (token,) = [v for v in w["spec"]["template"]["spec"]["volumes"] if "secret" in v]
            assert token["secret"]["secretName"] == "radixserve-worker-token"
    # No Service over all schedulers: clients go through the gateway (a unit
    # called directly serves a request alone, unsplit).
    assert f"{FULL}-scheduler" not in [s["metadata"]["name"] for s in of_kind(docs, "Service")]


def test_the_gateway_pairs_prefill_and_decode_units_by_their_own_services():
    docs = render("pd")
    args = container(named(docs, "Deployment", f"{FULL}-gateway"))["args"]
    assert "--worker-urls" not in args
    pd = args[args.index("--pd-disaggregation") :]
    assert pd == [
        "--pd-disaggregation",
        *("--prefill", f"grpc://{_host('p0')}:30000", "8998"),
        *("--prefill", f"grpc://{_host('p1')}:30000", "8998"),
        *("--decode", f"grpc://{_host('d0')}:30000"),
    ]
    parsed = parse_router_args(args[1:])
    assert parsed.pd_disaggregation
    assert parsed.prefill_urls == [(f"grpc://{_host(u)}:30000", 8998) for u in ("p0", "p1")]
    # Each prefill URL's host is a Service in front of that unit's scheduler
    # alone, which serves the bootstrap port there: the decode unit meets the
    # scheduler that got the request.
    for unit in ("p0", "p1"):
        svc = named(docs, "Service", f"{FULL}-scheduler-{unit}")
        hits = [w for w in workloads(docs) if matches(svc["spec"]["selector"], pod_labels(w))]
        assert [w["metadata"]["name"] for w in hits] == [f"{FULL}-scheduler-{unit}"]


def test_decode_workers_are_reachable_from_prefill_workers_only_where_needed():
    docs = render("pd")
    pods = {w["metadata"]["name"]: pod_labels(w) for w in workloads(docs)}
    # The decode scheduler's workers: headless per-pod DNS names, resolvable
    # from any pod (the prefill workers are told these same addresses).
    decode = container(named(docs, "Deployment", f"{FULL}-scheduler-d0"))["args"]
    svc = named(docs, "Service", f"{FULL}-worker-d0")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert flag_values(decode, "--worker") == [
        f"grpc://{FULL}-worker-d0-{r}.{FULL}-worker-d0.{NAMESPACE}.svc.cluster.local:50051"
        for r in range(2)
    ]
    expected = {
        "d0": {
            f"{FULL}-scheduler-d0",
            f"{FULL}-worker-d0",
            f"{FULL}-worker-p0",
            f"{FULL}-worker-p1",
        },
        "p0": {f"{FULL}-scheduler-p0", f"{FULL}-worker-p0"},
    }
    for unit, callers in expected.items():
        policy = policy_for(docs, named(docs, "StatefulSet", f"{FULL}-worker-{unit}"))
        for name, labels in pods.items():
            assert allowed(policy, "grpc", labels) == (name in callers), (unit, name)
    sched = policy_for(docs, named(docs, "Deployment", f"{FULL}-scheduler-p0"))
    for name, labels in pods.items():
        assert allowed(sched, "bootstrap", labels) == (name == f"{FULL}-scheduler-d0"), name
        assert allowed(sched, "grpc", labels) == (name == f"{FULL}-gateway"), name


def test_worker_gateway_and_test_pod_commands_parse(tmp_path):
    docs = render("pd")
    token = tmp_path / "token"
    token.write_text("worker-token\n")
    env = {"RADIXSERVE_WORKER_TP_RANK": "0", "RADIXSERVE_WORKER_TP_SIZE": "2"}
    for w in _of(docs, "worker"):
        args = [str(token) if a.endswith("/token") else a for a in container(w)["args"]]
        assert worker_config.load_config(args, env).tp_size == 2
    (pod,) = of_kind(docs, "Pod")
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["python", "-c"]
    compile(c["args"][0], "test-generate", "exec")
    assert c["args"][1] == f"http://{FULL}-gateway.{NAMESPACE}.svc.cluster.local:8000"


def test_replicas_port_and_timeouts_follow_the_values():
    sets = {
        **ON,
        "replicas": 7,  # ignored: the roles' replicas count
        "disaggregation.prefill.replicas": 3,
        "disaggregation.decode.replicas": 2,
        "disaggregation.bootstrapPort": 9100,
        "disaggregation.bootstrapTimeoutSeconds": 60,
        "disaggregation.waitingTimeoutSeconds": 120,
    }
    docs = render(None, sets)
    modes = [pod_labels(s)[MODE] for s in _of(docs, "scheduler")]
    assert modes == ["prefill"] * 3 + ["decode"] * 2
    assert len(_of(docs, "worker")) == 5
    args = container(named(docs, "Deployment", f"{FULL}-gateway"))["args"]
    assert flag_values(args, "--prefill") == [f"grpc://{_host(f'p{i}')}:30000" for i in range(3)]
    assert args.count("9100") == 3
    for s in _of(docs, "scheduler"):
        a = container(s)["args"]
        assert flag_value(a, "--disaggregation-bootstrap-timeout") == "60"
        assert flag_value(a, "--disaggregation-waiting-timeout") == "120"


def test_names_stay_within_kubernetes_limits_for_the_longest_release():
    release = "r" * 40  # fullname is cut at 40 characters
    sets = ["--set=disaggregation.enabled=true", "--set=disaggregation.prefill.replicas=99"]
    text = helm("template", release, str(CHART), *sets).stdout
    for sts in of_kind([d for d in yaml.safe_load_all(text) if d], "StatefulSet"):
        # The StatefulSet's controller-revision-hash label is <name>-<10 chars>.
        assert len(sts["metadata"]["name"]) <= 52, sts["metadata"]["name"]


@pytest.mark.parametrize("value_set", sorted(set(VALUE_SETS) - {"pd"}))
def test_without_disaggregation_nothing_changes(value_set):
    text = template_text(value_set)
    assert "disaggregation" not in text and "bootstrap" not in text
    off = {
        "disaggregation.prefill.replicas": 4,
        "disaggregation.bootstrapPort": 9000,
        "disaggregation.waitingTimeoutSeconds": 5,
    }
    assert template_text(value_set, off) == text


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ({**ON, "gateway.enabled": "false"}, "disaggregation.enabled needs gateway.enabled"),
        (
            {**ON, "lora.adapters[0].name": "sql", "lora.adapters[0].path": "/a/sql"},
            "disaggregation.enabled cannot be combined with LoRA",
        ),
        (
            {**ON, "lora.volume.persistentVolumeClaim.claimName": "x"},
            "disaggregation.enabled cannot be combined with LoRA",
        ),
        ({**ON, "hicache.enabled": "true"}, "cannot be combined with hicache.enabled"),
        (
            {**ON, "tls.workers.enabled": "true", "tls.workers.secretName": "m"},
            "cannot be combined with tls.workers.enabled",
        ),
        ({**ON, "disaggregation.prefill.replicas": 0}, "/disaggregation/prefill/replicas"),
        ({**ON, "disaggregation.decode.replicas": 100}, "/disaggregation/decode/replicas"),
        ({**ON, "disaggregation.bootstrapPort": 70000}, "/disaggregation/bootstrapPort"),
        ({**ON, "disaggregation.waitingTimeoutSeconds": 0}, "/disaggregation/waitingTimeout"),
        ({"disaggregation.mode": "prefill"}, "additional properties 'mode' not allowed"),
    ],
)
def test_refused_combinations_and_bad_values(sets, message):
    assert message in render_error(sets)


@pytest.mark.parametrize("version", ("1.37.0", "1.28.0"))
def test_pd_rendering_validates_strictly(version, tmp_path):
    path = tmp_path / "pd.yaml"
    sets = {**ON, "disaggregation.prefill.replicas": 3, "disaggregation.bootstrapPort": 9100}
    path.write_text(template_text("cpu", sets))
    result = subprocess.run(
        [str(VALIDATE), "--strict", "--kubernetes-version", version, str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
