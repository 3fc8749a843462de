"""The scheduler service's settings, read once at start into one frozen object.

Every knob is declared once below (or, for the scheduling knobs, in
core/config.py): its default, help text and flag. Flags and their
``RADIXSERVE_<FLAG>`` environment defaults are generated from the
declarations (common/settings.py); ``radixserve-scheduler`` and
``radixserve serve`` share them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.settings import Deprecated, add_flags, build, section, setting
from scheduler_service.core.adapters import ADAPTER_NAME
from scheduler_service.core.config import SchedulerConfig

ENV_PREFIX = "RADIXSERVE_"
TRACING_SERVICE_NAME = "radixserve-scheduler"  # OTEL_SERVICE_NAME overrides it
LOG_FORMATS = ("auto", "json", "console")


def _at_least_zero(kind: type) -> object:
    def parse(text: str) -> object:
        return max(kind(text), kind(0))

    return parse


class _OutOfRange(argparse.ArgumentTypeError, ValueError):
    """Shown as is by argparse (a flag) and by the settings' env reader."""


def _at_least(floor: float, kind: type = float) -> object:
    def parse(text: str) -> float:
        value = kind(text)
        if value < floor:
            raise _OutOfRange(f"{text} is below the least allowed, {floor:g}")
        return value

    return parse


@dataclass(frozen=True)
class PublicApiConfig:
    host: str = setting("127.0.0.1", "address the public, health and metrics ports bind")
    port: int = setting(30000, "public gRPC port (0: any free port)")
    port_file: str | None = setting(None, "write the bound public port here once serving")
    metrics_port: int | None = setting(None, "serve Prometheus metrics on this port")
    health_port: int | None = setting(
        None,
        "also serve grpc.health.v1, and nothing else, in plaintext on this port "
        "(kubelet gRPC probes cannot speak TLS)",
    )
    served_model_name: str | None = setting(
        None, "the model name reported to clients (default: the model file's name)"
    )
    tokenizer: str | None = setting(
        None, "local tokenizer directory (default: fetched from the worker)"
    )
    weight_version: str = setting(
        "default",
        "the weights' version reported as GetModelInfo.weight_version (SGLang's "
        "--weight-version; e.g. a checkpoint revision)",
    )
    sampling_defaults: str = setting(
        "model",
        "model: the sampling defaults the model declares (generation_config.json) are "
        "reported in GetModelInfo and fill the fields a request leaves unset; openai: "
        "neither (SGLang's --sampling-defaults)",
        choices=("model", "openai"),
    )
    think_end_token: str = setting(
        "</think>",
        "the vocabulary token that ends a reasoning model's thinking section: a "
        "require_reasoning request's grammar applies after it, and the tokens up to it "
        "count as reasoning_tokens (a model without it refuses require_reasoning)",
        metavar="TOKEN",
    )
    stream_chunks_per_s: float = setting(
        2000.0,
        "the most streamed chunks per second the API process writes, shared by the "
        "streams in flight: with S streams each sends at most one chunk every "
        "S / this seconds, carrying every token that came meanwhile (a stream's first "
        "token and its end go at once); a gRPC message costs tens of microseconds of "
        "CPU, a token in it a few (0: a chunk for every token, whatever the load)",
        metavar="N",
        parse=_at_least_zero(float),
    )
    drain_timeout_s: float = setting(
        30.0,
        "on SIGTERM/SIGINT stop admitting (new calls end UNAVAILABLE, readiness NOT_SERVING) "
        "and let the streams in flight finish for at most this many seconds, then end the "
        "rest with UNAVAILABLE and exit (a second signal ends them at once)",
        flag="--drain-timeout",
        metavar="SECONDS",
        parse=_at_least_zero(float),
    )


