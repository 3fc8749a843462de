"""The layout's rules, read from the code's own imports (every import
statement, those inside functions and under TYPE_CHECKING included):

- no import circle among the project's modules;
- the API process (scheduler_service/api/) and the core process
  (scheduler_service/engine/) meet only where the API process spawns the core
  (core_supervisor -> engine.main); the engine imports nothing of the API;
- the client library (clients/, but the benchmark, whose transformers
  baseline opens models the worker's way) imports neither service;
- the shared package (common/) imports neither service;
- the worker's parts import only their own part and the parts below them
  (WORKER_LEVELS: the gRPC face, the assembly, plan execution, the model's
  parts, the device), and the scheduler core's likewise (CORE_LEVELS);
- no mixin classes in the services;
- no module under tests/ or benchmarks/ imports a test module (``test_*``,
  ``conftest``): what two test files share lives in a ``support/`` module
  beside them, a fixture they share in their folder's conftest.py.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("scheduler_service", "worker_service", "clients", "common", "observability")
SPAWN = ("scheduler_service.api.core_supervisor", "scheduler_service.engine.main")
# The worker's parts (worker_service/'s folders and top-level modules), top
# to bottom; parts on one level are siblings and import none of each other.
WORKER_LEVELS = (
    ("__main__",),
    ("rpc",),
    ("worker", "export_tokenizer"),
    ("execution", "weights"),
    ("models",),
    ("attention", "lora", "sampling"),
    ("kernels", "device", "config", "telemetry"),
)
# The scheduler core's parts (core/'s folders and top-level modules), top to
# bottom, as for the worker: the Scheduler plans over its deciders, which sit
# on the KV metadata, the plan types and the request table, which sit on the
# request and its parameters.
CORE_LEVELS = (
    ("__init__",),
    ("scheduler",),
    ("disagg",),
    ("results",),
    ("admission", "decode", "integrity", "intake"),
    ("spec", "worker_loss", "outputs"),
    ("kv", "plan", "request_table"),
    ("request",),
    ("ids", "config", "adapters", "sampling", "stop_check", "embedding", "bootstrap"),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(p): p
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if "_pb2" not in p.name
    }


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (a module named in a from-import
    counts as imported; its package's __init__ does not)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(name, path, known) for name, path in modules.items()}
    # "from pkg import sub" and "import pkg.sub" also name pkg: drop edges to
    # a package's own __init__ when the importer already names a module in it.
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not any(o.startswith(d + ".") for o in deps)}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert _cycles(_graph()) == []


def test_the_api_and_core_processes_meet_only_at_the_spawn():
    crossings = []
    for name, deps in _graph().items():
        for d in deps:
            api_to_engine = name.startswith("scheduler_service.api") and d.startswith(
                "scheduler_service.engine"
            )
            engine_to_api = name.startswith("scheduler_service.engine") and d.startswith(
                "scheduler_service.api"
            )
            if (api_to_engine and (name, d) != SPAWN) or engine_to_api:
                crossings.append((name, d))
    assert crossings == []
    assert SPAWN[1] in _graph()[SPAWN[0]], "the spawn itself is where the rule expects it"


def test_the_client_library_and_the_shared_package_import_no_service():
    offenders = [
        (name, d)
        for name, deps in _graph().items()
        if (name.startswith(("clients", "common")) and not name.startswith("clients.bench"))
        for d in deps
        if d.startswith(("scheduler_service", "worker_service"))
    ]
    assert offenders == []


def _worker_part(module: str) -> str:
    return module.split(".")[1]


def test_the_workers_imports_run_down_its_levels():
    level = {part: i for i, parts in enumerate(WORKER_LEVELS) for part in parts}
    graph = _graph()
    worker = {name: deps for name, deps in graph.items() if name.startswith("worker_service.")}
    assert {_worker_part(name) for name in worker} <= set(level), "a part WORKER_LEVELS misses"
    upward = [
        (name, d)
        for name, deps in worker.items()
        for d in deps
        if d.startswith("worker_service.")
        and _worker_part(d) != _worker_part(name)
        and level[_worker_part(d)] <= level[_worker_part(name)]
    ]
    assert upward == []
    # The rule reads real edges: the gRPC face converts plans, the model applies LoRA.
    assert "worker_service.execution.convert" in graph["worker_service.rpc.servicer"]
    assert "worker_service.lora.batch" in graph["worker_service.models.llama"]


def _core_part(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def test_the_cores_imports_run_down_its_levels():
    level = {part: i for i, parts in enumerate(CORE_LEVELS) for part in parts}
    graph = _graph()
    core = {n: deps for n, deps in graph.items() if n.startswith("scheduler_service.core")}
    assert {_core_part(name) for name in core} <= set(level), "a part CORE_LEVELS misses"
    upward = [
        (name, d)
        for name, deps in core.items()
        for d in deps
        if d.startswith("scheduler_service.core.")
        and _core_part(d) != _core_part(name)
        and level[_core_part(d)] <= level[_core_part(name)]
    ]
    assert upward == []
    # The rule reads real edges: the scheduler asks admission, the KV manager holds requests.
    assert "scheduler_service.core.admission.decision" in graph["scheduler_service.core.scheduler"]
    assert "scheduler_service.core.request" in graph["scheduler_service.core.kv.manager"]


def test_no_mixins_in_the_services():
    mixins = []
    for name, path in _modules().items():
        if not name.startswith(("scheduler_service", "worker_service")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Mixin"):
                mixins.append(f"{name}.{node.name}")
    assert mixins == []


def test_the_scheduler_processes_import_no_torch():
    # The API process (and `radixserve serve`, which runs it) and the core
    # process stay light: torch is the workers' alone.
    code = (
        "import sys, scheduler_service.serve, scheduler_service.api.server, "
        "scheduler_service.engine.main\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_checker_sees_a_circle_and_a_crossing():
    # The rules above pass on the code; make sure they would not pass on anything.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _graph()
    assert "scheduler_service.core.scheduler" in graph["scheduler_service.engine.loop"]
    assert "scheduler_service.core.integrity" in graph["scheduler_service.core.scheduler"]


def _scheduler_uses(tree: ast.AST) -> set[str]:
    """Attributes read or called on ``sched`` / ``self.sched`` in a module."""
    used: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "sched") or (
            isinstance(owner, ast.Attribute)
            and owner.attr == "sched"
            and isinstance(owner.value, ast.Name)
            and owner.value.id == "self"
        ):
            used.add(node.attr)
    return used


def test_the_engine_uses_only_the_schedulers_interface():
    """engine/ (the loop, recovery, the adapter loader) calls named methods of
    the Scheduler (core/scheduler.py, ENGINE_INTERFACE), never its queues,
    cache, pool or tables."""
    from scheduler_service.core.scheduler import ENGINE_INTERFACE

    outside: dict[str, set[str]] = {}
    for path in sorted((ROOT / "scheduler_service" / "engine").glob("*.py")):
        used = _scheduler_uses(ast.parse(path.read_text()))
        if used - ENGINE_INTERFACE:
            outside[path.name] = used - ENGINE_INTERFACE
    assert not outside, f"the engine touches scheduler attributes outside its interface: {outside}"
    from scheduler_service.core.scheduler import Scheduler

    missing = {n for n in ENGINE_INTERFACE if not hasattr(Scheduler, n) and n not in _FIELDS}
    assert not missing, f"ENGINE_INTERFACE names what the Scheduler lacks: {missing}"


# Instance attributes of the Scheduler named in its interface (set in __init__).
_FIELDS = {"config", "stats", "on_requeue", "disagg"}


def test_the_interface_check_sees_a_stray_attribute():
    tree = ast.parse("def f(self):\n    self.sched.waiting.append(1)\n    sched.cache.reset()\n")
    assert _scheduler_uses(tree) == {"waiting", "cache"}


# The services' own code: past four parameters, keyword-only; no bare
# True/False/None passed positionally to a function of ours.
SERVICES = ("scheduler_service", "worker_service", "common", "observability")


def _service_trees() -> list[tuple[Path, ast.AST]]:
    return [
        (path, ast.parse(path.read_text()))
        for package in SERVICES
        for path in sorted((ROOT / package).rglob("*.py"))
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    ]


def _long_positional(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [a.arg for a in node.args.posonlyargs + node.args.args]
            if names and names[0] in ("self", "cls"):
                names = names[1:]
            if len(names) > 4:
                out.append(f"{node.name}({', '.join(names)})")
    return out


def _bare_flags(tree: ast.AST, ours: set[str]) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        if name not in ours:
            continue
        for a in node.args:
            if isinstance(a, ast.Constant) and (a.value is None or isinstance(a.value, bool)):
                out.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
                break
    return out


def test_long_signatures_are_keyword_only_and_flags_are_named():
    trees = _service_trees()
    ours = {
        n.name
        for _, tree in trees
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    # names shared with container and queue methods: a positional None there
    # is a value or a default, not a flag
    ours -= {"get", "pop", "put", "put_nowait", "discard", "setdefault", "append", "setting"}
    long, flags = {}, {}
    for path, tree in trees:
        rel = str(path.relative_to(ROOT))
        if found := _long_positional(tree):
            long[rel] = found
        if found := _bare_flags(tree, ours):
            flags[rel] = found
    assert not long, f"more than four positional parameters: {long}"
    assert not flags, f"True/False/None passed positionally: {flags}"


def test_the_signature_checks_see_what_they_look_for():
    tree = ast.parse("def f(a, b, c, d, e):\n    g(1, True)\n\ndef g(a, *, b): ...\n")
    assert _long_positional(tree) == ["f(a, b, c, d, e)"]
    assert _bare_flags(tree, {"g"}) == ["line 2: g(1, True)"]


# Test modules are pytest's to collect: a helper in one that another imports
# makes a test file a support module in disguise, a fixture imported with it
# shadows the conftest's, and a ``test_*`` name imported is collected twice.
TEST_TREES = ("tests", "benchmarks")


def _test_module_imports(tree: ast.AST, package: str) -> list[str]:
    """The project's test modules (``tests.**.test_*``, ``tests.**.conftest``)
    that a module in ``package`` imports (a ``test_*`` name imported from a
    support module counts too)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[0] == "tests" and any(
                p.startswith("test_") or p == "conftest" for p in parts[1:]
            ):
                found.append(f"line {node.lineno}: {target}")
                break
    return found


