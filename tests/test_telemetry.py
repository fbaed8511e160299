"""worker/telemetry.py: spans (in-memory exporter), the no-op default, and JSON log lines.

Fast: no model, no server. Each tracing test configures its own in-memory exporter;
``configure_tracing`` replaces the module's provider each time, so tests never fight over
the process-wide OpenTelemetry global (which can be set only once).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import subprocess
import sys
import textwrap
import time
import warnings
from collections import namedtuple
from pathlib import Path

import grpc
import pytest
import structlog
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, format_span_id, format_trace_id

from worker import telemetry
from worker.telemetry import (
    GenerationTrace,
    bind_request,
    configure_logging,
    configure_tracing,
    get_logger,
    log_request_summary,
    rpc_span,
)

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
METHOD = "/llmworker.v1.WorkerService/Generate"
HEX32 = re.compile(r"^[0-9a-f]{32}$")
HEX16 = re.compile(r"^[0-9a-f]{16}$")
PROMPT = "The secret prompt"
OUTPUT = "the secret completion"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _clean_otel_env(monkeypatch):
    for name in (
        "OTEL_SDK_DISABLED",
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_SEMCONV_STABILITY_OPT_IN",
    ):
        monkeypatch.delenv(name, raising=False)
    yield
    telemetry.shutdown_tracing()


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    exp = InMemorySpanExporter()
    assert configure_tracing(exporter=exp) is True
    assert telemetry.tracing_enabled()
    return exp


@pytest.fixture
def log_stream():
    """JSON logging into a buffer; the root logger and structlog are restored afterwards."""
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    stream = io.StringIO()
    configure_logging("json", "DEBUG", stream=stream)
    yield stream
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in saved_handlers:
        root.addHandler(handler)
    root.setLevel(saved_level)
    logging.captureWarnings(False)
    structlog.reset_defaults()


def json_lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def generation(**kwargs) -> GenerationTrace:
    args = dict(max_tokens=64, temperature=0.7, top_p=0.9, top_k=40, priority=2, seed=7)
    args.update(kwargs)
    return GenerationTrace("tiny-llama", "req-1", **args)


# --------------------------------------------------------------------------------------------
# Tracing
# --------------------------------------------------------------------------------------------

Metadatum = namedtuple("Metadatum", ["key", "value"])  # the shape grpc.aio hands servicers


@pytest.mark.parametrize(
    "metadata",
    [
        (("user-agent", "grpc-python"), ("traceparent", TRACEPARENT), ("tracestate", "gw=1")),
        (Metadatum("traceparent", TRACEPARENT), Metadatum("tracestate", "gw=1")),
        grpc.aio.Metadata(("traceparent", TRACEPARENT), ("tracestate", "gw=1"), ("x-bin", b"\0")),
        {"traceparent": TRACEPARENT, "tracestate": "gw=1"},
    ],
    ids=["pairs", "metadatum", "aio-metadata", "dict"],
)
def test_rpc_span_joins_callers_trace(exporter, metadata):
    with rpc_span(METHOD, metadata) as span:
        assert span.is_recording()
    (exported,) = exporter.get_finished_spans()
    assert exported.name == "llmworker.v1.WorkerService/Generate"
    assert exported.kind is SpanKind.SERVER
    assert format_trace_id(exported.context.trace_id) == TRACE_ID
    assert exported.parent is not None and exported.parent.is_remote
    assert format_span_id(exported.parent.span_id) == PARENT_SPAN_ID
    assert exported.context.trace_state.get("gw") == "1"
    assert dict(exported.attributes) == {
        "rpc.system": "grpc",
        "rpc.service": "llmworker.v1.WorkerService",
        "rpc.method": "Generate",
        "rpc.grpc.status_code": 0,
    }
    assert exported.status.status_code is StatusCode.UNSET
    assert exported.resource.attributes["service.name"] == "llm-worker"


def test_rpc_span_without_traceparent_starts_a_trace(exporter):
    with rpc_span("llmworker.v1.WorkerService/GetLoad", ()):
        pass
    (exported,) = exporter.get_finished_spans()
    assert exported.parent is None
    assert exported.name == "llmworker.v1.WorkerService/GetLoad"
    assert exported.attributes["rpc.method"] == "GetLoad"


def test_rpc_span_around_yield_closed_from_another_context_logs_no_error(exporter, caplog):
    """A streaming servicer's async generator, its span current across the yield, closed
    in a task of its own (as grpc.aio finalizes an abandoned stream): the span ends, and
    nothing is logged (OpenTelemetry logged "Failed to detach context" with a traceback)."""
    from opentelemetry import trace

    async def stream():
        with rpc_span("llmworker.v1.WorkerService/Generate", ()):
            yield 1
            yield 2

    async def main() -> None:
        agen = stream()
        await agen.__anext__()
        await asyncio.get_running_loop().create_task(agen.aclose())  # another Context

    async def same() -> bool:
        agen = stream()
        await agen.__anext__()
        await agen.aclose()  # the Context that attached it: detached
        return trace.get_current_span().get_span_context().is_valid

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
        assert not asyncio.run(same())
    assert "Failed to detach" not in caplog.text and "Traceback" not in caplog.text
    assert len(exporter.get_finished_spans()) == 2


def test_generation_trace_is_a_child_with_genai_attributes_and_ordered_events(exporter):
    queued_at = time.time() - 0.25
    with rpc_span(METHOD, [("traceparent", TRACEPARENT)]) as rpc:
        gen = generation(prompt=PROMPT)
        gen.event("queued", timestamp_s=queued_at)
        gen.event("scheduled", num_tokens=12)
        gen.event("first_token")
        gen.event("preempted", mode="swap")
        gen.event("resumed")
        gen.finish(
            "stop", 12, 30, output_text=OUTPUT, cached_tokens=4, queue_time_ms=1.5, ttft_ms=9.0
        )
        gen.finish("error", 0, 0)  # a second finish changes nothing
        assert gen.finished
        rpc_ctx = rpc.get_span_context()

    spans = {s.name: s for s in exporter.get_finished_spans()}
    child = spans["text_completion tiny-llama"]
    parent = spans["llmworker.v1.WorkerService/Generate"]
    assert child.kind is SpanKind.INTERNAL
    assert child.context.trace_id == parent.context.trace_id == rpc_ctx.trace_id
    assert format_trace_id(child.context.trace_id) == TRACE_ID
    assert child.parent.span_id == parent.context.span_id
    assert gen.trace_id_hex == TRACE_ID
    assert gen.span_id_hex == format_span_id(child.context.span_id)
    assert HEX16.match(gen.span_id_hex)

    attrs = dict(child.attributes)
    assert attrs == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "llm_worker",
        "gen_ai.request.model": "tiny-llama",
        "gen_ai.response.model": "tiny-llama",
        "gen_ai.response.id": "req-1",
        "gen_ai.output.type": "text",
        "gen_ai.request.max_tokens": 64,
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.top_k": 40,
        "gen_ai.request.seed": 7,
        "llm_worker.request.priority": 2,
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 30,
        "gen_ai.usage.cache_read.input_tokens": 4,
        "gen_ai.response.time_to_first_chunk": 0.009,
        "llm_worker.queue_time_ms": 1.5,
    }
    names = [e.name for e in child.events]
    assert names == ["queued", "scheduled", "first_token", "preempted", "resumed", "finished"]
    assert child.events[0].timestamp == int(queued_at * 1e9)
    assert child.events[1].attributes["num_tokens"] == 12
    assert child.events[-1].attributes["finish_reason"] == "stop"
    assert child.status.status_code is StatusCode.UNSET

    # Content is off by default: the texts appear nowhere in the export.
    dumped = child.to_json() + parent.to_json()
    assert PROMPT not in dumped and OUTPUT not in dumped


def test_generation_trace_records_content_only_when_opted_in(exporter):
    with rpc_span(METHOD, None):
        gen = generation(prompt=PROMPT, record_content=True)
        gen.event("first_token")
        gen.finish("length", 5, 64, output_text=OUTPUT)
    child = next(s for s in exporter.get_finished_spans() if s.name.startswith("text_completion"))
    # The current conventions' form: JSON strings of the message schema, on the span.
    assert json.loads(child.attributes["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": PROMPT}]}]
    assert json.loads(child.attributes["gen_ai.output.messages"]) == [
        {"role": "assistant", "parts": [{"type": "text", "content": OUTPUT}],
         "finish_reason": "length"}]
    assert [e.name for e in child.events] == ["first_token", "finished"]
    assert child.attributes["gen_ai.response.finish_reasons"] == ("length",)


DEPRECATED_GENAI = ("gen_ai.system", "gen_ai.prompt", "gen_ai.completion",
                    "gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens")


@pytest.mark.parametrize("record", [True, False], ids=["content", "no-content"])
def test_chat_messages_make_a_chat_span(exporter, record):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": PROMPT}]
    with rpc_span(METHOD, None):
        gen = GenerationTrace("tiny-llama", "chat-1", max_tokens=8, temperature=0.0, top_p=1.0,
                              top_k=0, input_messages=messages, record_content=record)
        gen.finish("stop", 9, 3, output_text=OUTPUT)
    (child,) = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.INTERNAL]
    assert child.name == "chat tiny-llama"
    assert child.attributes["gen_ai.operation.name"] == "chat"
    assert gen.operation == "chat"
    if record:
        assert json.loads(child.attributes["gen_ai.input.messages"]) == [
            {"role": "system", "parts": [{"type": "text", "content": "Be brief."}]},
            {"role": "user", "parts": [{"type": "text", "content": PROMPT}]}]
        assert json.loads(child.attributes["gen_ai.output.messages"])[0]["finish_reason"] == "stop"
    else:
        assert "gen_ai.input.messages" not in child.attributes
        assert "gen_ai.output.messages" not in child.attributes
        assert PROMPT not in child.to_json() and OUTPUT not in child.to_json()
    for name in DEPRECATED_GENAI:
        assert name not in child.attributes, name
    assert not any(e.name.startswith("gen_ai.content") for e in child.events)


def test_chat_messages_may_be_objects_with_role_and_content(exporter):
    Msg = namedtuple("Msg", ["role", "content"])  # our proto's ChatMessage has the same shape
    gen = GenerationTrace("m", "r", max_tokens=1, temperature=None, top_p=None, top_k=None,
                          input_messages=[Msg("user", "héllo \"q\"")], record_content=True)
    gen.finish("stop", 1, 1)
    (span,) = exporter.get_finished_spans()
    assert json.loads(span.attributes["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": 'héllo "q"'}]}]
    # No output text given: no output messages, even with content on.
    assert "gen_ai.output.messages" not in span.attributes


def test_operation_is_explicit_when_given_and_checked(exporter):
    gen = GenerationTrace("m", "r", max_tokens=1, temperature=None, top_p=None, top_k=None,
                          operation="text_completion",
                          input_messages=[{"role": "user", "content": "x"}])
    gen.finish("stop")
    assert exporter.get_finished_spans()[0].name == "text_completion m"
    with pytest.raises(ValueError, match="operation must be chat or text_completion"):
        GenerationTrace("m", "r", max_tokens=1, temperature=None, top_p=None, top_k=None,
                        operation="embeddings")


@pytest.mark.parametrize(("count", "present"), [(None, False), (1, False), (3, True)])
def test_optional_request_attributes(exporter, count, present):
    gen = GenerationTrace("m", "r", max_tokens=4, temperature=None, top_p=None, top_k=None,
                          choice_count=count, stream=True, stop_sequences=["\n\n", "END"],
                          frequency_penalty=0.5, presence_penalty=-0.5)
    gen.finish("stop")
    a = exporter.get_finished_spans()[0].attributes
    assert ("gen_ai.request.choice.count" in a) == present
    if present:
        assert a["gen_ai.request.choice.count"] == count
    assert a["gen_ai.request.stream"] is True
    assert a["gen_ai.request.stop_sequences"] == ("\n\n", "END")
    assert a["gen_ai.request.frequency_penalty"] == 0.5
    assert a["gen_ai.request.presence_penalty"] == -0.5
    for name in ("gen_ai.request.temperature", "gen_ai.request.top_p", "gen_ai.request.top_k"):
        assert name not in a  # not given: not set


def test_generation_error_and_context_manager_ending(exporter):
    with pytest.raises(RuntimeError), rpc_span(METHOD, None):
        with GenerationTrace("m", "req-err", max_tokens=8, temperature=0.0, top_p=1.0, top_k=0):
            raise RuntimeError("model step failed")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    gen, rpc = spans["text_completion m"], spans["llmworker.v1.WorkerService/Generate"]
    assert gen.attributes["gen_ai.response.finish_reasons"] == ("error",)
    assert gen.status.status_code is StatusCode.ERROR
    assert "model step failed" in gen.status.description
    # An unhandled exception is UNKNOWN, an ERROR on the server span, with the exception event.
    assert rpc.attributes["rpc.grpc.status_code"] == 2
    assert rpc.status.status_code is StatusCode.ERROR
    assert [e.name for e in rpc.events] == ["exception"]


class FakeContext:
    """What rpc_span asks of a grpc.aio ServicerContext."""

    def __init__(self, code=None, details=None, time_remaining=None, peer="ipv4:10.1.2.3:5555"):
        self._code, self._details, self._remaining = code, details, time_remaining
        self._peer = peer

    def peer(self):
        return self._peer

    def code(self):
        return self._code

    def details(self):
        return self._details

    def time_remaining(self):
        return self._remaining


class AbortError(Exception):
    """Stands in for grpc's cygrpc.AbortError, raised by ``context.abort``."""