@dataclass(frozen=True)
class LimitsConfig:
    max_n: int = setting(16, "most samples per request (n)")
    max_queued_requests: int = setting(
        1024,
        "samples waiting for their first token before Generate answers RESOURCE_EXHAUSTED "
        "(0 or -1: unbounded)",
    )
    max_message_mb: int = setting(
        64, "gRPC message size limit on the public API and the worker channels"
    )
    # Fixed limits (no flag); README.md, "Public API limits".
    max_stop_strings: int = setting(16, flag=None)
    max_stop_string_len: int = setting(256, flag=None)
    max_stop_token_ids: int = setting(1024, flag=None)
    max_logit_bias: int = setting(1024, flag=None)
    max_logit_bias_value: float = setting(100.0, flag=None)  # OpenAI's range
    max_top_logprobs: int = setting(64, flag=None)
    max_token_ids_logprob: int = setting(1024, flag=None)
    max_stream_interval: int = setting(1024, flag=None)
    max_grammar_bytes: int = setting(
        64 << 10, "longest regex, JSON schema, EBNF grammar or structural tag accepted (bytes)"
    )
    grammar_compile_timeout_s: float = setting(
        30.0,
        "a grammar not compiled by then is refused with RESOURCE_EXHAUSTED (retry later: "
        "the verdict is not remembered)",
        flag="--grammar-compile-timeout",
        metavar="SECONDS",
    )
    grammar_compiles_per_client: int = setting(
        8,
        "distinct grammars one client (its API key, else its IP address) may have waiting "
        "to compile at a time; past it RESOURCE_EXHAUSTED",
        parse=_at_least(1, int),
    )


@dataclass(frozen=True)
class SecurityConfig:
    """Paths only: the files are read at start (a config holding the keys would
    hand them to GetServerInfo, which reports these fields)."""

    tls_cert: str | None = setting(None, "serve TLS on the public port (PEM chain)", metavar="PATH")
    tls_key: str | None = setting(None, "the public port's TLS key (PEM)", metavar="PATH")
    api_key_file: str | None = setting(
        None,
        "API keys, one a line: public RPCs then need 'authorization: Bearer KEY'",
        metavar="PATH",
    )
    worker_tls_ca: str | None = setting(
        None, "mutual TLS to the workers: the CA that signed their certificates", metavar="PATH"
    )
    worker_tls_cert: str | None = setting(
        None, "mutual TLS to the workers: this scheduler's certificate", metavar="PATH"
    )
    worker_tls_key: str | None = setting(
        None, "mutual TLS to the workers: this scheduler's key", metavar="PATH"
    )
    worker_tls_server_name: str | None = setting(
        None,
        "expect this name in the workers' certificate whatever their addresses",
        metavar="NAME",
    )
    worker_token_file: str | None = setting(
        None,
        "a file holding the shared worker token, sent on every worker RPC (the workers' "
        "--worker-token-file); use it whenever mutual TLS is off",
        metavar="PATH",
    )


