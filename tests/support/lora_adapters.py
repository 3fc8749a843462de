"""PEFT LoRA adapters made on the fly for tests, and transformers + PEFT as
their reference. Shared by the worker's tests and the scheduler's end-to-end
tests; nothing is downloaded (adapters are drawn on the default model's
weights, or on any transformers model given as ``base``).

    make_adapter(directory, name, r, modules, rslora=False, seed=0, base=None) -> Path
        a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
        with random non-zero A and B, scaled so that it visibly changes greedy
        outputs while the text stays sane
    standard_adapters() -> dict[name, Path]
        the usual set on the default model, made once per process:
        "attn-r4" (q,k,v,o), "mlp-r8" (gate,up,down), "all-r16" (all seven),
        "qv-r64-rslora" (q,v, rsLoRA scale)
    peft_greedy(adapter_dir | None, prompt_ids, steps, base=None)
        -> (tokens, per-step log-softmax rows): greedy decoding by transformers
        with the adapter applied by PEFT (None: the base model)
"""

from __future__ import annotations

import copy
import functools
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel

from tests.support.hf_reference import default_model_reference, greedy_with_logprobs

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL = ATTENTION + MLP

# PEFT's init_lora_weights=False leaves nn.Linear's default (Kaiming uniform)
# init in A and B, which with alpha = 2r swamps the base model; B is scaled
# down so the adapter moves greedy outputs within a few tokens but the model
# still writes text.
B_SCALE = 0.08

# name -> (rank, modules, rslora, seed)
STANDARD = {
    "attn-r4": (4, ATTENTION, False, 1),
    "mlp-r8": (8, MLP, False, 2),
    "all-r16": (16, ALL, False, 3),
    "qv-r64-rslora": (64, ("q_proj", "v_proj"), True, 4),
}


def _default_base() -> PreTrainedModel:
    return default_model_reference()[1]


def make_adapter(
    directory: Path | str,
    name: str,
    r: int,
    modules: Sequence[str],
    rslora: bool = False,
    seed: int = 0,
    base: PreTrainedModel | None = None,
) -> Path:
    """Draw and save a LoRA adapter for ``base`` (default: the default model)
    in ``directory / name``; lora_alpha is 2r. The base model is not touched."""
    base = base if base is not None else _default_base()
    torch.manual_seed(seed)
    config = LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=list(modules),
        use_rslora=rslora,
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    peft = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for pname, param in peft.named_parameters():
            if "lora_B" in pname:
                param.mul_(B_SCALE)
    path = Path(directory) / name
    peft.save_pretrained(path)
    return path


@functools.cache
def standard_adapters() -> dict[str, Path]:
    """The standard set on the default model, in a directory of this process."""
    directory = Path(tempfile.mkdtemp(prefix="lora-adapters-"))
    return {
        name: make_adapter(directory, name, r, modules, rslora, seed)
        for name, (r, modules, rslora, seed) in STANDARD.items()
    }


# id(base) -> (its PEFT-wrapped private copy, adapter path -> PEFT adapter name)
_REFERENCES: dict[int, tuple[PeftModel | None, PreTrainedModel, dict[Path, str]]] = {}


def peft_greedy(
    adapter_dir: Path | str | None,
    prompt_ids: Sequence[int],
    steps: int,
    base: PreTrainedModel | None = None,
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and per-step log-softmax rows of the raw logits, by
    transformers + PEFT with the adapter in ``adapter_dir`` read from disk
    (None: the base model alone)."""
    base = base if base is not None else _default_base()
    if adapter_dir is None:
        return greedy_with_logprobs(base, list(prompt_ids), steps)
    path = Path(adapter_dir).resolve()
    peft, copy_, names = _REFERENCES.get(id(base), (None, None, {}))
    if copy_ is None:
        copy_ = copy.deepcopy(base)  # PEFT injects its layers into the model it wraps
    if path not in names:
        names[path] = f"a{len(names)}"
        if peft is None:
            peft = PeftModel.from_pretrained(copy_, str(path), adapter_name=names[path])
        else:
            peft.load_adapter(str(path), adapter_name=names[path])
    _REFERENCES[id(base)] = (peft, copy_, names)
    peft.set_adapter(names[path])
    peft.eval()
    return greedy_with_logprobs(peft, list(prompt_ids), steps)


def peft_greedy_logprobs(
    adapter_dir: Path | str | None,
    prompt_ids: Sequence[int],
    steps: int,
    base: PreTrainedModel | None = None,
) -> tuple[list[int], list[float]]:
    """Greedy tokens and the logprob of each (as tests.support.hf_reference.hf_greedy)."""
    tokens, rows = peft_greedy(adapter_dir, prompt_ids, steps, base)
    return tokens, [row[t].item() for row, t in zip(rows, tokens, strict=True)]