@pytest.mark.parametrize(
    ("context", "exc", "code", "error"),
    [
        (FakeContext(grpc.StatusCode.INVALID_ARGUMENT, "top_p"), AbortError(), 3, False),
        (FakeContext(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"), AbortError(), 8, False),
        (FakeContext(grpc.StatusCode.UNAVAILABLE, "draining"), AbortError(), 14, True),
        (FakeContext(grpc.StatusCode.INTERNAL, "boom"), None, 13, True),
        (FakeContext(), asyncio.CancelledError(), 1, False),
        (FakeContext(time_remaining=-0.1), asyncio.CancelledError(), 4, True),
        (None, None, 0, False),
    ],
    ids=["invalid", "exhausted", "unavailable", "set-internal", "cancel", "deadline", "ok"],
)
def test_rpc_span_status_follows_grpc_code(exporter, context, exc, code, error):
    if exc is None:
        with rpc_span(METHOD, None, context=context):
            pass
    else:  # rpc_span must re-raise what the body raised, never swallow it
        with pytest.raises(type(exc)) as raised, rpc_span(METHOD, None, context=context):
            raise exc
        assert raised.value is exc
    (span,) = exporter.get_finished_spans()
    assert span.attributes["rpc.grpc.status_code"] == code
    assert (span.status.status_code is StatusCode.ERROR) == error
    assert not span.events  # aborts and cancellations are not exceptions to record
    if error and context is not None and context.details():
        assert span.status.description == context.details()


@pytest.mark.parametrize(
    ("peer", "expected"),
    [
        ("ipv4:10.1.2.3:5555", {"network.transport": "tcp", "network.type": "ipv4",
                                "network.peer.address": "10.1.2.3", "network.peer.port": 5555}),
        ("ipv6:[::1]:41000", {"network.transport": "tcp", "network.type": "ipv6",
                              "network.peer.address": "::1", "network.peer.port": 41000}),
        ("ipv6:%5B::1%5D:41000", {"network.transport": "tcp", "network.type": "ipv6",
                                  "network.peer.address": "::1", "network.peer.port": 41000}),
        ("ipv4:10.0.0.9:80,127.0.0.1:9", {"network.transport": "tcp", "network.type": "ipv4",
                                          "network.peer.address": "10.0.0.9",
                                          "network.peer.port": 80}),
        ("unix:/run/worker.sock", {"network.transport": "unix",
                                   "network.peer.address": "/run/worker.sock"}),
        ("garbage", {}),
        ("ipv4:nohost", {}),
    ],
    ids=["ipv4", "ipv6", "ipv6-escaped", "proxied", "unix", "garbage", "no-port"],
)
def test_rpc_span_network_and_server_attributes(exporter, peer, expected):
    with rpc_span(METHOD, None, context=FakeContext(peer=peer),
                  server_address="worker.example", server_port=50051):
        pass
    (span,) = exporter.get_finished_spans()
    attrs = dict(span.attributes)
    got = {k: v for k, v in attrs.items() if k.startswith("network.")}
    assert got == expected
    assert attrs["server.address"] == "worker.example" and attrs["server.port"] == 50051


@pytest.mark.parametrize(
    ("opt_in", "expected"),
    [
        ("", {"rpc.system": "grpc", "rpc.service": "llmworker.v1.WorkerService",
              "rpc.method": "Generate", "rpc.grpc.status_code": 14}),
        ("rpc", {"rpc.system.name": "grpc", "rpc.method": "llmworker.v1.WorkerService/Generate",
                 "rpc.response.status_code": "UNAVAILABLE", "error.type": "UNAVAILABLE"}),
        ("http, rpc/dup", {"rpc.system": "grpc", "rpc.service": "llmworker.v1.WorkerService",
                           "rpc.system.name": "grpc",
                           "rpc.method": "llmworker.v1.WorkerService/Generate",
                           "rpc.grpc.status_code": 14, "rpc.response.status_code": "UNAVAILABLE",
                           "error.type": "UNAVAILABLE"}),
    ],
    ids=["default-old", "rpc", "rpc-dup"],
)
def test_rpc_attribute_names_follow_the_stability_opt_in(monkeypatch, opt_in, expected):
    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", opt_in)
    exp = InMemorySpanExporter()
    configure_tracing(exporter=exp)
    ctx = FakeContext(grpc.StatusCode.UNAVAILABLE, "draining", peer=None)
    with pytest.raises(AbortError), rpc_span(METHOD, None, context=ctx):
        raise AbortError()
    (span,) = exp.get_finished_spans()
    assert dict(span.attributes) == expected
    assert span.name == "llmworker.v1.WorkerService/Generate"
    assert span.status.status_code is StatusCode.ERROR


def test_rpc_span_in_an_async_generator_servicer(exporter):
    """The servicer shape grpc.aio uses: spans stay current across yields; a stream closed
    early (client gone) ends both spans, the generation as an abort."""

    async def servicer(n):
        with rpc_span(METHOD, [("traceparent", TRACEPARENT)]) as span:
            with generation() as gen:
                for i in range(n):
                    await asyncio.sleep(0)
                    assert telemetry.trace.get_current_span() is span
                    yield i
                gen.finish("stop", 3, n)

    async def main():
        whole = [x async for x in servicer(3)]
        stream = servicer(3)
        first = await anext(stream)
        await stream.aclose()
        return whole, first

    assert asyncio.run(main()) == ([0, 1, 2], 0)
    spans = exporter.get_finished_spans()
    assert len(spans) == 4
    gens = [s for s in spans if s.name.startswith("text_completion")]
    rpcs = [s for s in spans if s.kind is SpanKind.SERVER]
    assert [g.attributes["gen_ai.response.finish_reasons"] for g in gens] == [("stop",), ("abort",)]
    assert [r.attributes["rpc.grpc.status_code"] for r in rpcs] == [0, 1]
    assert all(format_trace_id(s.context.trace_id) == TRACE_ID for s in spans)


def test_monotonic_to_wall():
    # Bracketed by clock reads: the error is at most the time the bracket took, however long
    # a loaded machine deschedules the thread inside it (plus clock resolution).
    m0, before = time.monotonic(), time.time()
    wall = telemetry.monotonic_to_wall(time.monotonic() - 2.0)
    after, m1 = time.time(), time.monotonic()
    slack = (m1 - m0) + 0.002
    assert before - 2.0 - slack <= wall <= after - 2.0 + slack


def test_reconfiguring_replaces_the_exporter():
    first, second = InMemorySpanExporter(), InMemorySpanExporter()
    configure_tracing(exporter=first)
    with rpc_span(METHOD, None):
        pass
    configure_tracing("other-name", exporter=second)
    with rpc_span(METHOD, None):
        pass
    assert len(first.get_finished_spans()) == 1
    (span,) = second.get_finished_spans()
    assert span.resource.attributes["service.name"] == "other-name"


def test_otel_service_name_wins(monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "worker-7")
    exp = InMemorySpanExporter()
    configure_tracing("llm-worker", exporter=exp)
    with rpc_span(METHOD, None):
        pass
    assert exp.get_finished_spans()[0].resource.attributes["service.name"] == "worker-7"


def test_tracing_is_a_noop_without_exporter_or_env():
    assert configure_tracing() is False
    assert not telemetry.tracing_enabled()
    assert telemetry._provider is None
    # Nothing recorded, but ids still flow for log correlation: the caller's when given ...
    with rpc_span(METHOD, [("traceparent", TRACEPARENT)]) as span:
        assert not span.is_recording()
        ctx = span.get_span_context()
        assert format_trace_id(ctx.trace_id) == TRACE_ID
        gen = generation(prompt=PROMPT, record_content=True)
        assert not gen.span.is_recording()
        assert gen.trace_id_hex == TRACE_ID
        gen.event("queued")
        gen.finish("stop", 1, 1, output_text=OUTPUT)
    # ... fresh ones otherwise.
    with rpc_span(METHOD, None) as span:
        ctx = span.get_span_context()
        assert not span.is_recording() and ctx.is_valid
        assert HEX32.match(format_trace_id(ctx.trace_id))


def test_noop_installs_no_provider_in_a_fresh_process():
    code = textwrap.dedent(
        """
        from opentelemetry import trace
        from worker import telemetry
        assert telemetry.configure_tracing() is False
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        with telemetry.rpc_span("/a.B/C", None) as span:
            assert not span.is_recording()
        print("ok")
        """
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_sdk_disabled_wins_even_over_an_exporter(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert configure_tracing(exporter=InMemorySpanExporter()) is False
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    assert configure_tracing() is False
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert configure_tracing() is False


def _exporters() -> list:
    processors = telemetry._provider._active_span_processor._span_processors
    assert all(isinstance(p, BatchSpanProcessor) for p in processors)
    return [p.span_exporter for p in processors]


@pytest.mark.parametrize(
    ("env", "kinds", "endpoint"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, ["grpc"], "127.0.0.1:4317"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}, ["grpc"], "c:4317"),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ["grpc"], "localhost:4317"),
        # http/protobuf: the HTTP exporter, the general endpoint + /v1/traces, default :4318.
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
          "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ["http"], "http://c:4318/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, ["http"],
         "http://localhost:4318/v1/traces"),
        # The traces-specific variables win over the general ones; its endpoint is used as is.
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL":
          "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:9/x"}, ["http"],
         "http://t:9/x"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
          "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, ["grpc"], "localhost:4317"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, ["http"],
         "http://localhost:4318/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"}, ["grpc"], "localhost:4317"),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"], None),
        ({"OTEL_TRACES_EXPORTER": " OTLP , console,otlp", "OTEL_EXPORTER_OTLP_PROTOCOL":
          "http/protobuf"}, ["http", "console"], "http://localhost:4318/v1/traces"),
        ({"OTEL_TRACES_EXPORTER": "zipkin,console"}, ["console"], None),
    ],
    ids=["endpoint", "traces-endpoint", "exporter-otlp", "http", "http-default-endpoint",
         "traces-protocol-http", "traces-protocol-grpc", "http-json", "bad-protocol",
         "console", "list", "unknown-skipped"],
)
def test_env_picks_exporters_and_protocol(monkeypatch, env, kinds, endpoint):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert configure_tracing() is True
    exporters = _exporters()
    classes = {"grpc": GrpcExporter, "http": HttpExporter, "console": ConsoleSpanExporter}
    assert [type(e) for e in exporters] == [classes[k] for k in kinds]
    if endpoint is not None:
        assert exporters[0]._endpoint == endpoint
    telemetry.shutdown_tracing()  # nothing was recorded, so nothing is sent
    assert not telemetry.tracing_enabled()


