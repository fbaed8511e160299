"""`llm-worker serve`: the gRPC server around the one engine.

Start-up: listen at once (health says NOT_SERVING), load the model in a thread so the
loop keeps answering, run one warm-up generation, then health SERVING and the ready line::

    llm-worker: serving SmolLM2-135M-Instruct on 127.0.0.1:50051

SIGTERM or SIGINT drains: health NOT_SERVING at once, new Generate calls get UNAVAILABLE,
in-flight requests get --drain-grace-s to finish (a second signal cuts the grace short),
the rest are aborted; then the server and the engine stop and `serve` returns 0.
"""

from __future__ import annotations

import asyncio
import signal
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from llmworker.v1 import worker_pb2_grpc

from scheduler.request import SamplingParams
from worker import telemetry
from worker.bridge import EngineBridge
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.service import SERVICE_NAME, WorkerServicer

log = telemetry.get_logger("worker.server")

HEALTH_SERVICES = ("", SERVICE_NAME)  # "" = the whole server
_STOP_GRACE_S = 5.0  # for the last messages of finished streams to flush


def _say(line: str, **fields: object) -> None:
    log.info(f"llm-worker: {line}", **fields)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def warm_up(bridge: EngineBridge) -> None:
    """One tiny greedy generation through the whole path (engine thread, sink, stream)."""
    engine = bridge.engine
    ids = engine.tokenizer.encode("Hello") if engine.tokenizer else [1, 2, 3, 4]
    req = engine.make_request(ids, SamplingParams(temperature=0.0, max_tokens=2),
                              request_id=f"warmup-{uuid.uuid4().hex}")
    stream = bridge.open(req, tracked=False)
    while not (out := await stream.next()).finished:
        pass
    if out.finish_reason == "error":
        raise RuntimeError(f"the warm-up generation failed: {out.error}")


async def serve(config: WorkerConfig) -> int:
    """Run the worker until a signal drains it; returns the exit code: 0, or 1 when the
    engine thread died."""
    sc = config.server
    telemetry.configure_logging(sc.log_format, sc.log_level)
    tracing = telemetry.configure_tracing()
    loop = asyncio.get_running_loop()
    _say("config", config=config.to_dict(), tracing=tracing)

    health_servicer = health.aio.HealthServicer()
    for name in HEALTH_SERVICES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    servicer = WorkerServicer(config, on_drain=health_servicer.enter_graceful_shutdown)
    # so_reuseport off: a second worker on a taken port must fail, not share it silently.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if sc.reflection:
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = _address(sc.host, sc.port)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise ValueError(f"cannot listen on {address}: {e}") from e
    await server.start()
    _say(f"listening on {_address(sc.host, port)}; loading {config.model.model}")

    stop, force = asyncio.Event(), asyncio.Event()
    tasks: set[asyncio.Task[int]] = set()

    def begin_drain() -> None:
        stop.set()
        task = loop.create_task(servicer.start_draining())  # health NOT_SERVING at once
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            _say(f"{sig.name} again: aborting what is left")
            force.set()
        else:
            _say(f"{sig.name}: draining")
        begin_drain()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    exit_code = 0

    def on_engine_dead() -> None:  # exit non-zero so that a supervisor restarts us
        nonlocal exit_code
        exit_code = 1
        _say("the engine thread died; shutting down")
        begin_drain()

    bridge: EngineBridge | None = None
    try:
        engine = await asyncio.to_thread(Engine, config)  # the loop keeps serving health
        bridge = EngineBridge(engine)
        bridge.on_dead = on_engine_dead
        bridge.start()
        if not stop.is_set():
            await warm_up(bridge)
            servicer.attach(bridge)
            for name in HEALTH_SERVICES:
                await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
            loaded = engine.loaded
            _say(f"{engine.budget.describe()}")
            _say(f"serving {loaded.name} on {_address(sc.host, port)} ({loaded.source}, "
                 f"{loaded.device}, {str(loaded.dtype).removeprefix('torch.')})")
        await stop.wait()
        await _drain(bridge, sc.drain_grace_s, force)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await server.stop(_STOP_GRACE_S)
        if bridge is not None:
            await bridge.close()
        telemetry.shutdown_tracing()
    _say("stopped")
    return exit_code


async def _drain(bridge: EngineBridge, grace_s: float, force: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    n = bridge.num_in_flight
    _say(f"draining {n} in-flight requests (grace {grace_s:g}s)")
    deadline = loop.time() + grace_s
    while bridge.num_in_flight and loop.time() < deadline and not force.is_set():
        await asyncio.sleep(0.05)
    if bridge.num_in_flight:
        _say(f"aborting {bridge.abort_all()} requests still running after the grace period")
        deadline = loop.time() + 2.0
        while bridge.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
