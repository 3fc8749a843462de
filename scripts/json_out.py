"""A summary written so that a reader, or a kill in the middle, never sees
half a file: the GPU scripts rewrite theirs after every step, so a timeout
keeps what finished."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path | None, summary: dict[str, Any]) -> None:
    """``summary`` at ``path`` (nothing when None), replacing the last one whole."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    tmp.replace(path)
