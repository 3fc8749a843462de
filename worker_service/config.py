"""The worker's settings: command-line flags, with RADIXSERVE_WORKER_* environment
variables as defaults, read once at start into one frozen object."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ENV_PREFIX = "RADIXSERVE_WORKER_"


@dataclass(frozen=True)
class WorkerConfig:
    model: str = "default"  # a HF directory, a .gguf file, "default" or "simulated"
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (written to --port-file / printed)
    port_file: str | None = None
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    attention_backend: str = "auto"  # auto: flashinfer on CUDA, torch on CPU
    page_size: int = 16
    kv_memory: str = "auto"  # bytes for the KV cache, e.g. 2GiB; auto: see engine.py
    num_pages: int | None = None  # overrides kv_memory
    tp_size: int = 1
    tp_rank: int = 0
    dist_addr: str | None = None
    simulated_step_ms: float = 0.0
    simulated_vocab: int = 32000
    max_message_mb: int = 64
    threads: int = 0  # torch intra-op threads on CPU; 0: torch's default (all cores)
    cuda_graphs: bool = True  # capture decode steps in CUDA graphs (CUDA + flashinfer)
    log_level: str = "info"
    log_format: str = "auto"  # auto: JSON unless stderr is a TTY
    metrics_port: int | None = None
    health_port: int | None = None  # plaintext grpc.health.v1 only, for probes
    # Mutual TLS (all three or none): serve TLS and accept only schedulers whose
    # client certificate the CA signed. Paths; the files are read at start.
    worker_tls_ca: str | None = None
    worker_tls_cert: str | None = None
    worker_tls_key: str | None = None


TLS_FLAGS = ("--worker-tls-ca", "--worker-tls-cert", "--worker-tls-key")


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    def env_default(name: str, default: object) -> object:
        return env.get(ENV_PREFIX + name.upper().replace("-", "_"), default)

    d = WorkerConfig()
    p = argparse.ArgumentParser(
        prog="radixserve-worker",
        description="radixserve model worker: runs plans from the scheduler on a model.",
    )
    add = p.add_argument
    add(
        "--model",
        default=env_default("model", d.model),
        help="HF model directory, .gguf file, 'default' (SmolLM2-135M-Instruct) or 'simulated'",
    )
    add("--host", default=env_default("host", d.host))
    add("--port", type=int, default=env_default("port", d.port))
    add(
        "--port-file",
        default=env_default("port-file", d.port_file),
        help="write the bound port here once serving (useful with --port 0)",
    )
    add("--device", default=env_default("device", d.device), help="cpu, cuda or cuda:N")
    add(
        "--dtype",
        default=env_default("dtype", d.dtype),
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    add(
        "--attention-backend",
        default=env_default("attention-backend", d.attention_backend),
        choices=["auto", "torch", "flashinfer"],
    )
    add("--page-size", type=int, default=env_default("page-size", d.page_size))
    add(
        "--kv-memory",
        default=env_default("kv-memory", d.kv_memory),
        help="memory for the KV cache, e.g. 512MiB or 8GiB (auto: 1GiB on CPU, "
        "90%% of the free GPU memory after the weights)",
    )
    add(
        "--num-pages",
        type=int,
        default=env_default("num-pages", d.num_pages),
        help="KV pages to allocate (overrides --kv-memory)",
    )
    add("--tp-size", type=int, default=env_default("tp-size", d.tp_size))
    add("--tp-rank", type=int, default=env_default("tp-rank", d.tp_rank))
    add(
        "--dist-addr",
        default=env_default("dist-addr", d.dist_addr),
        help="HOST:PORT of the tensor-parallel rendezvous (rank 0's address)",
    )
    add(
        "--simulated-step-ms",
        type=float,
        default=env_default("simulated-step-ms", d.simulated_step_ms),
    )
    add("--simulated-vocab", type=int, default=env_default("simulated-vocab", d.simulated_vocab))
    add("--max-message-mb", type=int, default=env_default("max-message-mb", d.max_message_mb))
    add(
        "--threads",
        type=int,
        default=env_default("threads", d.threads),
        help="CPU threads for torch (0: all cores); leave a core to a scheduler on the "
        "same machine, a busy core makes every small op of a multi-threaded worker wait",
    )
    add(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        default=str(env_default("cuda-graphs", "1")).lower() not in ("0", "false", "no"),
        help="run decode steps eagerly instead of replaying captured CUDA graphs",
    )
    add("--log-level", default=env_default("log-level", d.log_level))
    add(
        "--log-format",
        default=env_default("log-format", d.log_format),
        choices=["auto", "json", "console"],
        help="auto: JSON lines unless stderr is a terminal",
    )
    add(
        "--metrics-port",
        type=int,
        default=env_default("metrics-port", d.metrics_port),
        help="serve Prometheus metrics at http://HOST:PORT/metrics",
    )
    add(
        "--health-port",
        type=int,
        default=env_default("health-port", d.health_port),
        help="also serve grpc.health.v1, and nothing else, in plaintext on this port "
        "(kubelet gRPC probes cannot speak TLS)",
    )
    # RADIXSERVE_WORKER_TLS_CA, not ..._WORKER_WORKER_TLS_CA: the same names as
    # the scheduler's flags of the same meaning.
    add("--worker-tls-ca", default=env_default("tls-ca", None), metavar="PATH")
    add("--worker-tls-cert", default=env_default("tls-cert", None), metavar="PATH")
    add(
        "--worker-tls-key",
        default=env_default("tls-key", None),
        metavar="PATH",
        help="with --worker-tls-ca/--worker-tls-cert: serve mutual TLS (schedulers "
        "must present a certificate signed by the CA)",
    )
    return p


def _check_tls_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    paths = {flag: getattr(args, flag[2:].replace("-", "_")) or None for flag in TLS_FLAGS}
    given = [flag for flag, path in paths.items() if path]
    if given and len(given) != len(TLS_FLAGS):
        p.error(f"{' '.join(TLS_FLAGS)} go together (given: {' '.join(given)})")
    for flag, path in paths.items():
        if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            p.error(f"{flag} {path}: no such file or not readable")


def load_config(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> WorkerConfig:
    p = _parser(os.environ if env is None else env)
    args = p.parse_args(argv)
    _check_tls_flags(p, args)
    cfg = WorkerConfig(**{k: v for k, v in vars(args).items()})
    if cfg.page_size < 1:
        raise SystemExit("--page-size must be >= 1")
    if cfg.tp_size < 1 or not 0 <= cfg.tp_rank < cfg.tp_size:
        raise SystemExit(f"--tp-rank must be in [0, --tp-size) (got {cfg.tp_rank}, {cfg.tp_size})")
    return cfg
