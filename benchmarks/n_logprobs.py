"""What prompt logprobs cost a call with n samples (a program, not a test).

For each n, a Generate call with ``n`` samples on a fresh random prompt,
once without logprobs and once with ``return_logprob`` and
``logprob_start_len = 0`` (the whole prompt's logprobs), alternating over
``--rounds``; every call gets a prompt of its own, so nothing is read from
the cache of an earlier call. The baseline is the same call without
logprobs, in the same process against the same server: the table gives the
medians and their ratio. The prompt's logprobs are the same for every
sample, so the ratio should stay near 1 whatever n is.

Starts ``radixserve serve`` (the default model on CPU) unless ``--server``
names a running one. The last line printed is one JSON object.

    python benchmarks/n_logprobs.py --prompt-len 2000 --n 4 16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

BIN = Path(sys.executable).parent


@contextmanager
def started_server(extra: list[str]):
    """``radixserve serve`` on a free port; yields its address."""
    with tempfile.TemporaryDirectory(prefix="n-logprobs-") as tmp:
        port_file = Path(tmp) / "port"
        log = open(Path(tmp) / "serve.log", "w")  # noqa: SIM115
        cmd = [str(BIN / "radixserve"), "serve", "--port", "0", "--port-file", str(port_file)]
        proc = subprocess.Popen([*cmd, "--log-level", "warning", *extra], stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 600
            while not (port_file.exists() and port_file.read_text()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"radixserve serve did not start:\n{log.name}")
                time.sleep(0.2)
            yield f"127.0.0.1:{port_file.read_text()}"
        finally:
            proc.terminate()
            proc.wait(60)
            log.close()


def one_call(stub, rid: str, prompt: list[int], n: int, max_new: int, logprobs: bool) -> float:
    req = pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(
            temperature=1.0, max_new_tokens=max_new, ignore_eos=True, n=n
        ),
        return_logprob=logprobs,
        logprob_start_len=0 if logprobs else -1,
    )
    t0 = time.perf_counter()
    done = [r for r in stub.Generate(req, timeout=3600) if r.HasField("complete")]
    elapsed = time.perf_counter() - t0
    if len(done) != n or any(len(c.complete.output_ids) != max_new for c in done):
        raise SystemExit(f"{rid}: expected {n} samples of {max_new} tokens")
    if logprobs and any(len(c.complete.input_logprobs.token_ids) != len(prompt) for c in done):
        raise SystemExit(f"{rid}: a sample lacks the prompt's logprobs")
    return elapsed


def measure(address: str, args: argparse.Namespace) -> dict:
    stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(address))
    rng = random.Random(args.seed)

    def prompt() -> list[int]:
        return [rng.randrange(100, 40_000) for _ in range(args.prompt_len)]

    one_call(stub, "warm", prompt()[:64], 2, 4, True)
    out: dict = {}
    for n in args.n:
        times: dict[str, list[float]] = {"plain": [], "logprobs": []}
        for r in range(args.rounds):
            for kind in ("plain", "logprobs"):
                rid = f"n{n}-{kind}-{r}"
                times[kind].append(
                    one_call(stub, rid, prompt(), n, args.max_new_tokens, kind == "logprobs")
                )
        plain, lp = statistics.median(times["plain"]), statistics.median(times["logprobs"])
        out[f"n{n}"] = {"plain_s": round(plain, 2), "logprobs_s": round(lp, 2)}
        out[f"n{n}"]["ratio"] = round(lp / plain, 2)
        ratio = lp / plain
        print(f"n={n:3d}  plain {plain:7.2f} s  with prompt logprobs {lp:7.2f} s  {ratio:.2f}x")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", help="HOST:PORT of a running server (default: start one)")
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--n", type=int, nargs="+", default=[4, 16])
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("serve_args", nargs="*", help="extra flags for radixserve serve")
    args = p.parse_args()
    if args.server:
        result = measure(args.server, args)
    else:
        with started_server(args.serve_args) as address:
            result = measure(address, args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
