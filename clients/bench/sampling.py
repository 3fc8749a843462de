"""How a run's requests sample: greedy (temperature 0, what the transformers
baseline compares token by token) or sampled at a temperature, with a seed
per request drawn from the run's seed, so a run can be repeated exactly on
servers that honour seeds and two servers get the same seeds."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from clients.bench.records import BenchRequest

# Seeds stay below 2^31: they travel as JSON numbers and protobuf doubles
# (custom_params), which hold such integers exactly.
SEED_RANGE = 1 << 31


@dataclass(frozen=True, slots=True)
class SamplingMode:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k (not sent to an OpenAI API)
    ignore_eos: bool = True
    request_seeds: bool = True  # sampled runs: a seed per request

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def describe(self) -> str:
        eos = "EOS ignored" if self.ignore_eos else "EOS honoured"
        if self.greedy:
            return f"greedy, {eos}"
        parts = [f"temperature {self.temperature:g}", f"top_p {self.top_p:g}"]
        if self.top_k > 0:
            parts.append(f"top_k {self.top_k}")
        parts.append("a seed per request" if self.request_seeds else "no seeds")
        return "sampled (" + ", ".join(parts) + f"), {eos}"


def with_seeds(
    requests: list[BenchRequest], mode: SamplingMode, run_seed: int
) -> list[BenchRequest]:
    """The requests, each with its own sampling seed when ``mode`` samples
    with seeds (distinct within the run; the same run seed, the same seeds);
    greedy or unseeded runs get none."""
    if mode.greedy or not mode.request_seeds:
        seeds: list[int | None] = [None] * len(requests)
    else:
        rng = random.Random(f"request-seeds-{run_seed}")
        seeds = list(rng.sample(range(SEED_RANGE), len(requests)))
    return [replace(r, seed=s) for r, s in zip(requests, seeds, strict=True)]
