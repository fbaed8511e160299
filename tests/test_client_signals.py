"""The client's standard signals, against a tiny stand-in grpc.aio server in this process
that refuses the first N Generate attempts and counts them:

- retries: gRPC itself, configured only by the shipped service config
  (`clients.client.RETRY_SERVICE_CONFIG` / `retry_channel_options`), retries Generate on
  RESOURCE_EXHAUSTED and UNAVAILABLE before the first chunk, waits what the refusal's
  ``grpc-retry-pushback-ms`` trailer says (gRFC A6) instead of its own backoff, never
  retries a stream that has begun, and stops at a negative pushback;
- trace context: the client sends the current OpenTelemetry span's ``traceparent``, or the
  one it is given.

The last test runs the same against a real worker whose waiting queue is full; it needs the
worker to send ``grpc-retry-pushback-ms`` (the door, issue 19)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import grpc
import pytest
from llmworker.v1 import worker_pb2 as pb
from llmworker.v1 import worker_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from clients.client import (
    RETRY_SERVICE_CONFIG,
    AsyncWorkerClient,
    WorkerClient,
    retry_channel_options,
    retry_service_config,
    trace_context_metadata,
)

PUSHBACK_MS = 500  # well above the shipped policy's first backoffs (random, <= 0.1 s, 0.2 s)


class StandIn(worker_pb2_grpc.WorkerServiceServicer):
    """Refuses the first `refusals` attempts with `code` (and the trailers given), then
    streams two chunks and a complete; with `fail_after_chunk` it fails after one chunk."""

    def __init__(self) -> None:
        self.refusals = 0
        self.code = grpc.StatusCode.RESOURCE_EXHAUSTED
        self.trailers: tuple[tuple[str, str], ...] = ()
        self.fail_after_chunk = False
        self.attempts: list[float] = []  # time.monotonic() of each attempt
        self.metadata: list[dict[str, str]] = []

    async def Generate(self, request, context):
        self.attempts.append(time.monotonic())
        self.metadata.append({m.key: m.value for m in context.invocation_metadata()})
        if len(self.attempts) <= self.refusals:
            await context.abort(self.code, f"refused attempt {len(self.attempts)}",
                                trailing_metadata=self.trailers)
        yield pb.GenerateResponse(request_id=request.request_id,
                                  chunk=pb.GenerateChunk(text="Hello", token_ids=[1]))
        if self.fail_after_chunk:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker shut down")
        yield pb.GenerateResponse(request_id=request.request_id,
                                  chunk=pb.GenerateChunk(text=" world", token_ids=[2]))
        yield pb.GenerateResponse(request_id=request.request_id, complete=pb.GenerateComplete(
            finish_reason=pb.FINISH_REASON_STOP,
            usage=pb.Usage(prompt_tokens=3, completion_tokens=2)))

    async def GetLoad(self, request, context):
        self.metadata.append({m.key: m.value for m in context.invocation_metadata()})
        return pb.GetLoadResponse()

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.attempts, self.attempts[1:], strict=False)]


@pytest.fixture
def stand_in() -> Iterator[tuple[StandIn, str]]:
    """The servicer and its address; the grpc.aio server runs on its own loop and thread,
    so that blocking clients can be used from the test."""
    servicer = StandIn()
    loop = asyncio.new_event_loop()
    started: Future[tuple[grpc.aio.Server, int]] = Future()

    async def start() -> None:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        started.set_result((server, port))

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop)
    server, port = started.result(10)
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def stock_generate(target: str, options: list | None = None) -> list[pb.GenerateResponse]:
    """A stock grpc client: a channel, the generated stub, nothing of ours but the options."""
    with grpc.insecure_channel(target, options=options or []) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        return list(stub.Generate(pb.GenerateRequest(request_id="r", text="hi"), timeout=20))


PUSHBACK = (("grpc-retry-pushback-ms", str(PUSHBACK_MS)), ("retry-after-ms", str(PUSHBACK_MS)))


# ---------------------------------------------------------------- the service config


def test_the_shipped_service_config() -> None:
    config = json.loads(RETRY_SERVICE_CONFIG)
    (method,) = config["methodConfig"]
    assert method["name"] == [{"service": "llmworker.v1.WorkerService", "method": "Generate"}]
    policy = method["retryPolicy"]
    assert policy["retryableStatusCodes"] == ["RESOURCE_EXHAUSTED", "UNAVAILABLE"]
    assert policy["maxAttempts"] == 5
    assert (policy["initialBackoff"], policy["maxBackoff"]) == ("0.1s", "5s")
    assert config["retryThrottling"] == {"maxTokens": 10, "tokenRatio": 0.1}
    assert ("grpc.service_config", RETRY_SERVICE_CONFIG) in retry_channel_options()
    with pytest.raises(ValueError, match="max_attempts"):
        retry_service_config(max_attempts=6)
    with pytest.raises(ValueError, match="backoff"):
        retry_service_config(initial_backoff_s=2, max_backoff_s=1)
    assert retry_service_config(initial_backoff_s=0.00001)["methodConfig"][0][
        "retryPolicy"]["initialBackoff"] == "0.00001s"


@pytest.mark.parametrize("refusals", [1, 2, 4])
def test_a_stock_client_retries_after_the_pushback_and_succeeds(stand_in, refusals) -> None:
    servicer, target = stand_in
    servicer.refusals, servicer.trailers = refusals, PUSHBACK
    responses = stock_generate(target, retry_channel_options())
    assert [r.chunk.text for r in responses[:2]] == ["Hello", " world"]
    assert responses[-1].complete.finish_reason == pb.FINISH_REASON_STOP
    assert len(servicer.attempts) == refusals + 1
    # gRPC waited the pushback (not its own backoff of at most 0.1 s, 0.2 s, ...) each time.
    assert all(gap >= PUSHBACK_MS / 1000 - 0.02 for gap in servicer.gaps()), servicer.gaps()
    assert all(gap < PUSHBACK_MS / 1000 + 1.0 for gap in servicer.gaps()), servicer.gaps()


def test_without_pushback_the_backoff_is_grpcs_own(stand_in) -> None:
    """The control for the test above: the same refusals without the trailer are retried
    after the policy's jittered exponential backoff, well under the pushback."""
    servicer, target = stand_in
    servicer.refusals = 2
    stock_generate(target, retry_channel_options())
    assert len(servicer.attempts) == 3
    # The first retry waits a random time up to 0.1 s; a loaded machine may stretch either
    # gap, never below what was waited: one gap well under the pushback tells the two apart.
    assert min(servicer.gaps()) < PUSHBACK_MS / 1000 - 0.2, servicer.gaps()


