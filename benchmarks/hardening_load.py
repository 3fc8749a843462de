"""The hardening round's background load and its latency probe.

GatewayLoad: a few client threads sending greedy chat completions through
the SMG gateway (streamed and not, in turn), one after another, for as long
as it runs; every answer is kept with its phase and checked against the
answer the same prompt got before any disturbance (greedy: it must be the
same text). Probe: a plain greedy Generate straight to the scheduler, timed.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 12 times 7?",
    "Give one tip for sleeping well.",
    "Who wrote Hamlet?",
    "What do bees make?",
)


@dataclass
class Answer:
    phase: str
    prompt: int
    streamed: bool
    t0: float  # monotonic
    t1: float
    text: str | None  # None: it failed
    error: str = ""


def chat(base: str, model: str, prompt: str, max_tokens: int, stream: bool) -> str:
    """One chat completion through the gateway; its text (raises on any error)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
    }
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        if not stream:
            out = json.loads(resp.read())
            if "error" in out:
                raise RuntimeError(f"error body: {out['error']}")
            return out["choices"][0]["message"]["content"]
        text, finished = [], False
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            for choice in event.get("choices") or []:
                text.append(choice.get("delta", {}).get("content") or "")
                finished = finished or bool(choice.get("finish_reason"))
        if not finished:
            raise RuntimeError("the stream ended without a finish_reason")
        return "".join(text)


def describe(e: Exception) -> str:
    if isinstance(e, urllib.error.HTTPError):
        try:
            body = e.read().decode(errors="replace")[:160]
        except OSError:
            body = ""
        return f"HTTP {e.code}: {body}"
    return f"{type(e).__name__}: {str(e)[:160]}"


