"""Synthetic workloads shared by the benchmarks (pure Python, no model needed)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TraceRequest:
    group: int
    prompt_ids: list[int]
    output_ids: list[int]


def generated_shared_prefix(
    seed: int = 42,
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    vocab: int = 128256,
) -> list[TraceRequest]:
    """SGLang's generated-shared-prefix workload, as random token ids.

    Draw order (it fixes the trace for a seed): every group's system prompt;
    then per group and prompt its question, then its output; then shuffle.
    The defaults are SGLang's bench defaults (64 x 16, 2048/128/256).
    """
    rng = random.Random(seed)
    randrange = rng.randrange
    systems = [[randrange(vocab) for _ in range(system_prompt_len)] for _ in range(num_groups)]
    requests: list[TraceRequest] = []
    for group, system in enumerate(systems):
        for _ in range(prompts_per_group):
            question = [randrange(vocab) for _ in range(question_len)]
            output = [randrange(vocab) for _ in range(output_len)]
            requests.append(TraceRequest(group, system + question, output))
    rng.shuffle(requests)
    return requests