def test_unavailable_before_the_first_chunk_is_retried(stand_in) -> None:
    servicer, target = stand_in
    servicer.refusals, servicer.code = 1, grpc.StatusCode.UNAVAILABLE
    responses = stock_generate(target, retry_channel_options())
    assert responses[-1].HasField("complete") and len(servicer.attempts) == 2


@pytest.mark.parametrize(
    ("case", "refusals", "code", "trailers", "attempts"),
    [
        ("no-policy", 1, grpc.StatusCode.RESOURCE_EXHAUSTED, PUSHBACK, 1),
        ("negative-pushback", 1, grpc.StatusCode.RESOURCE_EXHAUSTED,
         (("grpc-retry-pushback-ms", "-1"),), 1),
        ("not-retryable", 1, grpc.StatusCode.INVALID_ARGUMENT, (), 1),
        ("gives-up-after-5", 9, grpc.StatusCode.RESOURCE_EXHAUSTED, (), 5),
    ],
)
def test_what_is_not_retried(stand_in, case, refusals, code, trailers, attempts) -> None:
    servicer, target = stand_in
    servicer.refusals, servicer.code, servicer.trailers = refusals, code, trailers
    options = [] if case == "no-policy" else retry_channel_options()
    with pytest.raises(grpc.RpcError) as info:
        stock_generate(target, options)
    assert info.value.code() == code
    assert len(servicer.attempts) == attempts
    if case == "no-policy":  # what the worker sent is what the client sees
        assert dict(info.value.trailing_metadata())["grpc-retry-pushback-ms"] == str(PUSHBACK_MS)


def test_a_stream_that_has_begun_is_never_retried(stand_in) -> None:
    """gRPC commits a call at its first response: a failure after a chunk reaches the
    caller (who has text already) and nothing is sent twice."""
    servicer, target = stand_in
    servicer.fail_after_chunk = True
    got = []
    with pytest.raises(grpc.RpcError) as info:
        with grpc.insecure_channel(target, options=retry_channel_options()) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            for resp in stub.Generate(pb.GenerateRequest(request_id="r", text="hi"), timeout=20):
                got.append(resp.chunk.text)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert got == ["Hello"] and len(servicer.attempts) == 1


def test_our_clients_ship_the_policy(stand_in) -> None:
    servicer, target = stand_in
    servicer.refusals, servicer.trailers = 1, PUSHBACK
    with WorkerClient(target, timeout=20) as client:
        done = client.complete("hi")
    assert done.text == "Hello world" and len(servicer.attempts) == 2

    async def async_client() -> str:
        async with AsyncWorkerClient(target, timeout=20) as client:
            return (await client.complete("hi")).text

    servicer.attempts.clear()
    assert asyncio.run(async_client()) == "Hello world"
    assert len(servicer.attempts) == 2 and servicer.gaps()[0] >= PUSHBACK_MS / 1000 - 0.02

    servicer.attempts.clear()
    with WorkerClient(target, timeout=20, retry=False) as client, \
            pytest.raises(grpc.RpcError) as info:
        client.complete("hi")
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(servicer.attempts) == 1


