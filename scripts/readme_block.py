"""Writing a generated table between its two marker lines in README.md (the
settings and the model families tables)."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def write_block(readme: Path, *, start: str, end: str, body: str) -> None:
    """Replace what lies between the line holding ``start`` and the line
    starting with ``end`` by ``body``."""
    text = readme.read_text()
    first = text.index("\n", text.index(start)) + 1
    readme.write_text(text[:first] + body + text[text.index(end) :])