@pytest.mark.parametrize(
    "env",
    [{}, {"OTEL_TRACES_EXPORTER": "none"}, {"OTEL_TRACES_EXPORTER": "none,otlp",
                                            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"},
     {"OTEL_TRACES_EXPORTER": "zipkin"}, {"OTEL_EXPORTER_OTLP_HEADERS": "a=b"}],
    ids=["nothing", "none", "none-wins", "only-unknown", "headers-alone"],
)
def test_env_that_leaves_tracing_off(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert configure_tracing() is False
    assert telemetry._provider is None


@pytest.mark.parametrize(
    ("env", "says"),
    [({"OTEL_TRACES_EXPORTER": "zipkin,console"}, "unknown exporter 'zipkin'"),
     ({"OTEL_TRACES_EXPORTER": "none,console"}, "tracing stays off"),
     ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "exporting traces as http/protobuf"),
     ({"OTEL_EXPORTER_OTLP_PROTOCOL": "udp"}, "exporting traces with grpc")],
    ids=["unknown", "none-beside-others", "http-json", "bad-protocol"],
)
def test_what_is_not_honoured_is_said(monkeypatch, caplog, env, says):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with caplog.at_level(logging.WARNING, logger="worker.telemetry"):
        configure_tracing()
    assert says in caplog.text


def test_headers_and_timeout_reach_the_exporters(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "api-key=k1,x-tenant=t%201")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "3")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317")
    assert configure_tracing()
    (grpc_exporter,) = _exporters()
    assert dict(grpc_exporter._headers) == {"api-key": "k1", "x-tenant": "t 1"}
    assert grpc_exporter._timeout == 3.0  # Python's exporters read seconds
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "api-key=k2")
    assert configure_tracing()
    (http_exporter,) = _exporters()
    assert http_exporter._client._headers["api-key"] == "k2"
    assert http_exporter._client._timeout == 3.0


