"""The LoRA flood: LoadLoRAAdapter with real PEFT adapters for the default
model (tests/lora_adapters.py draws them) up to --max-loaded-loras and past
it, with bad paths (missing, a file, a FIFO, /dev/zero, a directory whose
files are a FIFO or /dev/zero, a lying safetensors header), requests on the
adapters while one of them is unloaded, and load/unload cycles (the
worker's memory must come back)."""

from __future__ import annotations

import json
import os
import struct
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from hardening_load import Probe, ProbeLoop
from hardening_report import Row
from hardening_system import Deployment
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

REFUSALS = {"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION"}
CONFIG = {
    "peft_type": "LORA",
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "v_proj"],
    "bias": "none",
}


def make_adapters(directory: Path, count: int) -> list[Path]:
    from tests.support.lora_adapters import ALL, ATTENTION, MLP, make_adapter  # torch, transformers

    kinds = [(4, ATTENTION), (8, MLP), (16, ALL), (8, ("q_proj", "v_proj"))]
    return [
        make_adapter(directory, f"a{i}", *kinds[i % len(kinds)], seed=100 + i) for i in range(count)
    ]


def bad_paths(directory: Path) -> dict[str, str]:
    """label -> a path LoadLoRAAdapter must refuse, quickly."""
    directory.mkdir(parents=True, exist_ok=True)
    out = {"missing": str(directory / "no-such-adapter"), "/dev/zero": "/dev/zero"}
    plain = directory / "plain-file"
    plain.write_text("not an adapter")
    out["a file"] = str(plain)
    fifo = directory / "fifo"
    os.mkfifo(fifo)
    out["a FIFO"] = str(fifo)

    def adapter_dir(name: str, config: Path | None, weights: Path | None) -> str:
        d = directory / name
        d.mkdir()
        (d / "adapter_config.json").symlink_to(config) if config else (
            d / "adapter_config.json"
        ).write_text(json.dumps(CONFIG))
        if weights is not None:
            (d / "adapter_model.safetensors").symlink_to(weights)
        return str(d)

    out["config is /dev/zero"] = adapter_dir("cfg-zero", Path("/dev/zero"), None)
    out["config is a FIFO"] = adapter_dir("cfg-fifo", fifo, None)
    out["weights are /dev/zero"] = adapter_dir("w-zero", None, Path("/dev/zero"))
    out["weights are a FIFO"] = adapter_dir("w-fifo", None, fifo)
    liar = directory / "liar.safetensors"
    liar.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")  # a 1 TiB header, 10 bytes of file
    out["safetensors header says 1 TiB"] = adapter_dir("w-liar", None, liar)
    out["/proc/self"] = "/proc/self"
    return out


def _load(dep: Deployment, lora_id: str, path: str) -> tuple[str, float, str]:
    t0 = time.monotonic()
    try:
        dep.stub.LoadLoRAAdapter(
            pb.LoadLoRAAdapterRequest(lora_name=lora_id, lora_id=lora_id, lora_path=path),
            timeout=120,
        )
        return "OK", time.monotonic() - t0, ""
    except grpc.RpcError as e:
        return e.code().name, time.monotonic() - t0, e.details() or ""


def _unload(dep: Deployment, lora_id: str) -> str:
    try:
        dep.stub.UnloadLoRAAdapter(
            pb.UnloadLoRAAdapterRequest(lora_name=lora_id, lora_id=lora_id), timeout=60
        )
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def _generate(dep: Deployment, lora_id: str, k: int, max_new: int = 12) -> tuple[str, list[int]]:
    req = pb.GenerateRequest(
        request_id=f"lora-{lora_id}-{k}-{time.time_ns()}",
        tokenized=pb.TokenizedInput(input_ids=list(range(400, 440))),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True),
        lora_id=lora_id,
    )
    try:
        (out,) = list(dep.stub.Generate(req, timeout=300))
        return "OK", list(out.complete.output_ids)
    except grpc.RpcError as e:
        return e.code().name, []


