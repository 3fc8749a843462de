"""``radixserve-scheduler``: the public API in front of a worker group."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from observability.logging_setup import configure_logging
from scheduler_service.api.server import STARTUP_ERRORS, serve
from scheduler_service.config import load_config
from scheduler_service.gc_tuning import tune_gc


def main(argv: Sequence[str] | None = None) -> int:
    config = load_config(argv)
    configure_logging(config.log_level, config.log_format)
    tune_gc()
    try:
        asyncio.run(serve(config))
    except STARTUP_ERRORS as e:
        print(f"radixserve-scheduler: error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
