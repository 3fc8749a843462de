"""A/B of one benchmark program between two checkouts (a program, not a test).

Runs the same benchmark program from this checkout (B) and from another
(A: say a worktree of the previous commit), alternating A, B, A, B, ... so
that both see the same noise of a shared machine, then reports for every
number in the program's last line (a JSON object) the median over the runs
of each side and the ratio B / A.

    git worktree add /tmp/base HEAD~1
    python benchmarks/ab_compare.py --base /tmp/base --rounds 5 -- \\
        benchmarks/scheduler_core.py --quick

Each side runs with its own checkout first on PYTHONPATH, so the program and
everything it starts (services launched through this environment's console
scripts included) import that checkout's code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def run_once(root: Path, program: list[str]) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(root / program[0]), *program[1:]],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{root}: {' '.join(program)} failed:\n{proc.stdout}\n{proc.stderr}")
    last = proc.stdout.strip().splitlines()[-1]
    return json.loads(last)


def numbers(result: dict, prefix: str = "") -> dict[str, float]:
    """Every number of a (nested) result, by dotted key."""
    out: dict[str, float] = {}
    for key, value in result.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[prefix + key] = float(value)
        elif isinstance(value, dict):
            out |= numbers(value, f"{prefix}{key}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    out |= numbers(item, f"{prefix}{key}[{i}].")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, required=True, help="checkout A (the baseline)")
    p.add_argument("--rounds", type=int, default=5, help="runs of each side, alternating")
    p.add_argument("program", nargs=argparse.REMAINDER, help="-- program.py [its flags]")
    args = p.parse_args()
    program = [a for a in args.program if a != "--"] if args.program[:1] == ["--"] else args.program
    if not program:
        p.error("name the benchmark program after --")
    sides = {"A": args.base.resolve(), "B": HERE}
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            runs[side].append(numbers(run_once(sides[side], program)))
            print(f"round {r + 1} {side} done", file=sys.stderr, flush=True)
    keys = [k for k in runs["A"][0] if all(k in x for x in runs["A"] + runs["B"])]
    report = {}
    print(f"{'figure':40} {'A (base) median':>15} {'B (this) median':>15} {'B/A':>6}  ranges")
    for k in keys:
        a_runs = [x[k] for x in runs["A"]]
        b_runs = [x[k] for x in runs["B"]]
        a, b = statistics.median(a_runs), statistics.median(b_runs)
        ratio = b / a if a else float("nan")
        report[k] = {"a": a, "b": b, "ratio": round(ratio, 4), "a_runs": a_runs, "b_runs": b_runs}
        spread = f"A {min(a_runs):.4g}..{max(a_runs):.4g}  B {min(b_runs):.4g}..{max(b_runs):.4g}"
        print(f"{k:40} {a:15.4f} {b:15.4f} {ratio:6.3f}  {spread}")
    print(json.dumps({"base": str(sides["A"]), "rounds": args.rounds, "figures": report}))


if __name__ == "__main__":
    main()
