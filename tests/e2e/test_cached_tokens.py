"""cached_tokens end to end: what a request read from the prefix cache, once,
the same number in the response, the metrics and the hit rate. A retracted
request re-prefills from what it computed itself (no hit), and after a worker
loss the cache is gone and everything is computed again."""

from __future__ import annotations

import asyncio
import signal

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.e2e.support.metrics import scrape
from tests.e2e.support.sim_server import simulated_server
from tests.e2e.support.streams import wait_for_progress
from tests.e2e.support.system import BIN, free_port, greedy, process, wait_until, worker_on_port


def _request(rid: str, ids: list[int], max_new: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=greedy(max_new, ignore_eos=True),
        stream=True,
    )


async def _streams(address: str, reqs: list[pb.GenerateRequest], on_progress=None) -> list:
    """Each stream's final GenerateComplete."""
    progress = [0] * len(reqs)

    async def one(s, i: int, req: pb.GenerateRequest) -> pb.GenerateComplete:
        async for r in s.Generate(req, timeout=120):
            progress[i] += len(r.chunk.token_ids)
            if r.HasField("complete"):
                return r.complete
        raise AssertionError(f"{req.request_id}: no complete")

    async with grpc.aio.insecure_channel(address) as ch:
        s = pb_grpc.SglangSchedulerStub(ch)
        tasks = [asyncio.create_task(one(s, i, r)) for i, r in enumerate(reqs)]
        if on_progress is not None:
            await on_progress(progress)
        return await asyncio.gather(*tasks)


def _counted(port: int) -> tuple[float, float, float]:
    m = scrape(port)
    return (
        m["radixserve_cached_tokens_total"],
        m["radixserve_prompt_tokens_total"],
        m["radixserve_cache_hit_ratio"],
    )


def test_a_retracted_request_reports_no_cached_tokens(tmp_path):
    # 16 pages of 4 tokens; six 6-token prompts with 20 tokens each to come:
    # admission counts running requests at a fraction of what they still
    # need (0.3 x 0.7), so more start than the pool can finish together and
    # some are retracted; they re-prefill their prompt and output from the
    # cache they filled themselves
    port = free_port()
    args = ("--metrics-port", str(port), "--schedule-conservativeness", "0.3")
    with simulated_server(
        tmp_path, num_pages=16, page_size=4, step_ms=1.0, scheduler_args=args
    ) as address:
        reqs = [_request(f"r{i}", [100 * (i + 1) + j for j in range(6)], 20) for i in range(6)]
        done = asyncio.run(_streams(address, reqs))
        assert [c.completion_tokens for c in done] == [20] * 6
        assert scrape(port)["radixserve_retractions_total"] >= 1, "the load must retract"
        assert [c.cached_tokens for c in done] == [0] * 6
        wait_until(lambda: _counted(port)[1] == 36, what="prompt tokens counted")
        assert _counted(port) == (0, 36, 0)


def test_after_a_worker_loss_recomputed_tokens_are_not_cached_tokens(tmp_path):
    wport, mport = free_port(), free_port()
    worker = ["--model", "simulated", "--simulated-step-ms", "5", "--page-size", "4"]
    worker += ["--log-level", "warning"]
    sched = [str(BIN / "radixserve-scheduler"), "--worker", f"grpc://127.0.0.1:{wport}"]
    sched += ["--log-level", "warning", "--metrics-port", str(mport)]
    prompt = list(range(1, 33))
    with (
        worker_on_port(tmp_path, wport, worker, "worker") as proc,
        process(tmp_path, "scheduler", sched) as sport,
    ):
        address = f"127.0.0.1:{sport}"
        (warm,) = asyncio.run(_streams(address, [_request("warm", prompt, 1)]))
        assert warm.cached_tokens == 0
        restarted = []

        async def kill_and_restart(progress: list[int]) -> None:
            await wait_for_progress(progress, 1, tokens=3)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            restarted.append(worker_on_port(tmp_path, wport, worker, "worker2"))
            await asyncio.to_thread(restarted[0].__enter__)

        try:
            (done,) = asyncio.run(
                _streams(address, [_request("reader", [*prompt, 40, 41], 150)], kill_and_restart)
            )
            assert done.completion_tokens == 150
            # it read 32 cached tokens, then lost them with the worker and
            # computed all of its prompt again
            assert done.cached_tokens == 0
            wait_until(lambda: _counted(mport)[1] == 32 + 34, what="prompt tokens counted")
            assert _counted(mport) == (0, 66, 0)
            # a third request reads the prompt the second one computed again
            (third,) = asyncio.run(_streams(address, [_request("third", [*prompt, 7], 2)]))
            assert third.cached_tokens == 32
            wait_until(lambda: _counted(mport)[0] == 32, what="cached tokens counted")
            _, prompts, ratio = _counted(mport)
            assert prompts == 66 + 33
            assert abs(ratio - 32 / (66 + 33)) < 1e-3
        finally:
            if restarted:
                restarted[0].__exit__(None, None, None)
