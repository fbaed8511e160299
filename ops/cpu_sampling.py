"""Sampling on the CPU with the C kernel (`cpu_kernels/sampling.c`): the C backend's `sample_c`.

`sample_ref`'s contract (ops/sampling.py), at a small part of its cost: on a 49k vocabulary
the reference took ~1.3 ms a row at temperature 1 and ~4.7 ms with top-p or top-k (a
sort of the row), on top of a ~3.5 ms batch-1 decode step, and ~100-230 ms for 64 rows
(BENCHMARKS.md, session 20). Penalties are a C pass over each row's seen tokens alone
(`penalize_c`, cpu_kernels/penalties.c), logprobs two read-only passes a row
(`ops.cpu_logprobs`); plain greedy steps keep the reference's numpy argmax.

What differs from the reference, as with the Triton kernel: its own random stream (an
inverse-CDF draw from one 64-bit key a row: `seed_key(seed, step)` for a seeded row, so
its token never depends on the batch; a base drawn from torch's global generator plus the
row for the others), and ties at a top-k / top-p boundary keep every tied token. Greedy
tokens and the kept sets of distinct logits are the reference's; the draw's distribution
is the kept tokens' renormalized softmax (tests/test_sampling_c.py).
"""

from __future__ import annotations

import array
import ctypes
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ops import cpu_kernels, cpu_logprobs
from ops.cpu_logprobs import with_logprobs_c
from ops.sampling import (
    SamplerOutput,
    SamplingTensors,
    sample_ref,
    seed_key,
)

Buffer = Any  # a C-contiguous, writable buffer: a numpy array or an array.array


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_kernels.load("sampling")
    if lib is not None:
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.sample_rows.argtypes = [p, i64, i32, i32, p, p, p, p, p, p, ctypes.c_uint64, p, p, i32]
        lib.sample_rows.restype = ctypes.c_int
    return lib


@functools.cache
def _penalties() -> ctypes.CDLL | None:
    lib = cpu_kernels.load("penalties")
    if lib is not None:
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.penalize_rows.argtypes = [p, i64, i32, i32, p, p, p, p, p, p, i32]
        lib.penalize_rows.restype = ctypes.c_int
    return lib


def available() -> bool:
    """The sampler's kernels are built and loaded (the runner asks at start-up, so that no
    request waits for gcc)."""
    return _library() is not None and _penalties() is not None and cpu_logprobs.available()


