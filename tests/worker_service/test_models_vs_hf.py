"""Our models against Hugging Face transformers on the same weights (fp32, CPU).

Tiny random models of each supported architecture: greedy tokens identical
for 32+ steps and chosen-token logprobs within 1e-4, in mixed batches
(requests at different positions, prefill and decode in one step), page sizes
1 and 16, prompts split into chunks, and prefixes read from pages that
earlier requests wrote.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.hf_reference import hf_greedy
from tests.worker_service.support.plan_driver import DriverRequest, PlanDriver
from tests.worker_service.support.tiny_hf_models import ARCHITECTURES, VOCAB, tiny_model
from tests.worker_service.support.worker_factory import runner_for
from worker_service.execution import prompt_scores
from worker_service.sampling.params import LogprobOptions

STEPS = 34


def workload(seed: int) -> list[DriverRequest]:
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    shared = rand(40)
    return [
        DriverRequest(shared + rand(7), STEPS, arrive=0),
        DriverRequest(rand(23), STEPS, arrive=1),
        DriverRequest(shared + rand(12), STEPS, arrive=4, share_from=0),  # cached prefix
        DriverRequest(rand(61), STEPS, arrive=6),  # long: several chunks
        DriverRequest(rand(3), STEPS, arrive=9),
    ]


@pytest.mark.slow  # 20 models against transformers
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize(("page_size", "chunk"), [(1, 9), (16, 32)])
def test_greedy_tokens_and_logprobs_match_hf(arch, page_size, chunk, tmp_path):
    hf = tiny_model(arch, tmp_path)
    runner = runner_for(tmp_path, page_size=page_size, num_pages=4096 // page_size)
    reqs = PlanDriver(runner, page_size, chunk=chunk).run(workload(seed=page_size))
    for r in reqs:
        tokens, logprobs = hf_greedy(hf, r.prompt, STEPS)
        assert r.outputs == tokens, f"request {r.slot}"
        assert max(abs(a - b) for a, b in zip(r.logprob_values, logprobs, strict=True)) < 1e-4


def test_prompt_logprobs_and_top_logprobs_match_hf(tmp_path):
    hf = tiny_model("llama3-rope-scaling", tmp_path)
    runner = runner_for(tmp_path, page_size=4, num_pages=256)
    lp = LogprobOptions(return_logprob=True, logprob_start_len=5, top_logprobs_num=3)
    prompt = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    (req,) = PlanDriver(runner, 4, chunk=8).run([DriverRequest(prompt, 4, logprobs=lp)])
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    assert sorted(req.prompt_logprobs) == list(range(5, 30))
    for pos, value in req.prompt_logprobs.items():
        assert abs(value - ref[pos - 1, prompt[pos]].item()) < 1e-4
    first_top = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert req.top[0] == first_top.topk(3).indices.tolist()


def test_prompt_logprobs_go_through_the_lm_head_a_few_rows_at_a_time(tmp_path, monkeypatch):
    # A long prompt's float32 logits (rows x vocabulary) must never exist at once.
    monkeypatch.setattr(prompt_scores, "PROMPT_LOGIT_ROWS", 3)
    hf = tiny_model("llama3-rope-scaling", tmp_path)
    runner = runner_for(tmp_path, page_size=4, num_pages=256)
    model = runner.compute.model
    sizes: list[int] = []
    logits = model.logits

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        sizes.append(hidden.shape[0])
        return logits(hidden)

    monkeypatch.setattr(model, "logits", spy)
    lp = LogprobOptions(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    prompt = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    (req,) = PlanDriver(runner, 4, chunk=None).run([DriverRequest(prompt, 2, logprobs=lp)])
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    assert sorted(req.prompt_logprobs) == list(range(30))
    for pos, value in req.prompt_logprobs.items():
        if pos:
            assert abs(value - ref[pos - 1, prompt[pos]].item()) < 1e-4
    assert max(sizes) <= 3 and sum(s for s in sizes if s == 3) >= 27
