"""The checked-in gRPC stubs are what `make protos` generates from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def test_generated_stubs_are_up_to_date(tmp_path):
    protos = sorted(p.relative_to(ROOT) for p in (ROOT / "protos").glob("*.proto"))
    assert protos
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *map(str, protos),
        ],
        cwd=ROOT,
        check=True,
    )
    stale = []
    for proto in protos:
        for suffix in GENERATED:
            name = proto.with_name(proto.stem + suffix)
            fresh = (tmp_path / name).read_text()
            current = (ROOT / name).read_text() if (ROOT / name).exists() else None
            if fresh != current:
                stale.append(str(name))
    assert not stale, f"regenerate with `make protos`: {stale}"