# --------------------------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------------------------


def test_every_line_is_json_including_stdlib_and_grpc(log_stream):
    get_logger("worker.engine").info("engine started", blocks=128)
    logging.getLogger("grpc._server").warning("Exception calling application: %s", "boom")
    logging.getLogger("worker.weights").debug("loaded %d tensors", 3, extra={"path": "/m"})
    try:
        raise ValueError("bad")
    except ValueError:
        logging.getLogger("worker.engine").exception("model step failed")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("old flag", DeprecationWarning, stacklevel=1)

    lines = json_lines(log_stream)
    assert len(lines) == 5
    for line in lines:
        assert {"timestamp", "level", "logger", "event"} <= line.keys()
        assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z$", line["timestamp"])
    first, grpc_line, debug, exc, warn = lines
    assert first == {**first, "event": "engine started", "blocks": 128, "level": "info"}
    assert first["logger"] == "worker.engine"
    assert grpc_line["logger"] == "grpc._server"
    assert grpc_line["level"] == "warning"
    assert grpc_line["event"] == "Exception calling application: boom"
    assert debug["event"] == "loaded 3 tensors" and debug["path"] == "/m"
    assert exc["level"] == "error" and "ValueError: bad" in exc["exception"]
    assert warn["logger"] == "py.warnings" and "old flag" in warn["event"]


