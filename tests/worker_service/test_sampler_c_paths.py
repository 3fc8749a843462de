"""The sampler's C paths on the CPU (kernels/c_sources/cpu_ops.c) against the
torch ops they replace: the chosen token's logprobs (token_logprobs) and the
draw of rows that only scale by a temperature (temperature_draw), on every
edge (masked, infinite and NaN logits, u at 0 and 1, padded vocabularies)."""

from __future__ import annotations

import math

import pytest
import torch

from worker_service.kernels import TorchKernels
from worker_service.sampling import filters
from worker_service.sampling.logprobs import logprob_tensors
from worker_service.sampling.params import LogprobOptions, SamplingParams
from worker_service.sampling.rows import SampleRow
from worker_service.sampling.sampler import Sampler

CPU = torch.device("cpu")


def row(spec: SamplingParams) -> SampleRow:
    return SampleRow(spec, LogprobOptions(), (), (), ())


def test_c_logprobs_equal_torch_s_on_every_edge(monkeypatch):
    """The CPU's one-pass C logprobs (cpu_ops.c's token_logprobs) against the
    torch ops they replace: the same NaN and infinity rules, values within a
    few float32 ulp, on a strided slice of a wider (padded) logits tensor."""
    from worker_service.sampling import logprobs

    if logprobs.cpu_ops() is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(7, 49160, generator=gen) * 6
    logits = wide[:, :49152]
    logits[1, :100] = float("-inf")  # masked tokens (a grammar)
    logits[2] = float("-inf")  # everything masked
    logits[3, 7] = float("inf")
    logits[4, 9] = float("nan")
    logits[5] = 0.0  # a flat row: log(1 / V)
    ids = torch.tensor([[3, -1, 49152]] + [[5, 50, 0]] * 6)
    got = logprob_tensors(logits, ids, top_n=4)
    monkeypatch.setattr(logprobs, "cpu_ops", lambda: None)
    want = logprob_tensors(logits, ids, top_n=4)
    for a, b in ((got.logprobs, want.logprobs), (got.top_logprobs, want.top_logprobs)):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
        finite = a.isfinite()
        assert torch.allclose(a[finite], b[finite], rtol=1e-6, atol=1e-5)
    assert torch.equal(got.top_ids, want.top_ids)
    assert got.logprobs[5, 0].item() == pytest.approx(-math.log(49152), abs=1e-5)
    assert math.isnan(got.logprobs[0, 1]) and math.isnan(got.logprobs[0, 2])


def test_c_draw_is_filters_draw_within_rounding(monkeypatch):
    """The CPU's C draw for rows without filters (cpu_ops.c temperature_draw)
    against filters.draw: the same token for every u except where u * total
    lies within rounding of a cumulative boundary; masked (-inf) tokens never
    drawn, u = 0 the first token with mass, u just below 1 the last; a row
    with a NaN or +inf refused (None), and the sampler then takes the torch
    draw, whose rules hold for it."""
    from worker_service.sampling import logprobs

    ops = logprobs.cpu_ops()
    if ops is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(6, 49160, generator=gen) * 3
    logits = wide[:, :49152]  # strided rows of a padded vocabulary
    logits[1, :1000] = float("-inf")
    logits[1, 2000:] = float("-inf")  # mass only on [1000, 2000)
    logits[2, 40000:] = float("-inf")
    temps = torch.tensor([1.0, 0.7, 1.3, 0.05, 2.0, 1.0])
    rows = torch.arange(6)
    mismatches = 0
    for trial in range(40):
        u = torch.rand(6, generator=gen)
        if trial == 0:
            u[:] = 0.0
        if trial == 1:
            u[:] = 1.0 - 2.0**-24
        got = ops.temperature_draw(logits, rows, temps, u)
        none = filters.sampling_filters(
            filters.filter_arrays([0] * 6, [1.0] * 6, [0.0] * 6, 49152),
            [torch.full((6,), 49152), torch.ones(6), torch.zeros(6)],
            49152,
        )
        assert not none.any
        want = filters.draw(logits.contiguous(), temps, none, u, kernels=TorchKernels())
        assert got is not None and got.dtype == torch.long
        assert 1000 <= got[1] < 2000 and got[2] < 40000
        for r in range(6):
            if got[r] == want[r]:
                continue
            # only a knife edge: the torch path's cumulative mass at the tokens
            # in between is within float rounding of u * total
            probs = torch.softmax(logits[r] / temps[r], -1).double().cumsum(-1)
            target = u[r].double() * probs[-1]
            lo, hi = sorted((int(got[r]), int(want[r])))
            assert torch.all((probs[lo:hi] - target).abs() <= 1e-6), (trial, r)
            mismatches += 1
    assert mismatches <= 2
    first = ops.temperature_draw(logits, rows, temps, torch.zeros(6))
    assert first[1] == 1000 + int(torch.nonzero(logits[1, 1000:2000] > -1e30)[0])
    last = ops.temperature_draw(logits, rows[1:2], temps[1:2], torch.tensor([1.0 - 2.0**-24]))
    assert last[0] == 1999
    # u * total reaching the total (u = 1 here) stops at the last token with mass
    assert ops.temperature_draw(logits, rows[1:2], temps[1:2], torch.ones(1))[0] == 1999
    # selected rows, in the order asked
    picked = ops.temperature_draw(logits, torch.tensor([4, 1]), temps[[4, 1]], torch.zeros(2))
    assert picked[1] == first[1]
    bad = logits.clone()
    bad[3, 7] = float("nan")
    assert ops.temperature_draw(bad, rows, temps, torch.zeros(6)) is None
    bad[3, 7] = float("inf")
    assert ops.temperature_draw(bad, rows, temps, torch.zeros(6)) is None


def test_sampler_draws_the_same_tokens_with_and_without_the_c_draw(monkeypatch):
    """Seeded rows at a temperature (no filter) through the whole sampler, C
    draw against the torch draw: the same tokens (one knife edge allowed);
    a row with a top-p or a NaN logit takes the torch path."""
    from worker_service.sampling import logprobs

    if logprobs.cpu_ops() is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(8, 4000, generator=gen) * 4
    specs = [SamplingParams(temperature=0.5 + 0.2 * i, seed=100 + i) for i in range(7)]
    specs.append(SamplingParams(temperature=0.0))
    rows = [row(s) for s in specs]
    got = Sampler(4000, CPU).sample(logits, rows)
    calls = []

    def refuse(self, *args):
        calls.append(args)
        return None  # as for a NaN row: the sampler takes torch's draw

    monkeypatch.setattr(type(logprobs.cpu_ops()), "temperature_draw", refuse)
    want = Sampler(4000, CPU).sample(logits, rows)
    assert calls
    same = sum(a == b for a, b in zip(got.token_ids, want.token_ids, strict=True))
    assert same >= 7 and got.token_ids[7] == int(logits[7].argmax())
    assert got.logprobs == pytest.approx(want.logprobs)
