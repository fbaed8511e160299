"""The Python client and CLI against an in-process fake WorkerService over loopback.

The fake records every request and its metadata and streams a few chunks then a
``complete``, so these tests check the client's request building, stream handling and
error mapping for real over gRPC, without a model. Tests against the real worker live
with the server's integration tests.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from llmworker.v1 import worker_pb2 as pb
from llmworker.v1 import worker_pb2_grpc

from clients import cli
from clients.client import (
    AsyncWorkerClient,
    Completion,
    IncompleteStreamError,
    WorkerClient,
    build_generate_request,
    default_target,
    finish_reason_name,
)

ROOT = Path(__file__).resolve().parents[1]
CHUNKS = ["Hel", "lo", ", world"]


class FakeWorker(worker_pb2_grpc.WorkerServiceServicer):
    """Streams CHUNKS then a complete; behaviour set per test through attributes."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.admin_calls: list[tuple[str, object]] = []
        self.chunks = list(CHUNKS)
        self.finish = pb.FINISH_REASON_STOP
        self.stop_reason = ""
        self.error_message = ""
        self.abort_with: tuple[grpc.StatusCode, str] | None = None
        self.send_complete = True
        self.delay_s = 0.0
        # When set, the stream waits after its first chunk until the client shows it.
        self.gate: threading.Event | None = None
        self.gate_passed: bool | None = None
        self.spec = (0, 0)  # (draft tokens, accepted tokens) on the complete

    def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if self.abort_with is not None:
            context.abort(*self.abort_with)
        rid = request.request_id or "gen-1"
        for i, text in enumerate(self.chunks):
            yield pb.GenerateResponse(
                request_id=rid, chunk=pb.GenerateChunk(text=text, token_ids=[100 + i])
            )
            if i == 0 and self.gate is not None:
                self.gate_passed = self.gate.wait(5.0)
        if self.delay_s:
            time.sleep(self.delay_s)
        if not self.send_complete:
            return
        yield pb.GenerateResponse(
            request_id=rid,
            complete=pb.GenerateComplete(
                finish_reason=self.finish,
                usage=pb.Usage(
                    prompt_tokens=5, completion_tokens=len(self.chunks), cached_tokens=2
                ),
                queue_time_ms=1.5,
                ttft_ms=12.5,
                total_time_ms=40.25,
                stop_reason=self.stop_reason,
                error_message=self.error_message,
                spec_draft_tokens=self.spec[0],
                spec_accepted_tokens=self.spec[1],
            ),
        )

    def Abort(self, request, context):
        self.admin_calls.append(("Abort", request))
        return pb.AbortResponse(
            aborted_ids=[i for i in request.request_ids if i.startswith("live")]
        )

    def GetModelInfo(self, request, context):
        self.admin_calls.append(("GetModelInfo", request))
        self.metadata.append(dict(context.invocation_metadata()))
        return pb.GetModelInfoResponse(
            model_name="fake-135m",
            architecture="llama",
            vocab_size=49152,
            max_model_len=2048,
            eos_token_ids=[2],
            dtype="float32",
            device="cpu",
            kv_block_size=16,
            weights_source="dummy",
            num_parameters=134_515_008,
        )

    def GetLoad(self, request, context):
        self.admin_calls.append(("GetLoad", request))
        return pb.GetLoadResponse(num_waiting=3, kv_cache_usage=0.25, num_total_blocks=100)

    def GetServerStatus(self, request, context):
        self.admin_calls.append(("GetServerStatus", request))
        return pb.GetServerStatusResponse(
            uptime_s=12.5,
            config_json='{"max_num_seqs": 8}',
            versions={"llm-worker": "0.1.0"},
            requests_by_finish_reason={"stop": 4},
        )

    def Drain(self, request, context):
        self.admin_calls.append(("Drain", request))
        return pb.DrainResponse(in_flight=2)


