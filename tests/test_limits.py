"""Limits at the door and fault handling (issue 8).

- A real `llm-worker serve` process (dummy weights) with tight limits: prompt tokens, chat
  messages, message size (gRPC's own RESOURCE_EXHAUSTED) and generation time.
- The bridge alone: `expire` ends a request through the abort path as "length".
- Fault injection in process: a tiny engine whose runner raises on a chosen step, behind
  the real `WorkerServicer` on a loopback gRPC server: the streams of that step end
  INTERNAL, the others complete, no block leaks; failed steps in a row stop the engine,
  and the worker stops serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from llmworker.v1 import worker_pb2 as pb
from llmworker.v1 import worker_pb2_grpc

from scheduler.request import Request
from tests.test_server import GREEDY, FakeEngine, Worker, blocks_all_free, code_of, run, wait_until
from worker.bridge import EngineBridge
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig, WorkerConfig
from worker.door import Door
from worker.engine import Engine
from worker.outputs import RequestOutput
from worker.service import WorkerServicer
from worker.weights import LoadedModel, _build, dummy

# ----- a real process with tight limits ----------------------------------------------------


@pytest.fixture(scope="module")
def limited_worker() -> Iterator[Worker]:
    w = Worker("--model", "dummy:smollm2-135m", "--max-prompt-tokens", "64",
               "--max-chat-messages", "2", "--max-message-bytes", "65536",
               "--max-generation-time-s", "1.5", "--no-reflection")
    try:
        yield w.wait_ready()
    finally:
        w.close()


def _ids(n: int) -> pb.TokenIdsInput:
    return pb.TokenIdsInput(ids=[10 + i % 100 for i in range(n)])


def test_prompt_token_limit(limited_worker: Worker) -> None:
    stub = limited_worker.stub
    _, done = run(stub, token_ids=_ids(64), sampling=GREEDY, stopping=pb.StoppingCriteria(max_tokens=2))
    assert done.finish_reason == pb.FINISH_REASON_LENGTH
    with pytest.raises(grpc.RpcError) as e:
        run(stub, token_ids=_ids(65), stopping=pb.StoppingCriteria(max_tokens=2), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "65 tokens" in e.value.details() and "--max-prompt-tokens" in e.value.details()


def test_chat_message_limit(limited_worker: Worker) -> None:
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi")] * 3)
    with pytest.raises(grpc.RpcError) as e:
        run(limited_worker.stub, chat=chat, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.messages" in e.value.details() and "--max-chat-messages" in e.value.details()


def test_oversize_message_is_resource_exhausted(limited_worker: Worker) -> None:
    # gRPC refuses it before our handler runs; the worker keeps serving.
    assert code_of(lambda: run(limited_worker.stub, text="x" * 70_000, timeout=10)
                   ) == grpc.StatusCode.RESOURCE_EXHAUSTED
    resp = limited_worker.health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_generation_time_limit_ends_with_length(limited_worker: Worker) -> None:
    stub = limited_worker.stub
    t0 = time.monotonic()
    chunks, done = run(stub, token_ids=_ids(8), sampling=GREEDY,
                       stopping=pb.StoppingCriteria(max_tokens=2000), timeout=60)
    took = time.monotonic() - t0
    n = sum(len(c.token_ids) for c in chunks)
    assert done.finish_reason == pb.FINISH_REASON_LENGTH and n == done.usage.completion_tokens
    assert 1 <= n < 2000 and 1.5 <= took < 10, (n, took)
    wait_until(lambda: blocks_all_free(limited_worker), what="blocks freed after the time limit")
    st = stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=5)
    assert st.requests_by_finish_reason["length"] >= 2 and "abort" not in st.requests_by_finish_reason


# ----- the bridge alone ---------------------------------------------------------------------


def test_bridge_expire_reports_length_and_keeps_a_natural_finish() -> None:
    async def main() -> None:
        eng = FakeEngine()
        bridge = EngineBridge(eng)  # type: ignore[arg-type]
        bridge.start()
        a, b = bridge.open(Request("a", [1])), bridge.open(Request("b", [1]))
        assert bridge.expire("a") and bridge.expire("b") and eng.aborted == ["a", "b"]
        assert not bridge.expire("nope")

        def engine_thread() -> None:  # a is aborted; b had stopped on its own in that step
            eng.sink([RequestOutput("a", [], "", finished=True, finish_reason="abort"),
                      RequestOutput("b", [7], "s", finished=True, finish_reason="stop")])

        await asyncio.to_thread(engine_thread)
        assert (await a.next()).finish_reason == "length"
        assert (await b.next()).finish_reason == "stop"
        assert bridge.finish_counts == {"length": 1, "stop": 1}
        await bridge.close()

    asyncio.run(main())


# ----- fault injection: a tiny engine behind the real servicer ------------------------------


def _tiny_loaded() -> LoadedModel:
    cfg = dataclasses.replace(dummy.SHAPES["smollm2-135m"], vocab_size=512, hidden_size=64,
                              intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=16, max_position_embeddings=512)
    model = _build(cfg, torch.device("cpu"), torch.float32)
    dummy.init_dummy(model)
    return LoadedModel(model, cfg, None, "tiny", "dummy", model.embed_tokens.weight.device,
                       model.embed_tokens.weight.dtype)


def _tiny_engine(max_num_seqs: int) -> Engine:
    conf = WorkerConfig(model=ModelConfig(device="cpu", max_model_len=256, cuda_graphs=False),
                        cache=CacheConfig(kv_cache_memory=0.002),
                        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs))
    return Engine(conf, loaded=_tiny_loaded())


class Served:
    """The engine behind a bridge, a `WorkerServicer` and health on a loopback aio server,
    wired as `worker.server` wires them (engine death -> drain -> health NOT_SERVING)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def __aenter__(self) -> Served:
        self.health = health.aio.HealthServicer()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.door = Door(WorkerConfig(server=ServerConfig()),
                         on_drain=self.health.enter_graceful_shutdown)
        self.servicer = WorkerServicer(self.door)
        self.bridge = EngineBridge(self.engine, watchdog_period_s=0.02)
        loop = asyncio.get_running_loop()
        self.bridge.on_dead = lambda: loop.create_task(self.door.start_draining())
        self.bridge.start()
        self.door.attach(self.bridge)
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()
        await self.server.stop(None)
        await self.bridge.close()

    async def generate(self, rid: str, max_tokens: int = 8, lora_name: str = "") -> tuple[grpc.StatusCode, str, list]:
        """(status, details, messages) of one Generate call."""
        msgs = []
        call = self.stub.Generate(pb.GenerateRequest(
            request_id=rid, token_ids=pb.TokenIdsInput(ids=[5, 6, 7, 8]), sampling=GREEDY,
            stopping=pb.StoppingCriteria(max_tokens=max_tokens), lora_name=lora_name), timeout=60)
        try:
            async for m in call:
                msgs.append(m)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or "", msgs
        return grpc.StatusCode.OK, "", msgs


