"""The torch.distributed side of a tensor-parallel group: one process group for the step
(gloo on the CPU, NCCL on CUDA) with --distributed-timeout-seconds, and a second, gloo,
with no practical timeout for the followers' wait for the next step (a doorbell: an idle
worker is not a hung rank).

Every collective that fails (a peer gone: gloo notices a closed socket at once; a peer
hung: at the timeout) raises `RankLost` and calls `on_lost` once (rank 0 kills the
followers there, so a stopped one cannot outlive the worker).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from worker.parallel import RankLost
from worker.parallel.messages import HEADER_LEN

_IDLE_TIMEOUT = timedelta(days=365)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Collectives:
    """This rank's collectives. Built before the group exists (the model's row-parallel
    layers hold `all_reduce`), joined by `join`."""

    def __init__(self) -> None:
        self.rank = 0
        self.world = 1
        self.device = torch.device("cpu")
        self._bell: dist.ProcessGroup | None = None
        self.lost: str | None = None
        self.on_lost: Callable[[str], None] | None = None
        # Where a step's time goes (benchmarks/tp.py): all-reduces made and their seconds.
        self.num_all_reduces = 0
        self.all_reduce_s = 0.0
        self.num_gathers = 0  # the vocab-parallel head's gathers of logits to rank 0
        self.gather_s = 0.0
        self.num_messages = 0  # step messages sent (rank 0) and their seconds
        self.send_s = 0.0

    def join(self, rank: int, world: int, port: int, device: torch.device, timeout_s: float) -> None:
        self.rank, self.world, self.device = rank, world, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        self._bell = dist.new_group(list(range(world)), timeout=_IDLE_TIMEOUT, backend="gloo")

    def _failed(self, what: str, e: BaseException) -> RankLost:
        message = f"tensor parallel rank {self.rank}: {what} failed ({str(e).splitlines()[0][:300]})"
        if self.lost is None:
            self.lost = message
            if self.on_lost is not None:
                self.on_lost(message)
        return RankLost(message)

    def all_reduce(self, t: torch.Tensor) -> None:
        if self.lost is not None:
            raise RankLost(self.lost)
        t0 = time.perf_counter()
        try:
            dist.all_reduce(t)
        except Exception as e:  # gloo and NCCL raise DistBackendError / RuntimeError
            raise self._failed("an all-reduce", e) from e
        self.all_reduce_s += time.perf_counter() - t0
        self.num_all_reduces += 1

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` (the same shape and dtype on each) gathered to rank 0, in rank
        order; None on a follower."""
        if self.lost is not None:
            raise RankLost(self.lost)
        t0 = time.perf_counter()
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
        try:
            dist.gather(t, parts, dst=0)
        except Exception as e:
            raise self._failed("a gather of logits", e) from e
        self.gather_s += time.perf_counter() - t0
        self.num_gathers += 1
        return parts

    def send(self, head: np.ndarray, payload: np.ndarray | None) -> None:
        """Rank 0: one message (messages.py) to every follower."""
        if self.lost is not None:
            raise RankLost(self.lost)
        t0 = time.perf_counter()
        try:
            dist.broadcast(torch.from_numpy(head), 0, group=self._bell)
            if payload is not None and len(payload):
                dist.broadcast(torch.from_numpy(payload).to(self.device), 0)
        except Exception as e:
            raise self._failed("sending a step", e) from e
        self.send_s += time.perf_counter() - t0
        self.num_messages += 1

    def receive_header(self) -> np.ndarray:
        """A follower: wait (without a timeout) for rank 0's next message header."""
        head = torch.zeros(HEADER_LEN, dtype=torch.int64)
        try:
            dist.broadcast(head, 0, group=self._bell)
        except Exception as e:
            raise self._failed("waiting for a step", e) from e
        return head.numpy()

    def receive_payload(self, n: int, dtype: torch.dtype = torch.int64) -> np.ndarray:
        t = torch.empty(n, dtype=dtype, device=self.device)
        if n:
            try:
                dist.broadcast(t, 0)
            except Exception as e:
                raise self._failed("receiving a step", e) from e
        return t.cpu().numpy()

    def destroy(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group's teardown may raise: the process ends anyway
                pass
