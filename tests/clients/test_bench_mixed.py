"""--dataset mixed's figures from known records: the streams' gaps during a
long prompt's prefill (its send to its first token) and outside it, TTFT,
TPOT and tokens/s; and its flags' checks."""

from __future__ import annotations

import math

import pytest

from clients.bench.flags import build_parser, check_args
from clients.bench.mixed import mixed_figures
from clients.bench.records import RequestRecord


def record(start: float, times: list[float], error: str | None = None) -> RequestRecord:
    r = RequestRecord(0, 10, start, token_times=list(times))
    r.error = error
    return r


def test_gaps_overlapping_a_prefill_count_as_during_it():
    # One stream: tokens every 0.1 s, but one 1 s stall from 1.0 to 2.0.
    times = [0.1 * i for i in range(11)] + [2.0 + 0.1 * i for i in range(10)]
    stream = record(0.0, times)
    # A long prompt sent at 1.05, first token at 1.95.
    long = record(1.05, [1.95, 2.05])
    f = mixed_figures([stream], [long], duration_s=3.0)
    assert f["itl_during_prefill_p50_ms"] == pytest.approx(1000.0)
    assert f["itl_outside_prefill_p50_ms"] == pytest.approx(100.0)
    assert f["long_ttft_p50_ms"] == pytest.approx(900.0)
    assert f["stream_tpot_median_ms"] == pytest.approx((2.9 - 0.0) / 20 * 1000)
    assert f["output_tok_s"] == pytest.approx((21 + 2) / 3.0)
    assert (f["streams_completed"], f["long_prompts_completed"], f["errors"]) == (1, 1, 0)


def test_failed_requests_are_counted_not_measured():
    f = mixed_figures([record(0.0, [], "UNAVAILABLE: x")], [record(1.0, [], "boom")], 2.0)
    assert f["errors"] == 2 and f["streams_completed"] == 0
    assert math.isnan(f["stream_itl_p99_ms"]) and math.isnan(f["long_ttft_p50_ms"])


@pytest.mark.parametrize(
    "flags",
    [
        ["--mixed-streams", "0"],
        ["--mixed-long-rate", "0"],
        ["--mixed-duration", "-1"],
        ["--save-trace", "x.jsonl"],
    ],
)
def test_bad_mixed_flags_are_refused(flags):
    p = build_parser()
    args = p.parse_args(["--dataset", "mixed", *flags])
    with pytest.raises(SystemExit):
        check_args(p, args)
