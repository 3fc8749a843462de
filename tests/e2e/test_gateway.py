"""The Shepherd Model Gateway (PyPI smg) in front of radixserve serves the
OpenAI API: /v1/chat/completions and /v1/completions, streamed and not."""

from __future__ import annotations

import urllib.error
import urllib.request

from tests.e2e.support.openai_http import post, post_stream


def test_chat_completions_streamed_and_not(gateway):
    base, model = gateway
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 24,
    }
    whole = post(base + "/v1/chat/completions", body)
    text = whole["choices"][0]["message"]["content"]
    assert "Paris" in text and whole["usage"]["completion_tokens"] > 0
    events = post_stream(base + "/v1/chat/completions", body)
    streamed = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]
    )
    assert streamed == text
    assert any(e["choices"] and e["choices"][0].get("finish_reason") for e in events)


def test_completions_streamed_and_not(gateway):
    base, model = gateway
    body = {
        "model": model,
        "prompt": "The capital of France is",
        "temperature": 0,
        "max_tokens": 12,
    }
    whole = post(base + "/v1/completions", body)
    text = whole["choices"][0]["text"]
    assert text.strip() and whole["choices"][0]["finish_reason"] in ("stop", "length")
    events = post_stream(base + "/v1/completions", body)
    assert "".join(e["choices"][0].get("text", "") for e in events if e["choices"]) == text


def test_the_gateway_does_not_forward_a_lora_adapter(gateway):
    """smg 1.13 has no way to pick a LoRA adapter: `model: "<base>:NAME"` is an
    unknown model and a `lora_path` field is dropped (the scheduler would
    refuse the unloaded adapter "sql" if it were sent), so the answer is the
    base model's. If a gateway upgrade starts forwarding it, this fails and
    docs/kubernetes.md ("LoRA adapters") must change."""
    base, model = gateway
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hi."}],
        "temperature": 0,
        "max_tokens": 6,
    }
    plain = post(base + "/v1/chat/completions", body)
    dropped = post(base + "/v1/chat/completions", {**body, "lora_path": "sql"})
    assert dropped["choices"][0]["message"] == plain["choices"][0]["message"]
    try:
        post(base + "/v1/chat/completions", {**body, "model": f"{model}:sql"})
        raise AssertionError("the gateway accepted <model>:<adapter>")
    except urllib.error.HTTPError as e:
        assert e.code == 404
