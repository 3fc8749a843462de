"""Floods of every expensive request kind, each while the probe (a plain
greedy Generate) is timed against its quiet latency: new hard JSON schemas,
prompts at and past the context limit, n at its limit, prompt logprobs with
top_logprobs at their limit, n with logprobs, many stop strings, big
logit_bias, cancel-and-resubmit storms, FlushCache and GetLoads storms, and
KV event subscribers that never read. Every call must end with the code
its kind expects (the limits' refusals are INVALID_ARGUMENT, the bounded
queues' RESOURCE_EXHAUSTED)."""

from __future__ import annotations

import random
import string
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from hardening_load import Probe, ProbeLoop
from hardening_report import Row
from hardening_storms import admin_storm, cancel_storm, silent_subscribers
from hardening_system import Deployment
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

OK = frozenset({"OK"})
REFUSED = frozenset({"INVALID_ARGUMENT"})


def hard_schema(seed: int, depth: int = 200, width: int = 1) -> str:
    """Objects nested ``depth`` deep, ``width`` - 1 extra leaves a level;
    the keys drawn from ``seed`` so every schema is new to the compile
    cache (xgrammar's time grows about as depth^3: 300 deep, seconds)."""
    rng = random.Random(seed)
    tag = "".join(rng.choices(string.ascii_lowercase, k=6))
    leaves = ('{"type": "integer"}', '{"type": "boolean"}', '{"enum": ["a", "b", "c"]}')
    schema = '{"type": "integer"}'
    for i in range(depth):
        props = [f'"{tag}{i}": {schema}']
        props += [f'"{tag}{i}x{j}": {rng.choice(leaves)}' for j in range(width - 1)]
        schema = (
            f'{{"type": "object", "properties": {{{", ".join(props)}}}, "required": ["{tag}{i}"]}}'
        )
    return schema


@dataclass
class Job:
    label: str
    run: Callable[[pb_grpc.SglangSchedulerStub], tuple[str, str]]  # -> (code, details)
    expect: frozenset[str]


def generate(
    rid: str, ids: list[int], timeout_s: float = 300, stream: bool = False, **kw
) -> Callable[[pb_grpc.SglangSchedulerStub], tuple[str, str]]:
    sampling = kw.pop("sampling", {})
    req = pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(**sampling),
        stream=stream,
        **kw,
    )

    def run(s: pb_grpc.SglangSchedulerStub) -> tuple[str, str]:
        try:
            for _ in s.Generate(req, timeout=timeout_s):
                pass
            return "OK", ""
        except grpc.RpcError as e:
            return e.code().name, e.details() or ""

    return run