# ---------------------------------------------------------------- trace context


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_the_current_span_travels_as_traceparent(stand_in) -> None:
    servicer, target = stand_in
    tracer = TracerProvider().get_tracer("test")
    with WorkerClient(target, timeout=20) as client:
        client.complete("no span")
        with tracer.start_as_current_span("caller") as span:
            client.complete("in a span")
            client.load()  # every call, not only Generate
            ctx = span.get_span_context()
        client.complete("explicit", traceparent=TRACEPARENT)
        with tracer.start_as_current_span("caller"):
            client.complete("explicit wins", traceparent=TRACEPARENT)
            client.complete("metadata wins", metadata=[("traceparent", TRACEPARENT)])
    assert "traceparent" not in servicer.metadata[0]
    want = (f"00-{trace.format_trace_id(ctx.trace_id)}-{trace.format_span_id(ctx.span_id)}"
            f"-{ctx.trace_flags:02x}")
    assert servicer.metadata[1]["traceparent"] == want
    assert servicer.metadata[2]["traceparent"] == want
    assert [m["traceparent"] for m in servicer.metadata[3:]] == [TRACEPARENT] * 3


def test_async_client_propagates_too(stand_in) -> None:
    servicer, target = stand_in
    tracer = TracerProvider().get_tracer("test")

    async def main() -> str:
        async with AsyncWorkerClient(target, timeout=20) as client:
            with tracer.start_as_current_span("caller") as span:
                await client.complete("hi")
                return trace.format_trace_id(span.get_span_context().trace_id)

    trace_id = asyncio.run(main())
    assert servicer.metadata[0]["traceparent"].split("-")[1] == trace_id


@pytest.mark.parametrize("bad", ["", "00-xyz", TRACEPARENT.upper(), TRACEPARENT + "-00",
                                 "x" * 10_000])
def test_a_malformed_traceparent_is_refused_before_sending(bad) -> None:
    with pytest.raises(ValueError, match="traceparent must be") as info:
        trace_context_metadata(bad)
    assert len(str(info.value)) < 200  # quotes a bounded prefix


# ---------------------------------------------------------------- a real worker


def test_a_full_worker_says_when_and_a_stock_client_comes_back_then() -> None:
    from tests.test_server import Worker, wait_until

    w = Worker("--model", "dummy:smollm2-135m", "--max-num-seqs", "1", "--max-waiting", "1",
               "--retry-after-ms", "400", "--no-reflection")
    calls: list = []
    try:
        w.wait_ready()

        def start(rid: str):
            call = w.stub.Generate(pb.GenerateRequest(
                request_id=rid, token_ids=pb.TokenIdsInput(ids=[1, 2, 3]),
                stopping=pb.StoppingCriteria(max_tokens=1500, ignore_eos=True)), timeout=120)
            calls.append(call)
            return call

        assert next(start("running")).HasField("chunk")  # holds the one seat
        start("waiting")
        wait_until(lambda: w.stub.GetLoad(pb.GetLoadRequest(), timeout=5).num_waiting == 1,
                   what="a full waiting queue")
        request = pb.GenerateRequest(request_id="late", token_ids=pb.TokenIdsInput(ids=[4, 5]),
                                     stopping=pb.StoppingCriteria(max_tokens=2))
        with grpc.insecure_channel(w.address) as plain, pytest.raises(grpc.RpcError) as info:
            list(worker_pb2_grpc.WorkerServiceStub(plain).Generate(request, timeout=20))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(info.value.trailing_metadata())
        assert trailers.get("grpc-retry-pushback-ms") == trailers.get("retry-after-ms") == "400"

        # The same request through the shipped policy: refused, then the seats free up
        # before the pushback ends, and the retry gets in.
        result: Future[list[pb.GenerateResponse]] = Future()

        def late() -> None:
            try:
                with grpc.insecure_channel(w.address, options=retry_channel_options()) as ch:
                    result.set_result(list(
                        worker_pb2_grpc.WorkerServiceStub(ch).Generate(request, timeout=30)))
            except Exception as e:
                result.set_exception(e)

        t0 = time.monotonic()
        threading.Thread(target=late, daemon=True).start()
        time.sleep(0.15)
        w.stub.Abort(pb.AbortRequest(request_ids=["running", "waiting"]), timeout=5)
        responses = result.result(30)
        assert responses[-1].complete.usage.completion_tokens == 2
        assert time.monotonic() - t0 >= 0.4 - 0.02
    finally:
        for call in calls:
            call.cancel()
        w.close()
