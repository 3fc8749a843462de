"""Prose for the text workload: paragraphs of text files, or by default of
Python's own documentation as the standard library ships it
(``pydoc_data/topics.py``: the language reference's topics that ``help()``
prints, written by the Python project, not here).

Only prose is kept: a paragraph (lines between blank lines, unwrapped) of
at least a dozen words, not indented (code, grammar rules, quoted output),
with no underline rows (titles) and mostly letters."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

DEFAULT_SOURCE = "pydoc_data/topics.py (Python's documentation, as the standard library ships it)"

MIN_WORDS = 12
_UNDERLINE = re.compile(r"^\s*([=*\-~^#+])\1{2,}\s*$")


def paragraphs_of(text: str) -> list[str]:
    """The prose paragraphs of one text, in order, each on one line."""
    out = []
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = block.split("\n")
        lines = [x for x in lines if x.strip()]
        if not lines or lines[0][:1].isspace():
            continue
        if any(_UNDERLINE.match(x) for x in lines):
            continue
        para = " ".join(x.strip() for x in lines)
        if len(para.split()) < MIN_WORDS or para.startswith((">>>", "$ ", "```")):
            continue
        letters = sum(c.isalpha() or c.isspace() for c in para)
        if letters < 0.8 * len(para):
            continue
        out.append(para)
    return out


def read_paragraphs(paths: Iterable[str | Path]) -> list[str]:
    """The prose paragraphs of the files, file by file (bytes that are not
    UTF-8 are replaced)."""
    out: list[str] = []
    for path in paths:
        out.extend(paragraphs_of(Path(path).read_text(encoding="utf-8", errors="replace")))
    return out


def default_paragraphs() -> list[str]:
    """The prose of pydoc_data's topics (sorted by topic name, so the order,
    and with it a seed's prompts, does not depend on dict order)."""
    from pydoc_data.topics import topics

    out: list[str] = []
    for name in sorted(topics):
        out.extend(paragraphs_of(topics[name]))
    return out
