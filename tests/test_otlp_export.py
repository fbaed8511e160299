"""Spans over the wire: a real `llm-worker serve` process exports to a loopback OTLP
receiver, gRPC (``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``, the default) and HTTP
(``http/protobuf``, ``POST /v1/traces``), configured only by the standard ``OTEL_*``
variables. Each worker gets a text request and a chat request that join a caller's trace;
the receivers decode the ``ExportTraceServiceRequest``s and the tests check what arrived:
the server span, the GenAI span and its attributes (the current conventions), and that
prompt and output text travel only with ``--trace-content``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from llmworker.v1 import worker_pb2 as pb

from tests.otlp_receivers import ReceivedSpan, Receiver, grpc_receiver, http_receiver
from tests.test_server import Worker

MODEL = "SmolLM2-135M-Instruct"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TEXT_PROMPT = "The capital of France is"
CHAT_MESSAGES = [("system", "You answer in one word."), ("user", "Name a colour of the sky.")]
SPAN_KIND_SERVER, SPAN_KIND_INTERNAL = 2, 1


@dataclass
class Traced:
    receiver: Receiver
    record_content: bool
    text: tuple[list[pb.GenerateChunk], pb.GenerateComplete]
    chat: tuple[list[pb.GenerateChunk], pb.GenerateComplete]

    def spans_of(self, rid: str) -> tuple[ReceivedSpan, ReceivedSpan]:
        """The Generate server span and the GenAI span of one request."""
        spans = self.receiver.spans
        gen = next(s for s in spans if s.attributes.get("gen_ai.response.id") == rid)
        rpc = next(s for s in spans if s.span_id == gen.parent_span_id)
        return rpc, gen


def _traced_worker(transport: str, record_content: bool) -> Iterator[Traced]:
    receiver = grpc_receiver() if transport == "grpc" else http_receiver()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc" if transport == "grpc" else "http/protobuf",
        "OTEL_EXPORTER_OTLP_HEADERS": f"x-tenant=test-{transport}",
        "OTEL_SERVICE_NAME": f"worker-under-test-{transport}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: spans leave within a tick, not 5 s
    }
    flags = ("--trace-content",) if record_content else ()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("OTEL_TRACES_EXPORTER", raising=False)
        mp.delenv("OTEL_SDK_DISABLED", raising=False)
        for key, value in env.items():
            mp.setenv(key, value)
        w = Worker(*flags)  # copies os.environ now
    try:
        w.wait_ready()
        meta = (("traceparent", f"00-{TRACE_ID}-{PARENT}-01"),)
        stop = pb.StoppingCriteria(max_tokens=6, ignore_eos=True)
        sampling = pb.SamplingParams(temperature=0.0, top_p=0.9, top_k=40, seed=11)

        def generate(**fields) -> tuple[list[pb.GenerateChunk], pb.GenerateComplete]:
            chunks, done = [], None
            for resp in w.stub.Generate(pb.GenerateRequest(**fields), timeout=120,
                                        metadata=meta):
                if resp.HasField("chunk"):
                    chunks.append(resp.chunk)
                else:
                    done = resp.complete
            assert done is not None
            return chunks, done

        text = generate(request_id=f"text-{transport}", text=TEXT_PROMPT, sampling=sampling,
                        stopping=stop)
        chat = generate(request_id=f"chat-{transport}", sampling=sampling, stopping=stop,
                        chat=pb.ChatInput(messages=[pb.ChatMessage(role=r, content=c)
                                                    for r, c in CHAT_MESSAGES]))
        ids = {f"text-{transport}", f"chat-{transport}"}
        receiver.wait_for(lambda spans: ids <= {s.attributes.get("gen_ai.response.id")
                                                for s in spans}
                          and sum(s.kind == SPAN_KIND_SERVER for s in spans) >= 2,
                          what="both requests' spans")
        yield Traced(receiver, record_content, text, chat)
    finally:
        w.close()
        receiver.stop()


@pytest.fixture(scope="module")
def grpc_traced() -> Iterator[Traced]:
    """OTLP/gRPC, content not recorded (the default)."""
    yield from _traced_worker("grpc", record_content=False)


@pytest.fixture(scope="module")
def http_traced() -> Iterator[Traced]:
    """OTLP/HTTP, with --trace-content."""
    yield from _traced_worker("http", record_content=True)


TRANSPORTS = ["grpc_traced", "http_traced"]


def _text(chunks: list[pb.GenerateChunk]) -> str:
    return "".join(c.text for c in chunks)


@pytest.mark.parametrize("fixture", TRANSPORTS)
def test_spans_arrive_over_the_wire_and_join_the_callers_trace(request, fixture) -> None:
    t: Traced = request.getfixturevalue(fixture)
    transport = t.receiver.transport
    # The standard variables were honoured: the transport (this receiver got them), the
    # headers, the service name.
    assert all(h.get("x-tenant") == f"test-{transport}" for h in t.receiver.headers)
    if transport == "http":
        assert all(h["content-type"] == "application/x-protobuf" for h in t.receiver.headers)
    for rid in (f"text-{transport}", f"chat-{transport}"):
        rpc, gen = t.spans_of(rid)
        assert rpc.name == "llmworker.v1.WorkerService/Generate"
        assert rpc.kind == SPAN_KIND_SERVER and gen.kind == SPAN_KIND_INTERNAL
        assert rpc.trace_id == gen.trace_id == TRACE_ID
        assert rpc.parent_span_id == PARENT
        assert rpc.resource["service.name"] == f"worker-under-test-{transport}"
        a = rpc.attributes
        assert (a["rpc.system"], a["rpc.service"], a["rpc.method"], a["rpc.grpc.status_code"]) \
            == ("grpc", "llmworker.v1.WorkerService", "Generate", 0)
        names = [name for name, _ in gen.events]
        assert names[0] == "queued" and names[-1] == "finished" and "first_token" in names


@pytest.mark.parametrize("fixture", TRANSPORTS)
def test_text_request_has_the_genai_attributes(request, fixture) -> None:
    t: Traced = request.getfixturevalue(fixture)
    rid = f"text-{t.receiver.transport}"
    chunks, done = t.text
    _, gen = t.spans_of(rid)
    assert gen.name == f"text_completion {MODEL}"
    a = gen.attributes
    expected = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "llm_worker",
        "gen_ai.request.model": MODEL,
        "gen_ai.response.model": MODEL,
        "gen_ai.response.id": rid,
        "gen_ai.request.max_tokens": 6,
        "gen_ai.request.temperature": 0.0,
        "gen_ai.request.top_k": 40,
        "gen_ai.request.seed": 11,
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.usage.input_tokens": done.usage.prompt_tokens,
        "gen_ai.usage.output_tokens": done.usage.completion_tokens,
    }
    assert {k: a.get(k) for k in expected} == expected
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert done.usage.completion_tokens == 6
    for deprecated in ("gen_ai.system", "gen_ai.usage.prompt_tokens",
                       "gen_ai.usage.completion_tokens", "gen_ai.prompt", "gen_ai.completion"):
        assert deprecated not in a
    assert not any(name.startswith("gen_ai.content.") for name, _ in gen.events)
    if t.record_content:
        assert json.loads(a["gen_ai.input.messages"]) == [
            {"role": "user", "parts": [{"type": "text", "content": TEXT_PROMPT}]}]
        assert json.loads(a["gen_ai.output.messages"]) == [
            {"role": "assistant", "parts": [{"type": "text", "content": _text(chunks)}],
             "finish_reason": "length"}]


def test_no_content_leaves_the_worker_without_trace_content(grpc_traced: Traced) -> None:
    """Not the prompt, not the chat messages, not the output: in no attribute, no event, in
    no byte the receiver got."""
    raw = b"".join(grpc_traced.receiver.bodies)
    secrets = [TEXT_PROMPT, *(c for _, c in CHAT_MESSAGES),
               _text(grpc_traced.text[0]), _text(grpc_traced.chat[0])]
    for secret in secrets:
        assert secret.strip() and secret.encode() not in raw, secret
    for s in grpc_traced.receiver.spans:
        assert "gen_ai.input.messages" not in s.attributes
        assert "gen_ai.output.messages" not in s.attributes


@pytest.mark.parametrize("fixture", TRANSPORTS)
def test_chat_request_is_a_chat_operation(request, fixture) -> None:
    t: Traced = request.getfixturevalue(fixture)
    rid = f"chat-{t.receiver.transport}"
    chunks, done = t.chat
    _, gen = t.spans_of(rid)
    a = gen.attributes
    assert gen.name == f"chat {MODEL}"
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.usage.input_tokens"] == done.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == done.usage.completion_tokens
    if t.record_content:
        assert json.loads(a["gen_ai.input.messages"]) == [
            {"role": r, "parts": [{"type": "text", "content": c}]} for r, c in CHAT_MESSAGES]
        out = json.loads(a["gen_ai.output.messages"])
        assert out[0]["parts"][0]["content"] == _text(chunks)