def _inject(engine: Engine, fail: Callable[[int], bool]) -> list[list[str]]:
    """Make `engine.runner.execute` raise when `fail(step_number)`; returns the ids of each
    failed step's batch."""
    real = engine.runner.execute
    failed: list[list[str]] = []
    n = [0]
    lock = threading.Lock()

    def execute(sched):
        with lock:
            n[0] += 1
            k = n[0]
        if fail(k):
            failed.append([s.request_id for s in sched.scheduled])
            raise RuntimeError(f"injected fault at step {k}")
        return real(sched)

    engine.runner.execute = execute  # type: ignore[method-assign]
    return failed


def _assert_no_leak(engine: Engine) -> None:
    wait_until(lambda: not engine.scheduler.has_unfinished_requests(), what="engine idle")
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_integrity()


def test_a_failed_model_step_ends_its_streams_internal_others_complete() -> None:
    engine = _tiny_engine(max_num_seqs=2)
    failed = _inject(engine, lambda k: k == 3)

    async def main() -> None:
        async with Served(engine) as s:
            results = await asyncio.gather(*(s.generate(f"r{i}") for i in range(5)))
            assert len(failed) == 1 and failed[0]
            for i, (code, details, msgs) in enumerate(results):
                if f"r{i}" in failed[0]:
                    assert code == grpc.StatusCode.INTERNAL, (code, details)
                    assert "injected fault at step 3" in details and f"r{i}" in details
                    assert not any(m.HasField("complete") for m in msgs)
                else:
                    assert code == grpc.StatusCode.OK, (code, details)
                    assert msgs[-1].complete.finish_reason == pb.FINISH_REASON_LENGTH
                    assert msgs[-1].complete.usage.completion_tokens == 8
            assert len(failed[0]) < 5  # some were not in that step, and completed
            _assert_no_leak(engine)
            assert not s.bridge.dead and engine.num_failed_steps == 0
            # The worker goes on serving.
            code, _, msgs = await s.generate("after")
            assert code == grpc.StatusCode.OK and msgs[-1].complete.usage.completion_tokens == 8
            assert s.bridge.finish_counts["error"] == len(failed[0])

    asyncio.run(main())


