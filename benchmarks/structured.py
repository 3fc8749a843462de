"""What structured generation costs (a program, not a test), on a running
server (``radixserve serve``; the default model on CPU by default):

1. TPOT of a batch of requests constrained by a JSON schema against the same
   requests unconstrained with the same output lengths (each unconstrained
   request gets ``max_new_tokens`` = its constrained twin's output length and
   ignores EOS), alternating, ``--rounds`` times: medians and their ratio.
2. How often the grammar forces the next token (one token allowed): the
   constrained outputs of step 1 replayed through xgrammar; this is all an
   exact jump-forward could skip (docs/design.md, "No jump-forward").
3. The step loop while grammars compile: ITL p99 of ``--streams`` running
   unconstrained streams while ``--compiles`` requests with new complex JSON
   schemas are served (each compiled for the first time), against the same
   streams while as many requests with one schema compiled before are served
   (the same prefills and steps, no compile).

The last line printed is one JSON object.

    .venv/bin/radixserve serve --port 30000 &
    python benchmarks/structured.py --server 127.0.0.1:30000 --batch 32 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from clients.tokenizer_bundle import TokenizerBundle
from common import tokenizer_archive

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "employed"],
    "additionalProperties": False,
}
TOPICS = ["a teacher", "a pilot", "a baker", "a painter", "a nurse", "a farmer", "a coder"]


def complex_schema(i: int) -> dict:
    """A schema no cache has seen: many typed, patterned, nested properties."""
    props = {}
    for j in range(24):
        kind = (i + j) % 6
        props[f"f{i}_{j}"] = [
            {"type": "string", "pattern": f"^[a-z]{{{1 + j % 5},{6 + j % 7}}}$"},
            {"type": "integer", "minimum": -j, "maximum": 1000 + i},
            {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
            {"enum": [f"v{i}_{j}_{k}" for k in range(6)]},
            {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"type": "null"}}},
            {"type": "string", "format": "date" if j % 2 else "email"},
        ][kind]
    return {"type": "object", "properties": props, "required": sorted(props)[:12]}


async def one(stub, req: pb.GenerateRequest) -> dict:
    """A streamed call's token arrival times."""
    t0 = time.perf_counter()
    times: list[float] = []
    ids: list[int] = []
    async for r in stub.Generate(req, timeout=600):
        if r.HasField("chunk") and r.chunk.token_ids:
            now = time.perf_counter()
            times += [now] * len(r.chunk.token_ids)
            ids += r.chunk.token_ids
    return {"t0": t0, "times": times, "tokens": len(ids), "ids": ids}


def tpot(call: dict) -> float | None:
    t = call["times"]
    return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


def request(rid: str, ids: list[int], max_new: int, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=max_new, **sampling),
        stream=True,
    )


