"""What an embedding costs with and without its prefix read from the cache
(a program, not a test): mean pooling computes every prompt position (the
cache holds KV, not hidden states), last-token pooling reads all but the
last page from the cache once another request computed it.

On the default model in process (the worker's ModelRunner, float32 on the
CPU), for each prompt length: a last-token embedding whose prefix is
cached (all full pages), a mean embedding of the same prompt (computed
whole) and, for reference, a last-token embedding with nothing cached;
``--rounds`` alternations, medians in milliseconds. The last line printed is
one JSON object.

    python benchmarks/embed_cache.py --prompt-len 256 1024 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from worker_service.config import WorkerConfig
from worker_service.execution.plan import Extend, ForwardMode, Join, Plan
from worker_service.sampling.params import LogprobOptions, SamplingParams
from worker_service.worker import build_worker

PAGE = 16


def _join(slot: int, prompt: list[int], pooling: str, prefix: list[int]) -> Join:
    return Join(
        slot,
        f"r{slot}",
        SamplingParams(temperature=0.0),
        LogprobOptions(),
        len(prompt),
        prefix,
        pooling=pooling,
        normalize=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-len", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    worker = build_worker(WorkerConfig(model="default", page_size=PAGE, num_pages=512))
    runner, vocab = worker.runner, worker.vocab_size
    step = 0
    report = {}
    for n in args.prompt_len:
        pages = list(range(-(-n // PAGE)))
        cached = (n - 1) // PAGE * PAGE  # the scheduler's cache hit: full pages, not the last token
        times: dict[str, list[float]] = {"last_cached": [], "mean": [], "last_uncached": []}
        for _ in range(args.rounds):
            prompt = [random.randrange(vocab) for _ in range(n)]
            for kind in times:
                step += 1
                if kind == "last_cached":
                    # Its prefix pages hold what an earlier request wrote there:
                    # the cost is measured here, not the vector.
                    plan = Plan(
                        step,
                        ForwardMode.PREFILL,
                        joins=[_join(0, prompt, "last", prompt[:cached])],
                        extends=[Extend(0, cached, prompt[cached:], pages, sample=False)],
                    )
                else:
                    pooling = "mean" if kind == "mean" else "last"
                    plan = Plan(
                        step,
                        ForwardMode.PREFILL,
                        joins=[_join(0, prompt, pooling, [])],
                        extends=[Extend(0, 0, prompt, pages, sample=False)],
                    )
                t0 = time.perf_counter()
                result = runner.execute(plan)
                times[kind].append((time.perf_counter() - t0) * 1e3)
                assert not result.error and len(result.embeddings) == 1, result.error
                step += 1
                runner.execute(Plan(step, ForwardMode.IDLE, leaves=[0]))
        report[n] = {k: round(statistics.median(v), 1) for k, v in times.items()}
        print(f"prompt {n}: " + ", ".join(f"{k} {v} ms" for k, v in report[n].items()))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
