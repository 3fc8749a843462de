"""Builds a worker from its config: model, KV cache, attention, sampler, model runner."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import structlog
import torch

from worker_service.attention.attention_choice import choose_attention, dtype_name
from worker_service.attention.base import AttentionBackend, AttentionSpec
from worker_service.attention.cpu_paged_kernel import load_paged_decode
from worker_service.attention.flashinfer_modules import (
    SAMPLER_OP_MODULES,
    check_prebuilt,
    flashinfer_kernel_source,
    model_op_modules,
    needed_modules,
)
from worker_service.attention.layer_groups import (
    Attention,
    LayerGroups,
    group_attention,
    layer_groups,
)
from worker_service.attention.torch_backend import TorchAttention
from worker_service.config import WorkerConfig
from worker_service.device.context import resolve_device, use_device
from worker_service.device.distributed import TensorParallel, init_tensor_parallel
from worker_service.device.dtypes import resolve_dtype
from worker_service.device.host_kv_pool import (
    HostKvPool,
    available_host_bytes,
    host_pages,
    refusal,
)
from worker_service.device.kv_cache import KvCache
from worker_service.device.kv_file_store import KvLayout
from worker_service.device.kv_quant import KvScaleReader, kv_storage_dtype
from worker_service.device.kv_sizing import size_kv_pools
from worker_service.execution.file_tier_setup import num_storage_pages as num_storage_pages_of
from worker_service.execution.file_tier_setup import open_file_tier
from worker_service.execution.model_compute import ModelCompute
from worker_service.execution.model_runner import ModelRunner
from worker_service.execution.simulated_compute import SimulatedCompute
from worker_service.kernels import Kernels, select_kernels
from worker_service.lora.graph_slots import LoraSlots
from worker_service.lora.loaders import AdapterLoader, ConfigOnlyLoader
from worker_service.models.config import ModelConfig
from worker_service.models.cpu_decode_chain import DecodeChain
from worker_service.models.lora_loader import ModelAdapterLoader, lora_targets
from worker_service.models.quantized import is_placeholder, quantized_bytes
from worker_service.models.registry import build_model
from worker_service.sampling.grammar import (
    SIMULATED_EOS,
    GrammarCompiler,
    huggingface_tokenizer_info,
    simulated_tokenizer_info,
)
from worker_service.sampling.sampler import Sampler
from worker_service.weights import ModelSource, fp8_checkpoint, gguf_quant, open_model
from worker_service.weights.gguf_quant import serve_quantized
from worker_service.weights.pooling_config import (
    PoolingConfig,
    classifier_pooling,
    resolve_pooling,
)

logger = structlog.get_logger(__name__)


@dataclass(kw_only=True)
class Worker:
    config: WorkerConfig
    runner: ModelRunner
    model_name: str
    model_config: ModelConfig | None  # None for the simulated model
    num_pages: int
    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    tp: TensorParallel
    source: ModelSource | None
    vocab_size: int
    # LoadAdapter's reader: this rank's shard of the weights, or (simulated) the config.
    adapter_loader: AdapterLoader
    # How embedding requests are pooled (GetInfo tells the scheduler).
    pooling: PoolingConfig
    # The sliding-window layers' pool (page 0 the null page) and their window;
    # 0, 0: one pool (no sliding layers, or --swa-memory off).
    num_swa_pages: int = 0
    swa_window: int = 0
    # The host tier's pool (--enable-hierarchical-cache; 0: none) and its bytes.
    num_host_pages: int = 0
    host_kv_bytes: int = 0
    # The file tier's cap in pages (--hicache-file-dir; 0: none).
    num_storage_pages: int = 0
    # Device memory this rank holds (reported by GetInfo; 0: none).
    weight_bytes: int = 0
    kv_cache_bytes: int = 0
    graph_bytes: int = 0

    @property
    def grammar_backend(self) -> str:
        return "xgrammar" if self.runner.grammars is not None else "none"

    def tokenizer_files(self) -> dict[str, bytes]:
        if self.source is None:
            raise LookupError("the simulated model has no tokenizer")
        return self.source.tokenizer_files()


def build_worker(cfg: WorkerConfig) -> Worker:
    device = resolve_device(cfg.device)
    use_device(device)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tp = init_tensor_parallel(cfg.tp_rank, cfg.tp_size, cfg.dist_addr, device)
    if cfg.model == "simulated":
        num_pages = cfg.num_pages or 65536
        # Shaped like a sliding-window model: a second pool whose plans the
        # runner validates (in range, never the null page inside a window).
        swa_window = cfg.simulated_swa_window if cfg.swa_memory else 0
        num_swa_pages = int(num_pages * cfg.swa_full_tokens_ratio) if swa_window else 0
        if swa_window and num_swa_pages < 2:
            raise SystemExit(
                f"the simulated sliding pool gets {num_swa_pages} pages; it needs its null "
                "page and at least one more"
            )
        compute = SimulatedCompute(
            cfg.simulated_step_ms / 1e3, cfg.simulated_vocab, cfg.simulated_fail_token
        )
        vocab = cfg.simulated_vocab
        grammars = None
        if tp.rank == 0 and vocab > SIMULATED_EOS:
            grammars = GrammarCompiler(
                lambda: simulated_tokenizer_info(vocab),
                processes=cfg.grammar_compile_processes,
                max_waiting=cfg.grammar_compile_queue,
            )
        runner = ModelRunner(
            compute,
            num_pages=num_pages,
            num_swa_pages=num_swa_pages,
            swa_window=swa_window,
            page_size=cfg.page_size,
            vocab_size=vocab,
            grammars=grammars,
            tp=tp,
        )
        return Worker(
            config=cfg,
            runner=runner,
            model_name="simulated",
            model_config=None,
            num_pages=num_pages,
            num_swa_pages=num_swa_pages,
            swa_window=swa_window,
            device=device,
            dtype=dtype,
            attention_backend="simulated",
            tp=tp,
            source=None,
            vocab_size=cfg.simulated_vocab,
            adapter_loader=ConfigOnlyLoader(),
            pooling=resolve_pooling(
                model_path=None, pooling=cfg.pooling, normalize=cfg.embed_normalize
            ),
        )

    source = open_model(None if cfg.model == "default" else cfg.model)
    model_dir = source.path if source.kind == "hf" else None
    mcfg = source.config
    # A sequence classifier (a score head, no LM head) only scores prompts:
    # no decode graphs, no grammars.
    classifier = mcfg.score_head is not None
    if classifier:
        pooling = classifier_pooling(pooling=cfg.pooling, normalize=cfg.embed_normalize)
    else:
        pooling = resolve_pooling(
            model_path=model_dir, pooling=cfg.pooling, normalize=cfg.embed_normalize
        )
    # Everything that can refuse this model on this device does so before the
    # weights are loaded.
    compute_choice = choose_compute(cfg, mcfg, tp_size=tp.size, device=device, dtype=dtype)
    kernels = compute_choice.model_kernels
    # An explicit --dtype float32 asks for the float path, as --dequantize does.
    quantized = serve_quantized(
        kind=source.kind,
        device=device,
        dtype=dtype,
        dequantize=cfg.dequantize or cfg.dtype == "float32",
    )
    if quantized:
        kernel = gguf_quant.kernels()
        assert kernel is not None
        source.files.check_quantized(kernel.KERNEL_TYPES, tp.size)  # type: ignore[attr-defined]
    logger.info(
        "loading model",
        path=str(source.path),
        arch=mcfg.architecture,
        dtype=str(dtype),
        quantized=quantized,
    )
    model = build_model(mcfg, tp=tp, dtype=dtype, device=device, kernels=kernels)
    # KV-cache scales are not the model's weights: taken out of the stream (and
    # used only by an fp8 cache).
    scale_reader = KvScaleReader()
    if source.kind == "random":
        model.init_random_weights(seed=0)
    else:
        tensors = source.tensors(dtype, keep_quantized=quantized)
        placed = fp8_checkpoint.placed(tensors, device=device, dtype=dtype)
        model.load_weights(scale_reader.filter(placed))
    # Counted before oneDNN packing, which re-lays the same weights out; a
    # quantized layer's float parameter is a placeholder (its storage counts).
    weight_bytes = _tensor_bytes(itertools.chain(model.parameters(), model.buffers()))
    weight_bytes += quantized_bytes(model)
    if device.type == "cpu" and cfg.onednn_linears:
        logger.info("packed linears for oneDNN", layers=model.pack_linears_for_cpu())
    if device.type == "cpu" and cfg.cpu_decode_chain and hasattr(model, "decode_chain"):
        model.decode_chain = DecodeChain.build(model)
        logger.info("C decode chain", on=model.decode_chain is not None)
    # Everything else that lives on the GPU (attention workspaces, sampler
    # buffers, LoRA graph slots) is allocated before the KV pool is sized from
    # the memory left; what the decode graphs and a step's activations take
    # comes out of the share of free memory the pool leaves (kv_sizing.GPU_KV_FRACTION).
    attn = _attention(cfg, compute_choice)
    sampler = Sampler(mcfg.vocab_size, device, kernels=compute_choice.sampler_kernels)
    graphs = cfg.cuda_graphs and not classifier and hasattr(attn, "enable_decode_graphs")
    # A MoE model's decode runs eagerly (models/moe_kernel.py).
    graphs = graphs and getattr(model, "decode_graphs_supported", True)
    lora_slots = None  # the LoRA decode graphs' adapter slots: fixed, like the workspaces
    if device.type == "cuda" and graphs and cfg.cuda_graph_lora_slots > 0:
        lora_slots = LoraSlots.create(
            lora_targets(model),
            slots=cfg.cuda_graph_lora_slots,
            max_rank=cfg.cuda_graph_lora_max_rank,
            dtype=dtype,
            device=device,
        )
    max_context = model.rope.max_positions
    pools = size_kv_pools(
        [mcfg.window_of(i) for i in range(mcfg.num_layers)],
        max_context=max_context,
        swa_memory=cfg.swa_memory,
        swa_ratio=cfg.swa_full_tokens_ratio,
        num_pages=cfg.num_pages,
        kv_memory=cfg.kv_memory,
        page_size=cfg.page_size,
        num_kv_heads=mcfg.num_kv_heads // tp.size,
        head_dim=mcfg.head_dim,
        dtype=compute_choice.spec.kv_cache_dtype,
        tp=tp,
        device=device,
    )
    num_pages, num_swa_pages, swa_window = pools.num_pages, pools.num_swa_pages, pools.swa_window
    # One page more per pool than the scheduler is told about: decode CUDA graphs
    # pad their batch with rows that write and read only this scratch page.
    kv = KvCache(
        num_layers=mcfg.num_layers,
        num_pages=num_pages + 1,
        page_size=cfg.page_size,
        num_kv_heads=model.num_local_kv_heads,
        head_dim=mcfg.head_dim,
        dtype=compute_choice.spec.kv_cache_dtype,
        device=device,
        swa_layers=pools.swa_layers,
        num_swa_pages=num_swa_pages + 1 if num_swa_pages else 0,
        compute_dtype=dtype,
        scales=scale_reader.scales(mcfg.num_layers) if compute_choice.spec.kv_dtype else None,
        shared_memory=cfg.kv_shared_memory,
    )
    compute = ModelCompute(model, attn=attn, kv=kv, sampler=sampler, tp=tp, device=device)
    compute.fail_token = cfg.fail_sample_token
    if cfg.enable_hierarchical_cache:
        compute.host_kv = _host_kv_pool(cfg, kv, num_pages, tp)
    graph_bytes = 0
    if device.type == "cuda" and graphs:
        before = torch.cuda.memory_reserved(device)
        attn.enable_decode_graphs(compute.scratch_page, -(-max_context // cfg.page_size))
        if cfg.cuda_graph_max_draft > 0:
            attn.enable_verify_graphs(cfg.cuda_graph_max_draft + 1)
        compute.lora_slots = lora_slots
        compute.capture_decode_graphs()
        graph_bytes = max(torch.cuda.memory_reserved(device) - before, 0)
    overlap = cfg.overlap == "on" or (cfg.overlap == "auto" and device.type == "cuda")
    grammars = None
    # The rank that samples, a vocabulary, an LM head to constrain.
    if tp.rank == 0 and source.kind != "random" and not classifier:
        grammars = GrammarCompiler(
            lambda: huggingface_tokenizer_info(
                source.tokenizer_files(), mcfg.vocab_size, mcfg.eos_token_ids
            ),
            processes=cfg.grammar_compile_processes,
            max_waiting=cfg.grammar_compile_queue,
        )
    runner = ModelRunner(
        compute,
        num_pages=num_pages,
        num_swa_pages=num_swa_pages,
        swa_window=swa_window,
        page_size=cfg.page_size,
        vocab_size=mcfg.vocab_size,
        max_context=max_context,
        overlap=overlap,
        grammars=grammars,
        scores_only=classifier,
        tp=tp,
        num_host_pages=compute.host_kv.num_pages if compute.host_kv is not None else 0,
    )
    num_storage_pages = 0
    if cfg.hicache_file_dir and compute.host_kv is not None:
        layout = KvLayout(
            model=str(source.path),
            dtype=dtype_name(kv.dtype),
            page_size=cfg.page_size,
            num_layers=kv.num_layers,
            num_kv_heads=kv.num_kv_heads,
            head_dim=kv.head_dim,
            tp_rank=tp.rank,
            tp_size=tp.size,
        )
        runner.files = open_file_tier(
            cfg.hicache_file_dir, cfg.hicache_file_size, compute.host_kv, layout
        )
        num_storage_pages = _agreed_min(num_storage_pages_of(runner.files), tp, kv.device)
    logger.info(
        "worker ready",
        pages=num_pages,
        host_pages=runner.num_host_pages,
        swa_pages=num_swa_pages,
        swa_layers=len(pools.swa_layers),
        page_size=cfg.page_size,
        kv_cache_dtype=dtype_name(kv.dtype),
        attention=attn.name,
        cpu_decode_kernel=getattr(attn, "decode_kernel", None) is not None,
        kernels=model.kernels.name,
        grammar_masks=sampler.bitmask_backend,
    )
    return Worker(
        config=cfg,
        runner=runner,
        model_name=str(source.path),
        model_config=mcfg,
        num_pages=num_pages,
        num_swa_pages=num_swa_pages,
        swa_window=swa_window,
        device=device,
        dtype=dtype,
        attention_backend=attn.name,
        tp=tp,
        source=source,
        vocab_size=mcfg.vocab_size,
        adapter_loader=ModelAdapterLoader(model, device),
        weight_bytes=weight_bytes,
        kv_cache_bytes=_tensor_bytes(kv.layers),
        graph_bytes=graph_bytes,
        pooling=pooling,
        num_host_pages=runner.num_host_pages,
        host_kv_bytes=compute.host_kv.nbytes if compute.host_kv is not None else 0,
        num_storage_pages=num_storage_pages,
    )


def _agreed_min(value: int, tp: TensorParallel, device: torch.device) -> int:
    """The smallest rank's ``value`` under tensor parallelism (each rank's
    own otherwise)."""
    if not tp.enabled:
        return value
    return int(tp.all_reduce_min(torch.tensor([value], device=device)).item())


def _host_kv_pool(cfg: WorkerConfig, kv: KvCache, num_pages: int, tp: TensorParallel) -> HostKvPool:
    """The host tier's pool (--hicache-size GiB, else --hicache-ratio x the
    device pool's pages; under tensor parallelism every rank takes the
    smallest rank's count), refused by name where it cannot be."""
    why = refusal(kv)
    if why is not None:
        raise SystemExit(f"--enable-hierarchical-cache: {why}")
    per_page = kv.bytes_per_page(
        num_layers=kv.num_layers,
        page_size=kv.page_size,
        num_kv_heads=kv.num_kv_heads,
        head_dim=kv.head_dim,
        dtype=kv.dtype,
    )
    pages = host_pages(
        device_pages=num_pages,
        bytes_per_page=per_page,
        ratio=cfg.hicache_ratio,
        size_gib=cfg.hicache_size,
    )
    if tp.enabled:
        pages = int(tp.all_reduce_min(torch.tensor([pages], device=kv.device)).item())
    if pages < 1:
        raise SystemExit(
            f"--enable-hierarchical-cache: the host pool gets {pages} pages of {per_page} bytes "
            "(raise --hicache-size or --hicache-ratio)"
        )
    available = available_host_bytes()
    if available is not None and pages * per_page > available:
        raise SystemExit(
            f"--enable-hierarchical-cache: the host pool needs {pages * per_page / 2**30:.2f} GiB "
            f"({pages} pages), but the host has {available / 2**30:.2f} GiB available (lower "
            "--hicache-size or --hicache-ratio)"
        )
    pool = HostKvPool(kv, pages)
    logger.info(
        "host KV tier",
        host_pages=pages,
        device_pages=num_pages,
        gib=round(pool.nbytes / 2**30, 3),
        pinned=pool.cuda,
    )
    return pool