@pytest.fixture(scope="module")
def server():
    servicer = FakeWorker()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, srv)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("llmworker.v1.WorkerService", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield servicer, f"127.0.0.1:{port}"
    srv.stop(0)


@pytest.fixture
def fake(server) -> FakeWorker:
    servicer, _ = server
    servicer.reset()
    return servicer


@pytest.fixture
def target(server) -> str:
    return server[1]


@pytest.fixture
def client(target):
    with WorkerClient(target, timeout=10) as c:
        yield c


# ---------------------------------------------------------------- request building


def test_text_prompt_request_and_stream(fake, client) -> None:
    responses = list(
        client.generate(
            "Say hello",
            max_tokens=7,
            temperature=0.0,
            seed=3,
            stop=["\n\n", "END"],
            stop_token_ids=[2, 7],
            request_id="r-1",
        )
    )
    assert [r.WhichOneof("response") for r in responses] == ["chunk"] * 3 + ["complete"]
    assert "".join(r.chunk.text for r in responses if r.HasField("chunk")) == "Hello, world"
    assert all(r.request_id == "r-1" for r in responses)

    (req,) = fake.requests
    assert req.WhichOneof("input") == "text" and req.text == "Say hello"
    assert req.request_id == "r-1"
    # temperature 0 (greedy) is present, not "unset"; what was not given is unset.
    assert req.sampling.HasField("temperature") and req.sampling.temperature == 0.0
    assert req.sampling.HasField("seed") and req.sampling.seed == 3
    for name in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty"):
        assert not req.sampling.HasField(name), name
    assert not req.sampling.HasField("frequency_penalty")
    assert req.stopping.max_tokens == 7
    assert list(req.stopping.stop) == ["\n\n", "END"]
    assert list(req.stopping.stop_token_ids) == [2, 7]
    assert req.stopping.ignore_eos is False
    assert req.priority == 0 and not req.logprobs and req.top_logprobs == 0


def test_chat_messages_request(fake, client) -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        ("user", "Hi"),
        pb.ChatMessage(role="assistant", content="Yo"),
    ]
    done = client.complete(messages=msgs, ignore_eos=True)
    assert done.text == "Hello, world"
    (req,) = fake.requests
    assert req.WhichOneof("input") == "chat"
    assert [(m.role, m.content) for m in req.chat.messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", "Yo"),
    ]
    assert req.stopping.ignore_eos is True and req.stopping.max_tokens == 0


def test_token_ids_request(fake, client) -> None:
    client.complete(token_ids=[1, 2, 3], max_tokens=4)
    (req,) = fake.requests
    assert req.WhichOneof("input") == "token_ids"
    assert list(req.token_ids.ids) == [1, 2, 3]


def test_nothing_optional_given_leaves_submessages_unset(fake, client) -> None:
    client.complete("x")
    (req,) = fake.requests
    assert not req.HasField("sampling")
    assert not req.HasField("stopping")
    assert req.request_id == ""  # the worker generates one


def test_every_field_is_sent(fake, client) -> None:
    client.complete(
        "x",
        max_tokens=16,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=2**40,
        stop="###",
        top_logprobs=5,
        priority=-3,
        cache_salt="tenant-a",
        include_special_tokens=True,
    )
    (req,) = fake.requests
    s = req.sampling
    assert s.temperature == pytest.approx(0.7)
    assert s.top_p == pytest.approx(0.9)
    assert s.top_k == 40
    assert s.min_p == pytest.approx(0.05)
    assert s.repetition_penalty == pytest.approx(1.1)
    assert s.presence_penalty == pytest.approx(0.5)
    assert s.frequency_penalty == pytest.approx(-0.5)
    assert s.seed == 2**40
    assert list(req.stopping.stop) == ["###"]  # a single string is one stop string
    assert req.top_logprobs == 5 and req.logprobs  # top_logprobs implies logprobs
    assert req.priority == -3
    assert req.cache_salt == "tenant-a"
    assert req.include_special_tokens


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prompt": "a", "messages": [("user", "b")]},
        {"prompt": "a", "token_ids": [1]},
        {"messages": [("user", "b")], "token_ids": [1]},
        {},
    ],
)
def test_exactly_one_input(fake, client, kwargs) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        client.generate(**kwargs)
    with pytest.raises(ValueError, match="exactly one"):
        build_generate_request(**kwargs)
    assert fake.requests == []  # raised before anything was sent


