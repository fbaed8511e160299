"""What one streamed gRPC message costs in CPU on each end, with nothing of ours around it
(issue 21): a bare `grpc.aio` server streams small messages to a Python client in another
process, one every `--pace-ms` (a token's pace on a CPU worker) or as fast as it can (0).
The server's figure is its process's CPU a message less that of the same paced loop
sending nothing; the client's is its own (a plain `grpc` channel, one with
`SingleThreadedUnaryStream`, or `grpc.aio`).

    python -m benchmarks.grpc_message_cost --messages 1000 --pace-ms 4 \\
        --output-json bench-results/grpc-message-cost.json

Paced, a message travels alone: every one wakes the loop, gRPC's threads and the reader.
That is the per-token floor of a served stream at `--stream-interval 1` whatever the worker
does around it, and what the CPU worker's compute threads lose to it (bridge.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.experimental

from clients.bench.environment import environment, recorded

METHOD = "/bench.Stream/Tokens"
# About a GenerateResponse chunk of one token: request id, one id, a few characters.
PAYLOAD = b"\n\x08req-0001\x12\x0c\n\x05 word\x12\x03\xb1\xe9\x02"
CLIENTS = ("sync", "single-threaded", "aio")


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _same(b: bytes) -> bytes:
    return b


def client(address: str, kind: str, messages: int) -> dict[str, float]:
    """Read one stream; this process's CPU and the wall time, per message."""
    if kind == "aio":
        async def read() -> tuple[int, float, float]:
            async with grpc.aio.insecure_channel(address) as ch:
                call = ch.unary_stream(METHOD, request_serializer=_same, response_deserializer=_same)
                n, c0, t0 = 0, _cpu_s(), time.perf_counter()
                async for _ in call(str(messages).encode()):
                    n += 1
                return n, _cpu_s() - c0, time.perf_counter() - t0

        n, cpu, wall = asyncio.run(read())
    else:
        opts = ([(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]
                if kind == "single-threaded" else [])
        with grpc.insecure_channel(address, options=opts) as ch:
            call = ch.unary_stream(METHOD, request_serializer=_same, response_deserializer=_same)
            n, c0, t0 = 0, _cpu_s(), time.perf_counter()
            for _ in call(str(messages).encode()):
                n += 1
            cpu, wall = _cpu_s() - c0, time.perf_counter() - t0
    assert n == messages, (n, messages)
    return {"client_cpu_us": cpu / n * 1e6, "wall_us": wall / n * 1e6}


async def _paced_idle(messages: int, pace_s: float) -> float:
    """CPU a message of the pacing alone (the loop's timers, nothing sent)."""
    c0 = _cpu_s()
    for _ in range(messages):
        await asyncio.sleep(pace_s)
    return (_cpu_s() - c0) / messages * 1e6


async def serve_rounds(kinds: list[str], rounds: int, messages: int, pace_s: float
                       ) -> list[dict[str, Any]]:
    async def tokens(request: bytes, context: grpc.aio.ServicerContext):
        for _ in range(int(request)):
            if pace_s:
                await asyncio.sleep(pace_s)
            yield PAYLOAD

    server = grpc.aio.server()
    handler = grpc.unary_stream_rpc_method_handler(tokens, request_deserializer=_same,
                                                    response_serializer=_same)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.Stream", {"Tokens": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out = []
    try:
        for r in range(rounds):
            idle = await _paced_idle(messages, pace_s) if pace_s else 0.0
            for kind in kinds:
                c0 = _cpu_s()
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "benchmarks.grpc_message_cost", "--client", kind,
                    "--address", f"127.0.0.1:{port}", "--messages", str(messages),
                    stdout=subprocess.PIPE)
                stdout, _ = await proc.communicate()
                assert proc.returncode == 0, f"the {kind} client failed"
                row = json.loads(stdout)
                # The client process's start-up runs in another process: only the stream's
                # own CPU is counted here (the server's, from its first message to its last,
                # is what this process spent while the child ran, less its idle pacing).
                row["server_cpu_us"] = (_cpu_s() - c0) / messages * 1e6 - idle
                row.update(round=r + 1, client=kind, paced_idle_us=idle)
                print(f"round {r + 1} {kind:16s} server {row['server_cpu_us']:6.1f} us/msg, "
                      f"client {row['client_cpu_us']:6.1f} us/msg, wall {row['wall_us']:7.1f} us/msg",
                      flush=True)
                out.append(row)
    finally:
        await server.stop(None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=1000)
    p.add_argument("--pace-ms", type=float, default=4.0, help="0: as fast as the server can")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--output-json", type=Path)
    p.add_argument("--client", choices=CLIENTS, help=argparse.SUPPRESS)  # the child's role
    p.add_argument("--address", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.client:
        print(json.dumps(client(a.address, a.client, a.messages)))
        return
    kinds = a.clients.split(",")
    rows = asyncio.run(serve_rounds(kinds, a.rounds, a.messages, a.pace_ms / 1000))
    summary = {k: {f: statistics.median(r[f] for r in rows if r["client"] == k)
                   for f in ("server_cpu_us", "client_cpu_us", "wall_us")} for k in kinds}
    for k, s in summary.items():
        print(f"median {k:16s} server {s['server_cpu_us']:6.1f} us/msg, client "
              f"{s['client_cpu_us']:6.1f} us/msg")
    if a.output_json:
        result = {"command": recorded(" ".join(["python -m benchmarks.grpc_message_cost", *sys.argv[1:]])),
                  "messages": a.messages, "pace_ms": a.pace_ms, "rows": rows, "summary": summary,
                  "grpc": grpc.__version__, "environment": environment()}
        a.output_json.parent.mkdir(parents=True, exist_ok=True)
        a.output_json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {a.output_json}")


if __name__ == "__main__":
    main()