def test_default_stream_is_stderr_and_level_filters(capsys):
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    try:
        configure_logging("json", "WARNING")  # binds the (captured) sys.stderr of this test
        logging.getLogger("grpc").info("hidden")
        get_logger("x").info("hidden too")
        logging.getLogger("grpc").error("shown")
        get_logger("x").warning("shown too")
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved_handlers:
            root.addHandler(handler)
        root.setLevel(saved_level)
        logging.captureWarnings(False)
        structlog.reset_defaults()
    err = capsys.readouterr().err
    events = [json.loads(line)["event"] for line in err.splitlines()]
    assert events == ["shown", "shown too"]


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_format_picks_console_on_a_terminal_and_json_otherwise():
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    try:
        tty, pipe = FakeTTY(), io.StringIO()
        configure_logging("auto", stream=tty)
        get_logger("x").info("hello console", n=1)
        configure_logging("auto", stream=pipe)
        get_logger("x").info("hello json", n=1)
        assert len(root.handlers) == 1  # reconfiguring replaces, never stacks
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved_handlers:
            root.addHandler(handler)
        root.setLevel(saved_level)
        logging.captureWarnings(False)
        structlog.reset_defaults()
    assert "hello console" in tty.getvalue()
    with pytest.raises(json.JSONDecodeError):
        json.loads(tty.getvalue().splitlines()[0])
    assert json.loads(pipe.getvalue())["event"] == "hello json"
    with pytest.raises(ValueError):
        configure_logging("xml")
    with pytest.raises(ValueError):
        configure_logging("json", "LOUD")


