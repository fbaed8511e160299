"""Logprobs on the CPU with the C kernel (`cpu_kernels/logprobs.c`): `token_logprobs_c`, the
C backend's `ops.token_logprobs` (the sampler's logprobs and prompt logprobs).

`token_logprobs_ref`'s contract (ops/sampling.py), at a small part of its cost: on a 49k
vocabulary the reference (finite_logits, log_softmax, gather, topk over a [B, V] copy) took
~0.25 ms at batch 1 and ~7 ms at 64 rows with 5 logprobs (~0.07 and ~1.6 ms here,
benchmarks.sampler_ops). The kernel reads each row twice (the max and the top n by logit;
the sum of exponentials) and writes only the results.

What differs from the reference (tests/test_logprobs_c.py): the sum of exponentials is
the kernel's own (simd.h's exp8; float partial sums added in double; x - max - log(sum)
rounded once), so values agree to within a few float ulps, not bit for bit (the kernel's
are the closer to float64's); tied logits are ranked lower token id first (torch's topk
leaves their order open). Where the kernel cannot run (not float32 2-D CPU logits with unit
column stride, not int64 / int32 CPU token ids, more than MAX_TOP or V alternatives, not
built here) the reference runs and raises what it raises; a token id out of range is
reported by the kernel, and the reference then raises torch's error.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ops import cpu_kernels
from ops.sampling import SamplerOutput, SamplingTensors, token_logprobs_ref

MAX_TOP = 64  # the kernel's largest n (its buffer); OpenAI's API asks for at most 20


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_kernels.load("logprobs")
    if lib is not None:
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.logprob_rows.argtypes = [p, i64, i32, i32, p, i32, p, p, p, i32]
        lib.logprob_rows.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _library() is not None


def _usable(logits: torch.Tensor, token_ids: torch.Tensor, n: int) -> bool:
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[0] > 0 and 0 < logits.shape[1] < 2**31 and logits.stride(-1) == 1
            and n <= MAX_TOP and n <= logits.shape[1]
            and token_ids.device.type == "cpu" and token_ids.dtype in (torch.int64, torch.int32)
            and token_ids.shape == logits.shape[:1] and available())


def token_logprobs_c(logits: torch.Tensor, token_ids: torch.Tensor, n: int, clean: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Drop-in for `token_logprobs_ref(logits, token_ids, n, clean)`: chosen [B] float32,
    and with n > 0 top ids [B, n] int64 and logprobs [B, n] float32 (else None, None).
    `clean` only matters where the reference runs."""
    if not _usable(logits, token_ids, n):
        return token_logprobs_ref(logits, token_ids, n, clean)
    lib = _library()
    assert lib is not None
    b, v = logits.shape
    tokens = token_ids.to(torch.int64).contiguous()
    chosen = torch.empty(b, dtype=torch.float32)
    top_ids = torch.empty(b, n, dtype=torch.int64) if n else None
    top_lp = torch.empty(b, n, dtype=torch.float32) if n else None
    rc = lib.logprob_rows(logits.data_ptr(), logits.stride(0), b, v, tokens.data_ptr(), n,
                          chosen.data_ptr(), None if top_ids is None else top_ids.data_ptr(),
                          None if top_lp is None else top_lp.data_ptr(), torch.get_num_threads())
    if rc:  # a token out of range: the reference raises torch's own error
        return token_logprobs_ref(logits, token_ids, n, clean)
    return chosen, top_ids, top_lp


def with_logprobs_c(logits: torch.Tensor, token_ids: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
    """`with_logprobs(logits, token_ids, st)` through `token_logprobs_c`."""
    if st.num_logprobs < 0:
        return SamplerOutput(token_ids, None, None, None)
    return SamplerOutput(token_ids, *token_logprobs_c(logits, token_ids, st.num_logprobs))