def test_bad_chat_message_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="role"):
        build_generate_request(messages=[{"content": "no role"}])


# ---------------------------------------------------------------- complete()


@pytest.mark.parametrize(
    ("reason", "name"),
    [
        (pb.FINISH_REASON_STOP, "stop"),
        (pb.FINISH_REASON_LENGTH, "length"),
        (pb.FINISH_REASON_ABORT, "abort"),
        (pb.FINISH_REASON_ERROR, "error"),
    ],
)
def test_complete_maps_finish_reason_and_usage(fake, client, reason, name) -> None:
    fake.finish = reason
    fake.stop_reason = "END" if name == "stop" else ""
    fake.error_message = "boom" if name == "error" else ""
    done = client.complete("x", request_id="req-9")
    assert finish_reason_name(reason) == name
    assert done == Completion(
        request_id="req-9",
        text="Hello, world",
        token_ids=[100, 101, 102],
        finish_reason=name,
        usage={"prompt_tokens": 5, "completion_tokens": 3, "cached_tokens": 2},
        ttft_ms=12.5,
        total_time_ms=40.25,
        stop_reason=fake.stop_reason,
        queue_time_ms=1.5,
        error_message=fake.error_message,
        logprobs=[],
    )


def test_complete_without_final_message_raises(fake, client) -> None:
    fake.send_complete = False
    with pytest.raises(IncompleteStreamError):
        client.complete("x")


# ---------------------------------------------------------------- errors, metadata, env


