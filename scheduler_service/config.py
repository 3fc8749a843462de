"""The scheduler service's settings: command-line flags, with RADIXSERVE_*
environment variables as defaults, read once at start into one frozen object."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scheduler_service.core.config import POLICIES, SchedulerConfig

ENV_PREFIX = "RADIXSERVE_"
TRACING_SERVICE_NAME = "radixserve-scheduler"  # OTEL_SERVICE_NAME overrides it


@dataclass(frozen=True)
class ServiceConfig:
    workers: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 30000
    port_file: str | None = None
    metrics_port: int | None = None
    health_port: int | None = None  # plaintext grpc.health.v1 only, for probes
    served_model_name: str | None = None
    tokenizer: str | None = None  # a local tokenizer directory (default: from the worker)
    overlap_depth: int = 2  # plans sent ahead of the result being waited for
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_logit_bias: int = 1024
    max_top_logprobs: int = 64
    max_message_mb: int = 64
    # Samples submitted to the core that have had no output yet (waiting, or in
    # their first prefill); past it Generate answers RESOURCE_EXHAUSTED. <= 0: unbounded.
    max_queued_requests: int = 1024
    # Debug: the core checks the page pool and radix cache after every step
    # and update, and fails every call loudly (INTERNAL) if they break.
    check_integrity: bool = False
    # How long requests wait for a lost worker group to come back (their
    # streams pause) before they end with UNAVAILABLE; reconnecting goes on.
    worker_recovery_timeout_s: float = 60.0
    log_level: str = "info"
    log_format: str = "auto"
    # Paths only: the files are read at start (and a config holding the keys
    # would hand them to GetServerInfo, which reports these fields).
    tls_cert: str | None = None  # the public port serves TLS when given (with tls_key)
    tls_key: str | None = None
    api_key_file: str | None = None  # one key per line; every public RPC then needs one
    worker_tls_ca: str | None = None  # mutual TLS to the workers (all three or none)
    worker_tls_cert: str | None = None
    worker_tls_key: str | None = None
    worker_tls_server_name: str | None = None  # the name the workers' certificate holds
    scheduler: dict = field(default_factory=dict)  # overrides of SchedulerConfig fields

    def scheduler_config(self, **from_worker: object) -> SchedulerConfig:
        return SchedulerConfig(**{**self.scheduler, **from_worker})


def add_scheduler_flags(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Flags of the scheduling core (shared by radixserve-scheduler and radixserve serve)."""

    def default(name: str, value: object) -> object:
        return env.get(ENV_PREFIX + name.upper().replace("-", "_"), value)

    d = SchedulerConfig()
    add = p.add_argument
    add("--schedule-policy", choices=POLICIES, default=default("schedule-policy", "lpm"))
    add(
        "--max-running-requests",
        type=int,
        default=default("max-running-requests", d.max_running_requests),
    )
    add(
        "--max-prefill-tokens",
        type=int,
        default=default("max-prefill-tokens", d.max_prefill_tokens),
    )
    add(
        "--chunked-prefill-size",
        type=int,
        default=default("chunked-prefill-size", d.chunked_prefill_size),
        help="most prompt tokens prefilled per step; -1 disables chunking",
    )
    add(
        "--enable-mixed-chunk",
        action="store_true",
        default=default("enable-mixed-chunk", "") not in ("", "0", "false"),
    )
    add(
        "--enable-priority-scheduling",
        action="store_true",
        default=default("enable-priority-scheduling", "") not in ("", "0", "false"),
    )
    add("--schedule-low-priority-values-first", action="store_true", default=False)
    add(
        "--priority-scheduling-preemption-threshold",
        type=int,
        default=default(
            "priority-scheduling-preemption-threshold", d.priority_preemption_threshold
        ),
    )
    add(
        "--schedule-conservativeness",
        type=float,
        default=default("schedule-conservativeness", d.schedule_conservativeness),
    )
    add(
        "--prefix-hold-tokens",
        type=int,
        default=default("prefix-hold-tokens", d.prefix_hold_tokens),
        help="a request sharing at least this many uncached prompt tokens with one admitted "
        "in the same step waits a step and reads them from the cache (0: off)",
    )


def scheduler_overrides(args: argparse.Namespace) -> dict:
    chunk = args.chunked_prefill_size
    return {
        "schedule_policy": args.schedule_policy,
        "max_running_requests": args.max_running_requests,
        "max_prefill_tokens": args.max_prefill_tokens,
        "chunked_prefill_size": None if chunk is None or chunk <= 0 else chunk,
        "enable_mixed_chunk": args.enable_mixed_chunk,
        "enable_priority_scheduling": args.enable_priority_scheduling,
        "schedule_low_priority_values_first": args.schedule_low_priority_values_first,
        "priority_preemption_threshold": args.priority_scheduling_preemption_threshold,
        "schedule_conservativeness": args.schedule_conservativeness,
        "prefix_hold_tokens": args.prefix_hold_tokens,
    }


