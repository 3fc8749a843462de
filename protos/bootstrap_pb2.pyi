from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClaimRequest(_message.Message):
    __slots__ = ("room", "targets", "pages", "prefix_len", "prompt_len", "page_size", "model")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    room: int
    targets: _containers.RepeatedScalarFieldContainer[str]
    pages: _containers.RepeatedScalarFieldContainer[int]
    prefix_len: int
    prompt_len: int
    page_size: int
    model: str
    def __init__(self, room: _Optional[int] = ..., targets: _Optional[_Iterable[str]] = ..., pages: _Optional[_Iterable[int]] = ..., prefix_len: _Optional[int] = ..., prompt_len: _Optional[int] = ..., page_size: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs", "ids", "ids_logprobs", "has_top", "has_ids")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    IDS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_TOP_FIELD_NUMBER: _ClassVar[int]
    HAS_IDS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    ids: _containers.RepeatedScalarFieldContainer[int]
    ids_logprobs: _containers.RepeatedScalarFieldContainer[float]
    has_top: bool
    has_ids: bool
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., ids: _Optional[_Iterable[int]] = ..., ids_logprobs: _Optional[_Iterable[float]] = ..., has_top: _Optional[bool] = ..., has_ids: _Optional[bool] = ...) -> None: ...

class ClaimResult(_message.Message):
    __slots__ = ("first_token", "logprobs", "cached_tokens", "grammar_ended", "pages_sent")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_ENDED_FIELD_NUMBER: _ClassVar[int]
    PAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    logprobs: TokenLogprobs
    cached_tokens: int
    grammar_ended: bool
    pages_sent: int
    def __init__(self, first_token: _Optional[int] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., grammar_ended: _Optional[bool] = ..., pages_sent: _Optional[int] = ...) -> None: ...
