"""Sampler tests: greedy, seeded draws against the filtered distribution, seed
independence from the batch, logit processing, logprobs.

Statistical bound: for each (config, token) the empirical frequency of N draws
must lie within Bernstein's bound of the reference probability p:
P(|f - p| >= t) <= 2 exp(-N t^2 / (2 p (1 - p) + 2 t / 3)), solved for t at
delta = 1e-9 per check. With ~100 checks the union bound puts the chance of a
false failure below 1e-7, if the seeded hash behaves like independent
uniforms. The seeds are fixed, so each run is deterministic anyway.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from worker_service.kernels import SamplingFilters, TorchKernels
from worker_service.sampling import filters, processors
from worker_service.sampling.filters import seeded_uniform, splitmix64
from worker_service.sampling.logprobs import logprob_tensors, token_logprobs
from worker_service.sampling.params import LogprobOptions, SamplingParams
from worker_service.sampling.processors import process_logits
from worker_service.sampling.rows import SampleRow
from worker_service.sampling.sampler import Sampler

CPU = torch.device("cpu")
NO_LP = LogprobOptions()


def row(
    spec: SamplingParams, prompt=(), output=(), eos=(), lp: LogprobOptions = NO_LP
) -> SampleRow:
    return SampleRow(spec, lp, prompt, output, tuple(eos))


def reference(logits, spec: SamplingParams, slack: float = 0.0) -> np.ndarray:
    """Filtered, renormalised distribution in float64, written loop-free but independently.

    slack > 0 loosens the top-p and min-p thresholds (a superset of the kept
    set); slack == 0 asserts that no threshold is within 1e-4 of a knife edge.
    """
    x = np.asarray(logits, dtype=np.float64) / spec.temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    sp = p[order]
    k = spec.top_k if 0 < spec.top_k <= len(p) else len(p)
    keep = sp >= sp[k - 1]  # ties with the k-th stay
    if spec.top_p < 1.0:
        before = np.concatenate([[0.0], np.cumsum(sp)[:-1]]) / sp[keep].sum()
        assert slack or np.abs(before[keep] - spec.top_p).min() > 1e-4
        in_p = keep & (before < spec.top_p + slack)
        keep &= sp >= sp[in_p].min()  # so do ties with top-p's last token
    keep &= sp >= (spec.min_p - slack) * sp[0]
    assert slack or spec.min_p == 0 or np.abs(sp / sp[0] - spec.min_p).min() > 1e-4
    keep[0] = True
    q = np.zeros_like(p)
    q[order[keep]] = sp[keep]
    return q / q.sum()


def bernstein_halfwidth(n: int, p: float, delta: float = 1e-9) -> float:
    big_l = math.log(2 / delta)
    a = 2 * big_l / 3
    return (a + math.sqrt(a * a + 8 * n * big_l * p * (1 - p))) / (2 * n)


def test_greedy_is_argmax_with_ties_to_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 2.0, 2.0]])
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(3)]
    assert Sampler(4, CPU).sample(logits, rows).token_ids == [1, 0, 2]
    # top_k == 1 is greedy whatever the temperature; also inside a mixed batch.
    rows = [row(SamplingParams(top_k=1)), row(SamplingParams(seed=3)), row(SamplingParams(top_k=1))]
    out = Sampler(4, CPU).sample(logits, rows)
    assert out.token_ids[0] == 1 and out.token_ids[2] == 2
    big = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(64)]
    assert Sampler(1000, CPU).sample(big, rows).token_ids == big.argmax(-1).tolist()


def test_greedy_fast_path_skips_processing_and_drawing(monkeypatch):
    def boom(*_a, **_k):
        raise AssertionError("fast path should not get here")

    monkeypatch.setattr(processors, "process_logits", boom)
    monkeypatch.setattr(filters, "draw", boom)
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    rows = [row(SamplingParams(temperature=0.0), lp=LogprobOptions(return_logprob=True))] * 8
    out = Sampler(50, CPU).sample(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1).max(-1).values
    torch.testing.assert_close(torch.tensor(out.logprobs), ref)


PROBS = [0.30, 0.20, 0.15, 0.12, 0.08, 0.06, 0.04, 0.03, 0.015, 0.005]
PERM = [3, 7, 0, 9, 5, 1, 8, 2, 6, 4]  # token PERM[r] has the r-th largest probability
LOGITS = np.zeros(10)
LOGITS[PERM] = np.log(PROBS) + 1.7
CONFIGS = {
    "plain": SamplingParams(),
    "temperature_low": SamplingParams(temperature=0.7),
    "temperature_high": SamplingParams(temperature=1.5),
    "top_k": SamplingParams(top_k=3),
    "top_p": SamplingParams(top_p=0.8),
    "min_p": SamplingParams(min_p=0.25),
    "combo": SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.1),
    "combo_hot": SamplingParams(temperature=1.3, top_p=0.6, min_p=0.05),
}
N_DRAWS = 40_000


def check_frequencies(tokens: list[int], expected: np.ndarray) -> None:
    counts = np.bincount(np.asarray(tokens), minlength=len(expected))
    n = len(tokens)
    for tok, p in enumerate(expected):
        if p == 0:
            assert counts[tok] == 0, f"token {tok} is filtered out but was drawn"
        else:
            t = bernstein_halfwidth(n, p)
            assert abs(counts[tok] / n - p) < t, (tok, counts[tok] / n, p, t)


@pytest.mark.slow  # statistical: many draws
@pytest.mark.parametrize("name", list(CONFIGS))
def test_seeded_frequencies_match_filtered_distribution(name):
    spec = CONFIGS[name]
    rows = [row(dataclasses.replace(spec, seed=s)) for s in range(N_DRAWS)]
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(N_DRAWS, -1)
    out = Sampler(10, CPU).sample(logits, rows)
    check_frequencies(out.token_ids, reference(LOGITS, spec))


@pytest.mark.slow  # statistical: many draws
def test_one_seed_over_many_steps_and_unseeded_rows_follow_distribution():
    spec = CONFIGS["combo"]
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(N_DRAWS, -1)
    # One seed, N consecutive output positions (range() is a cheap Sequence).
    rows = [row(dataclasses.replace(spec, seed=99), output=range(i)) for i in range(N_DRAWS)]
    check_frequencies(Sampler(10, CPU).sample(logits, rows).token_ids, reference(LOGITS, spec))
    rows = [row(spec)] * N_DRAWS
    check_frequencies(
        Sampler(10, CPU, seed=5).sample(logits, rows).token_ids, reference(LOGITS, spec)
    )


def test_tokens_outside_the_filtered_set_never_appear():
    gen = torch.Generator().manual_seed(2)
    rng = np.random.default_rng(3)
    rows, logit_rows, allowed = [], [], []
    for _ in range(40):
        logits = (torch.randn(64, generator=gen) * rng.uniform(0.5, 4)).tolist()
        spec = SamplingParams(
            temperature=float(rng.uniform(0.2, 2.0)),
            top_k=int(rng.choice([-1, 1, 2, 5, 20, 100])),
            top_p=float(rng.choice([1.0, 0.95, 0.5, 0.1, 0.0])),
            min_p=float(rng.choice([0.0, 0.05, 0.3, 1.0])),
        )
        ok = reference(logits, spec, slack=1e-4) > 0
        for s in range(300):
            rows.append(row(dataclasses.replace(spec, seed=s)))
            logit_rows.append(logits)
            allowed.append(ok)
    out = Sampler(64, CPU).sample(torch.tensor(logit_rows), rows)
    assert all(ok[t] for ok, t in zip(allowed, out.token_ids, strict=True))


def test_splitmix64_matches_reference_vector():
    # Outputs 1 and 2 of SplitMix64 from state 0 (the reference C implementation).
    assert splitmix64(0, 1) == 0xE220A8397B1DCDAF
    assert splitmix64(0, 2) == 0x6E789E6AA1B965F4
    us = [seeded_uniform(s, k) for s in (-5, 0, 1, 2**70) for k in range(50)]
    assert all(0.0 <= u < 1.0 and float(np.float32(u)) == u for u in us)


def test_same_seed_same_token_whatever_the_batch():
    gen = torch.Generator().manual_seed(4)
    target_logits = torch.randn(1000, generator=gen) * 0.3
    target = row(SamplingParams(temperature=0.9, top_p=0.95, seed=1234), output=[5] * 7)
    others = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(seed=1234), output=[1, 2]),
        row(SamplingParams(top_k=50, frequency_penalty=0.5), output=[3, 3]),
        row(SamplingParams()),
    ]
    other_logits = torch.randn(len(others), 1000, generator=gen)
    tokens = []
    for pos, sampler_seed in [(0, 1), (2, 2), (4, 3)]:
        torch.manual_seed(sampler_seed)  # the global RNG must not matter either
        rows = others[:pos] + [target] + others[pos:]
        logits = torch.cat([other_logits[:pos], target_logits[None], other_logits[pos:]])
        tokens.append(Sampler(1000, CPU, seed=sampler_seed).sample(logits, rows).token_ids[pos])
    tokens.append(Sampler(1000, CPU).sample(target_logits[None], [target]).token_ids[0])
    assert len(set(tokens)) == 1

    flat = target_logits[None].expand(200, -1)
    by_seed = [row(SamplingParams(seed=s), output=[5] * 7) for s in range(200)]
    by_step = [row(SamplingParams(seed=1234), output=[5] * k) for k in range(200)]
    assert len(set(Sampler(1000, CPU).sample(flat, by_seed).token_ids)) > 120
    assert len(set(Sampler(1000, CPU).sample(flat, by_step).token_ids)) > 120


def processed(values, spec: SamplingParams, **kw) -> list[float]:
    return process_logits(torch.tensor([values]), [row(spec, **kw)])[0].tolist()


def test_logit_bias_adds_and_ignores_out_of_range_ids():
    spec = SamplingParams(logit_bias=((0, 5.0), (3, -1.5), (99, 1.0), (0, 1.0)))
    assert processed([1.0, 2.0, 3.0, 4.0], spec) == [7.0, 2.0, 3.0, 2.5]


def test_repetition_penalty_over_prompt_and_output():
    spec = SamplingParams(repetition_penalty=2.0)
    got = processed([2.0, -1.0, -2.0, 3.0, 0.5], spec, prompt=(0,), output=(2, 2))
    assert got == [1.0, -1.0, -4.0, 3.0, 0.5]


def test_frequency_and_presence_count_output_only():
    spec = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = processed([0.0] * 5, spec, prompt=(4, 4), output=(1, 1, 3))
    assert got == [0.0, -1.25, 0.0, -0.75, 0.0]


def test_processing_order_bias_then_repetition_then_frequency():
    spec = SamplingParams(logit_bias=((0, 2.0),), repetition_penalty=2.0, frequency_penalty=1.0)
    # token 0: (-1 + 2) / 2 = 0.5, no output occurrence; token 1: 4 / 2 - 1 = 1.
    assert processed([-1.0, 4.0], spec, prompt=(0,), output=(1,)) == [0.5, 1.0]


def test_min_new_tokens_masks_eos_and_stop_ids_until_reached():
    spec = SamplingParams(min_new_tokens=3, stop_token_ids=(2,), ignore_eos=True)
    got = processed([1.0] * 6, spec, output=(0, 1), eos=(5, 77))
    assert got == [1.0, 1.0, -math.inf, 1.0, 1.0, -math.inf]
    logits = torch.ones(1, 6)
    assert process_logits(logits, [row(spec, output=(0, 1, 0), eos=(5,))]) is logits


def test_processing_is_per_row_and_leaves_input_alone():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 30, generator=gen)
    before = logits.clone()
    rows = [
        row(SamplingParams(repetition_penalty=1.3), prompt=(1, 2), output=(3,)),
        row(SamplingParams()),
        row(SamplingParams(presence_penalty=0.7, logit_bias=((4, 1.0),)), output=(9, 9)),
        row(SamplingParams(min_new_tokens=1), eos=(0,)),
    ]
    batch = process_logits(logits, rows)
    torch.testing.assert_close(logits, before, rtol=0, atol=0)
    for i, r in enumerate(rows):
        torch.testing.assert_close(batch[i], process_logits(logits[i : i + 1], [r])[0])
    torch.testing.assert_close(batch[1], logits[1], rtol=0, atol=0)


def test_logprobs_come_from_raw_logits():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 40, generator=gen) * 2
    lp_spec = LogprobOptions(return_logprob=True, top_logprobs_num=4, token_ids_logprob=(0, 5, 39))
    rows = [
        row(
            SamplingParams(temperature=0.5, repetition_penalty=1.5, seed=1),
            (1, 2),
            (3,),
            lp=lp_spec,
        ),
        row(SamplingParams(temperature=0.0, logit_bias=((7, 50.0),))),
        row(SamplingParams(top_k=3, seed=2), lp=LogprobOptions(top_logprobs_num=2)),
    ]
    out = Sampler(40, CPU).sample(logits, rows)
    ref = torch.log_softmax(logits, dim=-1)
    assert out.token_ids[1] == 7
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)
    vals, ids = ref.topk(4, dim=-1)
    assert out.top_ids == [ids[0].tolist(), [], ids[2, :2].tolist()]
    assert out.top_logprobs[0] == pytest.approx(vals[0].tolist(), abs=1e-5)
    assert out.top_logprobs[0] == sorted(out.top_logprobs[0], reverse=True)
    assert out.ids_logprobs[0] == pytest.approx(ref[0, [0, 5, 39]].tolist(), abs=1e-5)
    assert out.ids_logprobs[1:] == [[], []]


def test_token_logprobs_for_prompts():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(10, 25, generator=gen)
    ref = torch.log_softmax(logits, dim=-1)
    ids = torch.randint(0, 25, (10,), generator=gen)
    res = token_logprobs(logits, ids, top_n=3, token_ids=(0, 4, 25), chunk_rows=3)
    assert res.logprobs == pytest.approx(ref.gather(1, ids[:, None])[:, 0].tolist(), abs=1e-6)
    vals, top = ref.topk(3, dim=-1)
    assert res.top_ids == top.tolist()
    assert np.allclose(res.top_logprobs, vals.tolist(), atol=1e-6)
    assert np.allclose(np.asarray(res.ids_logprobs)[:, :2], ref[:, [0, 4]].numpy(), atol=1e-6)
    assert all(math.isnan(r[2]) for r in res.ids_logprobs)  # 25 is outside the vocabulary
    bare = token_logprobs(logits, ids)
    assert bare.top_ids == [[]] * 10 and bare.ids_logprobs == [[]] * 10
    # The tensor form takes per-row id lists padded with -1.
    two = logprob_tensors(logits, torch.tensor([[0, 4, -1]] * 10)).logprobs
    torch.testing.assert_close(two[:, :2], ref[:, [0, 4]])
    assert torch.isnan(two[:, 2]).all()


def test_padded_vocab_columns_are_ignored():
    logits = torch.cat([torch.zeros(2, 8), torch.full((2, 2), 100.0)], dim=1)
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(seed=1))]
    out = Sampler(8, CPU).sample(logits, rows)
    assert all(t < 8 for t in out.token_ids)
    assert out.logprobs == pytest.approx([-math.log(8)] * 2, abs=1e-6)


def test_draw_walks_token_ids_in_order():
    """The draw's order is part of the seeded contract (the CPU's sort-based filters
    and FlashInfer's threshold kernels must pick the same token for one u): with
    probabilities (0.1, 0.5, 0.4), u = 0.05 lands on token 0 (in a sorted order it
    would be token 1), u = 0.55 on token 1, u = 0.65 on token 2."""
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.4]])).expand(3, -1)
    host = filters.filter_arrays([-1] * 3, [1.0] * 3, [0.0] * 3, 3)
    flt = filters.sampling_filters(host, [torch.from_numpy(a) for a in host], 3)
    u = torch.tensor([0.05, 0.55, 0.65])
    tokens = filters.draw(logits, torch.ones(3), flt, u, kernels=TorchKernels())
    assert tokens.tolist() == [0, 1, 2]


def test_filters_are_thresholds_that_keep_ties():
    """Tokens tied with the k-th stay (as in FlashInfer's radix top-k), and so do
    those tied with top-p's last token."""
    probs = torch.tensor([[0.3, 0.2, 0.2, 0.2, 0.1]])
    top_k = SamplingFilters(torch.tensor([2]), torch.ones(1), torch.zeros(1), True, False, False)
    top_p = SamplingFilters(
        torch.tensor([5]), torch.tensor([0.4]), torch.zeros(1), False, True, False
    )
    for flt in (top_k, top_p):
        kept = TorchKernels().filter_probs(probs, flt)
        assert (kept > 0).tolist() == [[True, True, True, True, False]]


def test_out_of_range_filter_parameters_are_clipped():
    """top_k <= 0 or past the vocabulary: no limit; top_p and min_p into [0, 1], so
    that a row always keeps its most probable token."""
    k, p, m = host = filters.filter_arrays(
        [0, -1, 3, 10], [1.5, -0.2, 0.5, 1.0], [2.0, 0.0, 0.1, 0.0], 10
    )
    assert k.tolist() == [10, 10, 3, 10] and p.tolist() == [1.0, 0.0, 0.5, 1.0]
    assert m.tolist() == [1.0, 0.0, pytest.approx(0.1), 0.0]
    flt = filters.sampling_filters(host, [torch.from_numpy(a) for a in host], 10)
    assert flt.use_top_k and flt.use_top_p and flt.use_min_p
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    tokens = filters.draw(
        logits, torch.ones(4), flt, torch.full((4,), 0.999), kernels=TorchKernels()
    )
    assert tokens[:2].tolist() == logits[:2].argmax(-1).tolist()
