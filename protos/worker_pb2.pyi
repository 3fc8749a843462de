from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Pooling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_NONE: _ClassVar[Pooling]
    POOLING_LAST: _ClassVar[Pooling]
    POOLING_MEAN: _ClassVar[Pooling]

class ForwardMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FORWARD_MODE_UNSPECIFIED: _ClassVar[ForwardMode]
    FORWARD_MODE_PREFILL: _ClassVar[ForwardMode]
    FORWARD_MODE_DECODE: _ClassVar[ForwardMode]
    FORWARD_MODE_MIXED: _ClassVar[ForwardMode]
    FORWARD_MODE_IDLE: _ClassVar[ForwardMode]

class GrammarKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRAMMAR_KIND_NONE: _ClassVar[GrammarKind]
    GRAMMAR_KIND_REGEX: _ClassVar[GrammarKind]
    GRAMMAR_KIND_JSON_SCHEMA: _ClassVar[GrammarKind]
    GRAMMAR_KIND_EBNF: _ClassVar[GrammarKind]
    GRAMMAR_KIND_STRUCTURAL_TAG: _ClassVar[GrammarKind]
POOLING_NONE: Pooling
POOLING_LAST: Pooling
POOLING_MEAN: Pooling
FORWARD_MODE_UNSPECIFIED: ForwardMode
FORWARD_MODE_PREFILL: ForwardMode
FORWARD_MODE_DECODE: ForwardMode
FORWARD_MODE_MIXED: ForwardMode
FORWARD_MODE_IDLE: ForwardMode
GRAMMAR_KIND_NONE: GrammarKind
GRAMMAR_KIND_REGEX: GrammarKind
GRAMMAR_KIND_JSON_SCHEMA: GrammarKind
GRAMMAR_KIND_EBNF: GrammarKind
GRAMMAR_KIND_STRUCTURAL_TAG: GrammarKind

