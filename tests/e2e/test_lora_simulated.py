"""Multi-LoRA through the public API, on the simulated model (each adapter a
different simulated model: its requests hash their context from the
adapter's name), with real gRPC processes: load, list, generate with mixed
adapters over fewer slots than adapters, unload rules, refusals, preloading
at start, and a SIGKILLed worker whose group gets the adapters back before
the requests resume with identical outputs.

The worker reads only adapter_config.json for the simulated model; the real
model's adapters are checked against transformers + PEFT elsewhere
(tests/e2e/test_lora_real.py, tests/worker_service/test_lora_*.py)."""

from __future__ import annotations

import asyncio
import signal
import urllib.request

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common.simulated_model import expected_output
from tests.e2e.support.sim_server import VOCAB, simulated_server
from tests.e2e.support.simulated_lora import adapter_dir, ask, load, tokens_of
from tests.e2e.support.streams import run_streams, wait_for_progress
from tests.e2e.support.system import BIN, free_port, process, stub, worker_on_port


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_load_generate_mixed_adapters_and_unload(tmp_path):
    args = ("--max-loras-per-batch", "2", "--max-loaded-loras", "4", "--max-lora-rank", "16")
    with simulated_server(tmp_path, num_pages=256, step_ms=2, scheduler_args=args) as address:
        s = stub(address)
        assert not s.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest()).loaded_adapters
        names = ["a", "b", "c"]
        for i, name in enumerate(names):
            reply = load(s, name, adapter_dir(tmp_path, name), pinned=(name == "a"))
            assert reply.success and sorted(reply.loaded_lora_ids) == names[: i + 1]
        listed = s.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest()).loaded_adapters
        assert [(a.lora_id, a.lora_name, a.pinned) for a in listed] == [
            ("a", "name-a", True),
            ("b", "name-b", False),
            ("c", "name-c", False),
        ]
        assert listed[1].lora_path == str(tmp_path / "b")

        # 3 adapters + base over 2 slots (one pinned): all run, each its own model.
        prompt = list(range(100, 140))
        reqs = [
            ask(f"mix-{i}-{a or 'base'}", prompt + [i], 24, a)
            for i in range(4)
            for a in ["", *names]
        ]
        results = asyncio.run(run_streams(address, reqs))
        for req, (tokens, reason) in zip(reqs, results, strict=True):
            assert reason == "length", reason
            want = expected_output(req.tokenized.input_ids, 24, VOCAB, adapter=req.lora_id or None)
            assert tokens == want, req.request_id
        assert len({tuple(t) for t, _ in results[:4]}) == 4  # the same prompt, 4 models

        # Refusals.
        assert code_of(lambda: load(s, "b", tmp_path / "b"))[0] == grpc.StatusCode.ALREADY_EXISTS
        code, text = code_of(lambda: load(s, "big", adapter_dir(tmp_path, "big", r=32)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "32" in text, text
        code, text = code_of(lambda: load(s, "gone", tmp_path / "nowhere"))
        assert code == grpc.StatusCode.NOT_FOUND, (code, text)
        code, text = code_of(lambda: load(s, "", tmp_path / "a"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "lora_id is required" in text
        code, text = code_of(lambda: load(s, "bad id", tmp_path / "a"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert load(s, "d", adapter_dir(tmp_path, "d")).success
        code, text = code_of(lambda: load(s, "e", adapter_dir(tmp_path, "e")))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-loaded-loras" in text
        ids = s.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest()).loaded_adapters
        assert [a.lora_id for a in ids] == ["a", "b", "c", "d"]  # nothing half-loaded

        # Unload: refused while a request of the adapter runs, then done.
        async def unload_while_running() -> tuple:
            async with grpc.aio.insecure_channel(address) as ch:
                from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

                a = pb_grpc.SglangSchedulerStub(ch)
                call = a.Generate(ask("long-b", prompt, 400, "b"))
                first = await call.read()  # it is running
                assert first.HasField("chunk")
                try:
                    await a.UnloadLoRAAdapter(
                        pb.UnloadLoRAAdapterRequest(lora_name="name-b", lora_id="b")
                    )
                    refused = None
                except grpc.aio.AioRpcError as e:
                    refused = (e.code(), e.details())
                call.cancel()
                return refused

        refused = asyncio.run(unload_while_running())
        assert refused is not None and refused[0] == grpc.StatusCode.FAILED_PRECONDITION
        assert "used by 1" in refused[1]
        for _ in range(100):  # the cancelled request leaves
            try:
                r = s.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="name-b"))
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert r.success and list(r.loaded_lora_ids) == ["a", "c", "d"]
        code, _ = code_of(lambda: s.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="b")))
        assert code == grpc.StatusCode.NOT_FOUND
        code, text = code_of(lambda: list(s.Generate(ask("after", prompt, 4, "b"), timeout=30)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "no loaded LoRA adapter" in text
        # The slot b held serves others (c, d with one unpinned slot).
        got = list(s.Generate(ask("d-after", prompt, 6, "d"), timeout=30))
        assert tokens_of(got) == expected_output(prompt, 6, VOCAB, adapter="d")


def test_preloaded_adapters_metrics_and_bad_preload(tmp_path):
    a = adapter_dir(tmp_path, "pre")
    metrics_port = free_port()
    args = ("--lora-paths", f"pre={a}", "--metrics-port", str(metrics_port))
    with simulated_server(tmp_path, scheduler_args=args) as address:
        s = stub(address)
        listed = s.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest()).loaded_adapters
        assert [(x.lora_id, x.lora_name, x.lora_path) for x in listed] == [("pre", "pre", str(a))]
        got = list(s.Generate(ask("p", [5, 6, 7], 5, "pre"), timeout=30))
        assert tokens_of(got) == expected_output([5, 6, 7], 5, VOCAB, adapter="pre")
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        assert 'radixserve_lora_requests_total{lora_id="pre"} 1.0' in text
        assert 'radixserve_lora_generation_tokens_total{lora_id="pre"} 5.0' in text
    # An adapter that does not load stops the start with the reason.
    worker = ["--model", "simulated", "--log-level", "warning"]
    with process(tmp_path, "worker-bad", [str(BIN / "radixserve-worker"), *worker]) as wport:
        sched = [str(BIN / "radixserve-scheduler"), "--worker", f"grpc://127.0.0.1:{wport}"]
        sched += ["--lora-paths", f"x={tmp_path / 'missing'}", "--port", "0"]
        import subprocess

        done = subprocess.run(sched, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0
        assert "--lora-paths x=" in done.stdout + done.stderr


@pytest.mark.slow
def test_sigkilled_worker_gets_its_adapters_back_and_outputs_are_identical(tmp_path):
    port = free_port()
    worker_args = ["--model", "simulated", "--simulated-step-ms", "20", "--log-level", "warning"]
    sched = [str(BIN / "radixserve-scheduler"), "--worker", f"grpc://127.0.0.1:{port}"]
    sched += ["--log-level", "info", "--max-loras-per-batch", "2"]
    names = ["x", "y", "z"]
    prompts = [[7, 8, 9, i] for i in range(12)]
    reqs = [ask(f"k{i}", p, 40 + i, names[i % 3] if i % 4 else "") for i, p in enumerate(prompts)]
    holder: dict = {}
    with worker_on_port(tmp_path, port, worker_args, "worker") as proc:
        holder["proc"] = proc
        with process(tmp_path, "scheduler", sched) as sport:
            address = f"127.0.0.1:{sport}"
            s = stub(address)
            for n in names:
                assert load(s, n, adapter_dir(tmp_path, n)).success

            async def kill_and_restart(progress: list[int]) -> None:
                await wait_for_progress(progress, 6, tokens=5)
                holder["proc"].send_signal(signal.SIGKILL)
                holder["proc"].wait()
                await asyncio.sleep(0.3)
                holder["restart"] = worker_on_port(tmp_path, port, worker_args, "worker2")
                await asyncio.to_thread(holder["restart"].__enter__)

            try:
                results = asyncio.run(run_streams(address, reqs, kill_and_restart))
            finally:
                if "restart" in holder:
                    holder["restart"].__exit__(None, None, None)
    for req, (tokens, reason) in zip(reqs, results, strict=True):
        assert reason == "length", reason
        want = expected_output(
            req.tokenized.input_ids,
            req.sampling_params.max_new_tokens,
            VOCAB,
            adapter=req.lora_id or None,
        )
        assert tokens == want, req.request_id
    log = (tmp_path / "scheduler.log").read_text()
    assert "worker group lost" in log and "worker group back" in log
