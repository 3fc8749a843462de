"""The rendered manifests are wired together: Services reach the ports the
processes listen on, probes speak gRPC health, schedulers know their own
workers, GPU requests appear only on GPU installs, NetworkPolicies select the
right pods, and the schema rejects bad values."""

from __future__ import annotations

import json

import pytest

from tests.helm.support.chart import (
    CHART,
    NAMESPACE,
    VALUE_SETS,
    allowed,
    component,
    config_env,
    container,
    flag_value,
    flag_values,
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

FULL = "rs-radixserve"


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def docs(request):
    return render(request.param)


def _listen_port(c: dict, port_name: str) -> int:
    """The port the process is told to listen on, for a named container port."""
    flag = {
        "grpc": "--port",
        "http": "--port",
        "health": "--health-port",
        "bootstrap": "--disaggregation-bootstrap-port",
        "metrics": None,
    }[port_name]
    if port_name == "metrics":
        flag = "--prometheus-port" if c["name"] == "gateway" else "--metrics-port"
    return int(flag_value(c["args"], flag))


def test_services_reach_the_ports_processes_listen_on(docs):
    for svc in of_kind(docs, "Service"):
        backends = [w for w in workloads(docs) if matches(svc["spec"]["selector"], pod_labels(w))]
        assert backends, f"Service {svc['metadata']['name']} selects no pods"
        for w in backends:
            c = container(w)
            by_name = {p["name"]: p["containerPort"] for p in c["ports"]}
            for port in svc["spec"]["ports"]:
                target = port["targetPort"]
                assert target in by_name, (svc["metadata"]["name"], target)
                if target == "dist":
                    continue
                assert _listen_port(c, target) == by_name[target]
                if target == "grpc":
                    assert port["appProtocol"] == "grpc"


def test_probes_use_grpc_health_on_the_plaintext_health_port(docs):
    for w in workloads(docs):
        c = container(w)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if component(w) == "gateway":
                assert c[probe]["httpGet"]["port"] == "http"
                continue
            assert set(c[probe]) - {"periodSeconds", "timeoutSeconds", "failureThreshold"} == {
                "grpc"
            }
            # The health-only port: kubelet probes cannot speak TLS.
            assert c[probe]["grpc"]["port"] == int(flag_value(c["args"], "--health-port"))
            assert int(flag_value(c["args"], "--health-port")) != int(
                flag_value(c["args"], "--port")
            )
        if component(w) != "gateway":
            start = c["startupProbe"]
            # Long enough to load a large model (and capture CUDA graphs).
            assert start["periodSeconds"] * start["failureThreshold"] >= 600


@pytest.mark.parametrize(("value_set", "units", "tp"), [("default", 1, 1), ("tp2-replicas3", 3, 2)])
def test_worker_count_is_tp_size_times_replicas(value_set, units, tp):
    docs = render(value_set)
    sts = [w for w in of_kind(docs, "StatefulSet") if component(w) == "worker"]
    assert len(sts) == units and all(s["spec"]["replicas"] == tp for s in sts)
    assert sum(s["spec"]["replicas"] for s in sts) == units * tp
    assert len([w for w in of_kind(docs, "Deployment") if component(w) == "scheduler"]) == units
    assert config_env(docs)["RADIXSERVE_WORKER_TP_SIZE"] == str(tp)
    # Replicas scale whole units: renders for 5 units have 5 x tp workers.
    more = render(value_set, {"replicas": 5})
    assert sum(s["spec"]["replicas"] for s in of_kind(more, "StatefulSet")) == 5 * tp


def test_each_scheduler_is_told_its_own_workers_addresses():
    docs = render("tp2-replicas3")
    for unit in range(3):
        sched = container(named(docs, "Deployment", f"{FULL}-scheduler-{unit}"))
        sts = named(docs, "StatefulSet", f"{FULL}-worker-{unit}")
        svc = named(docs, "Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
        assert matches(svc["spec"]["selector"], pod_labels(sts))
        port = int(flag_value(container(sts)["args"], "--port"))
        pod, service = sts["metadata"]["name"], svc["metadata"]["name"]
        expected = [
            f"grpc://{pod}-{r}.{service}.{NAMESPACE}.svc.cluster.local:{port}"
            for r in range(sts["spec"]["replicas"])
        ]
        assert flag_values(sched["args"], "--worker") == expected
        # Ranks meet at their own unit's rank 0; the rank is the pod ordinal.
        dist = flag_value(container(sts)["args"], "--dist-addr")
        assert dist.startswith(expected[0].removeprefix("grpc://").rsplit(":", 1)[0] + ":")
        rank_env = {e["name"]: e for e in container(sts)["env"]}["RADIXSERVE_WORKER_TP_RANK"]
        assert "apps.kubernetes.io/pod-index" in rank_env["valueFrom"]["fieldRef"]["fieldPath"]
    gateway = container(named(docs, "Deployment", f"{FULL}-gateway"))
    urls = gateway["args"][gateway["args"].index("--worker-urls") + 1 :]
    assert urls == [
        f"grpc://{FULL}-scheduler-{u}.{NAMESPACE}.svc.cluster.local:30000" for u in range(3)
    ]
    for u in range(3):  # each URL names a Service that selects exactly that scheduler
        svc = named(docs, "Service", f"{FULL}-scheduler-{u}")
        hits = [w for w in workloads(docs) if matches(svc["spec"]["selector"], pod_labels(w))]
        assert [w["metadata"]["name"] for w in hits] == [f"{FULL}-scheduler-{u}"]


def test_gpu_requests_only_when_asked():
    default = render("default")
    for sts in of_kind(default, "StatefulSet"):
        assert container(sts)["resources"]["limits"]["nvidia.com/gpu"] == 1
    for d in workloads(default):
        if component(d) != "worker":
            assert "nvidia.com/gpu" not in json.dumps(d["spec"]["template"]["spec"]["containers"])
    assert config_env(default)["RADIXSERVE_WORKER_DEVICE"] == "cuda"
    cpu_text = template_text("cpu")
    assert "nvidia.com/gpu" not in cpu_text
    assert config_env(render("cpu"))["RADIXSERVE_WORKER_DEVICE"] == "cpu"
    two = render(None, {"worker.gpus": 2})
    assert container(of_kind(two, "StatefulSet")[0])["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_network_policies_select_the_right_pods():
    docs = render("tp2-replicas3")
    pods = {w["metadata"]["name"]: pod_labels(w) for w in workloads(docs)}
    (test_pod,) = of_kind(docs, "Pod")
    pods["test"] = test_pod["metadata"]["labels"]
    for unit in range(3):
        policy = policy_for(docs, named(docs, "StatefulSet", f"{FULL}-worker-{unit}"))
        for name, labels in pods.items():
            own = name in (f"{FULL}-scheduler-{unit}", f"{FULL}-worker-{unit}")
            assert allowed(policy, "grpc", labels) == own, (unit, name)
        assert allowed(policy, "metrics", {"app": "prometheus"})
    sched = policy_for(docs, named(docs, "Deployment", f"{FULL}-scheduler-0"))
    for name, labels in pods.items():
        expected = name in (f"{FULL}-gateway", "test")
        assert allowed(sched, "grpc", labels) == expected, name
    gateway = policy_for(docs, named(docs, "Deployment", f"{FULL}-gateway"))
    assert allowed(gateway, "http", {"app": "anyone"})
    # Without the gateway the schedulers are the public API: open to clients,
    # or to the peers named in networkPolicy.schedulerClients.
    open_docs = render(None, {"gateway.enabled": "false"})
    sched = policy_for(open_docs, of_kind(open_docs, "Deployment")[0])
    assert allowed(sched, "grpc", {"app": "anyone"})
    secure = render("secure-no-gateway")
    sched = policy_for(secure, of_kind(secure, "Deployment")[0])
    assert not allowed(sched, "grpc", {"app": "anyone"})
    (grpc_rule,) = [r for r in sched["spec"]["ingress"] if r["ports"][0]["port"] == "grpc"]
    assert {"namespaceSelector": {"matchLabels": {"radixserve.io/client": "true"}}} in grpc_rule[
        "from"
    ]


def test_secrets_are_wired_to_the_security_flags():
    docs = render("secure-no-gateway")
    assert not [w for w in workloads(docs) if component(w) == "gateway"]
    sched = named(docs, "Deployment", f"{FULL}-scheduler-0")
    worker = named(docs, "StatefulSet", f"{FULL}-worker-0")
    for w, flags in (
        (
            sched,
            (
                "--tls-cert",
                "--tls-key",
                "--api-key-file",
                "--worker-tls-ca",
                "--worker-tls-cert",
                "--worker-tls-key",
                "--worker-token-file",
            ),
        ),
        (
            worker,
            ("--worker-tls-ca", "--worker-tls-cert", "--worker-tls-key", "--worker-token-file"),
        ),
    ):
        c = container(w)
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        for flag in flags:
            path = flag_value(c["args"], flag)
            directory, key = path.rsplit("/", 1)
            secret = volumes[mounts[directory]]["secret"]["secretName"]
            assert secret in (
                "radixserve-public-tls",
                "radixserve-worker-mtls",
                "radixserve-api-keys",
                "radixserve-worker-token",
            )
            assert key in ("tls.crt", "tls.key", "ca.crt", "api-keys", "token")
    test_pod = of_kind(docs, "Pod")[0]["spec"]["containers"][0]
    assert "--tls-ca" in test_pod["args"]
    (key_env,) = [e for e in test_pod["env"] if e["name"] == "RADIXSERVE_API_KEY"]
    assert key_env["valueFrom"]["secretKeyRef"] == {
        "name": "radixserve-api-keys",
        "key": "client-key",
    }
    assert "api-key" not in json.dumps(config_env(docs))  # secrets stay out of the ConfigMap


def test_pods_run_non_root_with_read_only_root(docs):
    pods = [w["spec"]["template"]["spec"] for w in workloads(docs)] + [
        p["spec"] for p in of_kind(docs, "Pod")
    ]
    for spec in pods:
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"] + spec.get("initContainers", []):
            ctx = c["securityContext"]
            assert ctx["readOnlyRootFilesystem"] and not ctx["allowPrivilegeEscalation"]
            assert ctx["capabilities"]["drop"] == ["ALL"]
            assert "resources" in c or c["name"] == "model"


def test_model_source_volumes():
    pvc = named(render("tp2-replicas3"), "StatefulSet", f"{FULL}-worker-0")
    volumes = {v["name"]: v for v in pvc["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "llama-3-1-8b-instruct"
    image = render("secure-no-gateway")
    sts = of_kind(image, "StatefulSet")[0]["spec"]["template"]["spec"]
    (init,) = sts["initContainers"]
    assert init["image"] == "registry.example/models/smollm2-135m-instruct:1"
    assert config_env(image)["RADIXSERVE_WORKER_MODEL"] == "/models/SmolLM2-135M-Instruct"
    host = render(
        None, {"model.source": "hostPath", "model.hostPath.path": "/data/m", "model.path": "x.gguf"}
    )
    vol = {
        v["name"]: v for v in of_kind(host, "StatefulSet")[0]["spec"]["template"]["spec"]["volumes"]
    }
    assert vol["model"]["hostPath"]["path"] == "/data/m"
    assert config_env(host)["RADIXSERVE_WORKER_MODEL"] == "/models/x.gguf"
    assert config_env(render("default"))["RADIXSERVE_WORKER_MODEL"] == "default"


def test_observability_wiring():
    docs = render("tp2-replicas3")
    env = config_env(docs)
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger-collector.observability:4317"
    assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.05"
    gateway = container(named(docs, "Deployment", f"{FULL}-gateway"))
    assert (
        flag_value(gateway["args"], "--otlp-traces-endpoint")
        == "jaeger-collector.observability:4317"
    )
    (monitor,) = of_kind(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    scraped = [
        s
        for s in of_kind(docs, "Service")
        if matches(monitor["spec"]["selector"], s["metadata"]["labels"])
    ]
    assert all(any(p["name"] == "metrics" for p in s["spec"]["ports"]) for s in scraped)
    # Every pod is scraped exactly once.
    for w in workloads(docs):
        hits = [s for s in scraped if matches(s["spec"]["selector"], pod_labels(w))]
        assert len(hits) == 1, w["metadata"]["name"]
    assert not of_kind(render("default"), "ServiceMonitor")
    (dashboard,) = [
        c for c in of_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")
    ]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (CHART / "dashboards" / "radixserve.json").read_text()
    assert json.loads(dashboard["data"]["radixserve.json"]) == json.loads(shipped)


def test_pdb_covers_units_and_gateway():
    docs = render("tp2-replicas3")
    units, gateway = of_kind(docs, "PodDisruptionBudget")
    for w in workloads(docs):
        covering = [p for p in (units, gateway) if matches(p["spec"]["selector"], pod_labels(w))]
        assert len(covering) == 1 and covering[0]["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ({"replicas": -1}, "/replicas"),
        ({"device": "tpu"}, "'cuda', 'cpu'"),
        ({"tensorParallelSize": 0}, "/tensorParallelSize"),
        ({"scheduler.port": 70000}, "/scheduler/port"),
        ({"model.source": "pvc"}, "/model/pvc/claimName"),
        ({"otel.samplerArg": "1.5"}, "/otel/samplerArg"),
        ({"worker.kvMemory": "lots"}, "/worker/kvMemory"),
        ({"apiKey.enabled": "true"}, "/apiKey/secretName"),
        ({"workerToken.enabled": "true"}, "/workerToken/secretName"),
        ({"replica": 2}, "additional properties 'replica' not allowed"),
        # smg cannot reach a TLS scheduler or send it a key: refused, not broken.
        (
            {"tls.public.enabled": "true", "tls.public.secretName": "t"},
            "gateway.enabled cannot be combined with tls.public.enabled",
        ),
    ],
)
def test_schema_rejects_bad_values(sets, message):
    assert message in render_error(sets)
