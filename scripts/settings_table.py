"""README.md's settings table, from the declarations (tests check that the
README holds exactly this): ``python scripts/settings_table.py`` prints it,
``--write`` puts it into README.md between its markers."""

from __future__ import annotations

import sys

from common.settings import markdown_rows
from scheduler_service.config import ENV_PREFIX as SCHEDULER_ENV
from scheduler_service.config import ServiceConfig
from scripts.readme_block import README, write_block
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


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_block(README, start=START, end=END, body=table())
    else:
        print(table(), end="")