def test_failed_steps_in_a_row_stop_the_engine_and_the_worker_stops_serving() -> None:
    engine = _tiny_engine(max_num_seqs=4)
    _inject(engine, lambda k: True)  # a broken device: every step fails

    async def main() -> None:
        async with Served(engine) as s:
            for i in range(Engine.max_consecutive_failed_steps):
                code, details, _ = await s.generate(f"f{i}")
                assert code == grpc.StatusCode.INTERNAL and "injected fault" in details
            # The engine thread ends itself; the watchdog marks the bridge dead and drains.
            await asyncio.wait_for(_until(lambda: s.bridge.dead), 5)
            resp = await s.health_stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
            code, details, _ = await s.generate("late")
            assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
            assert engine.kv.num_free_blocks == engine.kv.num_blocks  # failed steps freed theirs

    asyncio.run(main())


async def _until(pred) -> None:
    while not pred():
        await asyncio.sleep(0.01)


def test_the_real_server_stops_serving_and_exits_1_when_the_engine_cannot_go_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`worker.server.serve` in process, its engine swapped for the tiny one: after the
    warm-up every model step fails; each request ends INTERNAL, the engine stops, health
    goes NOT_SERVING (the drain) and `serve` returns 1."""
    from worker import server

    engine = _tiny_engine(max_num_seqs=4)
    armed = threading.Event()
    _inject(engine, lambda k: armed.is_set())
    lines: list[str] = []
    say = server._say
    monkeypatch.setattr(server, "_say", lambda line, **kw: (lines.append(line), say(line, **kw)))
    monkeypatch.setattr(server, "Engine", lambda config: engine)
    monkeypatch.setattr(server.telemetry, "configure_logging", lambda *a, **k: None)
    statuses: list[str] = []
    shutdown = health.aio.HealthServicer.enter_graceful_shutdown

    async def spy(self) -> None:
        statuses.append("NOT_SERVING")
        await shutdown(self)

    monkeypatch.setattr(health.aio.HealthServicer, "enter_graceful_shutdown", spy)
    config = WorkerConfig(server=ServerConfig(port=0, drain_grace_s=1.0, reflection=False))

    async def main() -> int:
        task = asyncio.create_task(server.serve(config))
        await asyncio.wait_for(_until(lambda: any(ln.startswith("serving ") for ln in lines)), 60)
        port = next(ln for ln in lines if ln.startswith("listening on")).split()[2].rstrip(";").rsplit(":", 1)[1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            h = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert h.status == health_pb2.HealthCheckResponse.SERVING
            armed.set()
            for i in range(Engine.max_consecutive_failed_steps):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(pb.GenerateRequest(
                            request_id=f"x{i}", token_ids=pb.TokenIdsInput(ids=[5, 6, 7]),
                            stopping=pb.StoppingCriteria(max_tokens=4)), timeout=30):
                        pass
                assert e.value.code() == grpc.StatusCode.INTERNAL, e.value.details()
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(main()) == 1
    assert statuses == ["NOT_SERVING"]
    assert any("engine thread died" in ln for ln in lines)


def test_an_adapter_unloaded_after_the_door_checked_it_is_invalid_argument(tmp_path) -> None:
    """The door checks a request's LoRA adapter, the engine takes it a moment later: an
    unload in between (an admin RPC on another thread) refuses that request with
    INVALID_ARGUMENT naming the adapter, not INTERNAL; nothing leaks, the worker goes on."""
    from benchmarks.lora import write_adapters
    from worker.config import LoraConfig

    loaded = _tiny_loaded()
    (path,) = write_adapters(tmp_path, loaded.config, 1, 4, ["q_proj", "v_proj"]).values()
    conf = WorkerConfig(model=ModelConfig(device="cpu", max_model_len=256, cuda_graphs=False),
                        cache=CacheConfig(kv_cache_memory=0.002),
                        lora=LoraConfig(enable_lora=True, max_loras=2, max_lora_rank=8,
                                        lora_modules=(f"a0={path}",)))
    engine = Engine(conf, loaded=loaded)
    loras = engine.loras
    assert loras is not None
    real = loras.acquire
    unloads = []

    def acquire(key: str):  # the engine thread, right after the door let the request in
        if not unloads:
            loras.unload("a0")
            unloads.append(key)
        return real(key)

    loras.acquire = acquire  # type: ignore[method-assign]

    async def main() -> None:
        async with Served(engine) as s:
            code, details, msgs = await s.generate("late-unload", lora_name="a0")
            assert unloads and code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
            assert "'a0'" in details and "late-unload" in details and not msgs
            _assert_no_leak(engine)
            loras.load("a0", str(path))  # loaded again: served
            code, _, msgs = await s.generate("again", lora_name="a0")
            assert code == grpc.StatusCode.OK and msgs[-1].complete.usage.completion_tokens == 8
            _assert_no_leak(engine)
            assert not s.bridge.dead and engine.num_failed_steps == 0

    asyncio.run(main())