def lora_flood(dep: Deployment, probe: Probe, quiet_s: float, workdir: Path) -> Row:
    max_loaded = 8  # --max-loaded-loras' default
    adapters = make_adapters(workdir / "lora", max_loaded + 1)
    bad = bad_paths(workdir / "lora-bad")
    problems: list[str] = []
    ids = [f"a{i}" for i in range(max_loaded)]
    with ProbeLoop(probe) as loop, ThreadPoolExecutor(8) as pool:
        # the bad paths while there is room (past the limit they are refused for that)
        tries = [(f"bad{i}", path) for i, path in enumerate(bad.values())]
        refusals = dict(zip(bad, pool.map(lambda t: _load(dep, *t), tries), strict=True))
        for label, (code, seconds, details) in refusals.items():
            if code not in REFUSALS or seconds > 10:
                problems.append(f"bad path {label}: {code} after {seconds:.1f} s ({details[:100]})")
        loads = list(pool.map(lambda i: _load(dep, ids[i], str(adapters[i])), range(max_loaded)))
        problems += [
            f"load {ids[i]}: {c} {d[:100]}" for i, (c, _, d) in enumerate(loads) if c != "OK"
        ]
        past = _load(dep, "past", str(adapters[max_loaded]))
        if past[0] != "RESOURCE_EXHAUSTED":
            problems.append(f"a load past --max-loaded-loras: {past[0]} {past[2][:100]}")
        reference = {a: _generate(dep, a, 0) for a in ids[:4]}
        # requests on every adapter, and an unload of one of them meanwhile
        gens = [pool.submit(_generate, dep, ids[k % max_loaded], k) for k in range(16)]
        time.sleep(0.5)
        busy_unload = _unload(dep, ids[0])
        results = [g.result() for g in gens]
        bad_gens = Counter(c for c, _ in results if c != "OK")
        if bad_gens:
            problems.append(f"requests on adapters: {dict(bad_gens)}")
        if busy_unload not in ("OK", "FAILED_PRECONDITION"):
            problems.append(f"unloading an adapter in use: {busy_unload}")
        for a, (code, tokens) in reference.items():
            if a == ids[0] and busy_unload == "OK":
                continue
            again = _generate(dep, a, 99)
            if again != (code, tokens):
                problems.append(f"{a}: greedy tokens changed {tokens} -> {again[1]}")
        unloads = Counter(_unload(dep, a) for a in ids)
        rss = []
        for _cycle in range(3):
            list(pool.map(lambda i: _load(dep, ids[i], str(adapters[i])), range(max_loaded)))
            rss.append(_worker_rss(dep))
            for a in ids:
                _unload(dep, a)
        left = dep.stub.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest()).loaded_adapters
        if left:
            problems.append(f"adapters left loaded: {[a.lora_id for a in left]}")
    if len(rss) == 3 and rss[2] > rss[0] * 1.10 + 50 * 2**20:
        problems.append(
            f"worker RSS with 8 adapters loaded grew over cycles: {[r >> 20 for r in rss]} MiB"
        )
    problems += [f"probe: {e}" for e in loop.errors[:3]]
    slowest = max(refusals.items(), key=lambda kv: kv[1][1])
    return Row(
        "floods",
        f"LoRA: {max_loaded} real adapters loaded at once (the limit) and one past it; "
        f"{len(bad)} bad paths ({', '.join(bad)}); 16 requests over the adapters while one is "
        "unloaded; 3 load/unload cycles of all 8",
        f"loads {Counter(c for c, _, _ in loads)} in at most {max(s for _, s, _ in loads):.1f} s; "
        f"past the limit {past[0]}; bad paths {Counter(c for c, _, _ in refusals.values())}, "
        f"slowest {slowest[0]} {slowest[1][1]:.2f} s; unload in use {busy_unload}; "
        f"unloads {dict(unloads)}; worker RSS per cycle {[r >> 20 for r in rss]} MiB; "
        f"{loop.summary(quiet_s)}",
        not problems,
        problems,
        {"refusals": {k: list(v[:2]) for k, v in refusals.items()}},
    )


def _worker_rss(dep: Deployment) -> int:
    tree = dep.tree()
    return sum(p.rss for p in tree.procs if tree.roles[p.pid] == "worker")
