"""docs/design.md section 1 lists every source file of the packages, and
names none that does not exist.

The section's fenced blocks are the file tree: one entry a line, indented two
spaces per folder, the entry's name first (a folder's ends in ``/``), then
its description. Listed: every ``.py``, ``.c``, ``.h`` and ``.proto`` file under the
packages, but generated stubs (``*_pb2*``); an ``__init__.py`` may be listed
(where it holds code), and must exist if it is.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
PACKAGES = ("scheduler_service", "worker_service", "common", "clients", "observability", "protos")
SOURCE_SUFFIXES = (".py", ".c", ".h", ".proto")
_ENTRY = re.compile(r"(?P<indent> *)(?P<name>\S+)(?: +\S.*)?")


def layout_section(text: str) -> str:
    start = re.search(r"^## 1\. Layout\b.*$", text, re.MULTILINE)
    assert start is not None, "docs/design.md has no section 1. Layout"
    end = text.find("\n## ", start.end())
    return text[start.end() : end if end != -1 else len(text)]


def listed_entries(section: str) -> tuple[list[str], list[str], list[str]]:
    """(files, folders, problems) that the section's fenced blocks name, as
    paths from the repository root."""
    files: list[str] = []
    folders: list[str] = []
    problems: list[str] = []
    in_block = False
    stack: list[str] = []
    for number, line in enumerate(section.splitlines(), 1):
        if line.startswith("```"):
            in_block, stack = not in_block, []
            continue
        if not in_block or not line.strip():
            continue
        m = _ENTRY.fullmatch(line)
        indent = len(m["indent"]) if m else 1
        if m is None or indent % 2 or indent // 2 > len(stack):
            problems.append(f"section 1, line {number}: not an entry of the tree: {line!r}")
            continue
        del stack[indent // 2 :]
        name = m["name"]
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
            folders.append("/".join(stack))
        else:
            files.append("/".join([*stack, name]))
    return files, folders, problems


def source_files() -> set[str]:
    """Every source file of the packages (``__init__.py`` and stubs aside)."""
    found = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*"):
            rel = path.relative_to(ROOT)
            if (
                path.suffix in SOURCE_SUFFIXES
                and path.is_file()
                and "__pycache__" not in rel.parts
                and path.name != "__init__.py"
                and "_pb2" not in path.name
            ):
                found.add(rel.as_posix())
    return found


def layout_problems(text: str) -> list[str]:
    """What is wrong with section 1 of ``text`` against the tree on disk."""
    files, folders, problems = listed_entries(layout_section(text))
    listed = set(files)
    problems += [f"listed twice: {f}" for f in sorted({f for f in files if files.count(f) > 1})]
    problems += [f"not in section 1: {f}" for f in sorted(source_files() - listed)]
    problems += [f"section 1 names a missing file: {f}" for f in files if not (ROOT / f).is_file()]
    problems += [
        f"section 1 names a missing folder: {d}/" for d in folders if not (ROOT / d).is_dir()
    ]
    problems += [f"section 1 lists no {p}/" for p in PACKAGES if p not in folders]
    return problems


def test_section_1_lists_every_source_file_and_only_those():
    assert layout_problems(DESIGN.read_text()) == []


def test_the_check_sees_a_missing_line_a_bogus_one_and_a_broken_tree():
    text = DESIGN.read_text()
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("request_table.py "))
    assert layout_problems(text.replace(line + "\n", "", 1)) == [
        "not in section 1: scheduler_service/core/request_table.py"
    ]
    bogus = text.replace(line, line + "\n    inflight.py          the in-flight record", 1)
    assert layout_problems(bogus) == [
        "section 1 names a missing file: scheduler_service/core/inflight.py"
    ]
    moved = text.replace(line, "  " + line, 1)  # one level too deep: under no folder
    assert any("not an entry of the tree" in p for p in layout_problems(moved))
    twice = text.replace(line, line + "\n" + line, 1)
    assert layout_problems(twice) == ["listed twice: scheduler_service/core/request_table.py"]
