"""``ModelCompute.launch`` queues a step without reading anything back from
the device: prompt logprobs stay device tensors in the ModelStep and reach
the host in ``finish``, after the step's one wait. On CPU a read-back is a
``.tolist()`` / ``.item()``; on a GPU each would be a stream synchronisation
inside launch, and overlap would be lost for every prompt-logprob step."""

from __future__ import annotations

import pytest
import torch

from tests.worker_service.support.plan_driver import DriverRequest, PlanDriver
from tests.worker_service.support.tiny_hf_models import VOCAB, tiny_model
from tests.worker_service.support.worker_factory import runner_for
from worker_service.execution.model_step import ModelStep
from worker_service.sampling.params import LogprobOptions
from worker_service.sampling.rows import PromptLogprobs


def test_prompt_logprobs_stay_on_the_device_until_finish(tmp_path, monkeypatch):
    hf = tiny_model("llama3-rope-scaling", tmp_path)
    runner = runner_for(tmp_path, page_size=4, num_pages=256, overlap="on")
    compute = runner.compute
    read_back: list[str] = []
    in_launch = False

    def spy(name: str):
        real = getattr(torch.Tensor, name)

        def wrapped(self, *args, **kwargs):
            if in_launch:
                read_back.append(name)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)

    for name in ("tolist", "item", "__float__", "__int__", "numpy"):
        spy(name)
    steps: list[ModelStep] = []
    launch = compute.launch

    def launch_spy(*args, **kwargs) -> ModelStep:
        nonlocal in_launch
        in_launch = True
        try:
            step = launch(*args, **kwargs)
        finally:
            in_launch = False
        steps.append(step)
        return step

    monkeypatch.setattr(compute, "launch", launch_spy)
    finished: list[PromptLogprobs] = []
    finish = compute.finish

    def finish_spy(step: ModelStep):
        out = finish(step)
        finished.extend(out.prompt_logprobs)
        return out

    monkeypatch.setattr(compute, "finish", finish_spy)
    lp = LogprobOptions(
        return_logprob=True, logprob_start_len=0, top_logprobs_num=3, token_ids_logprob=(1, 7)
    )
    prompt = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    (req,) = PlanDriver(runner, 4, chunk=8).run([DriverRequest(prompt, 3, logprobs=lp)])
    scored = [p for s in steps for p in s.prompt_logprobs]
    assert len(scored) == 4  # one per chunk of the prompt
    assert read_back == []
    assert all(isinstance(t, torch.Tensor) for p in scored for t in p.tensors())
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    assert sorted(req.prompt_logprobs) == list(range(30))
    for pos, value in req.prompt_logprobs.items():
        if pos:
            assert value == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
    # The top-3 and the requested ids' logprobs of every scored position, in order.
    scored_positions = [
        pos for p in finished for pos in range(max(p.start, 1), p.start + len(p.logprobs))
    ]
    assert scored_positions == list(range(1, 30))
    top_ids = [i for p in finished for i in p.top_ids]
    assert top_ids == [i for pos in scored_positions for i in ref[pos - 1].topk(3).indices.tolist()]
    ids_lps = [x for p in finished for x in p.ids_logprobs]
    want = [ref[pos - 1, i].item() for pos in scored_positions for i in (1, 7)]
    assert ids_lps == pytest.approx(want, abs=1e-4)


def test_the_readback_is_queued_in_launch_not_finish(tmp_path, monkeypatch):
    """With overlap, step N+1 is queued before step N is finished: copies of
    N's results queued in ``finish`` would sit behind N+1's kernels on the
    stream, and waiting for them would wait for N+1 too."""
    import worker_service.execution.model_compute as model_compute

    tiny_model("llama3-rope-scaling", tmp_path)
    runner = runner_for(tmp_path, page_size=4, num_pages=256, overlap="on")
    compute = runner.compute
    where: list[str] = []
    phase = "runner"
    real_copy = model_compute.HostCopy

    class RecordingCopy(real_copy):
        def __init__(self, tensors):
            where.append(phase)
            super().__init__(tensors)

    monkeypatch.setattr(model_compute, "HostCopy", RecordingCopy)
    launch, finish = compute.launch, compute.finish

    def in_phase(name, fn):
        def wrapped(*args, **kwargs):
            nonlocal phase
            phase = name
            try:
                return fn(*args, **kwargs)
            finally:
                phase = "runner"

        return wrapped

    monkeypatch.setattr(compute, "launch", in_phase("launch", launch))
    monkeypatch.setattr(compute, "finish", in_phase("finish", finish))
    lp = LogprobOptions(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(9)).tolist()
    requests = [DriverRequest(prompt, 5, logprobs=lp), DriverRequest(prompt[:7], 6)]
    done = PlanDriver(runner, 4, chunk=8).run(requests)
    assert [len(r.outputs) for r in done] == [5, 6]
    assert where and set(where) == {"launch"}
