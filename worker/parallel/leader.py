"""Rank 0's side of tensor parallelism: it slices its own model, starts the followers
(`python -m worker.parallel.follower`, one per other rank), waits for their loads, joins
the group, and sends every step the runner runs (`ModelRunner.step_hook`: `moves` and
`forward`).

A follower's stdin is a pipe from rank 0 that it watches: when rank 0 dies, by any means
(SIGKILL included), the pipe ends and the follower exits at once. Its stdout carries one
line: `loaded`, or `error: MESSAGE` (the load's error, which `serve` then exits with).
Its stderr is rank 0's.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np
import torch

from worker.config import WorkerConfig
from worker.lora.adapter import LoraAdapter
from worker.parallel import lora as tp_lora
from worker.parallel import messages
from worker.parallel.group import Collectives, free_port
from worker.parallel.shard import ShardPlan, shard_model
from worker.weights import LoadedModel

log = logging.getLogger(__name__)

SPEC_ENV = "LLMWORKER_TP_FOLLOWER"  # the follower's spec (JSON), from rank 0
LOAD_TIMEOUT_S = 900.0  # a follower's model load, at most
_STOP_WAIT_S = 2.0


def threads_per_rank(world: int) -> int:
    """The CPU test bed: the allowed cores shared evenly by the ranks' torch threads."""
    return max(1, len(os.sched_getaffinity(0)) // world)


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


class TensorParallel:
    """Rank 0 of a group of `world` ranks over `loaded` (its model is sliced here, in place)."""

    def __init__(self, config: WorkerConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.world = config.parallel.tensor_parallel_size
        tp = f"--tensor-parallel-size {self.world}"
        if config.kv_transfer.kv_transfer_config is not None:
            raise ValueError(f"{tp} with --kv-transfer-config: KV handoffs move one rank's "
                             "blocks; not supported under tensor parallelism yet")
        self.plan = ShardPlan.of(loaded.config, self.world)  # ValueError naming the number
        self.device = rank_device(loaded.device, 0)
        self.collectives = Collectives()
        self.collectives.on_lost = self._lost
        self.procs: list[subprocess.Popen[bytes]] = []
        self._closed = False
        shard_model(loaded.model, self.plan, 0, self.collectives.all_reduce, self.collectives.gather,
                    sliced=loaded.split is not None)

    def describe(self) -> str:
        dev = self.device
        devices = ", ".join(str(rank_device(dev, r)) for r in range(self.world))
        backend = "nccl" if dev.type == "cuda" else "gloo"
        return (f"tensor parallel: {self.world} ranks over {backend} ({devices}); "
                + "; ".join(self.plan.describe(r) for r in range(self.world))
                + "; embedding and LM head vocab-parallel (logits gathered to rank 0)"
                + ("; on the CPU op by op with the C kernels (the fused decoder does not run sharded)"
                   if dev.type == "cpu" else "; no CUDA graphs under -tp yet"))

    # ----- start-up -----

    def start(self, num_blocks: int, num_cpu_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        """Start the followers with the runner's KV sizes (the same block ids on every rank),
        wait for their loads, and join the group. ValueError with a follower's message when
        it cannot load."""
        port = free_port()
        timeout_s = self.config.parallel.distributed_timeout_seconds
        threads = threads_per_rank(self.world) if self.device.type == "cpu" else 0
        lc = self.config.lora
        for rank in range(1, self.world):
            spec = {"rank": rank, "world": self.world, "port": port, "timeout_s": timeout_s,
                    "model": asdict(self.config.model), "num_blocks": num_blocks,
                    "num_cpu_blocks": num_cpu_blocks, "block_size": block_size,
                    "kv_dtype": str(kv_dtype).removeprefix("torch."), "threads": threads,
                    "lora": [lc.max_loras, lc.max_lora_rank] if lc.enable_lora else None}
            env = {**os.environ, SPEC_ENV: json.dumps(spec)}
            self.procs.append(subprocess.Popen([sys.executable, "-m", "worker.parallel.follower"],
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               env=env))
        atexit.register(self.close)
        try:
            self._wait_loaded()
        except BaseException:
            self.kill()
            raise
        if threads:
            torch.set_num_threads(threads)
        self.collectives.join(0, self.world, port, self.device, timeout_s)
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        log.info(self.describe())

    def _wait_loaded(self) -> None:
        waiting = {p.stdout.fileno(): (rank, p) for rank, p in enumerate(self.procs, 1)
                   if p.stdout is not None}
        buffers = dict.fromkeys(waiting, b"")
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ValueError(f"tensor parallel ranks {sorted(r for r, _ in waiting.values())} "
                                 f"did not load within {LOAD_TIMEOUT_S:g}s")
            ready, _, _ = select.select(list(waiting), [], [], min(left, 1.0))
            for fd in ready:
                chunk = os.read(fd, 65536)
                rank, proc = waiting[fd]
                buffers[fd] += chunk
                if not chunk:  # it exited without a word
                    code = proc.wait()
                    raise ValueError(f"tensor parallel rank {rank} exited with code {code} "
                                     "while loading the model (its stderr is above)")
                if b"\n" not in buffers[fd]:
                    continue
                line = buffers[fd].split(b"\n", 1)[0].decode("utf-8", "replace")
                if line != "loaded":
                    raise ValueError(f"tensor parallel rank {rank} could not load the model: "
                                     f"{line.removeprefix('error: ')[:2000]}")
                del waiting[fd]

    # ----- faults and the end -----

    def _watch(self) -> None:
        """A follower that exits while the group lives: lost (the next step fails at once)."""
        while not self._closed:
            for rank, p in enumerate(self.procs, 1):
                if p.poll() is not None and not self._closed and self.collectives.lost is None:
                    self.collectives.lost = f"tensor parallel rank {rank} exited with code {p.returncode}"
                    self._lost(self.collectives.lost)
            time.sleep(0.1)

    def _lost(self, message: str) -> None:
        log.error("%s; stopping every rank", message)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def close(self) -> None:
        """Stop the followers (a STOP message, then SIGKILL for any left after 2 s)."""
        if self._closed:
            return
        self._closed = True
        if self.collectives.lost is None and all(p.poll() is None for p in self.procs):
            try:
                self.collectives.send(messages.header(messages.STOP), None)
            except Exception:  # they are killed below either way
                pass
        deadline = time.monotonic() + _STOP_WAIT_S
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self.collectives.destroy()

    # ----- the runner's hooks (ModelRunner.step_hook) -----

    def moves(self, out: list[tuple[int, int]], into: list[tuple[int, int]],
              copies: list[tuple[int, int]]) -> None:
        self.collectives.send(*messages.pack_moves(messages.Moves(out, into, copies)))

    def forward(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
                block_tables: np.ndarray, seq_lens: np.ndarray, query_start_loc: np.ndarray,
                max_query_len: int, max_seq_len: int, lora_slots: Sequence[int] | None = None,
                logits: Sequence[Sequence[int]] = ()) -> None:
        """The step's forward arrays, and `logits`: the rows of each call this rank will make
        of the head after it, in order (every rank makes the same gathers)."""
        slots = None if lora_slots is None else np.asarray(lora_slots, dtype=np.int64)
        self.collectives.send(*messages.pack_forward(messages.ForwardArrays(
            input_ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc,
            max_query_len, max_seq_len, slots, [np.asarray(p, dtype=np.int64) for p in logits])))

    def write_lora(self, slot: int, adapter: LoraAdapter) -> None:
        """LoraSlots.on_write: the followers write the same adapter into the same slot."""
        self.collectives.send(*tp_lora.pack(slot, adapter))