@pytest.mark.parametrize("traced", [True, False], ids=["tracing-on", "tracing-off"])
def test_request_lines_carry_request_and_trace_ids(log_stream, traced):
    if traced:
        configure_tracing(exporter=InMemorySpanExporter())
    with rpc_span(METHOD, [("traceparent", TRACEPARENT)]) as span:
        log = bind_request("req-42", span)
        log.info("request admitted", prompt_tokens=12)
        logging.getLogger("worker.service").info("plain stdlib line inside the span")
        log_request_summary(
            log,
            request_id="req-42",
            finish_reason="stop",
            prompt_tokens=12,
            completion_tokens=30,
            cached_tokens=4,
            queue_time_ms=1.23456,
            ttft_ms=20.0,
            total_time_ms=310.5,
        )
        span_id = format_span_id(span.get_span_context().span_id)
    get_logger("worker.engine").info("a line about no request")

    admitted, plain, summary, other = json_lines(log_stream)
    for line in (admitted, plain, summary):
        assert line["trace_id"] == TRACE_ID and HEX32.match(line["trace_id"])
        assert line["span_id"] == span_id and HEX16.match(line["span_id"])
    if traced:
        assert span_id != PARENT_SPAN_ID  # our own server span
    assert admitted["request_id"] == summary["request_id"] == "req-42"
    assert admitted["event"] == "request admitted"
    assert summary == {
        **summary,
        "event": "request finished",
        "level": "info",
        "finish_reason": "stop",
        "prompt_tokens": 12,
        "completion_tokens": 30,
        "cached_tokens": 4,
        "queue_time_ms": 1.235,
        "ttft_ms": 20.0,
        "total_time_ms": 310.5,
    }
    assert "trace_id" not in other and "request_id" not in other


def test_bind_request_without_a_traceparent_still_has_ids(log_stream):
    with rpc_span(METHOD, None) as span:
        pass
    bind_request("req-7", span).warning("slow client")
    log_request_summary(
        bind_request("req-7", span),
        request_id="req-7",
        finish_reason="error",
        prompt_tokens=1,
        completion_tokens=0,
    )
    slow, summary = json_lines(log_stream)
    assert HEX32.match(slow["trace_id"]) and HEX16.match(slow["span_id"])
    assert summary["level"] == "warning" and summary["finish_reason"] == "error"
    assert summary["trace_id"] == slow["trace_id"]
