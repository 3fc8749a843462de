"""A minimal OTLP trace receiver (gRPC, or HTTP/protobuf at /v1/traces):
keeps every span it is sent.

For tests, benchmarks and a quick local look without Jaeger:

    python -m observability.otlp_receiver --port 4317

prints one line per span. In a test, ``OtlpReceiver().start()`` serves on a
free loopback port and ``spans()`` returns what arrived, flattened.
"""

from __future__ import annotations

import argparse
import gzip
import json
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tpb_grpc
from opentelemetry.proto.common.v1 import common_pb2


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    events: list[tuple[str, int]] = field(default_factory=list)  # (name, time)
    status_code: int = 0


def _spans_of(request: tpb.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    got = []
    for rs in request.resource_spans:
        service = str(_attributes(rs.resource.attributes).get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                got.append(
                    ReceivedSpan(
                        service=service,
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=_attributes(s.attributes),
                        links=[(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links],
                        events=[(e.name, e.time_unix_nano) for e in s.events],
                        status_code=s.status.code,
                    )
                )
    return got


class _Servicer(tpb_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpReceiver) -> None:
        self.sink = sink

    def Export(
        self, request: tpb.ExportTraceServiceRequest, context
    ) -> tpb.ExportTraceServiceResponse:
        self.sink.take(request)
        return tpb.ExportTraceServiceResponse()


class OtlpReceiver:
    """``protocol``: "grpc" or "http/protobuf" (POST /v1/traces)."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, protocol: str = "grpc", keep: bool = True
    ) -> None:
        self.host, self.port, self.protocol = host, port, protocol
        # False: keep the raw requests and count their spans at the end only
        # (benchmarks: receiving costs the measured machine next to nothing)
        self.keep = keep
        self.count = 0
        self.links = 0
        self.bytes = 0
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server: Any = None
        self.on_spans = None  # optional callback(list[ReceivedSpan])
        self._raw: list[bytes] = []

    @property
    def _raw_mode(self) -> bool:
        return not self.keep and self.on_spans is None

    def start(self) -> OtlpReceiver:
        if self.protocol == "http/protobuf":
            return self._start_http()
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4),
            options=[("grpc.max_receive_message_length", 64 << 20)],
        )
        if self._raw_mode:
            handler = grpc.method_handlers_generic_handler(
                "opentelemetry.proto.collector.trace.v1.TraceService",
                {"Export": grpc.unary_unary_rpc_method_handler(self._take_raw)},
            )
            server.add_generic_rpc_handlers((handler,))
        else:
            tpb_grpc.add_TraceServiceServicer_to_server(_Servicer(self), server)
        self.port = server.add_insecure_port(f"{self.host}:{self.port}")
        server.start()
        self._server = server
        return self

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _start_http(self) -> OtlpReceiver:
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                if sink._raw_mode:
                    sink._take_raw(body, context=None)
                else:
                    sink.take(tpb.ExportTraceServiceRequest.FromString(body))
                out = tpb.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        server = ThreadingHTTPServer((self.host, self.port), Handler)
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        if self.protocol == "http/protobuf":
            self._server.shutdown()
            self._server.server_close()
        else:
            self._server.stop(grace=1).wait()

    def _take_raw(self, data: bytes, context) -> bytes:
        with self._lock:
            self._raw.append(data)
        return b""  # an empty ExportTraceServiceResponse

    def totals(self) -> dict[str, int]:
        """Spans, links and bytes received (raw requests are counted now)."""
        with self._lock:
            raw, self._raw = self._raw, []
        for data in raw:
            request = tpb.ExportTraceServiceRequest.FromString(data)
            spans = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
            self.count += len(spans)
            self.links += sum(len(s.links) for s in spans)
            self.bytes += len(data)
        return {"spans": self.count, "links": self.links, "bytes": self.bytes}

    def take(self, request: tpb.ExportTraceServiceRequest) -> None:
        self.add(_spans_of(request))

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self.count += len(spans)
            self.links += sum(len(s.links) for s in spans)
            if self.keep:
                self._spans.extend(spans)
        if self.on_spans is not None:
            self.on_spans(spans)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, predicate, timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """Wait until ``predicate(spans)`` holds; returns the spans."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise TimeoutError(f"spans received so far: {len(spans)} {names}")
            time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4317)
    p.add_argument("--protocol", choices=["grpc", "http/protobuf"], default="grpc")
    p.add_argument("--quiet", action="store_true", help="print only the totals, on SIGTERM")
    args = p.parse_args()
    receiver = OtlpReceiver(args.host, args.port, args.protocol, keep=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def show(spans: list[ReceivedSpan]) -> None:
        for s in spans:
            ms = (s.end_ns - s.start_ns) / 1e6
            print(f"{s.trace_id} {s.service} {s.name} {ms:.2f} ms {s.attributes}", flush=True)

    if not args.quiet:
        receiver.on_spans = show
    receiver.start()
    print(f"OTLP receiver on {receiver.endpoint}", flush=True)
    stop.wait()
    receiver.stop()
    print(json.dumps(receiver.totals()), flush=True)


if __name__ == "__main__":
    main()