def test_status_code_is_the_rpc_error(fake, client) -> None:
    fake.abort_with = (grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature must be >= 0")
    with pytest.raises(grpc.RpcError) as info:
        list(client.generate("x", temperature=-1.0))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        client.complete("x")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_deadline(fake, client) -> None:
    fake.delay_s = 1.0
    with pytest.raises(grpc.RpcError) as info:
        client.complete("x", timeout=0.2)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_unreachable_worker_is_unavailable() -> None:
    with WorkerClient("127.0.0.1:1", timeout=5) as c, pytest.raises(grpc.RpcError) as info:
        c.load()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_token_and_metadata_are_sent(fake, target) -> None:
    with WorkerClient(target, token="s3cret", metadata=[("X-Tenant", "a")]) as c:
        c.complete("x", metadata=[("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")])
        c.model_info()
    gen_md, info_md = fake.metadata
    assert gen_md["authorization"] == "Bearer s3cret"
    assert gen_md["x-tenant"] == "a"
    assert gen_md["traceparent"].startswith("00-111")
    assert info_md["authorization"] == "Bearer s3cret"
    assert "traceparent" not in info_md


def test_default_target(monkeypatch) -> None:
    monkeypatch.delenv("LLMWORKER_TARGET", raising=False)
    assert default_target() == "127.0.0.1:50051"
    monkeypatch.setenv("LLMWORKER_TARGET", "10.1.2.3:6000")
    with WorkerClient() as c:
        assert c.target == "10.1.2.3:6000"


# ---------------------------------------------------------------- admin


def test_admin_calls(fake, client) -> None:
    assert client.model_info().model_name == "fake-135m"
    assert client.load().num_waiting == 3
    status = client.status()
    assert status.versions["llm-worker"] == "0.1.0"
    assert json.loads(status.config_json) == {"max_num_seqs": 8}
    assert list(client.abort("live-1", "gone-2").aborted_ids) == ["live-1"]
    assert client.drain().in_flight == 2
    assert client.health() == "SERVING"
    assert client.health("llmworker.v1.WorkerService") == "NOT_SERVING"
    client.wait_until_ready(5)
    names = [name for name, _ in fake.admin_calls]
    assert names == ["GetModelInfo", "GetLoad", "GetServerStatus", "Abort", "Drain"]
    assert list(fake.admin_calls[3][1].request_ids) == ["live-1", "gone-2"]


# ---------------------------------------------------------------- async


def test_async_client(fake, target) -> None:
    async def go():
        async with AsyncWorkerClient(target, timeout=10, token="t") as c:
            await c.wait_until_ready(5)
            texts = []
            async for resp in c.generate(messages=[("user", "Hi")], max_tokens=3, top_k=5):
                if resp.HasField("chunk"):
                    texts.append(resp.chunk.text)
            done = await c.complete(token_ids=[4, 5], stop_token_ids=[9], seed=1)
            with pytest.raises(ValueError, match="exactly one"):
                c.generate("a", token_ids=[1])
            fake.abort_with = (grpc.StatusCode.INVALID_ARGUMENT, "empty input")
            with pytest.raises(grpc.RpcError) as info:
                await c.complete(prompt="")
            fake.abort_with = None
            admin = (
                (await c.model_info()).model_name,
                (await c.load()).num_total_blocks,
                (await c.status()).uptime_s,
                list((await c.abort("live-x")).aborted_ids),
                (await c.drain()).in_flight,
                await c.health(),
            )
            return texts, done, info.value, admin

    texts, done, err, admin = asyncio.run(go())
    assert "".join(texts) == "Hello, world"
    assert done.text == "Hello, world" and done.finish_reason == "stop"
    assert done.usage["cached_tokens"] == 2
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details() == "empty input"
    assert admin == ("fake-135m", 100, 12.5, ["live-x"], 2, "SERVING")

    chat, ids, empty = fake.requests
    assert chat.WhichOneof("input") == "chat" and chat.chat.messages[0].content == "Hi"
    assert chat.stopping.max_tokens == 3 and chat.sampling.top_k == 5
    assert not chat.sampling.HasField("temperature")
    assert list(ids.token_ids.ids) == [4, 5] and list(ids.stopping.stop_token_ids) == [9]
    assert ids.sampling.seed == 1
    assert empty.WhichOneof("input") == "text" and empty.text == ""
    assert fake.metadata[0]["authorization"] == "Bearer t"


# ---------------------------------------------------------------- CLI


class _GatedStdout:
    """A stdout that records writes and flushes and opens the fake's gate on a flush."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate
        self.events: list[tuple[str, str]] = []

    def write(self, s: str) -> int:
        self.events.append(("write", s))
        return len(s)

    def flush(self) -> None:
        self.events.append(("flush", ""))
        if any(s == "Hel" for kind, s in self.events if kind == "write"):
            self.gate.set()

    def text(self) -> str:
        return "".join(s for kind, s in self.events if kind == "write")


def test_cli_generate_stream_shows_text_as_it_arrives(fake, target, monkeypatch, capsys) -> None:
    fake.gate = threading.Event()
    out = _GatedStdout(fake.gate)
    monkeypatch.setattr(sys, "stdout", out)
    rc = cli.main(
        [
            "--target",
            target,
            "generate",
            "Say hello",
            "--stream",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "--stop",
            "END",
            "--stop",
            "\n\n",
        ]
    )
    assert rc == 0
    # The server held the stream after its first chunk until the CLI had flushed it.
    assert fake.gate_passed is True
    assert out.text() == "Hello, world\n"
    assert out.events[:2] == [("write", "Hel"), ("flush", "")]
    err = capsys.readouterr().err
    assert (
        "tokens=3" in err
        and "finish=stop" in err
        and "ttft_ms=12.5" in err
        and "total_ms=40.2" in err
    )
    (req,) = fake.requests
    assert req.text == "Say hello" and req.stopping.max_tokens == 8
    assert list(req.stopping.stop) == ["END", "\n\n"] and req.sampling.temperature == 0.0


def test_speculation_counts_reach_the_completion_and_the_stats_line(fake, target, capsys) -> None:
    with WorkerClient(target) as client:
        plain = client.complete("hi")
        fake.spec = (7, 5)
        drafted = client.complete("hi")
    assert (plain.spec_draft_tokens, plain.spec_accepted_tokens) == (0, 0)
    assert (drafted.spec_draft_tokens, drafted.spec_accepted_tokens) == (7, 5)
    assert cli.main(["generate", "hi", "--target", target]) == 0
    assert "spec_accepted=5/7" in capsys.readouterr().err
    fake.spec = (0, 0)  # a worker without speculation: nothing said of it
    assert cli.main(["generate", "hi", "--target", target]) == 0
    assert "spec_accepted" not in capsys.readouterr().err


def test_cli_generate_whole_text_and_global_options_after_command(fake, target, capsys) -> None:
    rc = cli.main(
        ["generate", "hi", "--target", target, "--top-p", "0.5", "--seed", "4", "--top-k", "3"]
    )
    assert rc == 0
    cap = capsys.readouterr()
    assert cap.out == "Hello, world\n"
    assert "finish=stop" in cap.err
    (req,) = fake.requests
    assert req.sampling.top_p == pytest.approx(0.5) and req.sampling.seed == 4
    assert req.sampling.top_k == 3 and not req.sampling.HasField("temperature")


def test_cli_target_from_env(fake, target, monkeypatch, capsys) -> None:
    monkeypatch.setenv("LLMWORKER_TARGET", target)
    assert cli.main(["generate", "--token-ids", "1,2, 3"]) == 0
    assert list(fake.requests[0].token_ids.ids) == [1, 2, 3]


def test_cli_raw_json(fake, target, capsys) -> None:
    assert cli.main(["--target", target, "generate", "x", "--raw-json", "--request-id", "j1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["requestId"] for line in lines] == ["j1"] * 4
    assert lines[0]["chunk"]["text"] == "Hel"
    assert lines[-1]["complete"]["finishReason"] == "FINISH_REASON_STOP"


def test_cli_chat_sends_messages(fake, target, capsys) -> None:
    rc = cli.main(
        ["--target", target, "chat", "Write a haiku", "--system", "You are a poet.", "--stream"]
    )
    assert rc == 0
    assert capsys.readouterr().out == "Hello, world\n"
    (req,) = fake.requests
    assert [(m.role, m.content) for m in req.chat.messages] == [
        ("system", "You are a poet."),
        ("user", "Write a haiku"),
    ]


def test_cli_model_info_json(fake, target, capsys) -> None:
    assert cli.main(["--target", target, "model-info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["modelName"] == "fake-135m"
    assert info["eosTokenIds"] == [2]
    assert info["numParameters"] == "134515008"  # 64-bit integers are strings, as in grpcurl


def test_cli_admin_commands(fake, target, capsys) -> None:
    assert cli.main(["--target", target, "load"]) == 0
    load = json.loads(capsys.readouterr().out)
    assert load["numWaiting"] == 3 and load["numRunning"] == 0  # defaults are printed
    assert cli.main(["--target", target, "status"]) == 0
    assert json.loads(capsys.readouterr().out)["versions"] == {"llm-worker": "0.1.0"}
    assert cli.main(["--target", target, "abort", "live-1", "old-2"]) == 0
    assert json.loads(capsys.readouterr().out) == {"abortedIds": ["live-1"]}
    assert cli.main(["--target", target, "drain"]) == 0
    assert json.loads(capsys.readouterr().out) == {"inFlight": 2}
    assert cli.main(["--target", target, "health"]) == 0
    assert json.loads(capsys.readouterr().out) == {"status": "SERVING"}
    assert cli.main(["--target", target, "health", "--service", "llmworker.v1.WorkerService"]) == 1
    assert json.loads(capsys.readouterr().out) == {"status": "NOT_SERVING"}


def test_cli_grpc_error(fake, target, capsys) -> None:
    fake.abort_with = (grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1], got 2.0")
    assert cli.main(["--target", target, "generate", "x", "--top-p", "2"]) == 1
    cap = capsys.readouterr()
    assert cap.err.strip() == "error: INVALID_ARGUMENT: top_p must be in (0, 1], got 2.0"
    assert cap.out == ""


def test_cli_failed_generation_exits_1(fake, target, capsys) -> None:
    fake.finish = pb.FINISH_REASON_ERROR
    fake.error_message = "engine failed"
    assert cli.main(["--target", target, "generate", "x"]) == 1
    err = capsys.readouterr().err
    assert "finish=error" in err and "error: generation failed: engine failed" in err


def test_cli_usage_errors(fake, target, capsys) -> None:
    assert cli.main(["--target", target, "generate", "x", "--token-ids", "1"]) == 2
    assert cli.main(["--target", target, "generate", "--token-ids", "1,a"]) == 2
    with pytest.raises(SystemExit) as info:
        cli.main(["--target", target])  # no command
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        cli.main(["--target", target, "generate", "x", "--max-tokens", "many"])
    assert info.value.code == 2
    assert fake.requests == []
    assert "Traceback" not in capsys.readouterr().err


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_cli_traceparent_option_and_env(fake, target, monkeypatch, capsys) -> None:
    monkeypatch.delenv("TRACEPARENT", raising=False)
    assert cli.main(["--target", target, "generate", "x"]) == 0
    assert "traceparent" not in fake.metadata[-1]
    assert cli.main(["--target", target, "chat", "x", "--traceparent", TRACEPARENT]) == 0
    assert fake.metadata[-1]["traceparent"] == TRACEPARENT
    other = TRACEPARENT.replace("b7ad", "c8be")
    monkeypatch.setenv("TRACEPARENT", other)  # OpenTelemetry's environment carrier
    assert cli.main(["--target", target, "generate", "x"]) == 0
    assert fake.metadata[-1]["traceparent"] == other
    n = len(fake.requests)
    assert cli.main(["--target", target, "generate", "x", "--traceparent", "00-bad"]) == 2
    assert "traceparent must be" in capsys.readouterr().err
    assert len(fake.requests) == n  # nothing sent


def test_cli_retries_a_refusal_unless_told_not_to(fake, target, capsys) -> None:
    """The fake refuses every Generate with RESOURCE_EXHAUSTED: retried by default (gRPC
    makes up to 5 attempts), once with --no-retry."""
    fake.abort_with = (grpc.StatusCode.RESOURCE_EXHAUSTED, "the waiting queue is full")
    assert cli.main(["--target", target, "generate", "x", "--no-retry"]) == 1
    assert len(fake.requests) == 1
    assert "error: RESOURCE_EXHAUSTED" in capsys.readouterr().err
    assert cli.main(["--target", target, "generate", "x"]) == 1
    assert len(fake.requests) == 1 + 5


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LLMWORKER_TARGET"}
    return subprocess.run(
        [sys.executable, "-m", "clients.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_process_errors_have_no_traceback(fake, target) -> None:
    fake.abort_with = (grpc.StatusCode.INVALID_ARGUMENT, "stopping.max_tokens: 9999 > 2048")
    proc = _run_cli("--target", target, "generate", "x", "--max-tokens", "9999")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == "error: INVALID_ARGUMENT: stopping.max_tokens: 9999 > 2048"
    proc = _run_cli("--target", "127.0.0.1:1", "--timeout", "5", "load")
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: UNAVAILABLE: ") and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- layering


def _optional_imports(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside a ``try:`` whose handler catches ImportError."""
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id == "ImportError"
                for h in node.handlers):
            ids |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return ids


