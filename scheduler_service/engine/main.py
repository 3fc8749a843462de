"""The core process: connects to the worker group, builds the Scheduler and
runs the Engine loop; talks to the API process over a pipe."""

from __future__ import annotations

import cProfile
import dataclasses
import json
import os
import signal
from multiprocessing.connection import Connection
from pathlib import Path

import structlog
from google.protobuf.json_format import MessageToDict
from tokenizers import Tokenizer

from common import lifeline, tokenizer_archive
from observability import tracing
from observability.logging_setup import configure_logging
from scheduler_service import ipc
from scheduler_service.config import TRACING_SERVICE_NAME, ServiceConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.adapter_loader import AdapterLoader
from scheduler_service.engine.loop import Engine
from scheduler_service.engine.pd_setup import build_transfers
from scheduler_service.engine.stop_strings import StopStringMatcher
from scheduler_service.engine.worker_group import WorkerError, WorkerGroup
from scheduler_service.gc_tuning import tune_gc
from scheduler_service.tls import TlsConfigError, worker_channel_credentials, worker_token

logger = structlog.get_logger(__name__)

PROFILE_ENV = "RADIXSERVE_PROFILE_CORE"  # a path: write a cProfile of the core loop there


def load_tokenizer(archive: bytes) -> Tokenizer | None:
    """The tokenizer of an archive; None (token ids only) if it has none."""
    if not archive:
        return None
    files = tokenizer_archive.unpack(archive)
    if tokenizer_archive.TOKENIZER_JSON not in files:
        logger.warning("the model's files hold no tokenizer.json: serving token ids only")
        return None
    return Tokenizer.from_str(files[tokenizer_archive.TOKENIZER_JSON].decode())


def core_main(conn: Connection, config: ServiceConfig, parent_pid: int) -> None:
    """Entry point of the core process (spawned by the API process ``parent_pid``)."""
    # Without its API process nobody reads this one's outputs: die with it
    # (SIGKILL: there is nothing left to drain), also if it is already gone.
    lifeline.die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group; the API process decides when
    # this one stops (it sends Shutdown), so an interrupt must not kill it mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(config.log_level, config.log_format)
    tracing.setup_tracing(TRACING_SERVICE_NAME)
    try:
        credentials, options = worker_channel_credentials(config.security)
        token = worker_token(config.security)
    except TlsConfigError as e:
        conn.send(ipc.Failed(str(e)))
        return
    group = WorkerGroup(
        list(config.workers),
        config.limits.max_message_mb,
        credentials,
        options,
        token=token,
        keepalive_s=config.engine.worker_keepalive_s,
        step_timeout_s=config.engine.worker_step_timeout_s,
    )
    try:
        info = group.connect()
        if config.api.tokenizer:
            archive = tokenizer_archive.pack_directory(Path(config.api.tokenizer))
        else:
            try:
                archive = group.tokenizer_archive()
            except Exception as e:  # e.g. the simulated model has none
                logger.warning("the worker serves no tokenizer", error=str(e))
                archive = b""
    except WorkerError as e:
        conn.send(ipc.Failed(str(e)))
        return
    tokenizer = load_tokenizer(archive)
    if tokenizer is None:
        archive = b""
    model = info.model
    try:
        sched = Scheduler(
            dataclasses.replace(
                config.scheduler,
                page_size=info.page_size,
                vocab_size=model.vocab_size,
                eos_token_ids=frozenset(model.eos_token_ids),
                context_len=model.max_context_len or None,
                enable_kv_events=True,
                hicache_host_pages=info.num_host_pages,
                hicache_storage_pages=info.num_storage_pages if info.num_host_pages else 0,
            ),
            info.num_pages,
            stop_strings=StopStringMatcher(tokenizer) if tokenizer is not None else None,
            num_swa_pages=info.num_swa_pages,
            swa_window=info.swa_window,
        )
    except ValueError as e:  # a combination the scheduler refuses (e.g. PD with a host tier)
        conn.send(ipc.Failed(str(e)))
        return
    sched.note_stored_blocks(group.stored_hashes)  # the file tier's blocks, if any
    adapters = AdapterLoader(sched, group, config.engine.max_lora_rank)
    try:
        adapters.preload(list(config.engine.lora_paths))
    except WorkerError as e:
        conn.send(ipc.Failed(str(e)))
        return
    conn.send(
        ipc.Ready(
            model_name=model.name,
            architecture=model.architecture,
            vocab_size=model.vocab_size,
            eos_token_ids=list(model.eos_token_ids),
            max_context_len=model.max_context_len,
            page_size=info.page_size,
            num_pages=info.num_pages,
            tp_size=info.tp_size,
            tokenizer_zip=archive,
            worker_info=json.loads(json.dumps(MessageToDict(info))),
            sampling_worker=group.ranks[0].address,
            adapters=adapters.snapshot(),
            weight_bytes=info.weight_bytes,
            kv_cache_bytes=info.kv_cache_bytes,
            graph_bytes=info.graph_bytes,
            grammar_backend=info.grammar_backend,
            bos_token_id=model.bos_token_id if model.HasField("bos_token_id") else None,
            pad_token_id=model.pad_token_id if model.HasField("pad_token_id") else None,
            sampling_defaults={f.name: value for f, value in model.sampling_defaults.ListFields()},
        )
    )
    try:
        transfers, wakeup, closers = build_transfers(config, sched, group, info=info, token=token)
    except OSError as e:
        conn.send(ipc.Failed(f"the bootstrap server: {e}"))
        return
    engine = Engine(
        sched,
        group,
        conn,
        overlap_depth=config.engine.overlap_depth,
        recovery_timeout_s=config.engine.worker_recovery_timeout_s,
        check_integrity=config.engine.check_integrity,
        adapters=adapters,
        sliding=info.num_swa_pages > 0,
        transfers=transfers,
        wakeup=wakeup,
    )
    tune_gc()
    try:
        if os.environ.get(PROFILE_ENV):  # measure before optimizing: cProfile of the loop
            with cProfile.Profile() as prof:
                try:
                    engine.run()
                finally:
                    prof.dump_stats(os.environ[PROFILE_ENV])
        else:
            engine.run()
    finally:
        for close in closers:
            close()
        group.close()
        tracing.shutdown_tracing()  # flush the request spans before exiting
