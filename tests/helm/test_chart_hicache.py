"""The host KV tier's values (hicache.*): the worker pods get the host pool's
flags (and the file tier's volume, mounted writable at its path), the
schedulers the write policy; the schema refuses bad values; an install
without the tier renders exactly as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helm.support.chart import (
    CHART,
    VALUE_SETS,
    component,
    container,
    flag_value,
    helm,
    render,
    render_error,
    template_text,
    workloads,
)

VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
WORKER_FLAGS = (
    "--enable-hierarchical-cache",
    "--hicache-ratio",
    "--hicache-size",
    "--hicache-file-dir",
)
ON = {"hicache.enabled": "true"}
FILES = {**ON, "hicache.fileTier.enabled": "true"}


def by_component(docs: list[dict], name: str) -> list[dict]:
    return [w for w in workloads(docs) if component(w) == name]


def _volumes(w: dict) -> dict:
    return {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}


def _mounts(w: dict) -> dict:
    return {m["name"]: m for m in container(w)["volumeMounts"]}


def test_on_the_workers_get_the_host_pool_and_the_schedulers_the_write_policy():
    docs = render("tp2-replicas3", {**ON, "hicache.ratio": "3.5"})
    workers, schedulers = by_component(docs, "worker"), by_component(docs, "scheduler")
    assert len(workers) == len(schedulers) == 3
    for w in workers:
        args = container(w)["args"]
        assert "--enable-hierarchical-cache" in args
        assert flag_value(args, "--hicache-ratio") == "3.5"
        assert "--hicache-size" not in args and "--hicache-file-dir" not in args
        assert "--hicache-write-policy" not in args
        assert "hicache-files" not in _volumes(w)
    for s in schedulers:
        args = container(s)["args"]
        assert flag_value(args, "--hicache-write-policy") == "write_through"
        assert not any(f in args for f in WORKER_FLAGS)


def test_a_size_in_gib_replaces_the_ratio_and_the_policy_is_passed_as_given():
    sets = {**ON, "hicache.sizeGiB": "64", "hicache.writePolicy": "write_back"}
    docs = render(None, sets)
    (w,) = by_component(docs, "worker")
    args = container(w)["args"]
    assert flag_value(args, "--hicache-size") == "64"
    assert "--hicache-ratio" not in args
    (s,) = by_component(docs, "scheduler")
    assert flag_value(container(s)["args"], "--hicache-write-policy") == "write_back"
    # extraArgs still come last, after the tier's flags.
    docs = render(None, {**sets, "worker.extraArgs[0]": "--extra"})
    (w,) = by_component(docs, "worker")
    assert container(w)["args"][-1] == "--extra"


def test_file_tier_mounts_its_volume_writable_in_every_worker_only():
    docs = render("tp2-replicas3", FILES)
    for w in by_component(docs, "worker"):
        assert flag_value(container(w)["args"], "--hicache-file-dir") == "/hicache"
        mount = _mounts(w)["hicache-files"]
        assert mount["mountPath"] == "/hicache" and not mount.get("readOnly")
        assert _volumes(w)["hicache-files"] == {"name": "hicache-files", "emptyDir": {}}
    for other in by_component(docs, "scheduler") + by_component(docs, "gateway"):
        assert "hicache-files" not in _volumes(other)


@pytest.mark.parametrize(
    ("volume", "expected"),
    [
        (
            {"hicache.fileTier.volume.hostPath.path": "/mnt/nvme/kv"},
            {"hostPath": {"path": "/mnt/nvme/kv"}},
        ),
        (
            {"hicache.fileTier.volume.persistentVolumeClaim.claimName": "kv-files"},
            {"persistentVolumeClaim": {"claimName": "kv-files"}},
        ),
        (
            {"hicache.fileTier.volume.emptyDir.sizeLimit": "100Gi"},
            {"emptyDir": {"sizeLimit": "100Gi"}},
        ),
    ],
)
def test_file_tier_volume_sources_and_path(volume, expected):
    docs = render(None, {**FILES, **volume, "hicache.fileTier.path": "/var/kv"})
    (w,) = by_component(docs, "worker")
    assert _volumes(w)["hicache-files"] == {"name": "hicache-files", **expected}
    assert _mounts(w)["hicache-files"]["mountPath"] == "/var/kv"
    assert flag_value(container(w)["args"], "--hicache-file-dir") == "/var/kv"


def test_file_tier_without_the_tier_renders_nothing():
    docs = render(None, {"hicache.fileTier.enabled": "true"})
    for w in workloads(docs):
        assert not any("hicache" in a for a in container(w).get("args", []))
        assert "hicache-files" not in _volumes(w)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_without_the_tier_nothing_changes(value_set):
    text = template_text(value_set)
    # (The dashboard's ConfigMap names the tier's metrics whatever the values.)
    assert "--hicache" not in text and "hierarchical" not in text and "hicache-files" not in text
    off = {"hicache.ratio": 4, "hicache.writePolicy": "write_back", "hicache.sizeGiB": 8}
    assert template_text(value_set, off) == text


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ({**ON, "hicache.writePolicy": "write_sometimes"}, "/hicache/writePolicy"),
        ({**ON, "hicache.writePolicy": "WRITE_THROUGH"}, "/hicache/writePolicy"),
        ({**ON, "hicache.ratio": 0}, "/hicache/ratio"),
        ({**ON, "hicache.ratio": "0.0"}, "hicache.ratio must be above 0"),  # --set: a string
        ({**ON, "hicache.ratio": "lots"}, "/hicache/ratio"),
        ({**ON, "hicache.sizeGiB": -1}, "/hicache/sizeGiB"),
        ({**FILES, "hicache.fileTier.path": "relative"}, "/hicache/fileTier/path"),
        ({**FILES, "hicache.fileTier.path": "/tmp"}, "/hicache/fileTier/path"),
        ({**FILES, "hicache.fileTier.volume.nfs.server": "x"}, "invalid propertyName 'nfs'"),
        (
            {
                **FILES,
                "hicache.fileTier.volume.emptyDir.sizeLimit": "1Gi",
                "hicache.fileTier.volume.hostPath.path": "/x",
            },
            "/hicache/fileTier/volume",
        ),
        (
            {**FILES, "hicache.fileTier.volume.hostPath.type": "Directory"},
            "/hicache/fileTier/volume",
        ),
        ({"hicache.size": 4}, "additional properties 'size' not allowed"),
    ],
)
def test_schema_rejects_bad_hicache_values(sets, message):
    assert message in render_error(sets)


def test_file_tier_path_must_not_be_the_adapters_mount():
    sets = {**FILES, "hicache.fileTier.path": "/srv/lora", "lora.mountPath": "/srv/lora"}
    sets["lora.volume.persistentVolumeClaim.claimName"] = "x"
    assert "hicache.fileTier.path is lora.mountPath" in render_error(sets)


@pytest.mark.parametrize("version", ("1.37.0", "1.28.0"))
def test_hicache_rendering_validates_strictly(version, tmp_path):
    path = tmp_path / "hicache.yaml"
    sets = {**FILES, "hicache.fileTier.volume.hostPath.path": "/mnt/kv", "hicache.sizeGiB": 2.5}
    path.write_text(template_text("tp2-replicas3", sets))
    result = subprocess.run(
        [str(VALIDATE), "--strict", "--kubernetes-version", version, str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_lint_with_hicache():
    args = [f"--set={k}={v}" for k, v in FILES.items()]
    result = helm("lint", str(CHART), "--strict", *args)
    assert "0 chart(s) failed" in result.stdout, result.stdout + result.stderr
