"""The Grafana dashboard is the generator's output and queries documented metrics.

(tests/e2e/test_dashboard_prometheus.py runs every query against Prometheus.)
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "helm/radixserve/dashboards/radixserve.json"
DS = {"type": "prometheus", "uid": "${datasource}"}


def generator():
    spec = importlib.util.spec_from_file_location(
        "make_dashboard", ROOT / "scripts/make_dashboard.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_checked_in_json_is_the_generators_output():
    assert DASHBOARD.read_text() == generator().render(), (
        "stale dashboard: run python scripts/make_dashboard.py"
    )


def test_every_panel_and_target_uses_the_datasource_variable():
    d = json.loads(DASHBOARD.read_text())
    assert (d["uid"], d["title"]) == ("radixserve", "radixserve")
    (var,) = d["templating"]["list"]
    assert (var["name"], var["type"], var["query"]) == ("datasource", "datasource", "prometheus")
    for p in d["panels"]:
        assert p["datasource"] == DS, p["title"]
        if p["type"] != "row":
            assert p["targets"], p["title"]
        for t in p.get("targets", []):
            assert t["datasource"] == DS, p["title"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))


def test_queries_use_documented_metrics_and_only_rate_interval():
    documented = set(
        re.findall(r"`(radixserve_\w+)`", (ROOT / "docs/observability.md").read_text())
    )
    for expr in exprs(json.loads(DASHBOARD.read_text())):
        assert set(re.findall(r"\$\{?(\w+)", expr)) <= {"__rate_interval"}, expr
        for name in re.findall(r"\bradixserve_\w+", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert base in documented, f"{name} in {expr} is not in docs/observability.md"