def test_clients_import_only_stubs_grpc_and_stdlib() -> None:
    forbidden = {"worker", "scheduler", "kvcache", "ops"}
    allowed = {"grpc", "grpc_health", "google", "llmworker", "clients", "__future__"}
    allowed |= set(sys.stdlib_module_names)
    for rel in ("clients/client.py", "clients/cli.py"):
        tree = ast.parse((ROOT / rel).read_text(), filename=rel)
        optional = _optional_imports(tree)
        for node in ast.walk(tree):
            if id(node) in optional and isinstance(node, ast.ImportFrom) and (
                    node.module or "").split(".")[0] == "opentelemetry":
                continue  # trace propagation, used when opentelemetry-api is installed
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: inside clients/
                    continue
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top not in forbidden, f"{rel} imports {name}"
                assert top in allowed, f"{rel} imports {name}, not a stub, grpc or the stdlib"
                if top == "clients":
                    assert name == "clients.client", f"{rel} imports {name}"


def test_client_works_without_opentelemetry() -> None:
    """opentelemetry-api is optional for a client install: blocked from import, the client
    still builds its channel (retry policy included) and sends no trace context."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'opentelemetry': raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from clients.client import WorkerClient, trace_context_metadata\n"
        "assert trace_context_metadata() == []\n"
        "c = WorkerClient('127.0.0.1:1'); c.close()\n"
        "assert not any(m.startswith('opentelemetry') for m in sys.modules)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
