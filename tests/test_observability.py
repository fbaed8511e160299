"""Spans from a real gRPC server in this process, with an in-memory exporter."""

from __future__ import annotations

import asyncio

import grpc
from llmworker.v1 import worker_pb2 as pb
from llmworker.v1 import worker_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from worker import telemetry
from worker.bridge import EngineBridge
from worker.config import CacheConfig, ModelConfig, WorkerConfig
from worker.door import Door
from worker.engine import Engine
from worker.service import WorkerServicer

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN = "b7ad6b7169203331"


async def _run(loaded, requests: list[tuple[pb.GenerateRequest, tuple]],
               conf: WorkerConfig | None = None, concurrent: bool = False) -> list[list]:
    conf = conf or WorkerConfig(cache=CacheConfig(kv_cache_memory=0.5))
    bridge = EngineBridge(Engine(conf, loaded=loaded))
    bridge.start()
    door = Door(conf)
    door.attach(bridge)
    servicer = WorkerServicer(door)
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            async def one(req: pb.GenerateRequest, metadata: tuple) -> list:
                return [r async for r in stub.Generate(req, metadata=metadata)]

            if concurrent:
                results = list(await asyncio.gather(*(one(r, m) for r, m in requests)))
            else:
                results = [await one(r, m) for r, m in requests]
            await stub.GetLoad(pb.GetLoadRequest(), metadata=requests[-1][1])
            return results
    finally:
        await server.stop(0)
        await bridge.close()


def test_generate_spans_join_the_trace_and_carry_genai_attributes(default_model) -> None:
    exporter = InMemorySpanExporter()
    assert telemetry.configure_tracing(exporter=exporter)
    try:
        traceparent = (("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN}-01"),)
        req = pb.GenerateRequest(
            request_id="span-test", text="The capital of France is",
            sampling=pb.SamplingParams(temperature=0.0, top_p=0.9, top_k=40),
            stopping=pb.StoppingCriteria(max_tokens=5, ignore_eos=True))
        (responses,) = asyncio.run(_run(default_model, [(req, traceparent)]))
    finally:
        spans = exporter.get_finished_spans()
        telemetry.shutdown_tracing()
    text = "".join(r.chunk.text for r in responses if r.HasField("chunk"))
    assert responses[-1].complete.usage.completion_tokens == 5

    by_name = {s.name: s for s in spans}
    rpc = by_name["llmworker.v1.WorkerService/Generate"]
    assert format(rpc.context.trace_id, "032x") == TRACE_ID
    assert format(rpc.parent.span_id, "016x") == PARENT_SPAN
    # The peer, from grpc.aio's own context.peer() (the client's ephemeral port).
    assert rpc.attributes["network.peer.address"] == "127.0.0.1"
    assert rpc.attributes["network.transport"] == "tcp"
    assert rpc.attributes["network.type"] == "ipv4"
    assert 0 < rpc.attributes["network.peer.port"] < 65536
    assert "llmworker.v1.WorkerService/GetLoad" in by_name  # admin RPCs are traced too

    gen = by_name["text_completion SmolLM2-135M-Instruct"]
    assert gen.parent.span_id == rpc.context.span_id and gen.context.trace_id == rpc.context.trace_id
    a = gen.attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.provider.name"] == "llm_worker" and "gen_ai.system" not in a
    assert a["gen_ai.request.model"] == "SmolLM2-135M-Instruct"
    assert a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.request.temperature"] == 0.0
    assert abs(a["gen_ai.request.top_p"] - 0.9) < 1e-6 and a["gen_ai.request.top_k"] == 40
    assert a["gen_ai.response.id"] == "span-test"
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["gen_ai.usage.input_tokens"] == responses[-1].complete.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == 5
    names = [e.name for e in gen.events]
    assert names[:4] == ["queued", "scheduled", "first_token", "finished"]
    times = [e.timestamp for e in gen.events[:4]]
    assert times == sorted(times)
    # Prompt and output text are not recorded unless the server opts in.
    recorded = str(a) + str([dict(e.attributes or {}) for e in gen.events])
    assert "France" not in recorded and (not text or text not in recorded)


def test_preemption_shows_as_span_events(default_model) -> None:
    """Two requests that cannot both fit in a 12-block cache: the later one is preempted
    (recompute), resumes, and its span says so."""
    exporter = InMemorySpanExporter()
    assert telemetry.configure_tracing(exporter=exporter)
    per_block = 16 * 2 * 30 * 3 * 64 * 4  # tokens per block x fp32 KV bytes per token
    conf = WorkerConfig(model=ModelConfig(max_model_len=192),
                        cache=CacheConfig(kv_cache_memory=12.5 * per_block / (1 << 30)))
    reqs = [(pb.GenerateRequest(request_id=f"pre-{i}", token_ids=pb.TokenIdsInput(ids=list(range(100 + i, 110 + i))),
                                sampling=pb.SamplingParams(temperature=0.0),
                                stopping=pb.StoppingCriteria(max_tokens=150, ignore_eos=True)), ())
            for i in range(2)]
    try:
        results = asyncio.run(_run(default_model, reqs, conf, concurrent=True))
    finally:
        spans = exporter.get_finished_spans()
        telemetry.shutdown_tracing()
    assert all(r[-1].complete.usage.completion_tokens == 150 for r in results)
    events = {s.attributes["gen_ai.response.id"]: [e.name for e in s.events]
              for s in spans if s.name.startswith("text_completion")}
    assert any("preempted" in ev and "resumed" in ev for ev in events.values()), events
    for ev in events.values():
        assert ev[0] == "queued" and ev[-1] == "finished"
