"""What serving a GGUF file quantized costs in accuracy (a program, not a
test): the mean negative log-likelihood of real prose (the Python language
reference's text every CPython ships, tests/support/prose.py) on the default
model, three ways on the same text: radixserve with the blocks kept
(quantized kernels), radixserve's float path (--dequantize), and llama.cpp's
``llama-perplexity`` on the same GGUF file. Scoring as llama-perplexity
does: chunks of 512 tokens, each scoring its second half given the first.

Prints each mean NLL (nats), the relative differences, and a JSON line.

    python benchmarks/gguf_accuracy.py --chunks 6
    python benchmarks/gguf_accuracy.py --chunks 6 --no-llama-cpp

llama.cpp comes from ``../shared/peers/llama_cpp.sh install`` (outside the
project); ``--llama-cpp-bin`` names its folder otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.prose import CHUNK, mean_nll, prose_text  # noqa: E402
from tests.worker_service.support.quantized_models import (  # noqa: E402
    default_source,
    default_tokenizer,
    load_default,
)

LLAMA_CPP_SCRIPT = ROOT.parent / "shared" / "peers" / "llama_cpp.sh"
PPL_LINE = re.compile(r"Final estimate: PPL = ([0-9.]+)")


def llama_cpp_bin(given: str | None) -> Path:
    if given:
        return Path(given)
    out = subprocess.run(
        ["bash", str(LLAMA_CPP_SCRIPT), "bin"], capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip())


def llama_perplexity(bindir: Path, gguf: Path, text: Path, chunks: int, threads: int) -> dict:
    """llama-perplexity's final estimate on ``text``: its mean NLL is ln(PPL)."""
    cmd = [str(bindir / "llama-perplexity"), "-m", str(gguf), "-f", str(text)]
    cmd += ["-c", str(CHUNK), "-b", str(CHUNK), "--chunks", str(chunks), "-t", str(threads)]
    env = {**os.environ, "LD_LIBRARY_PATH": str(bindir)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    log = done.stdout + done.stderr
    match = PPL_LINE.search(log)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"llama-perplexity failed ({done.returncode}):\n{log[-3000:]}")
    tokens = re.search(r"tokenizing the input \.\.\.\s*\n.*?(\d+) tokens", log, re.S)
    ppl = float(match.group(1))
    return {
        "ppl": ppl,
        "nll": math.log(ppl),
        "log_tail": log[-400:],
        "tokens": tokens and tokens.group(1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=6, help="chunks of 512 tokens scored")
    p.add_argument("--chars", type=int, default=60_000, help="prose characters taken")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--llama-cpp-bin", help="llama.cpp's bin folder (default: the peer script's)")
    args = p.parse_args()
    text = prose_text(args.chars)
    ids = default_tokenizer()(text)["input_ids"]
    if len(ids) < args.chunks * CHUNK:
        raise SystemExit(f"{len(ids)} tokens fill fewer than {args.chunks} chunks: raise --chars")
    ids = ids[: args.chunks * CHUNK]
    report: dict = {"chunks": args.chunks, "tokens": len(ids), "scored": args.chunks * 255}
    report["quantized"] = mean_nll(load_default(quantized=True), ids)
    report["float"] = mean_nll(load_default(quantized=False), ids)
    print(f"radixserve quantized (Q4_1 blocks, Q8_0 head): mean NLL {report['quantized']:.5f}")
    print(f"radixserve float (--dequantize):              mean NLL {report['float']:.5f}")
    quant_vs_float = report["quantized"] / report["float"] - 1
    print(f"quantized vs float: {100 * quant_vs_float:+.3f}%")
    report["quantized_vs_float"] = quant_vs_float
    if not args.no_llama_cpp:
        with tempfile.TemporaryDirectory() as tmp:
            # The same text llama.cpp tokenizes itself: the tokens scored are
            # llama.cpp's, the first chunks' worth of the same prose.
            path = Path(tmp) / "prose.txt"
            path.write_text(text)
            peer = llama_perplexity(
                llama_cpp_bin(args.llama_cpp_bin),
                default_source().path,
                path,
                args.chunks,
                args.threads,
            )
        report["llama_cpp"] = peer["nll"]
        report["llama_cpp_ppl"] = peer["ppl"]
        vs = report["quantized"] / peer["nll"] - 1
        report["quantized_vs_llama_cpp"] = vs
        print(f"llama.cpp llama-perplexity (same GGUF):       mean NLL {peer['nll']:.5f}")
        print(f"radixserve quantized vs llama.cpp: {100 * vs:+.3f}%")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
