"""Multi-LoRA values: the adapters' volume is mounted read-only in every worker
pod, the scheduler is told to preload NAME=PATH with the paths the workers
see, the schema refuses bad names and limits, and an install without LoRA
renders exactly as before."""

from __future__ import annotations

import os
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
    of_kind,
    render,
    render_error,
    template_text,
    workloads,
)

VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
LORA_FLAGS = ("--lora-paths", "--max-loaded-loras", "--max-loras-per-batch", "--max-lora-rank")


def lora_sets(adapters: list[tuple[str, str]], **more: object) -> dict:
    """--set values for lora.adapters (name, path) pairs plus any other keys."""
    sets: dict = {}
    for i, (name, path) in enumerate(adapters):
        sets[f"lora.adapters[{i}].name"] = name
        sets[f"lora.adapters[{i}].path"] = path
    return sets | more


PVC = lora_sets(
    [("sql", "sql-lora"), ("chat.v2", "team/chat/"), ("baked", "/opt/adapters/baked")],
    **{"lora.volume.persistentVolumeClaim.claimName": "lora-adapters", "lora.maxLoraRank": 32},
)


def lora_paths(args: list[str]) -> list[str]:
    """The values after --lora-paths, up to the next flag."""
    rest = args[args.index("--lora-paths") + 1 :]
    return [a for a in rest[: next((i for i, a in enumerate(rest) if a.startswith("--")), None)]]


def _volumes(w: dict) -> dict:
    return {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}


def _mounts(w: dict) -> dict:
    return {m["mountPath"]: m for m in container(w)["volumeMounts"]}


def test_adapters_volume_is_mounted_read_only_in_every_worker():
    docs = render("tp2-replicas3", PVC)
    workers = [w for w in workloads(docs) if component(w) == "worker"]
    assert len(workers) == 3
    for w in workers:
        mount = _mounts(w)["/adapters"]
        assert mount["readOnly"] is True
        volume = _volumes(w)[mount["name"]]
        assert volume == {
            "name": mount["name"],
            "persistentVolumeClaim": {"claimName": "lora-adapters"},
        }
        assert not any(f in container(w)["args"] for f in LORA_FLAGS)  # workers get no flags
    # The model's own volume is still there, beside it.
    assert _mounts(workers[0])["/models"]["name"] == "model"


def test_scheduler_preloads_the_adapters_at_the_workers_paths():
    docs = render("tp2-replicas3", PVC)
    schedulers = [w for w in workloads(docs) if component(w) == "scheduler"]
    assert len(schedulers) == 3
    for s in schedulers:
        args = container(s)["args"]
        assert lora_paths(args) == [
            "sql=/adapters/sql-lora",
            "chat.v2=/adapters/team/chat",
            "baked=/opt/adapters/baked",  # absolute: as given (it must be in the image)
        ]
        assert flag_value(args, "--max-loaded-loras") == "8"
        assert flag_value(args, "--max-loras-per-batch") == "4"
        assert flag_value(args, "--max-lora-rank") == "32"
        # The scheduler does not read adapters: no mount unless asked for.
        assert "lora-adapters" not in _volumes(s)
    # Every relative path lies below the workers' mount of the volume.
    worker = next(w for w in workloads(docs) if component(w) == "worker")
    mount = next(p for p, m in _mounts(worker).items() if m["name"] == "lora-adapters")
    for entry in lora_paths(container(schedulers[0])["args"])[:2]:
        assert entry.split("=", 1)[1].startswith(mount + "/")


def test_extra_args_follow_the_adapter_list():
    """--lora-paths takes every value up to the next flag: extraArgs come after."""
    docs = render(None, {**PVC, "scheduler.extraArgs[0]": "--check-integrity"})
    (s,) = [w for w in workloads(docs) if component(w) == "scheduler"]
    args = container(s)["args"]
    assert args[-1] == "--check-integrity" and len(lora_paths(args)) == 3


def test_host_path_volume_custom_mount_and_scheduler_mount():
    sets = lora_sets(
        [("a", "a")],
        **{
            "lora.volume.hostPath.path": "/data/adapters",
            "lora.mountPath": "/srv/lora",
            "lora.mountInScheduler": "true",
        },
    )
    docs = render(None, sets)
    for w in workloads(docs):
        if component(w) not in ("scheduler", "worker"):
            assert "lora-adapters" not in _volumes(w)  # not the gateway
            continue
        assert _mounts(w)["/srv/lora"]["readOnly"] is True
        assert _volumes(w)["lora-adapters"]["hostPath"] == {"path": "/data/adapters"}
    (s,) = [w for w in workloads(docs) if component(w) == "scheduler"]
    assert lora_paths(container(s)["args"]) == ["a=/srv/lora/a"]


def test_absolute_paths_need_no_volume():
    docs = render(None, lora_sets([("baked", "/opt/adapters/baked")]))
    (s,) = [w for w in workloads(docs) if component(w) == "scheduler"]
    assert lora_paths(container(s)["args"]) == ["baked=/opt/adapters/baked"]
    for w in workloads(docs):
        assert "lora-adapters" not in _volumes(w)


