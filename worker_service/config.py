"""The worker's settings, read once at start into one frozen object.

Every knob is declared once below: its default, help text and flag. Flags and
their ``RADIXSERVE_WORKER_<FLAG>`` environment defaults are generated from the
declarations (common/settings.py); ``radixserve serve`` reuses the ones it
passes on to its workers.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.settings import add_flags, build, setting
from common.simulated_model import SIMULATED_VOCAB

ENV_PREFIX = "RADIXSERVE_WORKER_"
LOG_FORMATS = ("auto", "json", "console")
HICACHE_RATIO_DEFAULT = 2.0  # SGLang's --hicache-ratio


class _OutOfRange(argparse.ArgumentTypeError, ValueError):
    """Shown as is by argparse (a flag) and by the settings' env reader."""


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise _OutOfRange(f"{text} is below the least allowed, 1")
    return value


@dataclass(frozen=True)
class WorkerConfig:
    model: str = setting(
        "default",
        "HF model directory, .gguf file, 'default' (SmolLM2-135M-Instruct) or 'simulated'",
    )
    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(0, "gRPC port (0: any free port, written to --port-file)")
    port_file: str | None = setting(
        None, "write the bound port here once serving (useful with --port 0)"
    )
    device: str = setting("cpu", "cpu, cuda or cuda:N")
    dtype: str = setting(
        "auto",
        "weights and activations (auto: float32 on CPU, bfloat16 on CUDA)",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    attention_backend: str = setting(
        "auto",
        "auto: flashinfer on CUDA for bf16/fp16 models of head dim 64, 128 or 256, torch "
        "otherwise (FlashInfer has no fp32 kernels, and its FA2 ones take multiples of 64)",
        choices=("auto", "torch", "flashinfer"),
    )
    kernels: str = setting(
        "auto",
        "norms, RoPE, SiLU-and-mul and the sampling filters (auto: FlashInfer's fused "
        "kernels on CUDA when flashinfer imports, C ones built on the host for a float32 "
        "model on the CPU, torch otherwise)",
        choices=("auto", "torch", "flashinfer", "cpu"),
    )
    page_size: int = setting(16, "tokens per KV page")
    kv_memory: str = setting(
        "auto",
        "memory for the KV cache, e.g. 512MiB or 8GiB (auto: 1GiB on CPU, 90% of the free "
        "GPU memory after the weights)",
    )
    num_pages: int | None = setting(None, "KV pages to allocate (overrides --kv-memory)")
    kv_cache_dtype: str = setting(
        "auto",
        "what the KV pages hold (auto: the model's dtype; fp8_e4m3: float8 e4m3 with "
        "per-layer k/v scales from the checkpoint, else 1.0: 1 byte an element, so "
        "--kv-memory holds 2x the bf16 pages)",
        choices=("auto", "fp8_e4m3"),  # device/kv_quant.py's KV_CACHE_DTYPES
    )
    swa_full_tokens_ratio: float = setting(
        0.8,
        "a model with sliding-window layers: their pool's tokens per token of the full "
        "layers' pool, both within --kv-memory (SGLang's name; with --num-pages: that many "
        "full pages, this share of it sliding)",
    )
    swa_memory: bool = setting(
        True,
        "a model with sliding-window layers keeps their KV in a pool of its own, from which "
        "the scheduler frees what left the window; off: one pool for every layer (SGLang's "
        "--disable-hybrid-swa-memory; for a scheduler that does not send sliding pages)",
    )
    kv_shared_memory: bool = setting(
        False,
        "prefill/decode disaggregation on one host: keep this (decode) worker's KV pool in "
        "a /dev/shm file, so a prefill worker on the same host copies a prompt's pages "
        "straight into it instead of streaming them (CPU pools; /dev/shm must hold the pool)",
    )
    enable_hierarchical_cache: bool = setting(
        False,
        "a host-memory KV tier under the radix cache (SGLang's HiCache): pages the device "
        "evicts stay in host memory (pinned on CUDA) and are copied back on a hit instead "
        "of recomputed; sized by --hicache-size or --hicache-ratio",
    )
    hicache_ratio: float = setting(
        HICACHE_RATIO_DEFAULT,
        "with --enable-hierarchical-cache: the host pool's pages as a multiple of the "
        "device pool's (SGLang's default, 2.0)",
    )
    hicache_size: float = setting(
        0.0,
        "with --enable-hierarchical-cache: the host pool in GiB (overrides --hicache-ratio; "
        "0: use the ratio)",
        metavar="GIB",
    )
    hicache_file_dir: str | None = setting(
        None,
        "with --enable-hierarchical-cache: a file tier behind the host pool (SGLang's HiCache "
        "storage, file backend): host pages are also written to files named by block hash in "
        "a folder per model layout under PATH, so a restarted worker, or another on the same "
        "node, loads a prefix it never computed",
        metavar="PATH",
    )
    hicache_file_size: float = setting(
        0.0,
        "with --hicache-file-dir: the files' cap in GiB, least recently used evicted (0: the "
        "free space of PATH's filesystem at start, less 10%)",
        metavar="GIB",
    )
    tp_size: int = setting(1, "tensor-parallel ranks in the group")
    tp_rank: int = setting(0, "this worker's tensor-parallel rank")
    dist_addr: str | None = setting(
        None, "HOST:PORT of the tensor-parallel rendezvous (rank 0's address)"
    )
    simulated_step_ms: float = setting(0.0, "the simulated model's time per step")
    simulated_vocab: int = setting(SIMULATED_VOCAB, "the simulated model's vocabulary size")
    simulated_swa_window: int = setting(
        0,
        "the simulated model shaped like one with sliding-window layers (Gemma 3, GPT-OSS): "
        "their window in tokens, a sliding pool of --swa-full-tokens-ratio x --num-pages "
        "(page 0 the null page) and every plan's sliding pages checked; 0: one pool",
    )
    simulated_fail_token: int | None = setting(
        None,
        "fault tests: every step of the simulated model that computes this token fails "
        "(the worker answers it with an error)",
    )
    fail_sample_token: int | None = setting(
        None,
        "fault tests: rank 0's sampler fails every step of the real model whose inputs "
        "hold this token (the step fails on every tensor-parallel rank)",
    )
    max_message_mb: int = setting(64, "gRPC message size limit")
    drain_timeout_s: float = setting(
        60.0,
        "on SIGTERM/SIGINT keep serving the scheduler's open stream until it closes it "
        "(its own drain), at most this many seconds (a second signal stops at once)",
        flag="--drain-timeout",
        metavar="SECONDS",
    )
    threads: int = setting(
        0,
        "CPU threads for torch (0: all cores, also under radixserve serve); fewer leaves "
        "cores to other work on the machine",
    )
    dequantize: bool = setting(
        False,
        "GGUF: dequantize the quantized weights to float at load (the path compared "
        "bit for bit with transformers; needed for block types without a quantized CPU "
        "kernel; --dtype float32 given explicitly does the same). Off: a CPU worker at "
        "--dtype auto keeps Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K projections in their "
        "blocks (GGUF on CUDA is always dequantized)",
    )
    onednn_linears: bool = setting(
        True,
        "CPU: run the projections and the LM head with weights packed once: steps of up to "
        "128 rows through a C kernel, longer ones through oneDNN (faster than torch's plain "
        "linear; keeps two more copies of float32 weights)",
    )
    cpu_decode_chain: bool = setting(
        True,
        "CPU: run a Llama-shaped model's layers in one C call for steps of decode and short "
        "verify rows (the same C ops as the Python forward, bit for bit, without Python "
        "between them)",
    )
    cpu_decode_kernel: bool = setting(
        True,
        "CPU: decode attention through a small C kernel that reads the KV pages in place "
        "(built with the host's C compiler on first use and cached; torch's gather and "
        "SDPA where it cannot be built)",
    )
    cuda_graphs: bool = setting(
        True, "replay captured CUDA graphs for decode steps (CUDA + flashinfer)"
    )
    cuda_graph_max_draft: int = setting(
        8,
        "with --cuda-graphs: also capture graphs for drafted (speculative) steps of up to "
        "32 requests whose drafts are at most this long, each request's rows padded to "
        "this + 1 (the scheduler's --speculative-max-draft); 0: drafted steps run eagerly",
    )
    cuda_graph_lora_slots: int = setting(
        0,
        "with --cuda-graphs: also capture decode graphs for steps with LoRA rows, their "
        "adapters copied into this many slots of fixed buffers (the scheduler's "
        "--max-loras-per-batch; each slot costs its share of every layer's rank "
        "--cuda-graph-lora-max-rank weights); 0: such steps run eagerly",
    )
    cuda_graph_lora_max_rank: int = setting(
        64, "the largest LoRA rank --cuda-graph-lora-slots holds (higher ranks run eagerly)"
    )
    overlap: str = setting(
        "auto",
        "queue step N+1 before waiting for step N's tokens (auto: on CUDA; on the CPU it "
        "only delays each result by a step)",
        choices=("auto", "on", "off"),
    )
    grammar_compile_processes: int = setting(
        2,
        "grammars compiled at a time, each in a process of its own at lower CPU priority; "
        "while small grammars wait, slow compiles hold at most this many minus one",
        parse=_at_least_one,
    )
    grammar_compile_queue: int = setting(
        16,
        "grammar compiles waiting, running or paused at a time; past it CompileGrammar "
        "answers RESOURCE_EXHAUSTED (each holds a gRPC thread while it waits)",
        parse=_at_least_one,
    )
    pooling: str = setting(
        "auto",
        "embeddings (Embed): pool the last prompt position's or the mean of every prompt "
        "position's final hidden state (auto: the model's sentence-transformers config, "
        "else last)",
        choices=("auto", "last", "mean"),
    )
    embed_normalize: str = setting(
        "auto",
        "embeddings: L2-normalize the pooled vector (auto: as the model's "
        "sentence-transformers config says, else on)",
        choices=("auto", "on", "off"),
    )
    log_level: str = setting("info", "debug, info, warning or error")
    log_format: str = setting(
        "auto", "auto: JSON lines unless stderr is a terminal", choices=LOG_FORMATS
    )
    metrics_port: int | None = setting(None, "serve Prometheus metrics at http://HOST:PORT/metrics")
    health_port: int | None = setting(
        None,
        "also serve grpc.health.v1, and nothing else, in plaintext on this port "
        "(kubelet gRPC probes cannot speak TLS)",
    )
    # Mutual TLS (all three or none): serve TLS and accept only schedulers whose
    # client certificate the CA signed. Paths; the files are read at start. The
    # variables are RADIXSERVE_WORKER_TLS_*, the flags those of the scheduler's
    # settings of the same meaning.
    worker_tls_ca: str | None = setting(
        None,
        "mutual TLS: the CA schedulers' certificates must be signed by",
        env="TLS_CA",
        metavar="PATH",
    )
    worker_tls_cert: str | None = setting(
        None, "mutual TLS: this worker's certificate", env="TLS_CERT", metavar="PATH"
    )
    worker_tls_key: str | None = setting(
        None, "mutual TLS: this worker's key", env="TLS_KEY", metavar="PATH"
    )

    worker_token_file: str | None = setting(
        None,
        "a file holding the shared worker token: every Worker RPC must then carry it "
        "(the scheduler's --worker-token-file); use it whenever mutual TLS is off",
        env="TOKEN_FILE",
        metavar="PATH",
    )


TLS_FLAGS = ("--worker-tls-ca", "--worker-tls-cert", "--worker-tls-key")


def rank_device(name: str, rank: int, tp_size: int) -> str:
    """The --device of tensor-parallel rank ``rank`` when a launcher starts every
    rank on one host: ``cuda`` (no index) becomes ``cuda:<rank>``, or all ranks
    would share the current GPU. Pure string work: the launcher imports no torch."""
    kind, _, index = name.partition(":")
    if kind != "cuda" or tp_size == 1:
        return name
    if index:
        raise SystemExit(
            f"--device {name} with --tp-size {tp_size} would put every rank on one GPU; "
            "give --device cuda (rank r then uses cuda:r)"
        )
    return f"cuda:{rank}"


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
    p = argparse.ArgumentParser(
        prog="radixserve-worker",
        description="radixserve model worker: runs plans from the scheduler on a model.",
    )
    add_flags(p, WorkerConfig, os.environ if env is None else env, ENV_PREFIX)
    args = p.parse_args(argv)
    _check_tls_flags(p, args)
    token = args.worker_token_file
    if token and not (os.path.isfile(token) and os.access(token, os.R_OK)):
        p.error(f"--worker-token-file {token}: no such file or not readable")
    cfg = build(WorkerConfig, args)
    if cfg.page_size < 1:
        raise SystemExit("--page-size must be >= 1")
    if not 0 < cfg.swa_full_tokens_ratio <= 1:
        raise SystemExit(
            f"--swa-full-tokens-ratio must be in (0, 1] (got {cfg.swa_full_tokens_ratio})"
        )
    if cfg.tp_size < 1 or not 0 <= cfg.tp_rank < cfg.tp_size:
        raise SystemExit(f"--tp-rank must be in [0, --tp-size) (got {cfg.tp_rank}, {cfg.tp_size})")
    check_hicache_flags(cfg)
    return cfg


def check_hicache_flags(cfg: WorkerConfig) -> None:
    """The host tier's flags, and its file tier's, go together (SystemExit
    naming the fix)."""
    if not cfg.enable_hierarchical_cache:
        given = []
        if cfg.hicache_ratio != HICACHE_RATIO_DEFAULT:
            given.append(f"--hicache-ratio {cfg.hicache_ratio:g}")
        if cfg.hicache_size:
            given.append(f"--hicache-size {cfg.hicache_size:g}")
        if cfg.hicache_file_dir or cfg.hicache_file_size:
            raise SystemExit(
                "--hicache-file-dir is a file tier behind the host KV tier; add "
                "--enable-hierarchical-cache"
            )
        if given:
            raise SystemExit(
                f"{' and '.join(given)} size the host KV tier; add --enable-hierarchical-cache"
            )
        return
    if cfg.hicache_file_size and not cfg.hicache_file_dir:
        raise SystemExit("--hicache-file-size caps the file tier; add --hicache-file-dir PATH")
    if cfg.hicache_file_size < 0:
        raise SystemExit(f"--hicache-file-size must be >= 0 GiB (got {cfg.hicache_file_size:g})")
    if cfg.hicache_ratio <= 0:
        raise SystemExit(f"--hicache-ratio must be > 0 (got {cfg.hicache_ratio:g})")
    if cfg.hicache_size < 0:
        raise SystemExit(f"--hicache-size must be >= 0 GiB (got {cfg.hicache_size:g})")
    if cfg.model == "simulated":
        raise SystemExit(
            "--enable-hierarchical-cache needs a model with KV pages to copy; the simulated "
            "model keeps none"
        )
