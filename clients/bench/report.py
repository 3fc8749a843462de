"""The report: a text table, a JSON document, and PNG plots."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from clients.bench.metrics import throughput_over_time
from clients.bench.records import RequestRecord

# (label, key path into a summary, format)
ROWS: list[tuple[str, tuple[str, ...], str]] = [
    ("completed requests", ("completed",), "{:.0f}"),
    ("failed requests", ("failed",), "{:.0f}"),
    ("duration (s)", ("duration_s",), "{:.2f}"),
    ("request throughput (req/s)", ("request_throughput",), "{:.3f}"),
    ("input tokens/s", ("input_tokens_per_s",), "{:.1f}"),
    ("output tokens/s", ("output_tokens_per_s",), "{:.1f}"),
    ("total tokens/s", ("total_tokens_per_s",), "{:.1f}"),
    ("prefill tokens computed", ("prefill_tokens",), "{:.0f}"),
    ("cache hit rate", ("cache_hit_rate",), "{:.3f}"),
    ("mean concurrency", ("mean_concurrency",), "{:.1f}"),
    ("drafted tokens (speculative)", ("spec_draft_tokens",), "{:.0f}"),
    ("accepted drafted tokens", ("spec_accepted_tokens",), "{:.0f}"),
    ("draft acceptance rate", ("spec_acceptance_rate",), "{:.3f}"),
]
for _name, _key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
    for _stat in ("mean", "p50", "p90", "p99"):
        ROWS.append((f"{_name} {_stat} (ms)", (_key, _stat), "{:.1f}"))

# Ratios quoted against the baseline: higher is better for throughputs,
# lower for latencies; the ratio is always radixserve / baseline.
RATIOS = {
    "output_tokens_per_s": ("output_tokens_per_s",),
    "request_throughput": ("request_throughput",),
    "ttft_p50": ("ttft_ms", "p50"),
    "tpot_p50": ("tpot_ms", "p50"),
    "e2e_p50": ("e2e_ms", "p50"),
}


def _get(summary: Mapping, path: tuple[str, ...]) -> float:
    value = summary
    for key in path:
        value = value[key]
    return float(value)


def ratios(ours: Mapping, baseline: Mapping) -> dict[str, float]:
    out = {}
    for name, path in RATIOS.items():
        b = _get(baseline, path)
        out[name] = _get(ours, path) / b if b else math.nan
    return out


def table(summaries: Mapping[str, Mapping], ratio: Mapping[str, float] | None = None) -> str:
    """Rows of figures, one column per run (the first is radixserve); with a
    baseline, a last column of radixserve / baseline."""
    names = list(summaries)
    header = ["figure", *names] + (["ratio"] if ratio is not None and len(names) == 2 else [])
    lines = [header]
    for label, path, fmt in ROWS:
        cells = [label]
        values = [_get(summaries[n], path) for n in names]
        cells += ["-" if math.isnan(v) else fmt.format(v) for v in values]
        if len(header) > len(names) + 1:
            a, b = values
            cells.append(f"{a / b:.2f}x" if b and not math.isnan(a / b) else "-")
        lines.append(cells)
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]

    def fmt_row(row: list[str]) -> str:
        cells = zip(row, widths, strict=True)
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(cells))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt_row(lines[0]), rule, *map(fmt_row, lines[1:])])


def save_plots(
    runs: Mapping[str, tuple[Sequence[RequestRecord], float]], directory: str | Path
) -> list[Path]:
    """latency_cdf.png (TTFT, ITL, end-to-end) and throughput.png (output
    tokens/s over the run), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        ("TTFT", lambda r: [r.ttft_s]),
        ("inter-token latency", lambda r: r.itls_s()),
        ("end-to-end latency", lambda r: [r.e2e_s]),
    ]
    for ax, (title, values) in zip(axes, panels, strict=True):
        for name, (records, _) in runs.items():
            xs = sorted(v * 1e3 for r in records if r.ok for v in values(r))
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=name)
        ylabel = "fraction of requests" if title != "inter-token latency" else "fraction"
        _label(ax, title, "ms", ylabel)
        ax.set_xscale("log")
    cdf = _save(plt, fig, directory / "latency_cdf.png")

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name, (records, duration) in runs.items():
        xs, ys = throughput_over_time(records, duration)
        ax.plot(xs, ys, label=name)
    _label(ax, "output tokens/s over the run", "seconds since the run began", "tokens/s")
    tput = _save(plt, fig, directory / "throughput.png")
    return [cdf, tput]


def _label(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
