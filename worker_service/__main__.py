"""``radixserve-worker``: serve a model to a scheduler over gRPC."""

from __future__ import annotations

import gc
import signal
import sys
import threading
from collections.abc import Sequence

import structlog

from common import lifeline
from observability import tracing
from observability.logging_setup import configure_logging
from worker_service.config import load_config

logger = structlog.get_logger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    # Started by `radixserve serve`: die with it, however it dies (its
    # scheduler, whose streams this worker serves, goes with it, so there is
    # nothing to drain). Armed before torch is imported, which takes seconds.
    lifeline.die_with_launcher()
    from worker_service.rpc.server import serve
    from worker_service.worker import build_worker

    cfg = load_config(argv)
    configure_logging(cfg.log_level, cfg.log_format)
    if tracing.configured():  # step spans are made in a process of their own
        tracing.protocol()  # a bad protocol stops the worker here, not there
    worker = build_worker(cfg)
    server, port = serve(worker)
    print(f"radixserve-worker listening on {cfg.host}:{port}", flush=True)
    stop, force = threading.Event(), threading.Event()

    def on_signal(*_: object) -> None:
        if stop.is_set():
            force.set()  # a second signal: stop now
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    stop.wait()
    logger.info("shutting down", drain_timeout_s=cfg.drain_timeout_s)
    # The scheduler's open stream is served until it closes it (a scheduler
    # draining on SIGTERM too finishes its streams first), at most
    # --drain-timeout; with no stream open the worker stops at once.
    stopped = server.stop(grace=cfg.drain_timeout_s)
    while not stopped.wait(0.1):
        if force.is_set():
            server.stop(grace=None).wait()
            break
    if worker.runner.grammars is not None:
        worker.runner.grammars.close()  # its compile processes
    if worker.runner.files is not None:
        worker.runner.files.close()  # pages copied aside reach their files
    if getattr(server, "health_server", None) is not None:
        server.health_server.stop(grace=None)
    tracing.shutdown_tracing()  # after the last step: the span process flushes it too
    # Objects frozen are left out of the interpreter's last full collection at
    # exit, which takes seconds over a loaded model's objects.
    gc.freeze()
    return 0


if __name__ == "__main__":
    sys.exit(main())
