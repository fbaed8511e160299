"""`llm-worker serve`: the gRPC server around the one engine.

Start-up: listen at once (health says NOT_SERVING), load the model in a thread so the
loop keeps answering, run one warm-up generation, then health SERVING and the ready line::

    llm-worker: serving SmolLM2-135M-Instruct on 127.0.0.1:50051

SIGTERM, SIGINT or SIGHUP drains: health NOT_SERVING at once, new Generate calls get UNAVAILABLE,
in-flight requests get --drain-grace-s to finish (a second signal cuts the grace short),
the rest are aborted; then the server and the engine stop and `serve` returns 0.

Security (see `worker.auth`): --tls-cert/--tls-key serve TLS, --tls-client-ca adds mutual
TLS; --auth-token/--admin-token are bearer tokens checked by an interceptor (health stays
open; reflection, when on, needs the admin token). --health-port N answers health checks
plaintext on 127.0.0.1:N from the same health servicer. Tokens never reach the logs or
GetServerStatus.config_json.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import uuid

import grpc
import torch
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection
from llmworker.v1 import kv_transfer_pb2, worker_pb2
from smg_grpc_proto.generated import vllm_engine_pb2

from scheduler.request import SamplingParams
from worker import auth, cpu_placement, telemetry, wire
from worker.bridge import EngineBridge
from worker.config import WorkerConfig
from worker.door import Door
from worker.engine import Engine
from worker.kv_events import KvEventHub
from worker.kv_transfer.service import KVTransferServicer
from worker.metrics import MetricsServer
from worker.oneshot_thread import in_oneshot_thread
from worker.service import SERVICE_NAME, WorkerServicer
from worker.vllm_service import SERVICE_NAME as VLLM_SERVICE_NAME
from worker.vllm_service import VllmEngineServicer

log = telemetry.get_logger("worker.server")

HEALTH_SERVICES = ("", SERVICE_NAME)  # "" = the whole server
_STOP_GRACE_S = 5.0  # for the last messages of finished streams to flush


# SIGHUP too: a terminal that closes under a foreground worker sends it, and its default
# action killed the worker with its streams in flight.
DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

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
    _say("config", config=auth.redacted_config(config), tracing=tracing)
    credentials = auth.server_credentials(sc)  # ValueError on a missing file: exit 2

    health_servicer = health.aio.HealthServicer()
    health_names = HEALTH_SERVICES + ((VLLM_SERVICE_NAME,) if sc.vllm_protocol else ())
    for name in health_names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    # One door for both wire formats; the adapters only translate (see worker.door).
    door = Door(config, on_drain=health_servicer.enter_graceful_shutdown)
    servicer = WorkerServicer(door)
    servicer.config_json = auth.redacted_config_json(config)  # no tokens in GetServerStatus
    interceptor = auth.TokenInterceptor.from_config(sc)
    # so_reuseport off: a second worker on a taken port must fail, not share it silently.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                      ("grpc.max_receive_message_length", sc.max_message_bytes),
                                      ("grpc.max_send_message_length", sc.max_message_bytes),
                                      # A gateway's keepalive pings (every 10 s) during a long
                                      # non-streaming Generate must not cost it the connection.
                                      ("grpc.http2.min_recv_ping_interval_without_data_ms",
                                       10_000),
                                      ("grpc.keepalive_permit_without_calls", 1)],
                             interceptors=[interceptor] if interceptor else None)
    # Not the generated add_..._to_server: bytes that do not parse get INVALID_ARGUMENT.
    wire.add_servicer(servicer, worker_pb2.DESCRIPTOR.services_by_name["WorkerService"], server)
    # The vLLM engine protocol (SMG's) over the same door: see worker.vllm_service. Its
    # KV-event hub publishes the events each engine step takes from the KV cache.
    hub = None
    if sc.vllm_protocol and sc.kv_events and config.cache.enable_prefix_caching:
        hub = KvEventHub(config.cache.block_size, door.load, config.scheduler.max_num_seqs)
    vllm = VllmEngineServicer(door, hub) if sc.vllm_protocol else None
    if vllm is not None:
        wire.add_servicer(vllm, vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"], server)
    # Prefill/decode disaggregation: a producer serves its handoffs' blocks on this port.
    kv_spec = config.kv_transfer.kv_transfer_config
    if kv_spec is not None:
        if not sc.vllm_protocol:
            raise ValueError("--kv-transfer-config needs --vllm-protocol: the handoff travels "
                             "in its kv_transfer_params_json")
        if kv_spec.is_producer:
            wire.add_servicer(KVTransferServicer(door, sc.max_message_bytes),
                              kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"], server)
    wire.add_servicer(health_servicer, health_pb2.DESCRIPTOR.services_by_name["Health"], server)
    if sc.reflection:
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
            + ((VLLM_SERVICE_NAME,) if vllm is not None else ()), server)
    address = _address(sc.host, sc.port)
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as e:
        raise ValueError(f"cannot listen on {address}: {e}") from e
    if vllm is not None and kv_spec is not None and kv_spec.is_producer:
        vllm.kv_address = (_advertised_host(config), port)
        _say(f"KV handoffs ({kv_spec.kv_role}) pulled from "
             f"{_address(*vllm.kv_address)}, lease {config.kv_transfer.kv_transfer_lease_s:g}s")
    health_server = _health_server(health_servicer, sc.health_port) if sc.health_port else None
    await server.start()
    if health_server is not None:
        await health_server.start()
        _say(f"health checks (plaintext, no auth) on 127.0.0.1:{sc.health_port}")
    if credentials is not None:
        _say("TLS on" + ("; client certificates required (mTLS)" if sc.tls_client_ca else ""))
    if interceptor is not None:
        _say("bearer tokens required: " + ", ".join(
            what for what, on in (("Generate", sc.auth_token), ("admin RPCs", sc.admin_token))
            if on))
    _say(f"listening on {_address(sc.host, port)}; loading {config.model.model}")

    stop, force = asyncio.Event(), asyncio.Event()
    tasks: set[asyncio.Task[int]] = set()

    def begin_drain() -> asyncio.Task[int]:
        stop.set()
        task = loop.create_task(door.start_draining())  # health NOT_SERVING at once
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            _say(f"{sig.name} again: aborting what is left")
            force.set()
        else:
            _say(f"{sig.name}: draining")
        begin_drain()

    for sig in DRAIN_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)

    exit_code = 0

    def on_engine_dead() -> asyncio.Task[int]:  # exit non-zero so that a supervisor restarts us
        nonlocal exit_code
        exit_code = 1
        _say("the engine thread died; shutting down")
        return begin_drain()

    bridge: EngineBridge | None = None
    metrics: MetricsServer | None = None
    allowed_cpus = cpu_placement.allowed_cpus()  # given back to every thread at the end
    placed: str | None = None
    try:
        # The loop keeps serving health meanwhile; a thread that ends, so that the engine
        # thread's OpenMP pool is the process's only one (see worker.oneshot_thread).
        engine = await in_oneshot_thread(Engine, config, thread_name="engine-build")
        bridge = EngineBridge(engine, stream_interval=sc.stream_interval)
        bridge.on_dead = on_engine_dead
        bridge.start()
        if not stop.is_set():
            await warm_up(bridge)
            # After the warm-up: the engine thread's OpenMP partners exist now.
            if sc.cpu_threads_bind == "auto" and str(engine.loaded.device) == "cpu":
                thread = engine._thread
                assert thread is not None and thread.native_id is not None
                placed = cpu_placement.place_threads(thread.native_id, torch.get_num_threads())
                if placed:
                    _say(f"threads: {placed}")
            if str(engine.loaded.device) == "cpu":  # set by the CLI, or not (worker.openmp_env)
                _say(f"OpenMP wait policy: {os.environ.get('OMP_WAIT_POLICY', 'libgomp default')}")
            door.attach(bridge)
            if hub is not None:
                bridge.step_observers.append(hub)
            if sc.metrics_port:
                metrics = MetricsServer(bridge, sc.metrics_host, sc.metrics_port)
                _say(f"Prometheus metrics (vLLM's names) on "
                     f"http://{_address(sc.metrics_host, metrics.port)}/metrics")
            for name in health_names:
                await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
            loaded = engine.loaded
            _say(loaded.describe_weights())
            _say(f"{engine.budget.describe()}")
            _say(f"serving {loaded.name} on {_address(sc.host, port)} ({loaded.source}, "
                 f"{loaded.device}, {str(loaded.dtype).removeprefix('torch.')})")
        await stop.wait()
        await _drain(bridge, sc.drain_grace_s, force)
    finally:
        for sig in DRAIN_SIGNALS:
            loop.remove_signal_handler(sig)
        await server.stop(_STOP_GRACE_S)
        if health_server is not None:
            await health_server.stop(None)
        if bridge is not None:
            await bridge.close()
            _say(_kv_at_stop(bridge.engine))
        if metrics is not None:
            await asyncio.to_thread(metrics.stop)
        telemetry.shutdown_tracing()
        if placed:  # serve() may run inside a larger process (tests): leave it as found
            cpu_placement.unplace_threads(allowed_cpus)
    _say("stopped")
    return exit_code


def _kv_at_stop(engine: Engine) -> str:
    """The block accounting's check, once the engine thread has stopped (so nothing moves):
    the line an operator (and the P/D tests) read to know no block leaked."""
    kv = engine.kv
    try:
        kv.check_integrity()
        verdict = "integrity ok"
    except AssertionError as e:
        verdict = f"integrity FAILED: {str(e)[:200]}"
    return (f"KV cache at stop: {verdict}; {kv.blocks_in_use()} of {kv.num_blocks} blocks in "
            f"use, {kv.handoff_pins.num_blocks()} pinned for handoffs")


def _advertised_host(config: WorkerConfig) -> str:
    """The host a prefill's handoffs name: --kv-transfer-host, else --host, else (a
    wildcard) this machine's name."""
    host = config.kv_transfer.kv_transfer_host or config.server.host
    return socket.getfqdn() if host in ("0.0.0.0", "::", "") else host