def test_a_volume_without_adapters_mounts_and_sets_the_limits():
    """Adapters may be loaded later: the volume and the limits, no --lora-paths."""
    docs = render(None, {"lora.volume.persistentVolumeClaim.claimName": "x"})
    (s,) = [w for w in workloads(docs) if component(w) == "scheduler"]
    assert "--lora-paths" not in container(s)["args"]
    assert flag_value(container(s)["args"], "--max-loaded-loras") == "8"
    (w,) = of_kind(docs, "StatefulSet")
    assert _mounts(w)["/adapters"]["name"] == "lora-adapters"


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_without_lora_nothing_changes(value_set):
    text = template_text(value_set)
    assert "lora" not in text.lower()
    # The limits alone (no adapters, no volume) render nothing either.
    limits = {"lora.maxLoadedLoras": 16, "lora.maxLorasPerBatch": 2, "lora.maxLoraRank": 128}
    assert template_text(value_set, limits) == text


@pytest.mark.parametrize("version", ("1.37.0", "1.28.0"))
def test_lora_rendering_validates_strictly(version, tmp_path):
    path = tmp_path / "lora.yaml"
    path.write_text(template_text("tp2-replicas3", {**PVC, "lora.mountInScheduler": "true"}))
    result = subprocess.run(
        [str(VALIDATE), "--strict", "--kubernetes-version", version, str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_lint_with_lora():
    args = [f"--set={k}={v}" for k, v in PVC.items()]
    result = helm("lint", str(CHART), "--strict", *args)
    assert "0 chart(s) failed" in result.stdout, result.stdout + result.stderr


VOLUME = {"lora.volume.persistentVolumeClaim.claimName": "x"}


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (lora_sets([("has space", "a")], **VOLUME), "/lora/adapters/0/name"),
        (lora_sets([("base:sql", "a")], **VOLUME), "/lora/adapters/0/name"),
        (lora_sets([("-flag", "a")], **VOLUME), "/lora/adapters/0/name"),
        (lora_sets([("a" * 65, "a")], **VOLUME), "/lora/adapters/0/name"),
        (lora_sets([("", "a")], **VOLUME), "/lora/adapters/0"),  # --set name= drops it
        (lora_sets([("ok", "../etc")], **VOLUME), "/lora/adapters/0/path"),
        (lora_sets([("ok", "a b")], **VOLUME), "/lora/adapters/0/path"),
        (lora_sets([("ok", "")], **VOLUME), "/lora/adapters/0/path"),
        # A relative path needs the volume it is relative to.
        (lora_sets([("ok", "sql-lora")]), "/lora/adapters/0/path"),
        ({"lora.adapters[0].name": "ok"}, "/lora/adapters/0"),  # no path
        (lora_sets([("ok", "a")], **VOLUME, **{"lora.adapters[0].rank": 8}), "'rank' not"),
        ({"lora.maxLoadedLoras": 0}, "/lora/maxLoadedLoras"),
        ({"lora.maxLorasPerBatch": -1}, "/lora/maxLorasPerBatch"),
        ({"lora.maxLoraRank": "lots"}, "/lora/maxLoraRank"),
        ({"lora.maxLoraRank": 1.5}, "/lora/maxLoraRank"),
        ({"lora.mountPath": "adapters"}, "/lora/mountPath"),
        ({"lora.mountPath": "/tmp"}, "/lora/mountPath"),
        ({"lora.adapter": "x"}, "additional properties 'adapter' not allowed"),
        (
            {**VOLUME, "lora.volume.hostPath.path": "/data"},
            "/lora/volume",
        ),  # two volume sources
        ({"lora.volume.name": "x"}, "/lora/volume"),
    ],
)
def test_schema_rejects_bad_lora_values(sets, message):
    assert message in render_error(sets)


def test_template_rejects_duplicate_names_and_too_many_adapters():
    dup = lora_sets([("sql", "a"), ("sql", "b")], **VOLUME)
    assert 'the name "sql" is listed twice' in render_error(dup)
    many = lora_sets([(f"a{i}", f"a{i}") for i in range(3)], **VOLUME, **{"lora.maxLoadedLoras": 2})
    assert "lists 3 adapters, more than lora.maxLoadedLoras (2)" in render_error(many)


def test_rendered_lora_flags_parse_with_the_scheduler_parser(monkeypatch):
    """The scheduler's own flag parser reads what the chart renders."""
    from scheduler_service import config as scheduler_config
    from tests.helm.support import pods

    docs = render("tp2-replicas3", PVC)
    s = next(w for w in workloads(docs) if component(w) == "scheduler")
    env = {e["name"]: e.get("value", "") for e in container(s).get("env", []) if "value" in e}
    for key in [k for k in os.environ if k.startswith("RADIXSERVE_")]:
        monkeypatch.delenv(key)
    args = [pods.expand(a, env) for a in container(s)["args"]]
    cfg = scheduler_config.load_config(args)
    assert cfg.engine.lora_paths == (
        ("sql", "/adapters/sql-lora"),
        ("chat.v2", "/adapters/team/chat"),
        ("baked", "/opt/adapters/baked"),
    )
    assert cfg.engine.max_lora_rank == 32
    assert (cfg.scheduler.max_loaded_loras, cfg.scheduler.max_loras_per_batch) == (8, 4)
