"""The scheduler core's settings (one frozen object, built once at start).

Each scheduling knob is declared here once, with its flag's help text; the
service generates its flags from these declarations (common/settings.py)
and fills in what the worker group tells it (page size, vocabulary, ...).
Defaults follow SGLang's server arguments and environment defaults where we
have the same knob; the policy defaults to lpm, which SGLang used to.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.settings import setting

POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "routing-key")
RETRACTION_POLICIES = ("length", "priority")
# The host tier's write policies (SGLang's --hicache-write-policy names).
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
# Prefill/decode disaggregation roles (SGLang's --disaggregation-mode; None:
# not disaggregated, SGLang's "null").
DISAGGREGATION_MODES = ("prefill", "decode")
# How long a request waits for its prefetch from the file tier (SGLang's
# --hicache-storage-prefetch-policy names).
HICACHE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")

# SGLang's SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: admission assumes a request
# needs at most this many more tokens, so huge max_new_tokens do not starve it.
CLIP_MAX_NEW_TOKENS = 4096
# lpm falls back to fcfs past this many waiting requests (matching is O(queue)).
LPM_FALLBACK_QUEUE_LEN = 128
# In-batch prefix deduplication thresholds (SGLang's IN_BATCH_PREFIX_CACHING_*).
IN_BATCH_PREFIX_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_DEPRIORITIZE_THRESHOLD = 32


def _disaggregation_mode(text: str) -> str | None:
    mode = text.strip().lower()
    if mode in ("", "null", "none"):
        return None
    if mode not in DISAGGREGATION_MODES:
        raise ValueError(f"{text!r}: choose null, prefill or decode")
    return mode


def _chunk_size(text: str) -> int | None:
    size = int(text)
    return None if size <= 0 else size


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # Set from the worker group at start, not flags.
    page_size: int = 1
    context_len: int | None = None
    vocab_size: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    enable_kv_events: bool = False
    # The host tier (kv/hiradix_cache.py): the worker's host pool in pages
    # (WorkerInfo.num_host_pages, which the worker's --enable-hierarchical-cache
    # sizes; 0: no host tier, every path then runs as without one).
    hicache_host_pages: int = 0
    # write_through_selective copies a node to the host once matches and
    # inserts reached it this many times (SGLang's threshold; write_through
    # is 1, write_back never copies on hits).
    hicache_write_through_threshold: int = 2
    # A host hit shorter than this many tokens is computed, not loaded
    # (SGLang's load_back_threshold).
    hicache_load_back_threshold: int = 10
    # Prefill/decode disaggregation (core/disagg/): this unit's role, None
    # (today's co-located serving), "prefill" or "decode"; and SGLang's two
    # timeouts: a peer that has not claimed a request's bootstrap room within
    # the first (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT), or a transfer not
    # done within the second (SGLANG_DISAGGREGATION_WAITING_TIMEOUT), ends
    # the request.
    disaggregation_mode: str | None = setting(
        None,
        "prefill/decode disaggregation: this unit's role behind a gateway in PD mode "
        "(prefill: computes prompts and sends their KV to decode units; decode: receives "
        "it and decodes; null: serve alone)",
        parse=_disaggregation_mode,
        metavar="{null,prefill,decode}",
    )
    disaggregation_bootstrap_timeout_s: float = setting(
        300.0,
        "a disaggregated request whose peer unit has not claimed it (prefill) or given it "
        "pages (decode) within this many seconds ends UNAVAILABLE",
        flag="--disaggregation-bootstrap-timeout",
        metavar="SECONDS",
    )
    disaggregation_waiting_timeout_s: float = setting(
        300.0,
        "a disaggregated request whose KV transfer has not ended within this many seconds "
        "ends UNAVAILABLE",
        flag="--disaggregation-waiting-timeout",
        metavar="SECONDS",
    )
    # The file tier behind the host tier (kv/storage_tier.py): how many pages
    # the worker's file store holds (the index of blocks believed on disk
    # keeps at most this many; 0: no file tier, the default). Needs the host
    # tier. A prefix match that goes on in the files by at least
    # ``..._prefetch_threshold`` tokens is prefetched into host pages
    # (SGLang's prefetch_threshold), and the request waits for it as
    # ``..._prefetch_policy`` says (SGLang's names: best_effort waits not at
    # all, wait_complete until the worker reports, timeout until then or
    # base + per 1024 tokens seconds, at most max).
    hicache_storage_pages: int = 0
    hicache_storage_prefetch_threshold: int = 256
    hicache_storage_prefetch_policy: str = "timeout"
    hicache_storage_timeout_base_s: float = 2.0
    hicache_storage_timeout_per_ki_token_s: float = 0.1
    hicache_storage_timeout_max_s: float = 30.0

    # The scheduling knobs (flags of radixserve-scheduler and radixserve serve).
    schedule_policy: str = setting(
        "lpm", "order of the waiting queue before admission", choices=POLICIES
    )
    max_running_requests: int = setting(256, "most requests prefilling or decoding at once")
    max_prefill_tokens: int = setting(16384, "most prompt tokens admitted in one step")
    chunked_prefill_size: int | None = setting(
        8192,
        "most prompt tokens prefilled per step; a longer prompt continues next step "
        "(-1 or 0: no chunking)",
        parse=_chunk_size,
    )
    enable_mixed_chunk: bool = setting(
        False, "run a prefill chunk and the decode batch in one forward"
    )
    enable_priority_scheduling: bool = setting(
        False, "order by request priority first, and preempt lower-priority running requests"
    )
    schedule_low_priority_values_first: bool = setting(
        False, "with priority scheduling, lower priority values run first"
    )
    priority_preemption_threshold: int = setting(
        10,
        "preempt only for a priority this much higher",
        flag="--priority-scheduling-preemption-threshold",
    )
    # SGLang's --retraction-policy, with its default: which running request
    # gives up its KV first when a decode step runs out of pages.
    retraction_policy: str = setting(
        "length",
        "which running request a decode out of memory retracts first: length (fewest "
        "outputs, then the longest prompt) or priority (the lowest priority first, then as "
        "length; needs --enable-priority-scheduling)",
        choices=RETRACTION_POLICIES,
    )
    schedule_conservativeness: float = setting(
        1.0, "scales the expected need of running requests at admission (higher: admit fewer)"
    )
    # A waiting request that shares at least this many tokens beyond its cached
    # prefix with a request admitted in the same step waits one step: by then
    # those tokens are in the cache (computed prefixes are cached when planned)
    # and it prefills only its own suffix. 0 admits it at once (SGLang's way:
    # the shared tokens are computed once per request).
    prefix_hold_tokens: int = setting(
        32,
        "a request sharing at least this many uncached prompt tokens with one admitted in "
        "the same step waits a step and reads them from the cache (0: off)",
    )
    # lpm orders by cached prefix only, so a request that matches nothing can
    # wait behind a stream of matching ones for as long as the stream lasts.
    # Aging: one that has waited this long goes ahead of them.
    lpm_max_wait_s: float = setting(
        1.0,
        "lpm: a request that has waited this many seconds in the queue goes ahead of the "
        "prefix-matched ones, oldest first, so none starves (0: off)",
        flag="--lpm-max-wait",
    )
    max_loras_per_batch: int = setting(
        4,
        "most distinct LoRA adapters in one step (the worker's adapter slots); a request "
        "whose adapter finds no free slot waits",
    )
    max_loaded_loras: int = setting(
        8, "most LoRA adapters loaded at once (LoadLoRAAdapter past it: unload one first)"
    )
    speculative_ngram: bool = setting(
        True,
        "speculative decoding: draft tokens from n-gram matches in the request's own "
        "tokens and the prefix cache's other sequences, verified by the worker in one "
        "forward (outputs unchanged); per request off with custom_params speculative=false",
    )
    speculative_max_draft: int = setting(
        8, "speculative decoding: most drafted tokens per request and step"
    )
    # A drafted row costs k + 1 tokens of compute; while a step is bound by
    # reading the weights (small batches) they are nearly free, past that
    # they cost more, and draining the overlap pipeline for them costs too.
    # On 2 CPU cores drafts paid at 16 and 32 running requests once verify
    # rows attend through the C kernel (docs/benchmarks.md, speculative
    # decoding); beyond 32 is unmeasured.
    speculative_disable_by_batch_size: int = setting(
        32,
        "speculative decoding: no drafts in a step while more than this many requests are "
        "running (0: no limit)",
    )
    # The host tier's write policy (SGLang's --hicache-write-policy and default);
    # used when the workers keep a host pool (their --enable-hierarchical-cache).
    hicache_write_policy: str = setting(
        "write_through",
        "with a host KV tier on the workers: when a cached prefix is copied to host "
        "memory (write_through: as it enters the cache; write_through_selective: once it "
        "was hit twice; write_back: only as the device evicts it)",
        choices=HICACHE_WRITE_POLICIES,
    )

    # Fixed (SGLang's defaults).
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    # After a retraction, the ratio is estimated as if every remaining request
    # still decodes this many more steps.
    retract_decode_steps: int = 20
    random_seed: int = 0

    def __post_init__(self) -> None:
        if self.schedule_policy not in POLICIES:
            raise ValueError(
                f"unknown schedule policy {self.schedule_policy!r}; choose one of {POLICIES}"
            )
        if self.retraction_policy not in RETRACTION_POLICIES:
            raise ValueError(
                f"unknown retraction policy {self.retraction_policy!r}; choose one of "
                f"{RETRACTION_POLICIES}"
            )
        if self.retraction_policy == "priority" and not self.enable_priority_scheduling:
            raise ValueError("--retraction-policy priority needs --enable-priority-scheduling")
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(
                f"unknown hicache write policy {self.hicache_write_policy!r}; choose one of "
                f"{HICACHE_WRITE_POLICIES}"
            )
        if self.hicache_host_pages < 0 or self.hicache_write_through_threshold < 1:
            raise ValueError("hicache_host_pages must be >= 0 and the threshold >= 1")
        if (
            self.disaggregation_mode is not None
            and self.disaggregation_mode not in DISAGGREGATION_MODES
        ):
            raise ValueError(
                f"unknown disaggregation mode {self.disaggregation_mode!r}; choose one of "
                f"{DISAGGREGATION_MODES} or None"
            )
        timeouts = (self.disaggregation_bootstrap_timeout_s, self.disaggregation_waiting_timeout_s)
        if min(timeouts) <= 0:
            raise ValueError("the disaggregation timeouts must be > 0")
        if self.hicache_storage_prefetch_policy not in HICACHE_PREFETCH_POLICIES:
            raise ValueError(
                f"unknown hicache prefetch policy {self.hicache_storage_prefetch_policy!r}; "
                f"choose one of {HICACHE_PREFETCH_POLICIES}"
            )
        if self.hicache_storage_pages < 0 or self.hicache_storage_prefetch_threshold < 1:
            raise ValueError("hicache_storage_pages must be >= 0 and the threshold >= 1")
        if self.hicache_storage_pages and not self.hicache_host_pages:
            raise ValueError("the file tier (hicache_storage_pages) needs the host tier")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_loras_per_batch < 1 or self.max_loaded_loras < 1:
            raise ValueError("max_loras_per_batch and max_loaded_loras must be >= 1")
        if self.lpm_max_wait_s < 0:
            raise ValueError(f"lpm_max_wait_s must be >= 0, got {self.lpm_max_wait_s}")
        if self.speculative_max_draft < 1:
            raise ValueError(
                f"speculative_max_draft must be >= 1, got {self.speculative_max_draft}"
            )
        if self.speculative_disable_by_batch_size < 0:
            raise ValueError("speculative_disable_by_batch_size must be >= 0")
        if self.prefix_hold_tokens < 0:
            raise ValueError("prefix_hold_tokens must be >= 0")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < self.page_size:
            raise ValueError(
                f"chunked_prefill_size ({self.chunked_prefill_size}) must be >= page_size "
                f"({self.page_size}), or None to disable chunking"
            )

    @property
    def hicache_hits_to_write(self) -> int | None:
        """Hits after which a node is copied to the host (None: only when
        the device evicts it, write_back)."""
        policy = self.hicache_write_policy
        if policy == "write_back":
            return None
        return 1 if policy == "write_through" else self.hicache_write_through_threshold

    @property
    def priority_sign(self) -> int:
        """Sorting by ``priority * priority_sign`` puts the preferred first."""
        return 1 if self.schedule_low_priority_values_first else -1

    @property
    def retraction_priority_sign(self) -> int:
        """``priority_sign`` when retraction heeds priority, else 0 (it does not)."""
        return self.priority_sign if self.retraction_policy == "priority" else 0

    @property
    def start_new_token_ratio(self) -> float:
        return min(self.init_new_token_ratio * self.schedule_conservativeness, 1.0)

    @property
    def min_new_token_ratio(self) -> float:
        return min(self.start_new_token_ratio * self.min_new_token_ratio_factor, 1.0)

    @property
    def new_token_ratio_decay(self) -> float:
        steps = max(self.new_token_ratio_decay_steps, 1)
        return (self.start_new_token_ratio - self.min_new_token_ratio) / steps
