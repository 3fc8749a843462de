"""JSON requests to an OpenAI-compatible HTTP API (the SMG gateway's), answered
whole or as server-sent events."""

from __future__ import annotations

import json
import urllib.request


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def post_stream(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(
        url, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    events = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events
