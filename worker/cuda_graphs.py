"""Decode steps replayed from CUDA graphs.

A decode step of a small model is a few hundred short kernel launches; on a GPU the
launches, not the kernels, set its time. At start-up we capture the forward pass
(and the logits) once per batch size in `capture_sizes`, over static input buffers.
A decode-only step is padded up to the next captured size and replayed:

    captured size 8, 5 real decodes
    input_ids      | t0 t1 t2 t3 t4 | 0  0  0 |
    slot_mapping   | s0 s1 s2 s3 s4 | -1 -1 -1 |   -1: the KV write skips the row
    seq_lens       | n0 n1 n2 n3 n4 | 1  1  1 |    padded rows attend to block 0, slot 0
    block_tables   | real rows      | zeros    |
    query_start_loc  0 1 2 ... 8 (fixed: one query token per row)

The attention kernel is captured with max_seq_len = max_model_len, so its launch
grid covers any context; programs past a row's seq_len exit at once.

A speculative verification step is decode rows too: each drafted position is a row of
its own, with its request's block table and its own seq_len (model_runner.py), so it
replays the same graphs; a request verifying 3 drafts at positions p..p+3 is 4 rows:

    input_ids      | t  d1  d2  d3  |        every row writes its K/V before any
    positions      | p  p+1 p+2 p+3 |        row attends (the layer writes, then
    seq_lens       | p+1 p+2 p+3 p+4|        reads), so row j sees rows < j
    block_tables   | the request's table, on every row

Steps with a prompt chunk of more than one token run eagerly.
"""

from __future__ import annotations

import torch

from worker.models.llama import AttentionMetadata, KVCache, LlamaForCausalLM


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64 and every 16 beyond, ending at max_batch."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    s = 16
    while s < max_batch:
        sizes.append(s)
        s += 8 if s < 64 else 16
    return [*sizes, max_batch]


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.sizes = capture_sizes(max_batch)
        self.block_size = block_size
        # One int64 buffer for the per-row inputs, so a step is one host-to-device copy
        # (plus one for the block tables): input_ids, positions, slot_mapping, seq_lens.
        self.packed = torch.zeros(4, max_batch, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = self.packed
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_batch, self.max_blocks, dtype=torch.int32, device=device)
        pin = device.type == "cuda"  # (a stand-in on the CPU in tests has nothing to pin for)
        self._host = torch.zeros(4, max_batch, dtype=torch.int64, pin_memory=pin)
        self._host_tables = torch.zeros(max_batch, self.max_blocks, dtype=torch.int32, pin_memory=pin)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture_all()

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
        hidden = self.model(self.input_ids[:b], self.positions[:b], meta, self.kv_caches)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        assert self.packed.device.type == "cuda", "CUDA graphs need a CUDA device"
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # Largest first, so smaller graphs reuse the memory of the largest one's pool.
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):
                self._forward(b)  # warm-up: Triton compiles and autotunes outside capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._forward(b)
                self.graphs[b] = (graph, logits)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def can_run(self, num_rows: int) -> bool:
        return num_rows <= self.sizes[-1]

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
        """Logits [n, vocab] float32 for n decode rows (one token each; a row's block table,
        position and seq_len are its own, so a drafted position is a row too)."""
        n = len(input_ids)
        b = next(s for s in self.sizes if s >= n)
        self._stage(b, input_ids, positions, seq_lens, block_tables)
        return self._replay(b)[:n]

    def _replay(self, b: int) -> torch.Tensor:
        graph, logits = self.graphs[b]
        graph.replay()
        return logits

    def _stage(self, b: int, input_ids: list[int], positions: list[int], seq_lens: list[int],
               block_tables: list[list[int]]) -> None:
        """Copy a step's rows into the static buffers, padded to the captured size b."""
        n = len(input_ids)
        bs = self.block_size
        slots = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, positions, strict=True)]
        pad = b - n
        # The previous step's copies must have landed before the pinned staging is rewritten;
        # sampling read its tokens back to the host since, which waited for them.
        host = self._host
        host[:, :b] = torch.tensor([input_ids + [0] * pad, positions + [0] * pad,
                                    slots + [-1] * pad, seq_lens + [1] * pad], dtype=torch.int64)
        width = max(len(t) for t in block_tables)
        assert width <= self.max_blocks, "block table wider than max_model_len allows"
        tables = self._host_tables[:b, :width]
        tables.copy_(torch.tensor([t + [0] * (width - len(t)) for t in block_tables]
                                  + [[0] * width] * pad, dtype=torch.int32))
        self.packed[:, :b].copy_(host[:, :b], non_blocking=True)
        self.block_tables[:b, :width].copy_(tables, non_blocking=True)
