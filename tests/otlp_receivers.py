"""Two small OTLP trace receivers for tests, listening on 127.0.0.1: gRPC
(``opentelemetry.proto.collector.trace.v1.TraceService/Export``) and HTTP (``POST
/v1/traces`` with an ``application/x-protobuf`` ``ExportTraceServiceRequest`` body). Both
keep every request they decode, with the headers it came with, and every span in it,
flattened to `ReceivedSpan`s with plain Python attribute values."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


def any_value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(any_value(x) for x in v.array_value.values)
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return None if kind is None else getattr(v, kind)


def attributes(kvs: list[KeyValue]) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


@dataclass
class ReceivedSpan:
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    trace_id: str  # 32 hex digits
    span_id: str
    parent_span_id: str  # "" for a root
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    resource: dict[str, Any]
    status_code: int


@dataclass
class Receiver:
    """What a receiver got: the raw request bodies, their headers, and the spans."""

    transport: str
    endpoint: str = ""  # what OTEL_EXPORTER_OTLP_ENDPOINT should say
    bodies: list[bytes] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    spans: list[ReceivedSpan] = field(default_factory=list)
    stop: Callable[[], None] = lambda: None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, body: bytes, headers: dict[str, str]) -> None:
        req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        spans = []
        for rs in req.resource_spans:
            resource = attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(ReceivedSpan(
                        name=s.name, kind=s.kind, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                        attributes=attributes(s.attributes),
                        events=[(e.name, attributes(e.attributes)) for e in s.events],
                        resource=resource, status_code=s.status.code))
        with self._lock:
            self.bodies.append(body)
            self.headers.append(headers)
            self.spans.extend(spans)

    def wait_for(self, pred: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0,
                 what: str = "spans") -> list[ReceivedSpan]:
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if pred(spans):
                return spans
            assert time.monotonic() < end, (
                f"{self.transport} receiver: timed out waiting for {what}; got "
                f"{[(s.name, s.attributes.get('gen_ai.response.id')) for s in spans]}")
            time.sleep(0.05)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        headers = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        self.receiver.add(request.SerializeToString(), headers)
        return trace_service_pb2.ExportTraceServiceResponse()


def grpc_receiver() -> Receiver:
    rec = Receiver("grpc")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(rec), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    rec.endpoint = f"http://127.0.0.1:{port}"
    rec.stop = lambda: server.stop(0)
    return rec


def http_receiver() -> Receiver:
    rec = Receiver("http")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces" or self.headers.get(
                    "Content-Type") != "application/x-protobuf":
                self.send_error(404 if self.path != "/v1/traces" else 415)
                return
            rec.add(body, {k.lower(): v for k, v in self.headers.items()})
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:  # quiet
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
                              daemon=True)
    thread.start()
    rec.endpoint = f"http://127.0.0.1:{httpd.server_address[1]}"

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)

    rec.stop = stop
    return rec
