"""Real English text without a download, and a model's mean negative
log-likelihood of it, scored the way llama.cpp's ``llama-perplexity`` does.

The text is the Python language reference's prose that every CPython ships
(``pydoc_data.topics``: the help() pages of statements and operators), in
sorted topic order, so it is the same on every machine with the same Python
minor version. Write ``prose_text()`` to a file and pass it to
``llama-perplexity -f FILE -c 512`` to score the same tokens with llama.cpp.

``mean_nll`` splits the token ids into chunks of ``chunk`` tokens (the tail
that fills no chunk is dropped) and, in each chunk, scores tokens
chunk/2 + 1 .. chunk - 1 given everything before them in the chunk, as
llama-perplexity does (the first half is context only); the result is the
mean over all scored tokens, in nats (perplexity = exp of it).
"""

from __future__ import annotations

import math
from pydoc_data import topics

import torch

from worker_service.attention.base import AttentionBatch, AttentionSpec, SequenceSlice
from worker_service.attention.torch_backend import TorchAttention
from worker_service.device.kv_cache import KvCache
from worker_service.device.page_table import PageTable
from worker_service.models.llama import LlamaForCausalLM

CHUNK = 512
PAGE = 16


def prose_text(max_chars: int | None = None) -> str:
    """The language reference's topics, sorted by name, separated by blank lines."""
    text = "\n\n".join(topics.topics[name].strip() for name in sorted(topics.topics))
    return text if max_chars is None else text[:max_chars]


def sequence_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Float32 logits (len(ids), vocab) of one sequence prefilled whole."""
    cfg = model.config
    n = len(ids)
    pages = -(-n // PAGE)
    device = model.embed_tokens.weight.device
    spec = AttentionSpec(
        cfg.num_heads // model.tp.size,
        cfg.num_kv_heads // model.tp.size,
        cfg.head_dim,
        PAGE,
        None,
        model.dtype,
        device,
    )
    kv = KvCache(
        num_layers=cfg.num_layers,
        num_pages=pages,
        page_size=PAGE,
        num_kv_heads=model.num_local_kv_heads,
        head_dim=cfg.head_dim,
        dtype=model.dtype,
        device=device,
    )
    table = PageTable(str(device), rows=1, columns=pages)
    row = table.acquire()
    table.append(row, list(range(pages)))
    table.sync()
    positions = torch.arange(n, dtype=torch.int64)
    batch = AttentionBatch(
        seqs=[SequenceSlice(0, n, n, row)],
        num_extends=1,
        positions=positions.to(device),
        write_pages=(positions // PAGE).to(device),
        write_offsets=(positions % PAGE).to(device),
        page_size=PAGE,
        pages=table,
    )
    attn = TorchAttention(spec)
    attn.begin_step(batch)
    tokens = torch.tensor(ids, dtype=torch.int64, device=device)
    hidden = model(tokens, batch.positions, attn=attn, kv=kv)
    return model.logits(hidden).float()


@torch.inference_mode()
def mean_nll(
    model: LlamaForCausalLM, ids: list[int], *, chunk: int = CHUNK, bos: int | None = None
) -> float:
    """Mean negative log-likelihood (nats) over the second half of each chunk
    (module docstring). ``bos``: replaces each chunk's first token, as
    llama-perplexity does for a model that adds one."""
    total, count = 0.0, 0
    first = chunk // 2
    for start in range(0, len(ids) - chunk + 1, chunk):
        part = list(ids[start : start + chunk])
        if bos is not None:
            part[0] = bos
        logits = sequence_logits(model, part)
        # llama-perplexity: logits at j in [first, chunk - 1) score token j + 1.
        logprobs = torch.log_softmax(logits[first : chunk - 1], dim=-1)
        targets = torch.tensor(part[first + 1 : chunk], dtype=torch.int64, device=logprobs.device)
        nll = -logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
        total += float(nll.double().sum())
        count += nll.shape[0]
    if count == 0:
        raise ValueError(f"{len(ids)} tokens fill no chunk of {chunk}")
    return total / count


def perplexity(nll: float) -> float:
    return math.exp(nll)
