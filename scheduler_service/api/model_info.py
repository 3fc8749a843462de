"""What the API process knows about the served model once the core is ready:
limits for validation, the tokenizer (for original_text and GetTokenizer),
and the names reported to clients and the gateway."""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path

import structlog
from tokenizers import Tokenizer

from common import tokenizer_archive
from scheduler_service import ipc
from scheduler_service.api.convert.public import NO_DEFAULTS, Limits, ModelDefaults
from scheduler_service.api.convert.rerank import ScoringHead, scoring_head_of
from scheduler_service.config import ServiceConfig

logger = structlog.get_logger(__name__)


@dataclass
class ModelContext:
    ready: ipc.Ready
    limits: Limits
    served_model_name: str
    tokenizer: Tokenizer | None
    tokenizer_dir: str  # a local copy of the tokenizer files ("" if none)
    health_timeout_s: float = 20.0
    # The model's sampling defaults as declared (GetModelInfo reports them) and
    # those a request's unset fields take; empty under --sampling-defaults openai.
    declared_defaults: dict[str, float | int] = dataclasses.field(default_factory=dict)
    defaults: ModelDefaults = NO_DEFAULTS
    # A sequence classifier's score head (it scores prompts: Embed, rerank;
    # it cannot generate); None: a causal LM.
    scoring: ScoringHead | None = None

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        """A text pair through the tokenizer's pair template (a rerank's
        query and document, as ``tokenizer(query, document)`` encodes them)."""
        return self.tokenizer.encode(first, second).ids

    @classmethod
    def build(cls, ready: ipc.Ready, config: ServiceConfig, workdir: Path) -> ModelContext:
        context = min(ready.max_context_len or (1 << 30), ready.num_pages * ready.page_size)
        limits = Limits(
            vocab_size=ready.vocab_size,
            context_len=context,
            **dataclasses.asdict(config.limits),
        )
        tokenizer, tokenizer_dir = None, ""
        if ready.tokenizer_zip:
            target = Path(tempfile.mkdtemp(prefix="tokenizer-", dir=workdir))
            for name, data in tokenizer_archive.unpack(ready.tokenizer_zip).items():
                (target / Path(name).name).write_bytes(data)
            tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
            tokenizer_dir = str(target)
        end = reasoning_end_token(tokenizer, config.api.think_end_token, ready.vocab_size)
        limits = dataclasses.replace(limits, reasoning_end_token=end)
        name = config.api.served_model_name or Path(ready.model_name).stem or ready.model_name
        declared = dict(ready.sampling_defaults) if config.api.sampling_defaults == "model" else {}
        return cls(
            ready,
            limits,
            name,
            tokenizer,
            tokenizer_dir,
            declared_defaults=declared,
            defaults=ModelDefaults.of(declared),
            scoring=scoring_head_of(ready.worker_info),
        )


def reasoning_end_token(tokenizer: Tokenizer | None, token: str, vocab_size: int) -> int | None:
    """The id of ``token`` (the model's ``</think>``) if it is one token of the
    vocabulary, else None: a model without it has no thinking section to wait for."""
    if tokenizer is None or not token:
        return None
    found = tokenizer.token_to_id(token)
    if found is None or found >= vocab_size:
        return None
    logger.info("end-of-reasoning token", token=token, id=found)
    return found
