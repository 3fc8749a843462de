"""A sliding-window model served from two KV pools (the worker side of
docs/design.md's sliding-window memory): a tiny Mistral with a window of 8
tokens, its sliding pool small enough that the pages a request's window left
behind are written by other requests soon after, driven by plans that free
them (swa_plan_driver.py) with a cached prefix whose early sliding entries
are the null page, chunked prefill, page sizes 1 and 16. Greedy tokens and
logprobs are those of the same model on one pool (nothing freed), and of
transformers; through the torch backend (the CPU kernel and SDPA) and
through FlashInfer's real wrappers (CPU harness, bf16), eager and replaying
decode graphs whose padding writes the sliding pool's scratch page. And a
tiny Qwen2 whose layers alternate sliding and full attention: two layer
groups (GroupedAttention), each reading its own pool and table."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.support.hf_reference import hf_greedy
from tests.worker_service.support import flashinfer_cpu_harness as harness
from tests.worker_service.support.plan_driver import DriverRequest
from tests.worker_service.support.scheduler_plans import serve_with_scheduler
from tests.worker_service.support.swa_plan_driver import SwaPlanDriver
from tests.worker_service.support.tiny_hf_models import SLIDING_WINDOW, VOCAB, tiny_model
from tests.worker_service.support.worker_factory import worker_for
from worker_service.worker import Worker

STEPS = 34
W = SLIDING_WINDOW


def workload(seed: int) -> list[DriverRequest]:
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    shared = rand(40)
    # hf_greedy's generate takes token 0 for padding: a seed whose prompts hold
    # none (those of the tests against transformers do).
    return [
        DriverRequest(shared + rand(7), STEPS, arrive=0),
        DriverRequest(rand(23), STEPS, arrive=1),
        DriverRequest(shared + rand(12), STEPS, arrive=6, share_from=0),  # cached prefix
        DriverRequest(rand(61), STEPS, arrive=6),  # long: several chunks
        DriverRequest(rand(3), STEPS, arrive=9),
        DriverRequest(rand(30), STEPS, arrive=30),  # after others freed their windows
    ]


def serve(worker: Worker, page_size: int, chunk: int, seed: int) -> tuple[list, SwaPlanDriver]:
    runner = worker.runner
    pages = worker.num_swa_pages or None
    driver = SwaPlanDriver(runner, page_size, window=W, swa_pages=pages, chunk=chunk)
    reqs = driver.run(workload(seed))
    return [(r.outputs, r.logprob_values) for r in reqs], driver


# Full pages, and the sliding pool's share of them: a few requests' windows
# and chunks, so freed pages are reused.
POOLS = {1: (4096, 0.025), 16: (256, 0.08)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("swa") / "mistral"
    return path, tiny_model("mistral-sliding", path)


def two_pools(path, page_size: int, **overrides) -> Worker:
    pages, ratio = POOLS[page_size]
    worker = worker_for(
        path, page_size=page_size, num_pages=pages, swa_full_tokens_ratio=ratio, **overrides
    )
    assert worker.num_swa_pages == int(pages * ratio) and worker.swa_window == W
    return worker


def one_pool(path, page_size: int, **overrides) -> Worker:
    worker = worker_for(path, page_size=page_size, num_pages=POOLS[page_size][0], **overrides)
    assert worker.num_swa_pages == 0  # swa_memory off in overrides, or the baseline
    return worker


def check_sliding_pool_was_reused(driver: SwaPlanDriver) -> None:
    assert driver.reused > 0, "no sliding page was written by a second request"
    assert driver.null_entries > 0, "no plan carried the null page"


@pytest.mark.slow  # transformers' reference
@pytest.mark.parametrize(("page_size", "chunk"), [(1, 9), (16, 32)])
def test_two_pools_give_one_pools_and_transformers_tokens(checkpoint, page_size, chunk) -> None:
    path, hf = checkpoint
    two, driver = serve(two_pools(path, page_size), page_size, chunk, seed=page_size)
    check_sliding_pool_was_reused(driver)
    one, _ = serve(one_pool(path, page_size, swa_memory=False), page_size, chunk, seed=page_size)
    assert two == one
    for (tokens, logprobs), r in zip(two, workload(page_size), strict=True):
        ref_tokens, ref_logprobs = hf_greedy(hf, r.prompt, STEPS)
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < 1e-4


FLASHINFER = dict(device="cpu", dtype="bfloat16", attention_backend="flashinfer", kernels="torch")


@pytest.mark.usefixtures("fi_cpu")
@pytest.mark.parametrize(("page_size", "chunk"), [(1, 9), (16, 32)])
def test_flashinfer_reads_the_sliding_table(checkpoint, page_size, chunk) -> None:
    pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    path, _ = checkpoint
    two, driver = serve(two_pools(path, page_size, **FLASHINFER), page_size, chunk, seed=3)
    check_sliding_pool_was_reused(driver)
    one, _ = serve(
        one_pool(path, page_size, swa_memory=False, **FLASHINFER), page_size, chunk, seed=3
    )
    assert two == one


@pytest.mark.usefixtures("fi_cpu")
def test_decode_graphs_pad_into_the_sliding_pools_scratch_page(checkpoint, monkeypatch) -> None:
    """What build_worker does on CUDA: graphs captured with the compute's scratch
    page, the sliding pool's last (the pool a sliding-only model's backend reads)."""
    pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    path, _ = checkpoint
    eager, _ = serve(two_pools(path, 16, **FLASHINFER), 16, 32, seed=5)
    harness.install_model_graph_stand_ins(monkeypatch)
    worker = two_pools(path, 16, **FLASHINFER)
    compute = worker.runner.compute
    assert compute.scratch_page == worker.num_swa_pages
    compute.attn.enable_decode_graphs(compute.scratch_page, 16, sizes=(4, 8))
    compute.capture_decode_graphs()
    replays: Counter[str] = Counter()
    real_replay = compute.graphs.replay

    def counted(batch, inputs):
        out = real_replay(batch, inputs)
        replays["hit" if out is not None else "miss"] += 1
        return out

    monkeypatch.setattr(compute.graphs, "replay", counted)
    graphed, _ = serve(worker, 16, 32, seed=5)
    assert replays["hit"] > 10
    assert graphed == eager


@pytest.fixture
def alternating(tmp_path):
    """The tiny alternating Qwen2 (its config.json lists layer_types)."""
    return tmp_path, tiny_model("qwen2-alternating", tmp_path)


@pytest.mark.slow  # transformers' reference
@pytest.mark.parametrize(("page_size", "chunk"), [(1, 9), (16, 32)])
def test_layer_groups_each_read_their_own_pool(alternating, page_size, chunk) -> None:
    path, hf = alternating
    worker = two_pools(path, page_size)
    kv = worker.runner.compute.kv
    assert kv.swa_layers == {0, 2} and worker.runner.compute.groups == ("full", "sliding")
    assert [t.shape[0] for t in kv.layers] == [worker.num_swa_pages + 1, worker.num_pages + 1] * 2
    two, driver = serve(worker, page_size, chunk, seed=8)
    check_sliding_pool_was_reused(driver)
    one, _ = serve(one_pool(path, page_size, swa_memory=False), page_size, chunk, seed=8)
    assert two == one
    for (tokens, logprobs), r in zip(two, workload(8), strict=True):
        ref_tokens, ref_logprobs = hf_greedy(hf, r.prompt, STEPS)
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < 1e-4


@pytest.mark.slow  # transformers' reference
@pytest.mark.parametrize(("page_size", "chunk"), [(1, 9), (16, 32)])
def test_the_real_schedulers_plans_give_one_pools_tokens(checkpoint, page_size, chunk) -> None:
    """The scheduler frees sliding pages behind the window, reuses them, and
    serves the shared prefix from its radix cache (null entries where its
    sliding pages were freed)."""
    path, hf = checkpoint
    arrivals = [(r.arrive, r.prompt) for r in workload(page_size)]
    kw = {"new_tokens": STEPS, "chunk": chunk}
    two, stats = serve_with_scheduler(two_pools(path, page_size).runner, arrivals, **kw)
    assert stats.reused > 0 and stats.null_entries > 0, stats
    one, _ = serve_with_scheduler(
        one_pool(path, page_size, swa_memory=False).runner, arrivals, **kw
    )
    assert two == one
    for (tokens, logprobs), (_, prompt) in zip(two, arrivals, strict=True):
        ref_tokens, ref_logprobs = hf_greedy(hf, prompt, STEPS)
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < 1e-4