async def tpot_round(
    stub, prompts: list[list[int]], r: int, outputs: list[list[int]] | None = None
) -> tuple[float, float]:
    constrained = [
        request(f"c{r}-{i}", ids, 256, json_schema=json.dumps(SCHEMA))
        for i, ids in enumerate(prompts)
    ]
    got = await asyncio.gather(*(one(stub, q) for q in constrained))
    if outputs is not None:
        outputs += [g["ids"] for g in got]
    lengths = [max(g["tokens"], 2) for g in got]
    plain = [
        request(f"u{r}-{i}", ids, n, ignore_eos=True)
        for i, (ids, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    free = await asyncio.gather(*(one(stub, q) for q in plain))
    med = [statistics.median(x for x in map(tpot, calls) if x) for calls in (got, free)]
    return med[0], med[1]


def forced_steps(files: dict[str, bytes], info: Any, outputs: list[list[int]]) -> tuple[int, int]:
    """(steps whose mask allowed exactly one token, steps) over ``outputs``."""
    import numpy as np
    import xgrammar as xgr

    from worker_service.sampling.grammar import huggingface_tokenizer_info

    tok = huggingface_tokenizer_info(files, info.vocab_size, list(info.eos_token_ids))
    compiled = xgr.GrammarCompiler(tok).compile_json_schema(json.dumps(SCHEMA))
    forced = steps = 0
    for ids in outputs:
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        for token in ids:
            matcher.fill_next_token_bitmask(mask)
            allowed = int(np.unpackbits(mask.numpy().view(np.uint8)).sum())
            steps += 1
            forced += allowed == 1
            if not matcher.accept_token(token):
                break
    return forced, steps


async def itl_p99(stub, prompts: list[list[int]], compiles: int, fresh: bool, tag: str) -> float:
    """ITL p99 of the streams over the window in which ``compiles`` constrained
    requests are served: with ``fresh`` schemas (each compiled now), or with
    one schema compiled before (the same requests, prefills and all, but no
    compile: the baseline)."""
    streams = [request(f"s{tag}-{i}", ids, 200, ignore_eos=True) for i, ids in enumerate(prompts)]
    running = [asyncio.ensure_future(one(stub, q)) for q in streams]
    await asyncio.sleep(2.0)  # the streams are decoding
    if fresh:
        schemas = [complex_schema(hash((tag, i)) % 100_000) for i in range(compiles)]
    else:
        schemas = [complex_schema(0)] * compiles  # compiled in the warm-up
    asks = [
        request(f"k{tag}-{i}", prompts[i % len(prompts)], 8, json_schema=json.dumps(s))
        for i, s in enumerate(schemas)
    ]
    start = time.perf_counter()
    await asyncio.gather(*(one(stub, q) for q in asks))
    end = time.perf_counter()
    calls = await asyncio.gather(*running)
    gaps = [
        b - a
        for c in calls
        for a, b in zip(c["times"], c["times"][1:], strict=False)
        if start <= b <= end
    ]
    return statistics.quantiles(gaps, n=100)[98] if len(gaps) > 10 else float("nan")


async def main_async(args: argparse.Namespace) -> dict:
    async with grpc.aio.insecure_channel(args.server) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        files = tokenizer_archive.unpack(
            tokenizer_archive.join([c async for c in stub.GetTokenizer(cpb.GetTokenizerRequest())])
        )
        bundle = TokenizerBundle(files)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        prompts = [
            bundle.chat_prompt(
                [{"role": "user", "content": f"Describe {TOPICS[i % 7]} number {i} as JSON."}]
            )
            for i in range(args.batch)
        ]
        # warm-up: the schemas compile once, the model's first steps are slow
        await tpot_round(stub, prompts[:2], -1)
        await one(stub, request("warm", prompts[0], 4, json_schema=json.dumps(complex_schema(0))))
        ratios, cons, frees = [], [], []
        outputs: list[list[int]] = []
        for r in range(args.rounds):
            c, f = await tpot_round(stub, prompts, r, outputs)
            cons.append(c)
            frees.append(f)
            ratios.append(c / f)
            print(
                f"round {r + 1}: TPOT constrained {c * 1e3:.1f} ms, plain {f * 1e3:.1f} ms, "
                f"ratio {c / f:.3f}",
                flush=True,
            )
        forced, steps = forced_steps(files, info, outputs)
        print(f"forced steps (one token allowed): {forced} of {steps}", flush=True)
        quiet, busy = [], []
        for r in range(args.rounds):
            some = prompts[: args.streams]
            quiet.append(await itl_p99(stub, some, args.compiles, False, f"q{r}"))
            busy.append(await itl_p99(stub, some, args.compiles, True, f"b{r}"))
            print(
                f"round {r + 1}: ITL p99 {quiet[-1] * 1e3:.1f} ms with {args.compiles} "
                f"constrained requests of a cached schema, {busy[-1] * 1e3:.1f} ms with "
                f"{args.compiles} new schemas compiling",
                flush=True,
            )
    return {
        "batch": args.batch,
        "tpot_constrained_ms": statistics.median(cons) * 1e3,
        "tpot_plain_ms": statistics.median(frees) * 1e3,
        "tpot_ratio_median": statistics.median(ratios),
        "forced_step_fraction": forced / max(steps, 1),
        "itl_p99_quiet_ms": statistics.median(quiet) * 1e3,
        "itl_p99_compiling_ms": statistics.median(busy) * 1e3,
        "itl_p99_ratio": statistics.median(busy) / statistics.median(quiet),
        "rounds": args.rounds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", default="127.0.0.1:30000")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--compiles", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    result = asyncio.run(main_async(p.parse_args()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