@dataclass(frozen=True)
class ComputeChoice:
    """What runs the model's steps, decided at start before the weights load."""

    spec: AttentionSpec  # a single-group model's; with groups, theirs but the window
    attention: str  # the backend: "flashinfer" or "torch"
    model_kernels: Kernels
    sampler_kernels: Kernels
    groups: LayerGroups | None = None  # layers that differ in window (layer_groups.py)

    @property
    def specs(self) -> list[AttentionSpec]:
        """One spec per backend the worker builds."""
        if self.groups is None:
            return [self.spec]
        return list(self.groups.specs(self.spec).values())


def choose_compute(
    cfg: WorkerConfig,
    mcfg: ModelConfig,
    *,
    tp_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> ComputeChoice:
    """The attention backend (attention_choice.py: torch where FlashInfer's kernels
    do not fit the dtype or head dim or the model has sinks, logged), its layer
    groups where the layers differ in window, the kernels, and, where FlashInfer
    runs, a check that the modules it will load are prebuilt or compilable; a
    configuration that cannot work stops the worker here (SystemExit), by name."""
    try:
        groups = layer_groups([mcfg.window_of(i) for i in range(mcfg.num_layers)])
    except ValueError as e:
        raise SystemExit(f"{mcfg.architecture}: {e}") from None
    spec = AttentionSpec(
        num_heads=mcfg.num_heads // tp_size,
        num_kv_heads=mcfg.num_kv_heads // tp_size,
        head_dim=mcfg.head_dim,
        page_size=cfg.page_size,
        sliding_window=mcfg.window_of(0) if groups is None else None,
        dtype=dtype,
        device=device,
        logit_soft_cap=mcfg.attn_logit_softcap,
        softmax_scale=mcfg.attn_scale,
        kv_dtype=_kv_dtype(cfg.kv_cache_dtype, dtype),
    )
    choice = choose_attention(
        cfg.attention_backend,
        device_type=device.type,
        dtype=dtype,
        head_dim=mcfg.head_dim,
        sinks=mcfg.attention_sinks,
    )
    if choice.reason is not None:
        logger.warning("using the torch attention backend", reason=choice.reason)
    kernels = _select_kernels(device, dtype=dtype, choice=cfg.kernels)
    sampler_kernels = _select_kernels(device, dtype=None, choice=cfg.kernels)
    chosen = ComputeChoice(spec, choice.name, kernels, sampler_kernels, groups)
    _check_flashinfer_modules(chosen, hidden_act=mcfg.hidden_act)
    return chosen


def _kv_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype | None:
    """The spec's ``kv_dtype``: None where the pages hold the model's dtype."""
    stored = kv_storage_dtype(kv_cache_dtype, dtype)
    return None if stored == dtype else stored


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(
        t.untyped_storage().nbytes() if is_placeholder(t) else t.numel() * t.element_size()
        for t in tensors
    )


def _attention(cfg: WorkerConfig, choice: ComputeChoice) -> Attention:
    """The model's attention: one backend, or one per layer group (the groups'
    backends share the CPU decode kernel, or FlashInfer's float workspace)."""
    spec = choice.spec
    if choice.attention == "torch":
        kernel = None
        if spec.device.type == "cpu" and cfg.cpu_decode_kernel:
            kernel = load_paged_decode(
                spec.num_heads, spec.num_kv_heads, spec.head_dim, torch.get_num_threads()
            )
        if choice.groups is None:
            return TorchAttention(spec, kernel)
        specs = choice.groups.specs(spec)
        return group_attention(
            {g: TorchAttention(s, kernel) for g, s in specs.items()}, choice.groups
        )
    from worker_service.attention.flashinfer_backend import FlashInferAttention

    if choice.groups is None:
        return FlashInferAttention(spec)
    backends: dict[str, AttentionBackend] = {}
    workspace = None
    for group, group_spec in choice.groups.specs(spec).items():
        backend = FlashInferAttention(group_spec, workspace=workspace)
        workspace = backend.workspace
        backends[group] = backend
    return group_attention(backends, choice.groups)


def _select_kernels(device: torch.device, dtype: torch.dtype | None, choice: str) -> Kernels:
    try:
        return select_kernels(device, dtype, choice)
    except ValueError as e:
        raise SystemExit(f"--kernels {choice}: {e}; use --kernels auto or torch") from None


def _check_flashinfer_modules(choice: ComputeChoice, *, hidden_act: str = "silu") -> None:
    """Stop here, naming them, if FlashInfer modules this worker will load are
    neither prebuilt nor compilable (else the first use fails: graph capture)."""
    needed = []
    if choice.attention == "flashinfer":
        for spec in choice.specs:
            needed += needed_modules(
                dtype_name(spec.dtype),
                spec.head_dim,
                group=spec.num_heads // spec.num_kv_heads,
                sliding_window=bool(spec.sliding_window),
                soft_cap=spec.logit_soft_cap is not None,
                kv_dtype=None if spec.kv_dtype is None else dtype_name(spec.kv_dtype),
            )
    ops = list(model_op_modules(hidden_act)) if choice.model_kernels.name == "flashinfer" else []
    ops += SAMPLER_OP_MODULES if choice.sampler_kernels.name == "flashinfer" else ()
    if needed or ops:
        check_prebuilt(needed, ops, flashinfer_kernel_source(), log=logger.warning)
