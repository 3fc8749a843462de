"""Hugging Face transformers as the reference the tests compare against."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from worker_service.weights import default_model_path


@functools.cache
def default_model_reference():
    """(tokenizer, model) of the default model, read by transformers from the
    same GGUF file, fp32, generating a fixed number of tokens (EOS ignored).
    Loaded once per test process (~15 s)."""
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None
    return tok, model


def chat_ids(tok, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    out = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])


def greedy_with_logprobs(
    model: PreTrainedModel, prompt: list[int], steps: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and, per step, the log-softmax of the raw logits."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            # Given, not inferred: generate masks out every prompt token equal
            # to pad_token_id (0 here) when it builds the mask itself.
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [torch.log_softmax(lg[0].float(), -1) for lg in out.logits]


def hf_greedy(model: PreTrainedModel, prompt: list[int], steps: int):
    """Greedy tokens and the logprob of each."""
    tokens, rows = greedy_with_logprobs(model, prompt, steps)
    return tokens, [row[t].item() for row, t in zip(rows, tokens, strict=True)]


def hf_greedy_check(
    model: PreTrainedModel, prompt: list[int], tokens: list[int]
) -> tuple[list[int], list[float]]:
    """transformers' greedy choice and the logprob of ``tokens[i]`` at each of
    their positions, from one uncached forward over ``prompt + tokens[:-1]``:
    ``tokens`` are transformers' greedy tokens exactly when they equal the
    choices. The reference for sliding-window models: transformers 5.24's
    generate() with its sliding-window cache picks tokens its own uncached
    forward does not (a tiny Phi-3 with a 16-token window, the decode steps
    after a 47- or 48-token prompt, eager and SDPA attention alike)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    rows = torch.log_softmax(logits.float(), -1)
    picked = rows.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    return rows.argmax(-1).tolist(), picked.tolist()