def _lora_path(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not path:
        raise ValueError(f"expected NAME=PATH, got {text!r}")
    if not ADAPTER_NAME.match(name):
        raise ValueError(f"adapter name {name!r}: use 1-64 of A-Z a-z 0-9 . _ -")
    return name, path


@dataclass(frozen=True)
class EngineConfig:
    """The core process's loop."""

    overlap_depth: int = setting(
        2,
        "plans sent before the oldest result is read (0: wait for every result; 1: plan "
        "N+1 goes out before result N arrives; 2 gives a loaded machine more slack, at one "
        "more wasted token per finished request)",
        parse=_at_least_zero(int),
        deprecated=(Deprecated("--disable-overlap", 0, "use --overlap-depth 0"),),
    )
    worker_recovery_timeout_s: float = setting(
        60.0,
        "when the worker group is lost, streams pause while it is reconnected; past this "
        "many seconds from the first loss (a group that keeps coming back and dying is one "
        "outage until it stays up 10 s) they end with UNAVAILABLE (and new requests too "
        "until it is back)",
        flag="--worker-recovery-timeout",
        metavar="SECONDS",
        parse=_at_least_zero(float),
    )
    worker_keepalive_s: float = setting(
        10.0,
        "ping each worker channel this often; a worker that leaves a ping unanswered as "
        "long counts as lost (a stopped process, a dead host). At least 1",
        flag="--worker-keepalive",
        metavar="SECONDS",
        parse=_at_least(1.0),
    )
    worker_step_timeout_s: float = setting(
        0.0,
        "a step result not back within this many seconds counts as a lost worker group "
        "(recovery runs); 0: max(60, 20 x the p99 of the last 1024 steps' waits, the step's "
        "tokens x 20 x the p99 seconds per token of recent steps of 32+ tokens, at least "
        "0.05 s a token)",
        flag="--worker-step-timeout",
        metavar="SECONDS",
        parse=_at_least_zero(float),
    )
    check_integrity: bool = setting(
        False, "debug: check the page pool and radix cache after every step (slow)"
    )
    lora_paths: tuple[tuple[str, str], ...] = setting(
        (),
        "LoRA adapters loaded at start, NAME=PATH each (env: comma-separated; a PEFT "
        "directory the workers can read; NAME is also its lora_id)",
        parse=_lora_path,
        metavar="NAME=PATH",
        many=True,
    )
    max_lora_rank: int = setting(64, "LoRA adapters of a higher rank are refused")
    disaggregation_bootstrap_port: int = setting(
        8998,
        "a prefill unit (--disaggregation-mode prefill) serves decode units' claims of "
        "bootstrap rooms on this port of --host (the port the gateway's --prefill URL names; "
        "SGLang's default; 0: any free port)",
    )
    disaggregation_worker_addresses: tuple[str, ...] = setting(
        (),
        "a decode unit: its workers' addresses (rank order) as the prefill unit's workers "
        "reach them (default: --workers)",
        parse=str,
        metavar="HOST:PORT",
        many=True,
    )


@dataclass(frozen=True)
class ServiceConfig:
    # From --worker (repeated) or RADIXSERVE_WORKERS (comma-separated).
    workers: tuple[str, ...] = setting((), flag=None)
    api: PublicApiConfig = section(PublicApiConfig, "public API")
    limits: LimitsConfig = section(LimitsConfig, "limits")
    security: SecurityConfig = section(SecurityConfig, "security")
    engine: EngineConfig = section(EngineConfig, "core process")
    scheduler: SchedulerConfig = section(SchedulerConfig, "scheduling")
    log_level: str = setting("info", "debug, info, warning or error")
    log_format: str = setting(
        "auto", "auto: JSON lines unless stderr is a terminal", choices=LOG_FORMATS
    )


def add_service_flags(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """The scheduler's flags (radixserve-scheduler and radixserve serve)."""
    add_flags(p, ServiceConfig, env, ENV_PREFIX)


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
    for flag in (*groups[0], *groups[1], "--api-key-file", "--worker-token-file"):
        path = getattr(args, _dest(flag))
        if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            p.error(f"{flag} {path}: no such file or not readable")
    if args.security__worker_tls_server_name and not args.security__worker_tls_ca:
        p.error("--worker-tls-server-name needs --worker-tls-ca/--worker-tls-cert/--worker-tls-key")


def _dest(flag: str) -> str:
    return "security__" + flag.removeprefix("--").replace("-", "_")


def service_config(args: argparse.Namespace, workers: Sequence[str]) -> ServiceConfig:
    try:
        return build(ServiceConfig, args, workers=tuple(workers))
    except ValueError as e:  # settings that do not go together (the dataclasses check)
        raise SystemExit(f"error: {e}") from None


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
        help=f"a worker rank (repeat for each tensor-parallel rank; env {ENV_PREFIX}WORKERS, "
        "comma-separated)",
    )
    add_service_flags(p, env)
    args = p.parse_args(argv)
    check_security_flags(p, args)
    workers = args.worker or [w for w in env.get(ENV_PREFIX + "WORKERS", "").split(",") if w]
    if not workers:
        p.error("give the worker group with --worker grpc://HOST:PORT (one per rank)")
    return service_config(args, workers)
