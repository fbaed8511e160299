"""What a request's own settings do to its row of logits before sampling: its grammar's
token bitmask (structured outputs, worker.structured), its `logit_bias`, and `min_tokens`
(EOS and stop ids masked until then). Applied by the model runner to the logits of the
rows that sample, before `ops.sample`, on every kernel path (the Triton sampler gets the
masked logits too).

One step::

    execute(step)                 start(): on a GPU, fill the bitmask of every constrained
      |                           row at once (llguidance's executor, from a helper thread),
      forward pass                while the GPU runs the forward pass; the matchers are the
      |                           engine thread's, and it does not touch them until then
      apply(logits) -------------> (on the CPU, the fill happens here: the forward pass has
      ops.sample                  every core, and a fill beside it would stall torch's
                                  threads); bitmask rows -> -inf where not allowed;
                                  + logit_bias; -inf on EOS/stop ids below min_tokens
                                  (unless the grammar allows nothing else)

Logprobs are then of this distribution (the one the token is drawn from, before penalties
and temperature), as vLLM reports them under a grammar.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from scheduler.request import Request

# byte value -> its 8 bits as additive logits (0 allowed, -inf not), lowest bit first.
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()


@dataclass
class MaskStats:
    """Figures of the masks, summed over steps (read by benchmarks)."""

    num_steps: int = 0  # steps with at least one constrained row
    num_rows: int = 0  # constrained rows masked
    fill_s: float = 0.0  # llguidance filling bitmasks (in the helper thread)
    wait_s: float = 0.0  # the engine thread waiting for a fill after the forward pass
    apply_s: float = 0.0  # unpacking and applying masks, biases and min_tokens


@dataclass
class StepMasks:
    """One step's work, begun by `LogitsMasks.start`."""

    reqs: Sequence[Request]
    grammar_rows: list[int] = field(default_factory=list)  # indices into reqs
    matchers: list = field(default_factory=list)  # (llguidance matcher, bitmask row)
    fill: Future[float] | None = None  # the fill begun in start(): its duration, when done
    # Some row has a logit_bias or an unmet min_tokens; False (a grammar-only step): apply
    # does not walk the rows a second time for them.
    bias: bool = True


def _needs_min_tokens(r: Request) -> bool:
    return r.num_output_tokens < r.sampling_params.min_tokens


