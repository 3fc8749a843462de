"""README.md's settings table, from the declarations (tests check that the
README holds exactly this): ``python scripts/settings_table.py`` prints it,
``--write`` puts it into README.md between its markers."""

from __future__ import annotations

import sys
from pathlib import Path

from common.settings import markdown_rows
from scheduler_service.config import ENV_PREFIX as SCHEDULER_ENV
from scheduler_service.config import ServiceConfig
from worker_service.config import ENV_PREFIX as WORKER_ENV
from worker_service.config import WorkerConfig

HEADER = [
    "| service | flag | environment | default | what |",
    "|---|---|---|---|---|",
    "| scheduler | `--worker grpc://HOST:PORT` (repeated) | `RADIXSERVE_WORKERS` "
    "(comma-separated) | - | the worker group's ranks, rank 0 first (not for `radixserve "
    "serve`, which starts them) |",
]


def table() -> str:
    rows = HEADER + markdown_rows(ServiceConfig, SCHEDULER_ENV, "scheduler")
    rows += markdown_rows(WorkerConfig, WORKER_ENV, "worker")
    return "\n".join(rows) + "\n"


START = "<!-- settings table:"
END = "<!-- end of the settings table -->"


def write(readme: Path) -> None:
    text = readme.read_text()
    start = text.index("\n", text.index(START)) + 1
    readme.write_text(text[:start] + table() + text[text.index(END) :])


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write(Path(__file__).resolve().parent.parent / "README.md")
    else:
        print(table(), end="")