class SendKvRequest(_message.Message):
    __slots__ = ("room", "src_pages", "target", "dst_pages", "timeout_s")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    SRC_PAGES_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DST_PAGES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    room: str
    src_pages: _containers.RepeatedScalarFieldContainer[int]
    target: str
    dst_pages: _containers.RepeatedScalarFieldContainer[int]
    timeout_s: float
    def __init__(self, room: _Optional[str] = ..., src_pages: _Optional[_Iterable[int]] = ..., target: _Optional[str] = ..., dst_pages: _Optional[_Iterable[int]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class SendKvResponse(_message.Message):
    __slots__ = ("pages_sent", "shared_memory")
    PAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    pages_sent: int
    shared_memory: bool
    def __init__(self, pages_sent: _Optional[int] = ..., shared_memory: _Optional[bool] = ...) -> None: ...

class KvBatch(_message.Message):
    __slots__ = ("room", "bytes_per_page", "seq", "dst_pages", "data", "crc32", "last")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_PAGE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DST_PAGES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    room: str
    bytes_per_page: int
    seq: int
    dst_pages: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    crc32: int
    last: bool
    def __init__(self, room: _Optional[str] = ..., bytes_per_page: _Optional[int] = ..., seq: _Optional[int] = ..., dst_pages: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., last: _Optional[bool] = ...) -> None: ...

class KvAck(_message.Message):
    __slots__ = ("seq", "pages_written")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PAGES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    seq: int
    pages_written: int
    def __init__(self, seq: _Optional[int] = ..., pages_written: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size", "eos_token_ids", "max_context_len", "dtype", "bos_token_id", "pad_token_id", "sampling_defaults", "pooling", "normalize", "num_labels", "labels", "score_activation")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LABELS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SCORE_ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context_len: int
    dtype: str
    bos_token_id: int
    pad_token_id: int
    sampling_defaults: ModelSamplingDefaults
    pooling: Pooling
    normalize: bool
    num_labels: int
    labels: _containers.RepeatedScalarFieldContainer[str]
    score_activation: str
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context_len: _Optional[int] = ..., dtype: _Optional[str] = ..., bos_token_id: _Optional[int] = ..., pad_token_id: _Optional[int] = ..., sampling_defaults: _Optional[_Union[ModelSamplingDefaults, _Mapping]] = ..., pooling: _Optional[_Union[Pooling, str]] = ..., normalize: _Optional[bool] = ..., num_labels: _Optional[int] = ..., labels: _Optional[_Iterable[str]] = ..., score_activation: _Optional[str] = ...) -> None: ...

class ModelSamplingDefaults(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    max_new_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("protocol_version", "model", "page_size", "num_pages", "tp_rank", "tp_size", "attention_backend", "device", "session_epoch", "weight_bytes", "kv_cache_bytes", "graph_bytes", "grammar_backend", "num_swa_pages", "swa_window", "num_host_pages", "num_storage_pages", "stored_block_hashes", "kv_shared_memory")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SESSION_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRAPH_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_BACKEND_FIELD_NUMBER: _ClassVar[int]
    NUM_SWA_PAGES_FIELD_NUMBER: _ClassVar[int]
    SWA_WINDOW_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_STORAGE_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    KV_SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model: ModelInfo
    page_size: int
    num_pages: int
    tp_rank: int
    tp_size: int
    attention_backend: str
    device: str
    session_epoch: int
    weight_bytes: int
    kv_cache_bytes: int
    graph_bytes: int
    grammar_backend: str
    num_swa_pages: int
    swa_window: int
    num_host_pages: int
    num_storage_pages: int
    stored_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    kv_shared_memory: str
    def __init__(self, protocol_version: _Optional[int] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., attention_backend: _Optional[str] = ..., device: _Optional[str] = ..., session_epoch: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., graph_bytes: _Optional[int] = ..., grammar_backend: _Optional[str] = ..., num_swa_pages: _Optional[int] = ..., swa_window: _Optional[int] = ..., num_host_pages: _Optional[int] = ..., num_storage_pages: _Optional[int] = ..., stored_block_hashes: _Optional[_Iterable[int]] = ..., kv_shared_memory: _Optional[str] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("session_id", "epoch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "stop_token_ids", "ignore_eos", "logit_bias_ids", "logit_bias_values", "seed", "grammar", "reasoning_end_token")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    REASONING_END_TOKEN_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    min_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logit_bias_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    seed: int
    grammar: Grammar
    reasoning_end_token: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logit_bias_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., seed: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., reasoning_end_token: _Optional[int] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "text")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    kind: GrammarKind
    text: str
    def __init__(self, kind: _Optional[_Union[GrammarKind, str]] = ..., text: _Optional[str] = ...) -> None: ...

class CompileGrammarRequest(_message.Message):
    __slots__ = ("grammar",)
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    grammar: Grammar
    def __init__(self, grammar: _Optional[_Union[Grammar, _Mapping]] = ...) -> None: ...

class CompileGrammarResponse(_message.Message):
    __slots__ = ("error", "compile_ms")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPILE_MS_FIELD_NUMBER: _ClassVar[int]
    error: str
    compile_ms: float
    def __init__(self, error: _Optional[str] = ..., compile_ms: _Optional[float] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "max_rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    max_rank: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., max_rank: _Optional[int] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("error", "rank", "target_modules", "load_ms")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    error: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    load_ms: float
    def __init__(self, error: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., load_ms: _Optional[float] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class AdapterSlot(_message.Message):
    __slots__ = ("slot", "name")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    slot: int
    name: str
    def __init__(self, slot: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class LogprobOptions(_message.Message):
    __slots__ = ("return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob")
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_START_LEN_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_NUM_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, return_logprob: _Optional[bool] = ..., logprob_start_len: _Optional[int] = ..., top_logprobs_num: _Optional[int] = ..., token_ids_logprob: _Optional[_Iterable[int]] = ...) -> None: ...

class TraceContext(_message.Message):
    __slots__ = ("traceparent", "tracestate")
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    traceparent: str
    tracestate: str
    def __init__(self, traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class Join(_message.Message):
    __slots__ = ("slot", "rid", "sampling", "logprobs", "prompt_len", "prefix_ids", "num_output_tokens", "trace", "adapter_slot", "last_token", "kv_pages", "pooling", "normalize")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SLOT_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    slot: int
    rid: str
    sampling: SamplingParams
    logprobs: LogprobOptions
    prompt_len: int
    prefix_ids: _containers.RepeatedScalarFieldContainer[int]
    num_output_tokens: int
    trace: TraceContext
    adapter_slot: int
    last_token: int
    kv_pages: _containers.RepeatedScalarFieldContainer[int]
    pooling: Pooling
    normalize: bool
    def __init__(self, slot: _Optional[int] = ..., rid: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., logprobs: _Optional[_Union[LogprobOptions, _Mapping]] = ..., prompt_len: _Optional[int] = ..., prefix_ids: _Optional[_Iterable[int]] = ..., num_output_tokens: _Optional[int] = ..., trace: _Optional[_Union[TraceContext, _Mapping]] = ..., adapter_slot: _Optional[int] = ..., last_token: _Optional[int] = ..., kv_pages: _Optional[_Iterable[int]] = ..., pooling: _Optional[_Union[Pooling, str]] = ..., normalize: _Optional[bool] = ...) -> None: ...

class Extend(_message.Message):
    __slots__ = ("slot", "start_pos", "input_ids", "new_pages", "sample", "next_token", "draft_len", "new_swa_pages")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_SWA_PAGES_FIELD_NUMBER: _ClassVar[int]
    slot: int
    start_pos: int
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    new_pages: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    next_token: int
    draft_len: int
    new_swa_pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slot: _Optional[int] = ..., start_pos: _Optional[int] = ..., input_ids: _Optional[_Iterable[int]] = ..., new_pages: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., next_token: _Optional[int] = ..., draft_len: _Optional[int] = ..., new_swa_pages: _Optional[_Iterable[int]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "mode", "leaves", "joins", "extends", "decode_slots", "decode_positions", "decode_new_pages", "adapter_slots", "session", "decode_new_swa_pages", "write_back_device_pages", "write_back_host_pages", "load_host_pages", "load_device_pages", "storage_write_hashes", "storage_write_host_pages", "storage_read_hashes", "storage_read_host_pages")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    JOINS_FIELD_NUMBER: _ClassVar[int]
    EXTENDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NEW_PAGES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    DECODE_NEW_SWA_PAGES_FIELD_NUMBER: _ClassVar[int]
    WRITE_BACK_DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    WRITE_BACK_HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOAD_HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOAD_DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_WRITE_HASHES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_WRITE_HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_READ_HASHES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_READ_HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    mode: ForwardMode
    leaves: _containers.RepeatedScalarFieldContainer[int]
    joins: _containers.RepeatedCompositeFieldContainer[Join]
    extends: _containers.RepeatedCompositeFieldContainer[Extend]
    decode_slots: _containers.RepeatedScalarFieldContainer[int]
    decode_positions: _containers.RepeatedScalarFieldContainer[int]
    decode_new_pages: _containers.RepeatedScalarFieldContainer[int]
    adapter_slots: _containers.RepeatedCompositeFieldContainer[AdapterSlot]
    session: SessionOpen
    decode_new_swa_pages: _containers.RepeatedScalarFieldContainer[int]
    write_back_device_pages: _containers.RepeatedScalarFieldContainer[int]
    write_back_host_pages: _containers.RepeatedScalarFieldContainer[int]
    load_host_pages: _containers.RepeatedScalarFieldContainer[int]
    load_device_pages: _containers.RepeatedScalarFieldContainer[int]
    storage_write_hashes: _containers.RepeatedScalarFieldContainer[int]
    storage_write_host_pages: _containers.RepeatedScalarFieldContainer[int]
    storage_read_hashes: _containers.RepeatedScalarFieldContainer[int]
    storage_read_host_pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., mode: _Optional[_Union[ForwardMode, str]] = ..., leaves: _Optional[_Iterable[int]] = ..., joins: _Optional[_Iterable[_Union[Join, _Mapping]]] = ..., extends: _Optional[_Iterable[_Union[Extend, _Mapping]]] = ..., decode_slots: _Optional[_Iterable[int]] = ..., decode_positions: _Optional[_Iterable[int]] = ..., decode_new_pages: _Optional[_Iterable[int]] = ..., adapter_slots: _Optional[_Iterable[_Union[AdapterSlot, _Mapping]]] = ..., session: _Optional[_Union[SessionOpen, _Mapping]] = ..., decode_new_swa_pages: _Optional[_Iterable[int]] = ..., write_back_device_pages: _Optional[_Iterable[int]] = ..., write_back_host_pages: _Optional[_Iterable[int]] = ..., load_host_pages: _Optional[_Iterable[int]] = ..., load_device_pages: _Optional[_Iterable[int]] = ..., storage_write_hashes: _Optional[_Iterable[int]] = ..., storage_write_host_pages: _Optional[_Iterable[int]] = ..., storage_read_hashes: _Optional[_Iterable[int]] = ..., storage_read_host_pages: _Optional[_Iterable[int]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("slot", "start", "logprobs", "top_ids", "top_logprobs", "ids_logprobs")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IDS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    start: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    ids_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, slot: _Optional[int] = ..., start: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., ids_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "error", "slots", "token_ids", "logprobs", "top_counts", "top_ids", "top_logprobs", "ids_counts", "ids_logprobs", "prompt_logprobs", "forward_ms", "idle_ms", "grammar_ended", "token_counts", "embeddings", "storage_done")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IDS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    IDS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_ENDED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_DONE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    error: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_counts: _containers.RepeatedScalarFieldContainer[int]
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    ids_counts: _containers.RepeatedScalarFieldContainer[int]
    ids_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    forward_ms: float
    idle_ms: float
    grammar_ended: _containers.RepeatedScalarFieldContainer[int]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    storage_done: _containers.RepeatedCompositeFieldContainer[StorageReadsDone]
    def __init__(self, step_id: _Optional[int] = ..., error: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_counts: _Optional[_Iterable[int]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., ids_counts: _Optional[_Iterable[int]] = ..., ids_logprobs: _Optional[_Iterable[float]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., forward_ms: _Optional[float] = ..., idle_ms: _Optional[float] = ..., grammar_ended: _Optional[_Iterable[int]] = ..., token_counts: _Optional[_Iterable[int]] = ..., embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., storage_done: _Optional[_Iterable[_Union[StorageReadsDone, _Mapping]]] = ...) -> None: ...

class StorageReadsDone(_message.Message):
    __slots__ = ("step_id", "failed")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    failed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., failed: _Optional[_Iterable[int]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("slot", "values")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    slot: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, slot: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerChunk(_message.Message):
    __slots__ = ("data", "sha256")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    sha256: str
    def __init__(self, data: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...
