"""Shared by the tensor-parallel tests: a tiny random checkpoint, served workers whose
followers can be found, a stream that can be timed, and ranks run as threads."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import torch
from llmworker.v1 import worker_pb2 as pb

from tests.helpers import save_tiny_checkpoint
from tests.test_server import Worker


def tiny_checkpoint(folder: Path, kv_heads: int, heads: int = 4, seed: int = 0) -> str:
    """A 2-layer Llama of `heads` query heads and `kv_heads` KV heads (save_pretrained)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    save_tiny_checkpoint(cfg, folder, seed=seed)
    return str(folder)


class TPWorker(Worker):
    """tests/test_server.Worker, named for the tensor-parallel tests (`env` and `kv` are
    Worker's: passed to the process, so that workers started side by side from threads
    cannot leak one another's environment, a fault injection included)."""


def start_all(specs: dict[str, tuple[tuple[str, ...], dict[str, str] | None]]) -> dict[str, Worker]:
    """Start workers side by side (each waits for its own listening line), by name."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(TPWorker, *flags, env=env) for name, (flags, env) in specs.items()}
        return {name: f.result() for name, f in futures.items()}


def followers(w: Worker) -> list[psutil.Process]:
    found = []
    for p in psutil.Process(w.proc.pid).children(recursive=True):
        try:
            if "worker.parallel.follower" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:  # exited meanwhile
            pass
    return found


def _running(p: psutil.Process) -> bool:
    try:  # a zombie has exited (rank 0, its parent, may be gone and not have reaped it)
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone(procs: list[psutil.Process], timeout: float) -> bool:
    """Every one of `procs` exited within `timeout` seconds."""
    end = time.monotonic() + timeout
    while any(map(_running, procs)):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def long_stream(w: Worker, ids: list[int], max_tokens: int = 2000):
    return w.stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIdsInput(ids=ids), sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True)), timeout=120)


def fail_time(stream, fault) -> tuple[grpc.StatusCode, float, str]:
    """Read `stream` to its first chunk, call `fault()`, and time how long the stream takes
    to end after it; returns its status code, that time and its details."""
    it = iter(stream)
    next(it)
    fault()
    t0 = time.monotonic()
    try:
        for _ in it:
            pass
    except grpc.RpcError as e:
        return e.code(), time.monotonic() - t0, e.details() or ""
    return grpc.StatusCode.OK, time.monotonic() - t0, ""


class Ranks:
    """`world` sharded copies run in lockstep, one thread each, whose all-reduce is a sum
    over the copies at a barrier and whose gather hands rank 0 every copy's tensor: the
    group's arithmetic without processes (`num_gathers`: rank 0's gathers)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=120)  # a rank that raised fails the rest
        self.parts: list[torch.Tensor | None] = [None] * world
        self.local = threading.local()
        self.num_gathers = 0

    def reduce(self, t: torch.Tensor) -> None:
        self.parts[self.local.rank] = t.clone()
        self.barrier.wait()
        total = torch.stack(self.parts).sum(0)  # type: ignore[arg-type]
        self.barrier.wait()
        t.copy_(total)

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        rank = self.local.rank
        self.parts[rank] = t.clone()
        self.barrier.wait()
        out = list(self.parts) if rank == 0 else None
        self.barrier.wait()
        if rank == 0:
            self.num_gathers += 1
        return out  # type: ignore[return-value]


def run_ranks(ranks, world: int, run) -> None:
    """`run(rank)` on a thread a rank; a rank that raises breaks the barrier (the others then
    leave it broken) and its error, not the others' BrokenBarrierError, is raised here."""
    errors: list[BaseException] = []

    def guarded(rank: int) -> None:
        try:
            run(rank)
        except BaseException as e:
            errors.append(e)
            ranks.barrier.abort()

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
