"""helm lint and helm template over the CI value sets, every rendering checked
by kubernetes-validate --strict against current Kubernetes schemas."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helm.support.chart import (
    CHART,
    VALUE_SETS,
    helm,
    helm_binary,
    of_kind,
    render,
    template_text,
)

# The newest schemas kubernetes-validate ships, and the oldest Kubernetes the
# chart supports (Chart.yaml kubeVersion; the pod-index label needs 1.28).
KUBERNETES_VERSIONS = ("1.37.0", "1.28.0")
VALIDATE = Path(sys.executable).parent / "kubernetes-validate"


def test_helm_is_v4():
    out = subprocess.run([helm_binary(), "version", "--short"], capture_output=True, text=True)
    assert out.stdout.startswith("v4."), out.stdout


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_lint(value_set):
    result = helm("lint", str(CHART), "--strict", "-f", str(CHART / "ci" / VALUE_SETS[value_set]))
    assert "0 chart(s) failed" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_rendering_validates_strictly(value_set, version, tmp_path):
    path = tmp_path / f"{value_set}.yaml"
    path.write_text(template_text(value_set))
    result = subprocess.run(
        [str(VALIDATE), "--strict", "--kubernetes-version", version, str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # Everything but the Prometheus operator's CRD must have been checked.
    skipped = [line for line in result.stdout.splitlines() if "Couldn't find schema" in line]
    assert all("ServiceMonitor" in line for line in skipped), skipped
    assert result.stdout.count(" passed for resource ") >= len(render(value_set)) - len(skipped)


def test_every_value_set_renders_each_component():
    for value_set in VALUE_SETS:
        docs = render(value_set)
        kinds = {d["kind"] for d in docs}
        assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "Pod"} <= kinds, value_set
        assert of_kind(docs, "NetworkPolicy") and of_kind(docs, "PodDisruptionBudget")
