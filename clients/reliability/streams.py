"""Async gRPC streams with the ways a client can misbehave, and what each one saw.

Every call ends in exactly one `Outcome`: ``status`` is the gRPC status name (``OK`` only
after a ``complete`` message), or ``CANCELLED_BY_CLIENT`` when this side cancelled on
purpose, so a run can account for every request it sent.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from llmworker.v1 import worker_pb2 as pb
from llmworker.v1 import worker_pb2_grpc

from clients.bench.arrival import dispatch

CANCELLED_BY_CLIENT = "CANCELLED_BY_CLIENT"

# Short prompts of different lengths; requests draw from them so batches mix.
PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "1, 2, 3, 4, 5,",
    "Explain why the sky is blue in two sentences.",
    "def fibonacci(n):",
    "List three fruits that are red:",
    "Once upon a time, in a small village by the mountains, there lived",
    "Translate to French: good morning, how are you today?",
)


@dataclass
class Plan:
    """One request and how its client behaves."""

    request_id: str
    prompt: str
    max_tokens: int
    priority: int = 0
    cancel_after_chunks: int | None = None  # cancel once this many chunks arrived (0 = at once)
    cancel_after_s: float | None = None  # or this long after sending
    stall_after_chunks: int | None = None  # stop reading after this many chunks ...
    stall_s: float = 0.0  # ... for this long, then read on (or disconnect, below)
    disconnect_after_stall: bool = False
    deadline_s: float | None = None  # gRPC deadline

    def request(self) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            request_id=self.request_id, text=self.prompt, priority=self.priority,
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingCriteria(max_tokens=self.max_tokens, ignore_eos=True))


@dataclass
class Outcome:
    request_id: str
    status: str  # OK, CANCELLED_BY_CLIENT, or the gRPC status name
    details: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    priority: int = 0
    sent_at: float = 0.0
    ttft_s: float | None = None  # first chunk with a token, client side
    e2e_s: float = 0.0
    num_chunks: int = 0


async def run_plan(stub: worker_pb2_grpc.WorkerServiceStub, plan: Plan,
                   t0: float | None = None) -> Outcome:
    sent = time.monotonic()
    out = Outcome(plan.request_id, "", priority=plan.priority,
                  sent_at=sent - (t0 if t0 is not None else sent))
    call = stub.Generate(plan.request(), timeout=plan.deadline_s)
    intended = (plan.cancel_after_chunks is not None or plan.cancel_after_s is not None
                or plan.disconnect_after_stall)
    timer = None
    if plan.cancel_after_s is not None:
        timer = asyncio.get_running_loop().call_later(plan.cancel_after_s, call.cancel)
    try:
        if plan.cancel_after_chunks == 0:
            call.cancel()
        async for msg in call:
            if msg.HasField("chunk"):
                out.num_chunks += 1
                if msg.chunk.token_ids and out.ttft_s is None:
                    out.ttft_s = time.monotonic() - sent
                out.token_ids += msg.chunk.token_ids
                if plan.cancel_after_chunks is not None and out.num_chunks >= plan.cancel_after_chunks:
                    call.cancel()
                    break
                if plan.stall_after_chunks is not None and out.num_chunks == plan.stall_after_chunks:
                    await asyncio.sleep(plan.stall_s)
                    if plan.disconnect_after_stall:
                        call.cancel()
                        break
            elif msg.HasField("complete"):
                out.finish_reason = pb.FinishReason.Name(msg.complete.finish_reason)
                out.status = "OK"
        if not out.status:
            out.status = CANCELLED_BY_CLIENT if call.cancelled() else "NO_COMPLETE"
    except asyncio.CancelledError:  # grpc.aio raises this when the call was cancelled
        if not (intended and call.cancelled()):
            call.cancel()
            raise
        out.status = CANCELLED_BY_CLIENT
    except grpc.aio.AioRpcError as e:
        code = e.code()
        out.status = (CANCELLED_BY_CLIENT if code == grpc.StatusCode.CANCELLED and intended
                      else code.name)
        out.details = e.details() or ""
    finally:
        if timer is not None:
            timer.cancel()
    out.e2e_s = time.monotonic() - sent
    return out


async def run_all(stub: worker_pb2_grpc.WorkerServiceStub, plans: Sequence[Plan],
                  concurrency: int, t0: float | None = None) -> list[Outcome]:
    """Every plan at once, at most `concurrency` streams open, results in plan order."""
    outs, _ = await dispatch(plans, lambda p: run_plan(stub, p, t0), [0.0] * len(plans),
                             concurrency)
    return outs


async def wait_idle(stub: worker_pb2_grpc.WorkerServiceStub, timeout: float = 60.0
                    ) -> pb.GetLoadResponse:
    """Poll GetLoad until nothing runs, waits or is swapped and every block is free; returns
    the last answer (the caller checks it: a leak shows as a timeout with blocks held)."""
    end = time.monotonic() + timeout
    while True:
        load = await stub.GetLoad(pb.GetLoadRequest(), timeout=10)
        idle = (load.num_running == load.num_waiting == load.num_swapped == 0
                and load.num_free_blocks == load.num_total_blocks)
        if idle or time.monotonic() > end:
            return load
        await asyncio.sleep(0.1)


def load_dict(load: pb.GetLoadResponse) -> dict[str, float]:
    return {"num_running": load.num_running, "num_waiting": load.num_waiting,
            "num_swapped": load.num_swapped, "num_free_blocks": load.num_free_blocks,
            "num_total_blocks": load.num_total_blocks,
            "kv_cache_usage": round(load.kv_cache_usage, 4)}


def is_idle(load: dict[str, float]) -> bool:
    return (load["num_running"] == load["num_waiting"] == load["num_swapped"] == 0
            and load["num_free_blocks"] == load["num_total_blocks"])


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def rng(seed: int) -> random.Random:
    return random.Random(seed)
