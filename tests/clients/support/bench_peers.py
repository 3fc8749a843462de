"""What radixserve-bench's driver tests talk to: a small byte-level BPE
tokenizer with a ChatML template (trained here on the default prose, so
cutting text to a token budget meets real merges at its edges), and two
recording servers on loopback ports: an SglangScheduler gRPC servicer and an
OpenAI /v1/completions HTTP endpoint that streams server-sent events."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from clients.bench.prose import default_paragraphs
from clients.tokenizer_bundle import TokenizerBundle
from common import tokenizer_archive

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
OUTPUT = [5, 6, 7]  # what both servers answer: three tokens


@cache
def tokenizer_files() -> dict[str, bytes]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(default_paragraphs()[:300], trainer)
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>"}
    return {
        "tokenizer.json": tok.to_str().encode(),
        "tokenizer_config.json": json.dumps(config).encode(),
    }


def small_tokenizer() -> TokenizerBundle:
    return TokenizerBundle(tokenizer_files())


class RecordingScheduler(pb_grpc.SglangSchedulerServicer):
    """Records every GenerateRequest; answers with OUTPUT, streamed."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.lock = threading.Lock()

    def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(vocab_size=600)

    def GetTokenizer(self, request, context):
        for data, digest in tokenizer_archive.chunks(
            tokenizer_archive.pack(tokenizer_files()), 1024
        ):
            yield cpb.GetTokenizerChunk(data=data, sha256=digest)

    def Generate(self, request, context):
        with self.lock:
            self.requests.append(request)
        n = len(request.tokenized.input_ids)
        for t in OUTPUT:
            yield pb.GenerateResponse(
                request_id=request.request_id,
                chunk=pb.GenerateStreamChunk(token_ids=[t], prompt_tokens=n),
            )
        yield pb.GenerateResponse(
            request_id=request.request_id,
            complete=pb.GenerateComplete(
                output_ids=OUTPUT,
                finish_reason="length",
                prompt_tokens=n,
                completion_tokens=len(OUTPUT),
            ),
        )


@contextmanager
def recording_scheduler(
    servicer: RecordingScheduler | None = None,
) -> Iterator[tuple[str, RecordingScheduler]]:
    servicer = servicer or RecordingScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(8))
    pb_grpc.add_SglangSchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(None)


class _OpenAIHandler(BaseHTTPRequestHandler):
    bodies: list[dict]  # set on the subclass each server gets

    def log_message(self, *args) -> None:  # no access log on stderr
        pass

    def do_GET(self) -> None:
        if self.path != "/v1/models":
            self.send_error(404)
            return
        self._send(200, {"data": [{"id": "peer-model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        events = [{"choices": [{"index": 0, "text": f" w{t}"}]} for t in OUTPUT]
        usage = {"prompt_tokens": 10, "completion_tokens": len(OUTPUT)}
        events.append({"choices": [], "usage": usage})
        for e in events:
            self.wfile.write(f"data: {json.dumps(e)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def _send(self, status: int, value: dict) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextmanager
def recording_openai() -> Iterator[tuple[str, list[dict]]]:
    """An OpenAI completions endpoint; yields its base URL and the JSON
    bodies of the requests it received."""
    bodies: list[dict] = []
    handler = type("Handler", (_OpenAIHandler,), {"bodies": bodies})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    finally:
        server.shutdown()
        server.server_close()
