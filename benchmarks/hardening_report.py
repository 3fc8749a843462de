"""The hardening round's rows (what a phase tried, what it measured, whether
it held) and how they are printed: one line per row as it lands, the whole
table at the end, and a JSON summary as the very last line."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass, field


@dataclass
class Row:
    phase: str  # garbage, kills, floods, leaks, ...
    tried: str  # what was done, with its counts
    measured: str  # what came back, with its numbers
    held: bool
    problems: list[str] = field(default_factory=list)
    numbers: dict = field(default_factory=dict)  # for the JSON summary


def show(row: Row) -> None:
    """One row, as soon as its phase ends (a long run shows progress)."""
    verdict = "HELD" if row.held else "DID NOT HOLD"
    print(f"[{row.phase}] {verdict}: {row.tried} -> {row.measured}", flush=True)
    for p in row.problems:
        print(f"    problem: {p}", flush=True)


def table(rows: list[Row], width: int = 60) -> str:
    """The rows as a plain-text table, long cells wrapped."""
    heads = ("phase", "tried", "measured", "held")
    widths = (10, width, width, 4)
    lines = [" | ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True))]
    lines.append("-+-".join("-" * w for w in widths))
    for r in rows:
        cells = [
            [r.phase],
            textwrap.wrap(r.tried, width) or [""],
            textwrap.wrap(r.measured + "".join(f"; PROBLEM: {p}" for p in r.problems), width)
            or [""],
            ["yes" if r.held else "NO"],
        ]
        for i in range(max(len(c) for c in cells)):
            lines.append(
                " | ".join(
                    (c[i] if i < len(c) else "").ljust(w)
                    for c, w in zip(cells, widths, strict=True)
                )
            )
    return "\n".join(lines)


def summary(rows: list[Row], extra: dict) -> str:
    """The JSON line that ends the output."""
    return json.dumps(
        {
            "held": all(r.held for r in rows),
            "rows": len(rows),
            "did_not_hold": [f"{r.phase}: {r.tried}" for r in rows if not r.held],
            **extra,
            "results": [asdict(r) for r in rows],
        },
        sort_keys=False,
        default=str,
    )