class LogitsMasks:
    """The runner's hook; `vocab_size` is the logits' width (the bitmask's too: llguidance's
    tokenizer is built with the model's vocabulary size, so padding ids are never allowed)."""

    def __init__(self, vocab_size: int, device: torch.device,
                 overlap: bool | None = None) -> None:
        self.vocab_size = vocab_size
        # Fill during the forward pass: where the forward pass leaves the CPU free.
        self.overlap = device.type == "cuda" if overlap is None else overlap
        self.words = (vocab_size + 31) // 32
        self.device = device
        self.stats = MaskStats()
        self._bitmask = torch.empty(0, self.words, dtype=torch.int32)
        self._executor = None  # llguidance's, made on first use
        self._pool: ThreadPoolExecutor | None = None
        self._tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def start(self, reqs: Sequence[Request]) -> StepMasks | None:
        """Begin the step's masks for the rows `reqs` (the requests that sample, in logits
        row order); None when no row needs any."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        bias = any(r.sampling_params.logit_bias or _needs_min_tokens(r) for r in reqs)
        if not rows and not bias:
            return None
        step = StepMasks(reqs, rows, bias=bias)
        if rows:
            if self._bitmask.shape[0] < len(rows):
                n = max(len(rows), 2 * self._bitmask.shape[0], 8)
                self._bitmask = torch.empty(n, self.words, dtype=torch.int32,
                                            pin_memory=self.device.type == "cuda")
            step.matchers = [(reqs[i].grammar.matcher, k) for k, i in enumerate(rows)]
            if self.overlap:
                if self._pool is None:
                    import llguidance as llg

                    self._executor = llg.LLExecutor()
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
                step.fill = self._pool.submit(self._fill, step.matchers)
        return step

    def _fill(self, matchers: list) -> float:
        """Rows k < len(matchers) of the bitmask; llguidance drops the GIL while it fills.
        Overlapped (a GPU): its executor, rows in parallel on its own threads. Inline (the
        CPU): one row after another on this thread, with no extra threads to contend with
        torch's (a few hundredths of a millisecond a row)."""
        start = time.perf_counter()
        bm, row_bytes = self._bitmask, self.words * 4
        if self._executor is not None:
            self._executor.unsafe_compute_mask_ptr(matchers, bm.data_ptr(), row_bytes,
                                                   bm.shape[0])
        else:
            base = bm.data_ptr()  # row k at base + k * row_bytes: no tensor view per row
            for matcher, k in matchers:
                matcher.unsafe_compute_mask_ptr(base + k * row_bytes, row_bytes)
        return time.perf_counter() - start

    def apply(self, logits: torch.Tensor, step: StepMasks | None) -> torch.Tensor:
        """The logits [B, V] with the step's masks and biases applied (in place)."""
        if step is None:
            return logits
        st = self.stats
        if step.fill is not None:
            waited = time.perf_counter()
            st.fill_s += step.fill.result()
            st.wait_s += time.perf_counter() - waited
        elif step.matchers:
            filled = self._fill(step.matchers)
            st.fill_s += filled
            st.wait_s += filled  # the engine thread did it
        start = time.perf_counter()
        if step.grammar_rows:
            n = len(step.grammar_rows)
            if _c_usable(logits):  # the CPU: in place, one pass over the bitmask
                _apply_c(logits, self._bitmask[:n], step.grammar_rows, self.vocab_size)
            else:
                add = self._additive(self._bitmask[:n].to(logits.device, non_blocking=True),
                                     logits.dtype)
                if n == logits.shape[0]:
                    logits.add_(add)
                else:
                    logits.index_add_(0, torch.tensor(step.grammar_rows, device=logits.device),
                                      add)
            st.num_steps += 1
            st.num_rows += n
        if step.bias:
            self._bias(logits, step.reqs)
        st.apply_s += time.perf_counter() - start
        return logits

    def _additive(self, bitmask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[n, words] int32 bitmask -> [n, V] logits to add: 0 where allowed, -inf not. Bit j
        of word w is token 32w + j: read as little-endian bytes, byte b holds tokens
        8b..8b+7, lowest bit first. A table lookup per byte and one add: on the CPU several
        times faster than masked_fill with a [n, V] bool mask."""
        key = (dtype, bitmask.device)
        table = self._tables.get(key)
        if table is None:
            table = torch.zeros(256, 8, dtype=dtype).masked_fill_(~_BYTE_BITS, float("-inf"))
            table = self._tables[key] = table.to(bitmask.device)
        by = bitmask.view(torch.uint8)
        add = torch.nn.functional.embedding(by.int(), table)
        return add.view(by.shape[0], -1)[:, : self.vocab_size]

    def _bias(self, logits: torch.Tensor, reqs: Sequence[Request]) -> None:
        """logit_bias added; EOS and stop ids -inf for rows below min_tokens."""
        rows: list[int] = []
        ids: list[int] = []
        values: list[float] = []
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, r in enumerate(reqs):
            p = r.sampling_params
            for t, b in p.logit_bias:
                rows.append(i)
                ids.append(t)
                values.append(b)
            if _needs_min_tokens(r):
                stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
                ban_rows += [i] * len(stops)
                ban_ids += stops
        dev = logits.device
        if rows:
            logits.index_put_(
                (torch.tensor(rows, device=dev), torch.tensor(ids, device=dev)),
                torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)
        if ban_rows:
            where = (torch.tensor(ban_rows, device=dev), torch.tensor(ban_ids, device=dev))
            # A grammar may allow nothing but a stop token (regex [0-9] with the digits as
            # stop ids): then min_tokens yields to it. Banned anyway, the row had no token
            # left, drew one the grammar refuses, and failed as a server error.
            grammar = sorted({i for i in ban_rows if reqs[i].grammar is not None})
            before = logits[where] if grammar else None
            logits.index_put_(where, torch.tensor(float("-inf"), dtype=logits.dtype, device=dev))
            if grammar:
                dead = [i for i, m in zip(grammar, logits[grammar].amax(dim=1).tolist(), strict=True)
                        if m == float("-inf")]
                if dead:
                    back = torch.isin(where[0], torch.tensor(dead, device=dev))
                    logits[where[0][back], where[1][back]] = before[back]


@functools.cache
def _library() -> ctypes.CDLL | None:
    from ops import cpu_kernels

    lib = cpu_kernels.load("token_bitmask")
    if lib is not None:
        p, i32 = ctypes.c_void_p, ctypes.c_int
        lib.apply_token_bitmask.argtypes = [p, ctypes.c_int64, p, i32, p, i32, i32, i32]
        lib.apply_token_bitmask.restype = None
    return lib


def _c_usable(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and _library() is not None)


def _apply_c(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> None:
    """logits[rows[k]] = -inf where bitmask row k bans the token (cpu_kernels/token_bitmask.c)."""
    lib = _library()
    assert lib is not None and bitmask.is_contiguous() and bitmask.dtype == torch.int32
    assert logits.shape[1] >= vocab and max(rows) < logits.shape[0]
    idx = torch.tensor(rows, dtype=torch.int64)
    lib.apply_token_bitmask(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(),
                            bitmask.shape[1], idx.data_ptr(), len(rows), vocab,
                            torch.get_num_threads())
