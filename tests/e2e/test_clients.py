"""The Python client (sync and asyncio) and radixserve-client against a real server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from clients.client import AsyncRadixClient, RadixClient

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_sync_generate_stream_and_chat(smollm2_address):
    client = RadixClient(smollm2_address)
    whole = client.generate("The capital of France is", max_new_tokens=8, temperature=0)
    assert whole.text and len(whole.token_ids) == whole.choices[0].completion_tokens
    events = list(client.stream("The capital of France is", max_new_tokens=8, temperature=0))
    assert "".join(e.text for e in events) == whole.text
    assert events[-1].finish_reason in ("stop", "length")
    answer = client.chat(QUESTION, max_new_tokens=24, temperature=0)
    assert "Paris" in answer.text and answer.finish_reason == "stop"
    assert client.health()
    client.close()


def test_stop_strings_are_trimmed_unless_asked_not_to(smollm2_address):
    client = RadixClient(smollm2_address)
    trimmed = client.chat(QUESTION, max_new_tokens=24, temperature=0, stop=["Paris"])
    assert trimmed.finish_reason == "stop" and trimmed.choices[0].matched_stop == "Paris"
    assert "Paris" not in trimmed.text and trimmed.text
    streamed = "".join(
        e.text
        for e in client.chat(QUESTION, True, max_new_tokens=24, temperature=0, stop=["Paris"])
    )
    assert streamed == trimmed.text
    kept = client.chat(
        QUESTION, max_new_tokens=24, temperature=0, stop=["Paris"], no_stop_trim=True
    )
    assert kept.text.endswith("Paris") or "Paris" in kept.text
    client.close()


def test_n_samples_and_logprobs(smollm2_address):
    client = RadixClient(smollm2_address)
    result = client.generate(
        "Once upon a time", max_new_tokens=6, temperature=0, n=2, logprobs=True
    )
    assert [c.index for c in result.choices] == [0, 1]
    assert result.choices[0].token_ids == result.choices[1].token_ids
    assert len(result.choices[0].logprobs) == 6 and all(
        lp <= 0 for lp in result.choices[0].logprobs
    )
    client.close()


def test_async_client(smollm2_address):
    async def run():
        client = AsyncRadixClient(smollm2_address)
        whole = await client.generate("Water boils at", max_new_tokens=6, temperature=0)
        parts = [
            e.text async for e in client.stream("Water boils at", max_new_tokens=6, temperature=0)
        ]
        prompt = await client.chat_prompt(QUESTION)
        answer = await client.generate(prompt, max_new_tokens=24, temperature=0)
        assert await client.abort("no-such-request")
        await client.close()
        return whole.text, "".join(parts), answer.text

    whole, streamed, answer = asyncio.run(run())
    assert whole == streamed and "Paris" in answer


def test_cli_chat_answers_paris(smollm2_address):
    cli = Path(sys.executable).parent / "radixserve-client"
    out = subprocess.run(
        [str(cli), "--server", smollm2_address, "chat", "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    gen = subprocess.run(
        [
            str(cli),
            "--server",
            smollm2_address,
            "generate",
            "1, 2, 3,",
            "--stream",
            "--max-new-tokens",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gen.returncode == 0 and gen.stdout.strip(), gen.stderr