def test_no_test_module_imports_another():
    offenders = {}
    for tree_root in TEST_TREES:
        for path in sorted((ROOT / tree_root).rglob("*.py")):
            name = _module_name(path)
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            if found := _test_module_imports(ast.parse(path.read_text()), package):
                offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, (
        f"test modules imported (move the helper to a support/ module): {offenders}"
    )


def test_the_test_import_check_sees_each_form():
    code = (
        "from tests.e2e.test_metrics import scrape\n"
        "from tests.e2e import test_tracing\n"
        "import tests.worker_service.test_sessions as sessions\n"
        "from tests.e2e.conftest import SMG\n"
        "from .test_gateway import post\n"
        "def f():\n"
        "    from ..test_scheduler_properties import scenarios\n"
        "from tests.e2e.support.system import stub\n"
        "from tests.e2e.support import streams\n"
        "from tests.scheduler_service.testing import x\n"
    )
    assert _test_module_imports(ast.parse(code), "tests.e2e") == [
        "line 1: tests.e2e.test_metrics",
        "line 2: tests.e2e.test_tracing",
        "line 3: tests.worker_service.test_sessions",
        "line 4: tests.e2e.conftest",
        "line 5: tests.e2e.test_gateway",
        "line 7: tests.test_scheduler_properties",
    ]