def penalize_c(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """`apply_penalties` for the C sampler: a copy of the float32 CPU logits with each row's
    seen tokens penalized (cpu_kernels/penalties.c) and every other logit as it was. Equal
    to the reference wherever the reference is finite; a non-finite logit stays non-finite
    (the reference: -inf), which the sampler never draws either."""
    pt = st.penalty_tokens
    if pt is None:
        return logits
    lib = _penalties()
    assert lib is not None
    z = logits.clone(memory_format=torch.contiguous_format)
    b, v = z.shape
    # The values as the requests gave them: the kernel clamps them as penalty_values does.
    rep, pres, freq = (t.float().contiguous() for t in (st.repetition_penalty, st.presence_penalty,
                                                         st.frequency_penalty))
    ids, starts, lens = pt.ids.contiguous(), pt.starts.contiguous(), pt.prompt_lens.contiguous()
    assert starts.numel() == b + 1, "one row of penalty tokens per row of logits"
    rc = lib.penalize_rows(z.data_ptr(), z.stride(0), b, v, ids.data_ptr(), starts.data_ptr(),
                           lens.data_ptr(), rep.data_ptr(), pres.data_ptr(), freq.data_ptr(),
                           torch.get_num_threads())
    if rc:
        raise MemoryError("the C penalties could not allocate their scratch")
    return z


def _usable(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[0] > 0 and logits.stride(-1) == 1 and available())


def _draw(logits: torch.Tensor, st: SamplingTensors, kept: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of the (penalized) logits."""
    z = penalize_c(logits, st)
    b = z.shape[0]
    # all_greedy rows take their argmax whatever their temperature (e.g. top_k 1).
    temp = np.zeros(b, dtype=np.float32) if st.all_greedy else st.temperature.float().numpy()

    def host(x: torch.Tensor | np.ndarray, dtype: type) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=dtype)

    return torch.from_numpy(_sample_rows(z, host(temp, np.float32), host(st.top_p.float().numpy(), np.float32),
                                         host(st.top_k.to(torch.int64).numpy(), np.int64),
                                         host(st.min_p.float().numpy(), np.float32), st.seeds, st.steps, kept))


def _sample_rows(z: torch.Tensor, temp: Buffer, top_p: Buffer, top_k: Buffer, min_p: Buffer,
                 seeds: Sequence[int | None], steps: Sequence[int], kept: torch.Tensor | None = None) -> np.ndarray:
    """The kernel's draw of one token per row of float32 CPU logits z (penalized already), the
    rows' controls as float32 (temp, top_p, min_p) and int64 (top_k) buffers, numpy arrays or
    array.array: what `_draw` and `sample_plain` share."""
    lib = _library()
    assert lib is not None
    if z.stride(-1) != 1:
        z = z.contiguous()
    b, v = z.shape
    assert len(temp) == len(top_p) == len(top_k) == len(min_p) == len(seeds) == len(steps) == b
    for x, kind in ((temp, "f"), (top_p, "f"), (min_p, "f"), (top_k, "q")):
        assert _kind(memoryview(x)) == kind, "float32 or int64 controls"
    seeded = array.array("B", [s is not None for s in seeds])
    keys = array.array("Q", [0 if s is None else seed_key(s, n) for s, n in zip(seeds, steps, strict=True)])
    base = int(torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.int64)) & ((1 << 64) - 1)
    out = np.empty(b, dtype=np.int64)
    at = cpu_kernels.address
    rc = lib.sample_rows(z.data_ptr(), z.stride(0), b, v, at(temp), at(top_p), at(top_k), at(min_p),
                         at(keys), at(seeded), base, at(out), None if kept is None else kept.data_ptr(),
                         torch.get_num_threads())
    if rc:
        raise MemoryError("the C sampler could not allocate its scratch")
    return out


def _kind(m: memoryview) -> str:
    """"f" for float32 items, "q" for int64 ones (numpy's int64 says "l" on LP64), else the
    format."""
    return "q" if m.format in ("q", "l") and m.itemsize == 8 else m.format


def sample_plain(logits: torch.Tensor, temperature: Sequence[float], top_p: Sequence[float],
                 top_k: Sequence[int], min_p: Sequence[float], seeds: Sequence[int | None],
                 steps: Sequence[int]) -> list[int] | None:
    """`sample_c`'s tokens for rows with no penalties and no logprobs, not all greedy, from
    the rows' controls as lists (row i's seeded generator at output index steps[i]), without
    building SamplingTensors: a one-request step's sampling was ~0.2 ms of Python around
    the kernel's ~0.07 ms. The same kernel call with the same values (float32 as torch.tensor
    rounds them: to nearest, inf past float32's range) and the same base from torch's
    generator: the same tokens. Its arrays are the standard library's: numpy's conversions,
    each dispatched for the first time since the decode call swept the caches, were a large
    part of a sampled step's Python (BENCHMARKS.md, session 26). None where the kernel cannot
    run here."""
    if not _usable(logits):
        return None
    return _sample_rows(logits, array.array("f", temperature), array.array("f", top_p), array.array("q", top_k),
                        array.array("f", min_p), seeds, steps).tolist()


def sample_c(logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
    """logits: [B, V] float32 -> one token per row; drop-in for sample_ref (which runs where
    the kernel cannot: not float32 CPU logits, not built here)."""
    if not _usable(logits) or (st.all_greedy and st.penalty_tokens is None and st.num_logprobs < 0):
        return sample_ref(logits, st)  # plain greedy: its numpy argmax is as cheap
    return with_logprobs_c(logits, _draw(logits, st), st)


def inspect_c(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """For tests: (tokens, kept), kept [B, V] bool the set each row's draw picks from (a
    greedy row: its argmax)."""
    assert _usable(logits)
    kept = torch.zeros(logits.shape, dtype=torch.uint8)
    tokens = _draw(logits, st, kept)
    return tokens, kept.bool()