class GatewayLoad:
    def __init__(self, base: str, model: str, streams: int = 3, max_tokens: int = 16) -> None:
        self.base, self.model = base, model
        self.streams, self.max_tokens = streams, max_tokens
        self.reference: dict[int, str] = {}
        self.phase = "start"
        self._answers: list[Answer] = []
        self._lock = threading.Lock()
        self._go = threading.Event()  # set: send; clear: pause
        self._stop = threading.Event()
        self._busy = [False] * streams
        self._threads: list[threading.Thread] = []

    def record_reference(self) -> None:
        """Each prompt's answer, undisturbed (and the streamed one must agree)."""
        for i, prompt in enumerate(PROMPTS):
            whole = chat(self.base, self.model, prompt, self.max_tokens, stream=False)
            streamed = chat(self.base, self.model, prompt, self.max_tokens, stream=True)
            if whole != streamed or not whole.strip():
                raise RuntimeError(f"prompt {i}: streamed {streamed!r} != whole {whole!r}")
            self.reference[i] = whole

    def start(self) -> None:
        self._go.set()
        for k in range(self.streams):
            t = threading.Thread(target=self._client, args=(k,), daemon=True, name=f"load-{k}")
            t.start()
            self._threads.append(t)

    def pause(self, timeout_s: float = 600) -> None:
        """Stop sending and wait for the requests in flight."""
        self._go.clear()
        deadline = time.monotonic() + timeout_s
        while any(self._busy) and time.monotonic() < deadline:
            time.sleep(0.05)

    def resume(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        for t in self._threads:
            t.join(310)

    def _client(self, k: int) -> None:
        n = 0
        while not self._stop.is_set():
            self._go.wait()
            if self._stop.is_set():
                return
            if not self._go.is_set():
                continue
            self._busy[k] = True
            i, streamed = (k * 3 + n) % len(PROMPTS), (n + k) % 2 == 0
            phase, t0 = self.phase, time.monotonic()
            try:
                text, error = chat(self.base, self.model, PROMPTS[i], self.max_tokens, streamed), ""
            except Exception as e:  # every failure is a finding, kept as it is
                text, error = None, describe(e)
            with self._lock:
                self._answers.append(Answer(phase, i, streamed, t0, time.monotonic(), text, error))
            self._busy[k] = False
            n += 1

    def take(self) -> list[Answer]:
        with self._lock:
            out, self._answers = self._answers, []
        return out

    def judge(self, answers: list[Answer], excused: tuple[float, float] | None = None) -> dict:
        """Counts; an error in a request that overlapped ``excused`` (a
        window in which failures are the design's answer) is counted apart."""
        out = {"answers": len(answers), "ok": 0, "different": 0, "errors": 0, "excused": 0}
        samples: list[str] = []
        for a in answers:
            if a.text is None:
                inside = excused is not None and a.t0 <= excused[1] and a.t1 >= excused[0]
                out["excused" if inside else "errors"] += 1
                if not inside and len(samples) < 3:
                    samples.append(a.error)
            elif a.text != self.reference[a.prompt]:
                out["different"] += 1
                if len(samples) < 3:
                    samples.append(f"prompt {a.prompt}: {a.text!r} != {self.reference[a.prompt]!r}")
            else:
                out["ok"] += 1
        out["samples"] = samples
        return out


class Probe:
    """A plain greedy request, timed; its tokens must always be the same."""

    PROMPT = list(range(1000, 1040))

    def __init__(self, address: str, max_new: int = 8) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)
        self.max_new = max_new
        self.expected: list[int] | None = None
        self._n = 0

    def once(self, timeout_s: float = 300) -> tuple[float, list[int]]:
        """(seconds, tokens); raises grpc.RpcError."""
        self._n += 1
        req = pb.GenerateRequest(
            request_id=f"probe-{self._n}",
            tokenized=pb.TokenizedInput(input_ids=self.PROMPT),
            sampling_params=pb.SamplingParams(
                temperature=0.0, max_new_tokens=self.max_new, ignore_eos=True
            ),
        )
        t0 = time.monotonic()
        (out,) = list(self.stub.Generate(req, timeout=timeout_s))
        return time.monotonic() - t0, list(out.complete.output_ids)

    def quiet(self, runs: int = 5) -> float:
        times = []
        for _ in range(runs):
            seconds, tokens = self.once()
            if self.expected is None:
                self.expected = tokens
            elif tokens != self.expected:
                raise RuntimeError(
                    f"the probe's greedy tokens changed: {tokens} != {self.expected}"
                )
            times.append(seconds)
        return statistics.median(times)

    def until_served(self, timeout_s: float = 300) -> tuple[float, int]:
        """Send the probe again and again until one is answered with the
        expected tokens; (seconds from now, refusals meanwhile)."""
        t0, refused = time.monotonic(), 0
        while time.monotonic() - t0 < timeout_s:
            try:
                _, tokens = self.once(timeout_s)
                if tokens == self.expected:
                    return time.monotonic() - t0, refused
                raise RuntimeError(f"the probe's tokens changed: {tokens} != {self.expected}")
            except grpc.RpcError:
                refused += 1
                time.sleep(0.1)
        raise TimeoutError(f"not served within {timeout_s:.0f} s ({refused} refusals)")


class ProbeLoop:
    """The probe sent back to back while a flood runs."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.times: list[float] = []
        self.errors: list[str] = []
        self.different = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="probe")

    def __enter__(self) -> ProbeLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(600)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                seconds, tokens = self.probe.once()
                self.times.append(seconds)
                self.different += tokens != self.probe.expected
            except grpc.RpcError as e:
                self.errors.append(f"{e.code().name}: {e.details()}")
            self._stop.wait(0.2)

    def summary(self, quiet_s: float) -> str:
        if not self.times:
            return f"probe: no answer ({len(self.errors)} errors)"
        med, worst = statistics.median(self.times), max(self.times)
        return (
            f"probe {len(self.times)}x: median {med:.2f} s ({med / quiet_s:.1f}x quiet), "
            f"max {worst:.2f} s"
        )