def add_service_flags(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    def default(name: str, value: object) -> object:
        return env.get(ENV_PREFIX + name.upper().replace("-", "_"), value)

    d = ServiceConfig()
    add = p.add_argument
    add("--host", default=default("host", d.host))
    add("--port", type=int, default=default("port", d.port), help="public gRPC port (0: any)")
    add(
        "--port-file",
        default=default("port-file", None),
        help="write the bound public port here once serving",
    )
    add(
        "--metrics-port",
        type=int,
        default=default("metrics-port", None),
        help="serve Prometheus metrics on this port",
    )
    add(
        "--health-port",
        type=int,
        default=default("health-port", None),
        help="also serve grpc.health.v1, and nothing else, in plaintext on this port "
        "(kubelet gRPC probes cannot speak TLS)",
    )
    add("--served-model-name", default=default("served-model-name", None))
    add(
        "--tokenizer",
        default=default("tokenizer", None),
        help="local tokenizer directory (default: fetched from the worker)",
    )
    add(
        "--disable-overlap",
        action="store_true",
        default=default("disable-overlap", "") not in ("", "0", "false"),
        help="wait for each step's result before planning the next",
    )
    add(
        "--overlap-depth",
        type=int,
        default=default("overlap-depth", d.overlap_depth),
        help="plans sent before the oldest result is read (1: plan N+1 goes out before "
        "result N arrives; 2 gives a loaded machine more slack, at one more wasted "
        "token per finished request)",
    )
    add("--max-n", type=int, default=default("max-n", d.max_n))
    add(
        "--max-queued-requests",
        type=int,
        default=default("max-queued-requests", d.max_queued_requests),
        help="samples waiting for their first token before Generate answers "
        "RESOURCE_EXHAUSTED (0 or -1: unbounded)",
    )
    add(
        "--max-message-mb",
        type=int,
        default=default("max-message-mb", d.max_message_mb),
        help="gRPC message size limit on the public API and the worker channels",
    )
    add(
        "--check-integrity",
        action="store_true",
        default=default("check-integrity", "") not in ("", "0", "false"),
        help="debug: check the page pool and radix cache after every step (slow)",
    )
    add(
        "--worker-recovery-timeout",
        type=float,
        default=default("worker-recovery-timeout", d.worker_recovery_timeout_s),
        metavar="SECONDS",
        help="when the worker group is lost, streams pause while it is reconnected; past "
        "this many seconds they end with UNAVAILABLE (and new requests too until it is back)",
    )
    add("--log-level", default=default("log-level", d.log_level))
    add(
        "--log-format",
        default=default("log-format", d.log_format),
        choices=["auto", "json", "console"],
        help="auto: JSON lines unless stderr is a terminal",
    )
    add_security_flags(p, env)
    add_scheduler_flags(p, env)


def add_security_flags(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    def default(name: str) -> str | None:
        return env.get(ENV_PREFIX + name.upper().replace("-", "_")) or None

    add = p.add_argument
    add("--tls-cert", default=default("tls-cert"), metavar="PATH", help="serve TLS (PEM chain)")
    add("--tls-key", default=default("tls-key"), metavar="PATH", help="the TLS key (PEM)")
    add(
        "--api-key-file",
        default=default("api-key-file"),
        metavar="PATH",
        help="API keys, one a line: public RPCs then need 'authorization: Bearer KEY'",
    )
    add("--worker-tls-ca", default=default("worker-tls-ca"), metavar="PATH")
    add("--worker-tls-cert", default=default("worker-tls-cert"), metavar="PATH")
    add(
        "--worker-tls-key",
        default=default("worker-tls-key"),
        metavar="PATH",
        help="with --worker-tls-ca/--worker-tls-cert: mutual TLS to the workers",
    )
    add(
        "--worker-tls-server-name",
        default=default("worker-tls-server-name"),
        metavar="NAME",
        help="expect this name in the workers' certificate whatever their addresses",
    )


def check_security_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse half a TLS set-up and unreadable files before anything starts."""
    groups = [
        ("--tls-cert", "--tls-key"),
        ("--worker-tls-ca", "--worker-tls-cert", "--worker-tls-key"),
    ]
    for group in groups:
        given = [flag for flag in group if getattr(args, _dest(flag))]
        if given and len(given) != len(group):
            p.error(f"{' '.join(group)} go together (given: {' '.join(given)})")
    for flag in (*groups[0], *groups[1], "--api-key-file"):
        path = getattr(args, _dest(flag))
        if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            p.error(f"{flag} {path}: no such file or not readable")
    if args.worker_tls_server_name and not args.worker_tls_ca:
        p.error("--worker-tls-server-name needs --worker-tls-ca/--worker-tls-cert/--worker-tls-key")


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def service_config(args: argparse.Namespace, workers: Sequence[str]) -> ServiceConfig:
    return ServiceConfig(
        workers=tuple(workers),
        host=args.host,
        port=args.port,
        port_file=args.port_file,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        served_model_name=args.served_model_name,
        tokenizer=args.tokenizer,
        overlap_depth=0 if args.disable_overlap else max(args.overlap_depth, 0),
        max_n=args.max_n,
        max_queued_requests=args.max_queued_requests,
        max_message_mb=args.max_message_mb,
        check_integrity=args.check_integrity,
        worker_recovery_timeout_s=max(float(args.worker_recovery_timeout), 0.0),
        log_level=args.log_level,
        log_format=args.log_format,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        api_key_file=args.api_key_file,
        worker_tls_ca=args.worker_tls_ca,
        worker_tls_cert=args.worker_tls_cert,
        worker_tls_key=args.worker_tls_key,
        worker_tls_server_name=args.worker_tls_server_name,
        scheduler=scheduler_overrides(args),
    )


def load_config(argv: Sequence[str] | None = None) -> ServiceConfig:
    env = os.environ
    p = argparse.ArgumentParser(
        prog="radixserve-scheduler",
        description="radixserve scheduler: the public gRPC API in front of a worker group.",
    )
    p.add_argument(
        "--worker",
        action="append",
        default=None,
        metavar="grpc://HOST:PORT",
        help="a worker rank (repeat for each tensor-parallel rank)",
    )
    add_service_flags(p, env)
    args = p.parse_args(argv)
    check_security_flags(p, args)
    workers = args.worker or [w for w in env.get(ENV_PREFIX + "WORKERS", "").split(",") if w]
    if not workers:
        p.error("give the worker group with --worker grpc://HOST:PORT (one per rank)")
    return service_config(args, workers)