def _health_server(health_servicer: health.aio.HealthServicer, port: int) -> grpc.aio.Server:
    """Only grpc.health.v1, plaintext, on 127.0.0.1:`port`, sharing the main server's
    health servicer (so SERVING/NOT_SERVING change on both at once)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    wire.add_servicer(health_servicer, health_pb2.DESCRIPTOR.services_by_name["Health"], server)
    address = _address("127.0.0.1", port)
    try:
        server.add_insecure_port(address)
    except RuntimeError as e:
        raise ValueError(f"--health-port: cannot listen on {address}: {e}") from e
    return server


async def _drain(bridge: EngineBridge, grace_s: float, force: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    n = bridge.num_in_flight
    _say(f"draining {n} in-flight requests (grace {grace_s:g}s)")
    deadline = loop.time() + grace_s
    while bridge.num_in_flight and loop.time() < deadline and not force.is_set():
        await asyncio.sleep(0.05)
    # A draining prefill keeps serving its handoffs until they are pulled or expire.
    pins = bridge.engine.kv.handoff_pins
    if pins.num_live and not force.is_set():
        _say(f"waiting for {pins.num_live} KV handoffs to be pulled or expire")
    while pins.num_live and loop.time() < deadline and not force.is_set():
        await asyncio.sleep(0.05)
    if bridge.num_in_flight:
        _say(f"aborting {bridge.abort_all()} requests still running after the grace period")
        deadline = loop.time() + 2.0
        while bridge.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
