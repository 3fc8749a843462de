"""Write the Grafana dashboard helm/radixserve/dashboards/radixserve.json.

The JSON is generated (deterministically) from the panel list below; edit
this file and run ``python scripts/make_dashboard.py``. ``--check`` exits 1
when the checked-in JSON differs (tests/test_dashboard.py checks the same).
Metric names: docs/observability.md. Every query uses only the variables
``${datasource}`` and ``$__rate_interval``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "helm/radixserve/dashboards/radixserve.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
R = "[$__rate_interval]"


def rate(metric: str) -> str:
    return f"rate({metric}{R})"


def quantile(q: float, histogram: str, by: str = "le") -> str:
    return f"histogram_quantile({q}, sum by ({by}) ({rate(histogram + '_bucket')}))"


def percentiles(histogram: str, by: str = "le", legend: str = "") -> list[tuple[str, str]]:
    return [(quantile(q, histogram, by), f"p{round(q * 100)}{legend}") for q in (0.5, 0.9, 0.99)]


def mean(histogram: str) -> str:
    return f"sum({rate(histogram + '_sum')}) / sum({rate(histogram + '_count')})"


# Instances of either service (to pick their process_* series out of the rest).
RADIXSERVE = "on (job, instance) (radixserve_requests_running or radixserve_worker_requests_active)"

ABORTS = rate('radixserve_requests_total{finish_reason="abort"}')

# (title, kind, unit, [(expr, legend)]); kind: stat, timeseries or row.
PANELS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    ("Overview", "row", "", []),
    ("Requests running", "stat", "short", [("sum(radixserve_requests_running)", "running")]),
    ("Requests waiting", "stat", "short", [("sum(radixserve_requests_waiting)", "waiting")]),
    (
        "Output tokens/s",
        "stat",
        "short",
        [(f"sum({rate('radixserve_generation_tokens_total')})", "tokens/s")],
    ),
    (
        "KV pages used",
        "stat",
        "percentunit",
        [("sum(radixserve_kv_pages_used) / sum(radixserve_kv_pages_total)", "used")],
    ),
    (
        "Cache hit ratio (since start)",
        "stat",
        "percentunit",
        [("radixserve_cache_hit_ratio", "{{instance}}")],
    ),
    (
        "Workers connected",
        "stat",
        "short",
        [("sum(radixserve_worker_connected)", "connected")],
    ),
    ("Throughput", "row", "", []),
    (
        "Tokens/s",
        "timeseries",
        "short",
        [
            (f"sum({rate('radixserve_generation_tokens_total')})", "output"),
            (f"sum({rate('radixserve_prompt_tokens_total')})", "prompt"),
        ],
    ),
    (
        "Finished requests/s",
        "timeseries",
        "reqps",
        [
            (f"sum({rate('radixserve_requests_total')})", "all"),
            (
                f"sum by (finish_reason) ({rate('radixserve_requests_total')})",
                "{{finish_reason}}",
            ),
        ],
    ),
    ("Latency", "row", "", []),
    (
        "Time to first token",
        "timeseries",
        "s",
        percentiles("radixserve_time_to_first_token_seconds"),
    ),
    (
        "Inter-token latency",
        "timeseries",
        "s",
        percentiles("radixserve_inter_token_latency_seconds"),
    ),
    (
        "End-to-end request latency",
        "timeseries",
        "s",
        percentiles("radixserve_e2e_request_latency_seconds"),
    ),
    ("Queue time", "timeseries", "s", percentiles("radixserve_queue_time_seconds")),
    ("Queue and KV cache", "row", "", []),
    (
        "Requests",
        "timeseries",
        "short",
        [
            ("sum(radixserve_requests_running)", "running"),
            ("sum(radixserve_requests_waiting)", "waiting"),
        ],
    ),
    (
        "KV pages used",
        "timeseries",
        "percentunit",
        [("radixserve_kv_pages_used / radixserve_kv_pages_total", "{{instance}}")],
    ),
    (
        "Prefix cache hit rate",
        "timeseries",
        "percentunit",
        [
            (
                f"sum({rate('radixserve_cached_tokens_total')})"
                f" / sum({rate('radixserve_prompt_tokens_total')})",
                "over the interval",
            ),
            ("radixserve_cache_hit_ratio", "since start {{instance}}"),
        ],
    ),
    (
        "Speculative decoding: drafts accepted",
        "timeseries",
        "percentunit",
        [
            (
                f"sum({rate('radixserve_spec_accepted_tokens_total')})"
                f" / sum({rate('radixserve_spec_draft_tokens_total')})",
                "accepted / drafted",
            ),
            (
                f"sum({rate('radixserve_spec_accepted_tokens_total')})"
                f" / sum({rate('radixserve_generation_tokens_total')})",
                "share of output tokens from drafts",
            ),
        ],
    ),
    ("Worker", "row", "", []),
    (
        "Batch size (requests per step)",
        "timeseries",
        "short",
        [
            (mean("radixserve_worker_batch_size_requests"), "mean"),
            (quantile(0.9, "radixserve_worker_batch_size_requests"), "p90"),
        ],
    ),
    (
        "Batch size (tokens per step)",
        "timeseries",
        "short",
        [
            (mean("radixserve_worker_batch_size_tokens"), "mean"),
            (quantile(0.9, "radixserve_worker_batch_size_tokens"), "p90"),
        ],
    ),
    (
        "Step time by mode",
        "timeseries",
        "s",
        percentiles("radixserve_worker_step_duration_seconds", "le, mode", " {{mode}}"),
    ),
    (
        "Worker busy fraction",
        "timeseries",
        "percentunit",
        [
            (
                f"{rate('radixserve_worker_busy_seconds_total')}"
                f" / ({rate('radixserve_worker_busy_seconds_total')}"
                f" + {rate('radixserve_worker_idle_seconds_total')})",
                "{{instance}}",
            )
        ],
    ),
    (
        "Worker connections",
        "timeseries",
        "short",
        [
            ("radixserve_worker_connected", "scheduler {{instance}} to {{worker}}"),
            ("radixserve_worker_scheduler_connected", "worker {{instance}} from a scheduler"),
        ],
    ),
    # The host KV tier (hierarchical cache, issue 34): what moves between
    # the device pool and the worker's host pool, how long it takes, and how
    # full the host pool is (the worker's series only while the tier is on).
    ("Host KV tier", "row", "", []),
    (
        "Host tier tokens/s",
        "timeseries",
        "short",
        [
            (f"sum({rate('radixserve_hicache_loaded_tokens_total')})", "loaded (host to device)"),
            (f"sum({rate('radixserve_hicache_written_tokens_total')})", "written (device to host)"),
        ],
    ),
    (
        "Host tier bytes/s",
        "timeseries",
        "Bps",
        [
            (f"sum({rate('radixserve_worker_hicache_loaded_bytes_total')})", "loaded"),
            (f"sum({rate('radixserve_worker_hicache_written_bytes_total')})", "written"),
        ],
    ),
    (
        "Host tier transfer time",
        "timeseries",
        "s",
        [
            *percentiles("radixserve_worker_hicache_transfer_duration_seconds"),
            (mean("radixserve_worker_hicache_transfer_duration_seconds"), "mean"),
        ],
    ),
    (
        "Host pages used",
        "timeseries",
        "short",
        [
            ("sum(radixserve_hicache_host_pages_used)", "used"),
            ("sum(radixserve_hicache_host_pages_total)", "in the pool"),
        ],
    ),
    ("Errors", "row", "", []),
    (
        "Request errors/s by code",
        "timeseries",
        "reqps",
        [(f"sum by (code) ({rate('radixserve_request_errors_total')})", "{{code}}")],
    ),
    (
        "Aborts, retractions and preemptions/s",
        "timeseries",
        "short",
        [
            (f"sum({ABORTS})", "aborts"),
            (f"sum({rate('radixserve_retractions_total')})", "retractions"),
            (f"sum({rate('radixserve_preemptions_total')})", "preemptions"),
        ],
    ),
    ("Processes", "row", "", []),
    (
        "Resident memory",
        "timeseries",
        "bytes",
        [(f"process_resident_memory_bytes and {RADIXSERVE}", "{{job}} {{instance}}")],
    ),
    (
        "CPU",
        "timeseries",
        "percentunit",
        [(f"{rate('process_cpu_seconds_total')} and {RADIXSERVE}", "{{job}} {{instance}}")],
    ),
]


def panel(pid: int, title: str, kind: str, unit: str, targets, grid: dict) -> dict:
    if kind == "row":
        return {
            "collapsed": False,
            "datasource": DS,
            "gridPos": grid,
            "id": pid,
            "panels": [],
            "title": title,
            "type": "row",
        }
    if kind == "stat":
        options = {
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "auto",
        }
    else:
        options = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        }
    return {
        "datasource": DS,
        "fieldConfig": {"defaults": {"min": 0, "unit": unit}, "overrides": []},
        "gridPos": grid,
        "id": pid,
        "options": options,
        "targets": [
            {
                "datasource": DS,
                "expr": expr,
                "legendFormat": legend,
                "range": True,
                "refId": chr(ord("A") + i),
            }
            for i, (expr, legend) in enumerate(targets)
        ],
        "title": title,
        "type": kind,
    }


def layout() -> list[dict]:
    """Rows full width; stats 4 wide and 4 high; time series 12 wide, two a line."""
    panels, x, y, line_h = [], 0, 0, 0
    for pid, (title, kind, unit, targets) in enumerate(PANELS, start=1):
        w, h = {"row": (24, 1), "stat": (4, 4), "timeseries": (12, 8)}[kind]
        if x + w > 24 or kind == "row":
            x, y, line_h = 0, y + line_h, 0
        panels.append(panel(pid, title, kind, unit, targets, {"h": h, "w": w, "x": x, "y": y}))
        x, line_h = x + w, max(line_h, h)
        if kind == "row":
            x, y, line_h = 0, y + h, 0
    return panels


def dashboard() -> dict:
    return {
        "annotations": {"list": []},
        "editable": True,
        "graphTooltip": 1,
        "panels": layout(),
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["radixserve"],
        "templating": {
            "list": [
                {
                    "current": {},
                    "hide": 0,
                    "includeAll": False,
                    "label": "Data source",
                    "multi": False,
                    "name": "datasource",
                    "options": [],
                    "query": "prometheus",
                    "refresh": 1,
                    "regex": "",
                    "type": "datasource",
                }
            ]
        },
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "radixserve",
        "uid": "radixserve",
        "version": 1,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python scripts/make_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
