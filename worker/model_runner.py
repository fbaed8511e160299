"""Turns one scheduler step into tensors, runs the model and samples.

A step over requests a (decode), b (prefill chunk of 4), c (decode)::

    input_ids      | a7 | b3 b4 b5 b6 | c29 |     flat, T = 6
    positions      |  7 |  3  4  5  6 |  29 |     start + i
    slot_mapping   block_tables[r][pos // bs] * bs + pos % bs
    sample rows    0, 4, 5                       last token of each chunk that samples

Logits are computed only for the sample rows; a prefill chunk that does not reach
the end of its prompt samples nothing.

A decode with k draft tokens (speculative decoding, worker/spec_decode) is a chunk of 1 + k
tokens [t, d1..dk] that samples at every position: sample row j draws the model's token at
position N + j as the sampler would if d1..dj were already output (its penalties count
them, a seeded request uses that output index's generator). The drafts are accepted while
they equal those tokens; the request gets the accepted drafts and the next token.

Attention sees such a chunk as 1 + k decodes of one token each, sharing the request's block
table, each with the context up to its own position (a request c with drafts d1 d2)::

    input_ids      | c29 d1 d2 |            positions 29 30 31
    seq_lens       | 30  31 32 |            one attention row per token
    block_tables   | c   c  c  |

The step's keys and values are all written before any row attends (in every kernel path),
so each row sees exactly its causal context: the same arithmetic as decoding those tokens
one by one, and a step of decodes with drafts stays a decode step (the CPU's fused decoder
runs it as one call).

Parallel sampling (scheduler/sample_group.py): the step that samples a group leader's
first token samples its followers from the same logits row (one sample row each, their
own parameters and seeds). A request that asked for prompt logprobs gets them from the
logits of its chunk's prompt positions (worker/prompt_logprobs.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import ops
from ops import cpu_attention, cpu_decoder, cpu_sampling, huge_pages, quantized_linear
from ops.linear import PackedLinear, can_pack, pack_linears
from ops.sampling import PenaltyTokens, SamplingTensors, greedy_ids_cpu
from ops.scaled_linear import ScaledLinear
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import Request
from worker import prompt_logprobs
from worker.cuda_graphs import DecodeGraphs
from worker.logits_masks import LogitsMasks, StepMasks
from worker.lora.slots import LoraSlots
from worker.models.llama import AttentionMetadata, KVCache, LlamaForCausalLM
from worker.spec_decode import accepted


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        max_num_seqs: int = 0,
        max_model_len: int = 0,
        cuda_graphs: bool = False,
        max_decode_rows: int = 0,
        num_cpu_blocks: int = 0,
        cpu_packed_linear: bool = False,
        cpu_huge_pages: bool = False,
        lora: LoraSlots | None = None,
    ) -> None:
        """With `cuda_graphs` (CUDA only), decode steps of up to `max_num_seqs` requests
        replay graphs captured here, over contexts up to `max_model_len`; with speculation,
        verification steps too, up to `max_decode_rows` rows (a row per drafted position
        and one per request; worker/cuda_graphs.py). `num_cpu_blocks`
        sizes the swap space in host memory (pinned on CUDA, so swaps are DMA copies).
        `cpu_packed_linear` (CPU, float32) packs the model's float linear weights for oneDNN
        (ops/linear.py), in place: a model shared by several runners is packed once. A GGUF
        load's linears come already on their blocks where the CPU kernels take them
        (worker/weights/gguf_load.py: `QuantLinear`, in the load's activation arithmetic).
        `cpu_huge_pages` (CPU) moves
        the weights into 2 MB pages (ops/huge_pages.py). `kv_dtype`: what the KV cache holds
        (None: `dtype`; float16 on the CPU: --kv-cache-dtype). A model whose layers
        are all quantized then runs as a few native calls per step (ops/cpu_decoder.py).
        `lora` (--enable-lora) holds the device slots of the LoRA adapters; requests that
        name one get its delta on every adapted linear (ops/lora.py)."""
        cfg = model.config
        if cpu_packed_linear and can_pack(device, dtype):
            pack_linears(model)
            if model.lm_head is None and model.tied_head is None:
                # The tied head gets a packed copy; the embedding lookup keeps the table.
                model.tied_head = PackedLinear(model.embed_tokens.weight)
        self.model = model
        # (moved bytes, of which in huge pages): before the C decoder keeps pointers
        self.huge_pages = huge_pages.move_to_huge_pages(model) if cpu_huge_pages and device.type == "cpu" else None
        # The CPU decoder hook: every step through it, or none (its elementwise ops round
        # differently from torch's; see ops/cpu_decoder.py).
        # With LoRA the C layers add each adapter row's delta themselves (ops/cpu_kernels/lora.c);
        # base rows are untouched, so a base request has the same bits with or without
        # adapter rows beside it, and with or without --enable-lora.
        self.cpu_decoder = (cpu_decoder.CpuDecoder(model, block_size, lora.layers if lora else None)
                            if ops.kernel_path(device) == "c" and dtype == torch.float32
                            and cpu_decoder.unsupported(model) is None
                            and (lora is None or cpu_decoder.lora_unsupported(lora.layers) is None) else None)
        # A file descriptor the next native call writes a byte to as it begins (-1: none):
        # the engine's deferred wake of a served worker's event loop (Engine._loop).
        self.wake_fd = -1
        self.lora = lora
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size
        # Grammar bitmasks, logit_bias and min_tokens, applied to the logits before sampling.
        self.logits_masks = LogitsMasks(cfg.vocab_size, device)
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        kv_dtype = kv_dtype or dtype
        self.kv_caches: list[KVCache] = [
            (torch.zeros(shape, dtype=kv_dtype, device=device), torch.zeros(shape, dtype=kv_dtype, device=device))
            for _ in range(cfg.num_layers)
        ]
        cpu_shape = (num_cpu_blocks, *shape[1:])
        pin = device.type == "cuda"
        # torch.empty: host pages are touched only when a block is swapped into them.
        self.cpu_caches: list[KVCache] = [
            (torch.empty(cpu_shape, dtype=kv_dtype, pin_memory=pin),
             torch.empty(cpu_shape, dtype=kv_dtype, pin_memory=pin))
            for _ in range(cfg.num_layers)
        ] if num_cpu_blocks else []
        self.graphs: DecodeGraphs | None = None
        # Captured graphs have no LoRA rows (their index tensors change with every step).
        if cuda_graphs and device.type == "cuda" and lora is None:
            assert max_num_seqs > 0 and max_model_len > 0
            self.graphs = DecodeGraphs(model, self.kv_caches, max(max_num_seqs, max_decode_rows),
                                       max_model_len, block_size, device)
        self.num_graph_steps = 0  # steps replayed from a graph (benchmarks report the share)
        # Tensor parallelism (worker/parallel/leader.py): the followers get every step's KV
        # moves and forward arrays from here, before this rank runs them.
        self.step_hook = None

    def describe_kernels(self) -> str:
        """The ops backend and which implementation runs the linears, the embedding lookup,
        decode attention and the other ops (for the start-up log)."""
        kinds = Counter(type(m).__name__ for m in self.model.modules()
                        if isinstance(m, (nn.Linear, PackedLinear, quantized_linear.QuantLinear, ScaledLinear)))
        linears = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        path = ops.kernel_path(self.device)
        others = "Triton" if path == "triton" else "torch"
        # The op-by-op C attention reads float32 caches; the fused decoder reads float16 too.
        c_kernel = (path == "c" and self.dtype == torch.float32 and cpu_attention.available()
                    and (self.cpu_decoder is not None or self.kv_caches[0][0].dtype == torch.float32))
        attention = "C kernel" if c_kernel else others
        embed = self.model.embed_tokens
        embed = getattr(embed, "inner", embed)  # a vocab-parallel rank's lookup in its rows
        quant_embed = isinstance(embed, quantized_linear.QuantEmbedding)
        embedding = "Q8_0 blocks" if quant_embed else "table"
        decoder = self.cpu_decoder.describe() if self.cpu_decoder else "op by op"
        pages = ""
        if self.huge_pages is not None:
            moved, huge = self.huge_pages
            thp = huge_pages.thp_mode() or "unknown"
            pages = f"; weights in 2 MB pages: {huge >> 20} of {moved >> 20} MiB (THP {thp})"
        # The fused decoder runs every row's attention (prefill rows too), norm, rotary and
        # activation in its own C; op by op, only decode attention has a C kernel.
        # (Loads the C sampler at start-up: its first build is not a request's wait.)
        sampling = "C" if path == "c" and cpu_sampling.available() else others
        rest = ("prefill attention, norm, rotary, activation: C (in the decoder)"
                if self.cpu_decoder else f"prefill attention, norm, rotary, activation: {others}")
        rest += f"; sampling: {sampling}"
        kv = str(self.kv_caches[0][0].dtype).removeprefix("torch.") if self.kv_caches else "none"
        return (f"linear layers: {linears}; embedding: {embedding}; decode attention: {attention}; "
                f"{rest}; decoder: {decoder} (--kernels {ops.backend()}); KV cache {kv}{pages}")

    def _tensor(self, data: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def _host(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def move_blocks(self, step: SchedulerOutput) -> None:
        """The step's KV moves, before its forward pass, in the order `kvcache.moves` argues
        is safe: swap out, swap in, copy. One batched gather/scatter per layer tensor each."""
        out_gpu, out_cpu = _unzip(step.blocks_to_swap_out)
        in_cpu, in_gpu = _unzip(step.blocks_to_swap_in)
        src, dst = _unzip(step.blocks_to_copy)
        assert self.cpu_caches or not (out_gpu or in_cpu), "a swap with no swap space"
        if self.step_hook is not None:
            self.step_hook.moves(step.blocks_to_swap_out, step.blocks_to_swap_in, step.blocks_to_copy)
        for layer, gpu_kv in enumerate(self.kv_caches):
            for i, g in enumerate(gpu_kv):  # the layer's K, then its V
                if out_gpu:
                    ops.swap_blocks(g, self.cpu_caches[layer][i], out_gpu, out_cpu)
                if in_cpu:
                    ops.swap_blocks(self.cpu_caches[layer][i], g, in_cpu, in_gpu)
                if src:
                    ops.copy_blocks(g, src, dst)

    def execute(self, step: SchedulerOutput) -> dict[str, list[SampleResult]]:
        """Run one step; return the tokens of every request that samples: one, or with
        drafts the accepted drafts and then the model's own token."""
        if self.cpu_decoder is None:
            with torch.inference_mode():
                return self._execute(step)
        # The C decoder's steps skip the switch: no weight requires grad (worker/weights), so
        # no torch op here records any, and in the caches its call has just swept, entering
        # the mode is one more cold dispatch (BENCHMARKS.md, session 26).
        return self._execute(step)

    def _execute(self, step: SchedulerOutput) -> dict[str, list[SampleResult]]:
        if step.blocks_to_swap_out or step.blocks_to_swap_in or step.blocks_to_copy:
            self.move_blocks(step)
        input_ids: list[int] = []
        positions: list[int] = []
        req_index: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        sample_rows: list[int] = []
        sampling: list[ScheduledRequest] = []
        prompt_rows: list[tuple[ScheduledRequest, int, range]] = []  # (chunk, offset, positions)
        tables: list[list[int]] = []  # one per attention row: a request, or a drafted token
        for s in step.scheduled:
            end = s.start + s.num_new_tokens
            wanted = prompt_logprobs.positions_wanted(s)
            if wanted:
                prompt_rows.append((s, len(input_ids) - s.start, wanted))
            input_ids += s.token_ids
            positions += range(s.start, end)
            if s.spec_token_ids:  # a decode row per token (see the top)
                req_index += range(len(tables), len(tables) + s.num_new_tokens)
                tables += [s.block_table] * s.num_new_tokens
                seq_lens += range(s.start + 1, end + 1)
                query_start_loc += range(query_start_loc[-1] + 1, len(input_ids) + 1)
            else:
                req_index += [len(tables)] * s.num_new_tokens
                tables.append(s.block_table)
                seq_lens.append(end)
                query_start_loc.append(len(input_ids))
            if s.will_sample:
                sample_rows += range(len(input_ids) - 1 - len(s.spec_token_ids), len(input_ids))
                sample_rows += [len(input_ids) - 1] * len(s.forks)  # the leader's row again
                sampling.append(s)
        spec = any(s.spec_token_ids for s in sampling)
        # The request each sampled row draws for: a drafted position is a row, a fork too.
        row_reqs = [r for s in sampling
                    for r in [s.request] * (len(s.spec_token_ids) + 1) + s.forks]
        # Grammar bitmasks (on a GPU filled while the model runs; worker/logits_masks.py), one
        # per sampled row. Requests with a grammar or an unmet min_tokens get no drafts
        # (Engine._propose), so their one row's mask is right; logit_bias is the same at
        # every position.
        masks = self.logits_masks.start(row_reqs)
        # Rows all plain greedy: the CPU decoder's call finds their tokens too (`greedy`).
        greedy = (np.empty(len(input_ids), dtype=np.int64)
                  if self.cpu_decoder is not None and sampling and masks is None
                  and all(map(_plain_greedy, row_reqs)) else None)
        if self.graphs is not None and not prompt_rows and len(tables) == len(input_ids) and (
            self.graphs.can_run(len(input_ids))
        ):
            # Every row is one token with its own table and seq_len (a decode, a drafted
            # position, a one-token prompt chunk): replay a captured graph.
            hidden, all_logits = None, self.graphs.run(input_ids, positions, seq_lens, tables)
            self.num_graph_steps += 1
        else:
            # Under -tp the followers make the same calls of the vocab-parallel head as this
            # rank does below (each a gather of logits): prompt logprobs' passes, then the
            # sampled rows' (worker/parallel/vocab.py).
            passes = ([p for s, offset, wanted in prompt_rows
                       for p in prompt_logprobs.passes([offset + q for q in wanted])]
                      + ([sample_rows] if sampling else [])) if self.step_hook is not None else []
            hidden, all_logits = self._forward(step, input_ids, positions, req_index, tables, seq_lens,
                                               query_start_loc, logits=bool(sampling), argmax=greedy,
                                               passes=passes)
            if prompt_rows:
                self._prompt_logprobs(hidden, prompt_rows)
        if not sampling:
            return {}
        ids: list[int] | None = None
        if all_logits is not None:  # every row's: forks repeat a row, prompt chunks skip theirs
            every = len(sample_rows) == len(input_ids) and sample_rows == list(range(len(input_ids)))
            logits = all_logits if every else all_logits.index_select(0, self._tensor(sample_rows))
            if greedy is not None:  # the call wrote it with the logits (CpuDecoder.decode)
                found = greedy.tolist()
                ids = found if every else [found[i] for i in sample_rows]
        else:
            assert hidden is not None
            logits = self.model.compute_logits(hidden.index_select(0, self._tensor(sample_rows)))
        if spec:
            return self._verify(sampling, logits, masks, ids)
        return self._one_each(self._sample(row_reqs, logits, masks, ids))

    def _forward(self, step: SchedulerOutput, input_ids: list[int], positions: list[int],
                 req_index: list[int], tables: list[list[int]], seq_lens: list[int],
                 query_start_loc: list[int], logits: bool, argmax: np.ndarray | None = None,
                 passes: list[list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step run eagerly: hidden states of every row, and with the CPU decoder (when
        `logits`) every row's logits from the same native call (else None), and where they
        come back, each row's greedy token in `argmax` (CpuDecoder.decode: its outputs last
        until the next step's call). `passes`: the rows of each call of the head after it,
        for a tensor-parallel step hook."""
        max_blocks = max(len(t) for t in tables)
        # Built in numpy on the host: a few microseconds an op where torch's CPU ops take
        # tens each, which a batch-1 step's Python felt.
        # The CPU decoder reads int64 tables (the GPU's kernels int32).
        index = np.int64 if self.cpu_decoder is not None else np.int32
        table_np = np.array([t + [0] * (max_blocks - len(t)) for t in tables], dtype=index)
        pos_np = np.array(positions, dtype=np.int64)
        # A token's slot: its block (from its row's table) times the block size, plus its offset.
        # A few rows' in Python: numpy's indexing and four ufuncs, each dispatched for the
        # first time since the last call swept the caches, took ~25 us of a batch-1 step
        # (a scratch timing).
        bs = self.block_size
        if len(positions) <= 64:
            slots_np = np.array([tables[r][p // bs] * bs + p % bs for r, p in zip(req_index, positions, strict=True)],
                                dtype=np.int64)
        else:
            slots_np = table_np[req_index, pos_np // bs].astype(np.int64, copy=False) * bs + pos_np % bs
        seq_lens_np = np.array(seq_lens, dtype=np.int64)
        query_start_np = np.array(query_start_loc, dtype=np.int64)
        max_query_len = max(1 if s.spec_token_ids else s.num_new_tokens for s in step.scheduled)
        if self.cpu_decoder is not None:  # the host arrays as they are; logits from the same call
            wake_fd, self.wake_fd = self.wake_fd, -1  # taken by this call
            return self.cpu_decoder.decode(np.array(input_ids, dtype=np.int64), pos_np, slots_np, table_np,
                                           seq_lens_np, query_start_np, max_query_len, self.kv_caches,
                                           lora=self._lora_step(step), logits=logits, argmax=argmax,
                                           wake_fd=wake_fd)
        lora = self._lora_step(step)  # (under -tp: its slot writes reach the followers first)
        if self.step_hook is not None:
            self.step_hook.forward(np.array(input_ids, dtype=np.int64), pos_np, slots_np, table_np,
                                   seq_lens_np, query_start_np, max_query_len, max(seq_lens),
                                   None if lora is None else lora.token_slots, passes or [])
        pos_t = self._host(pos_np)
        meta = AttentionMetadata(
            lora=lora,
            slot_mapping=self._host(slots_np),
            block_tables=self._host(table_np),
            seq_lens=self._host(seq_lens_np),
            query_start_loc=self._host(query_start_np),
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
        )
        return self.model(self._tensor(input_ids), pos_t, meta, self.kv_caches), None

    def _prompt_logprobs(self, hidden: torch.Tensor,
                         chunks: list[tuple[ScheduledRequest, int, range]]) -> None:
        """Append the logprobs of the prompt tokens this step's chunks predict to their
        requests (`Request.prompt_logprobs`), per request (each its own top-k)."""
        for s, offset, wanted in chunks:
            req = s.request
            assert wanted.start == len(req.prompt_logprobs)
            req.prompt_logprobs += prompt_logprobs.compute(
                self.model.compute_logits, hidden, [offset + q for q in wanted],
                [req.prompt_token_ids[q + 1] for q in wanted],
                req.sampling_params.prompt_logprobs or 0)

    def _lora_step(self, step: SchedulerOutput):
        """Slots for the step's adapters and each token's slot (-1: base), or None."""
        if self.lora is None:
            return None
        adapters = [s.request.lora for s in step.scheduled if s.request.lora is not None]
        if not adapters:
            return None
        slot_of = self.lora.assign(adapters)
        token_slots: list[int] = []
        for s in step.scheduled:
            a = s.request.lora
            token_slots += [-1 if a is None else slot_of[a.uid]] * s.num_new_tokens
        return self.lora.step(token_slots)

    def _sample(self, sampling: list[Request], logits: torch.Tensor,
                masks: StepMasks | None = None, ids: list[int] | None = None) -> dict[str, SampleResult]:
        rows = self._greedy_rows(sampling, logits, masks, ids)
        if rows is None:
            rows = self._plain_rows(sampling, logits, masks)
        if rows is not None:
            return {r.request_id: res for r, res in zip(sampling, rows, strict=True)}
        logits = self.logits_masks.apply(logits, masks)
        out = ops.sample(logits, self._sampling_tensors(sampling))
        return self._results(sampling, out)

    @staticmethod
    def _greedy_rows(reqs: list[Request], logits: torch.Tensor, masks: StepMasks | None,
                     ids: list[int] | None = None) -> list[SampleResult] | None:
        """What ops.sample gives rows that are all plain greedy on CPU logits (each row's
        argmax), without building its tensors; None for any other step. `ids`: those
        argmaxes as the CPU decoder's call found them (-1: not finite), if it did."""
        if masks is not None or not all(map(_plain_greedy, reqs)):
            return None
        if ids is None or min(ids) < 0:  # (ids come from the CPU decoder's call alone)
            if logits.device.type != "cpu":
                return None
            ids = greedy_ids_cpu(logits)
        return None if ids is None else [SampleResult(t) for t in ids]

    @staticmethod
    def _plain_rows(reqs: list[Request], logits: torch.Tensor, masks: StepMasks | None,
                    prior: list[list[int]] | None = None) -> list[SampleResult] | None:
        """What ops.sample gives CPU rows with no mask, penalty or logprobs (and not all
        greedy: `_greedy_rows`), through the C sampler's own call without the tensors of
        `_sampling_tensors` (ops.cpu_sampling.sample_plain: the same tokens); None for any
        other step. `prior` as `_sampling_tensors` takes it."""
        if masks is not None or ops.kernel_path(logits.device) != "c":
            return None
        ps = [r.sampling_params for r in reqs]
        if all(p.greedy for p in ps) or not all(p.logprobs is None and not p.penalized for p in ps):
            return None
        # all_greedy is ruled out, so each row's own temperature stands (as _draw takes it).
        steps = [r.num_output_tokens + (len(prior[i]) if prior else 0) for i, r in enumerate(reqs)]
        tokens = cpu_sampling.sample_plain(logits, [p.temperature for p in ps], [p.top_p for p in ps],
                                           [p.top_k for p in ps], [p.min_p for p in ps],
                                           [p.seed for p in ps], steps)
        return None if tokens is None else [SampleResult(t) for t in tokens]

    @staticmethod
    def _one_each(results: dict[str, SampleResult]) -> dict[str, list[SampleResult]]:
        return {rid: [r] for rid, r in results.items()}

    def _verify(self, sampling: list[ScheduledRequest], logits: torch.Tensor,
                masks: StepMasks | None = None, ids: list[int] | None = None) -> dict[str, list[SampleResult]]:
        """Sample every row of a step with drafts, row j of a request as if its drafts d1..dj
        were output, and keep each request's accepted drafts and next token."""
        reqs: list[Request] = []
        prior: list[list[int]] = []
        for s in sampling:  # the rows as `execute` laid them out: own ones, then forks'
            d = s.spec_token_ids
            reqs += [s.request] * (len(d) + 1) + s.forks
            prior += [d[:j] for j in range(len(d) + 1)] + [[] for _ in s.forks]
        rows = self._greedy_rows(reqs, logits, masks, ids)  # the drafts change no plain greedy row
        if rows is None:
            rows = self._plain_rows(reqs, logits, masks, prior)
        if rows is None:
            logits = self.logits_masks.apply(logits, masks)
            rows = self._row_results(reqs, ops.sample(logits, self._sampling_tensors(reqs, prior)))
        results: dict[str, list[SampleResult]] = {}
        first = 0
        for s in sampling:
            mine = rows[first : first + len(s.spec_token_ids) + 1]
            first += len(mine)
            n = accepted(s.spec_token_ids, [r.token_id for r in mine])
            results[s.request_id] = mine[: n + 1]
            for f in s.forks:
                results[f.request_id] = [rows[first]]
                first += 1
        return results

    def _sampling_tensors(self, reqs: list[Request], prior: list[list[int]] | None = None) -> SamplingTensors:
        """One row per entry of `reqs`; `prior[i]` (drafts) counts as output after row i's
        request's own, for its penalties and its seeded generator's output index."""
        prior = prior or [[] for _ in reqs]
        ps = [r.sampling_params for r in reqs]
        # The per-row floats travel as one tensor: one host-to-device copy, not six.
        floats = torch.tensor(
            [[p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
              p.frequency_penalty] for p in ps], dtype=torch.float32,
        ).t().to(self.device, non_blocking=True)

        penalty_tokens = None
        if any(p.penalized for p in ps):
            # Rows without penalties count no token: their seen logits stay as they are.
            penalty_tokens = PenaltyTokens.from_lists([
                (r.prompt_token_ids, r.output_token_ids + d) if p.penalized else ([], [])
                for r, p, d in zip(reqs, ps, prior, strict=True)
            ])
        wants = [p.logprobs for p in ps if p.logprobs is not None]
        return SamplingTensors(
            temperature=floats[0],
            top_p=floats[1],
            top_k=self._tensor([p.top_k for p in ps]),
            min_p=floats[2],
            repetition_penalty=floats[3],
            presence_penalty=floats[4],
            frequency_penalty=floats[5],
            penalty_tokens=penalty_tokens,
            seeds=[p.seed for p in ps],
            steps=[r.num_output_tokens + len(d) for r, d in zip(reqs, prior, strict=True)],
            all_greedy=all(p.greedy for p in ps),
            num_logprobs=max(wants) if wants else -1,
        )

    @classmethod
    def _results(cls, reqs: list[Request], out) -> dict[str, SampleResult]:
        return {r.request_id: res for r, res in zip(reqs, cls._row_results(reqs, out), strict=True)}

    @staticmethod
    def _row_results(reqs: list[Request], out) -> list[SampleResult]:
        # One device-to-host copy per step, not one per request.
        tokens = out.token_ids.tolist()
        chosen = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        results = []
        for i, r in enumerate(reqs):
            res = SampleResult(tokens[i])
            n = r.sampling_params.logprobs
            if n is not None and chosen is not None:
                res.logprob = chosen[i]
                res.top_logprobs = list(zip(top_ids[i][:n], top_lp[i][:n], strict=True)) if top_ids else []
            results.append(res)
        return results


def _plain_greedy(req: Request) -> bool:
    """Sampled as the argmax of the raw logits, with no logprobs wanted."""
    p = req.sampling_params
    return p.greedy and p.logprobs is None and not p.penalized


def _unzip(pairs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [a for a, _ in pairs], [b for _, b in pairs]
