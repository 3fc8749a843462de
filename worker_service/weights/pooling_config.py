"""How a model pools an embedding, from its sentence-transformers files: a
``modules.json`` naming a ``Pooling`` module (its ``config.json`` says the
mode) and perhaps a ``Normalize`` module after it. A model without them
pools its last token and normalizes it, SGLang's pooler for decoder models
(``Pooler(LAST, normalize=True)``); the worker's --pooling and
--embed-normalize settings override either. A sequence classifier's score
head reads its last token's state as it is (``classifier_pooling``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import structlog

logger = structlog.get_logger(__name__)

# sentence-transformers' pooling_mode_* keys that we compute, by our name.
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    pooling: str = "last"  # last | mean
    normalize: bool = True


class PoolingConfigError(ValueError):
    """The model asks for a pooling this worker does not compute."""


def read_pooling_config(model_path: Path | None) -> PoolingConfig | None:
    """The model directory's sentence-transformers pooling, or None when it
    has none (a GGUF file, a plain causal-LM directory)."""
    if model_path is None or not (model_path / "modules.json").is_file():
        return None
    modules = json.loads((model_path / "modules.json").read_text())
    pooling, normalize = None, False
    for m in modules:
        kind = str(m.get("type", ""))
        if kind.endswith(".Pooling"):
            cfg = json.loads((model_path / m.get("path", "") / "config.json").read_text())
            chosen = [key for key, on in cfg.items() if key.startswith("pooling_mode") and on]
            if len(chosen) != 1 or chosen[0] not in _MODES:
                raise PoolingConfigError(
                    f"{model_path}: sentence-transformers pooling {chosen} is not supported "
                    f"(one of {sorted(_MODES)})"
                )
            pooling = _MODES[chosen[0]]
        elif kind.endswith(".Normalize"):
            normalize = True
    if pooling is None:
        return None
    return PoolingConfig(pooling, normalize)


def classifier_pooling(*, pooling: str, normalize: str) -> PoolingConfig:
    """A sequence classifier pools its last token, raw, for its score head
    (transformers' *ForSequenceClassification, SGLang's ``Pooler(LAST,
    normalize=False)``); settings asking for another are refused, not ignored."""
    if pooling not in ("auto", "last") or normalize == "on":
        raise PoolingConfigError(
            f"--pooling {pooling} / --embed-normalize {normalize}: a sequence classifier's "
            "score head reads the last token's hidden state, unnormalized"
        )
    logger.info("embedding pooling", pooling="last", normalize=False, score_head=True)
    return PoolingConfig("last", normalize=False)


def resolve_pooling(*, model_path: Path | None, pooling: str, normalize: str) -> PoolingConfig:
    """The settings (``auto`` defers) over the model's own config over SGLang's default."""
    found = read_pooling_config(model_path) or PoolingConfig()
    chosen = PoolingConfig(
        found.pooling if pooling == "auto" else pooling,
        found.normalize if normalize == "auto" else normalize == "on",
    )
    logger.info("embedding pooling", pooling=chosen.pooling, normalize=chosen.normalize)
    return chosen