def run_flood(
    dep: Deployment,
    probe: Probe,
    quiet_s: float,
    name: str,
    tried: str,
    jobs: list[Job],
    concurrency: int,
    max_probe_ratio: float | None = None,
) -> Row:
    codes: dict[str, Counter] = {}
    samples: dict[tuple[str, str], str] = {}
    t0 = time.monotonic()
    with ProbeLoop(probe) as loop, ThreadPoolExecutor(concurrency) as pool:
        futures = [(j, pool.submit(j.run, dep.stub)) for j in jobs]
        for j, f in futures:
            code, details = f.result()
            codes.setdefault(j.label, Counter())[code] += 1
            if code not in j.expect:
                samples.setdefault((j.label, code), details[:160])
    wall = time.monotonic() - t0
    problems = [f"{label}: {code} ({d})" for (label, code), d in samples.items()]
    # Every kind meant to run must have run at least once (a flood that is
    # only ever refused as busy serves nobody).
    problems += [
        f"{label}: none served ({dict(c)})"
        for label, c in codes.items()
        if "OK" in next(j.expect for j in jobs if j.label == label) and not c["OK"]
    ]
    problems += [f"probe failed: {e}" for e in loop.errors[:3]]
    if loop.different:
        problems.append(f"the probe's greedy tokens changed {loop.different} times")
    if max_probe_ratio and loop.times:
        ratio = sorted(loop.times)[len(loop.times) // 2] / quiet_s
        if ratio > max_probe_ratio:
            problems.append(
                f"probe median {ratio:.1f}x its quiet latency (limit {max_probe_ratio}x)"
            )
    counts = "; ".join(f"{label}: {dict(c)}" for label, c in codes.items())
    return Row(
        "floods",
        f"{name}: {tried}",
        f"{len(jobs)} calls in {wall:.0f} s ({counts}); {loop.summary(quiet_s)}",
        not problems,
        problems,
        {
            "calls": len(jobs),
            "wall_s": round(wall, 1),
            "probe_s": [round(t, 2) for t in loop.times],
        },
    )


def rand_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def jobs(label: str, count: int, expect: frozenset[str], make: Callable[[], Callable]) -> list[Job]:
    return [Job(label, make(), expect) for _ in range(count)]


def floods(
    dep: Deployment, probe: Probe, quiet_s: float, seed: int
) -> list[tuple[str, Callable[[], Row]]]:
    """(name, run) of every flood, in order."""
    info = dep.stub.GetModelInfo(pb.GetModelInfoRequest())
    ctx, vocab = info.max_context_length, info.vocab_size
    rng = random.Random(seed)
    uid = iter(range(10**9))
    schemas = iter(range(seed * 1000, 10**9))

    def gen(kind: str, n_ids: int, **kw) -> Callable[[], Callable]:
        """A maker of Generate calls of ``kind`` on fresh ``n_ids``-token prompts."""
        return lambda: generate(f"{kind}-{next(uid)}", rand_ids(rng, n_ids, vocab), **kw)

    def flood(name: str, tried: str, js: list[Job], concurrency: int, ratio=None):
        return lambda: run_flood(dep, probe, quiet_s, name, tried, js, concurrency, ratio)

    greedy = {"temperature": 0.0, "max_new_tokens": 16}

    def schema() -> dict:
        return {**greedy, "json_schema": hard_schema(next(schemas), rng.choice([60, 120, 200]), 2)}

    # The refusals first (sent before the flood fills this client's compile
    # slots: past them any grammar is RESOURCE_EXHAUSTED, broken or not).
    grammar = (
        [
            Job(
                "broken schema",
                gen("gb", 3, sampling={**greedy, "json_schema": "{" * (i + 1)})(),
                REFUSED,
            )
            for i in range(6)
        ]
        + jobs(
            "schema > 64 KiB",
            2,
            REFUSED,
            gen("gl", 3, sampling={**greedy, "json_schema": hard_schema(1, 600, 3)}),
        )
        + [
            Job(
                "new schema",
                gen("g", 24, sampling=schema())(),
                frozenset({"OK", "RESOURCE_EXHAUSTED"}),
            )
            for _ in range(24)
        ]
    )
    one = {"temperature": 0.0, "max_new_tokens": 1}
    long = (
        jobs("ctx-1 prompt", 1, OK, gen("l", ctx - 1, sampling=one))
        + jobs("ctx+1 prompt", 12, REFUSED, gen("lx", ctx + 1, sampling=greedy))
        + jobs("prompt+max_new past ctx", 12, REFUSED, gen("lm", ctx - 4, sampling=greedy))
        + jobs("4x ctx prompt", 4, REFUSED, gen("l4", 4 * ctx, sampling=greedy))
    )
    n = jobs(
        "n=max", 6, OK, gen("n", 64, sampling={"temperature": 0.8, "max_new_tokens": 32, "n": 16})
    ) + jobs("n=max+1", 10, REFUSED, gen("nx", 3, sampling={"max_new_tokens": 4, "n": 17}))
    top, four = 64, {"temperature": 0.0, "max_new_tokens": 4}
    prompt_lp = jobs(
        "prompt logprobs, top 64",
        4,
        OK,
        lambda: generate(
            f"p-{next(uid)}",
            rand_ids(rng, 1024, vocab),
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=top,
            token_ids_logprob=rand_ids(rng, 1024, vocab),
            sampling=four,
        ),
    ) + jobs(
        "top 65",
        10,
        REFUSED,
        gen("px", 3, return_logprob=True, top_logprobs_num=top + 1, sampling=four),
    )
    n_lp = jobs(
        "n=16 + prompt logprobs top 64",
        3,
        OK,
        gen(
            "nl",
            512,
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=top,
            sampling={"temperature": 0.7, "max_new_tokens": 8, "n": 16},
        ),
    )

    def stops(k: int, length: int) -> dict:
        texts = ["".join(rng.choices(string.ascii_letters + " ", k=length)) for _ in range(k)]
        return {**greedy, "max_new_tokens": 32, "stop": texts}

    stop = (
        [
            Job("16 stops x 256 chars", gen("s", 48, sampling=stops(16, 256))(), OK)
            for _ in range(12)
        ]
        + jobs("17 stops", 10, REFUSED, gen("sx", 3, sampling=stops(17, 8)))
        + jobs("a 257-char stop", 10, REFUSED, gen("sl", 3, sampling=stops(1, 257)))
    )

    def bias(k: int, hi: float = 100.0) -> dict:
        values = {str(t): rng.uniform(-hi, hi) for t in rng.sample(range(vocab), k)}
        return {**greedy, "max_new_tokens": 32, "logit_bias": values}

    biases = (
        [Job("1024 biases", gen("b", 48, sampling=bias(1024))(), OK) for _ in range(12)]
        + jobs("1025 biases", 10, REFUSED, gen("bx", 3, sampling=bias(1025)))
        + jobs(
            "bias 101", 10, REFUSED, gen("bv", 3, sampling={**greedy, "logit_bias": {"5": 101.0}})
        )
    )
    return [
        (
            "grammars",
            flood(
                "grammars",
                "6 broken JSON schemas and 2 past --max-grammar-bytes, then 24 new ones "
                "nested 60-200 deep from one client (12 at a time)",
                grammar,
                12,
                3.0,
            ),
        ),
        (
            "long-prompts",
            flood(
                "long prompts",
                f"prompts of context - 1 = {ctx - 1} tokens; past "
                "the context; prompt + max_new_tokens past it; 4x the context",
                long,
                4,
            ),
        ),
        ("n", flood("n", "n = 16 (the limit) x 32 tokens sampled; n = 17", n, 3)),
        (
            "prompt-logprobs",
            flood(
                "prompt logprobs",
                "1024-token prompts with prompt logprobs "
                "from 0, top_logprobs_num 64 and 1024 token_ids_logprob; top 65",
                prompt_lp,
                2,
            ),
        ),
        (
            "n-logprobs",
            flood(
                "n with logprobs",
                "n = 16 with prompt logprobs (top 64) on 512-token prompts",
                n_lp,
                2,
            ),
        ),
        (
            "stop-strings",
            flood(
                "stop strings", "16 stop strings of 256 chars (the limits); 17; 257 chars", stop, 6
            ),
        ),
        (
            "logit-bias",
            flood(
                "logit bias", "1024 logit_bias entries (the limit); 1025; a value of 101", biases, 6
            ),
        ),
        ("cancel-storm", lambda: cancel_storm(dep, probe, quiet_s, rounds=300)),
        ("admin-storm", lambda: admin_storm(dep, probe, quiet_s)),
        ("kv-subscribers", lambda: silent_subscribers(dep, probe, quiet_s, rng, vocab)),
    ]
