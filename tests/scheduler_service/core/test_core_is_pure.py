"""The scheduler core stays pure Python: it imports neither torch nor grpc (nor
do its oracle and the shared package it uses)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import common
import scheduler_service.core
import scheduler_service.testing

CORE = Path(scheduler_service.core.__file__).parent
PURE = (CORE, Path(scheduler_service.testing.__file__).parent, Path(common.__file__).parent)
FORBIDDEN = {"torch", "grpc", "numpy"}


def test_no_forbidden_import_statements():
    offenders = []
    for path in sorted(p for folder in PURE for p in folder.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []


def test_importing_the_core_loads_neither_torch_nor_grpc():
    code = (
        "import sys, scheduler_service.core, scheduler_service.testing.simulated_worker\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'grpc'})\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
