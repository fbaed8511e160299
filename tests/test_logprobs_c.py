"""Tests of the CPU's C logprobs (ops.cpu_logprobs, cpu_kernels/logprobs.c) against the torch
reference (ops.sampling.with_logprobs).

Tolerance. The kernel sums exp(x - max) with its own exp (simd.h's exp8; float partial sums
of 16 terms a lane, added in double) and rounds x - max - log(sum) once; torch rounds x - max
to float, sums in float and subtracts. On ordinary rows (|logprob| < ~60) the kernel is within
about an ulp of float64's value, torch within a few (measured: up to 8e-6 at |logprob| ~ 20;
ulp(32) is 3.8e-6): atol 2e-5 against torch, tighter against float64
(test_accuracy_against_float64). Rows of huge magnitudes (|logprob| ~ 1e38) agree to an ulp
or two: rtol 1e-6.
Ties: torch's topk orders tied values arbitrarily, so the top ids are compared with torch's
only where torch's values are distinct; everywhere the ids are distinct and each id's logprob
(of the reference's full log_softmax) is the value reported.
"""

from __future__ import annotations

import pytest
import torch

from ops import cpu_logprobs
from ops.cpu_logprobs import with_logprobs_c
from ops.sampling import SamplerOutput, finite_logits, with_logprobs
from tests.test_sampling import make_st

pytestmark = pytest.mark.skipif(not cpu_logprobs.available(), reason="no C kernels here")

ATOL, RTOL = 2e-5, 1e-6
V_MODEL = 49152  # the default model's vocabulary
NAN, INF = float("nan"), float("inf")


@pytest.fixture
def kernel_only(monkeypatch):
    """The wrapper's fallback fails the test: these inputs must run in the kernel."""
    def no_fallback(*args, **kwargs):
        raise AssertionError("with_logprobs_c fell back to the reference")
    monkeypatch.setattr(cpu_logprobs, "token_logprobs_ref", no_fallback)


def reference_lp(logits: torch.Tensor) -> torch.Tensor:
    lp = finite_logits(logits).log_softmax(-1)
    return lp.masked_fill_(lp.isnan(), -INF)


def check(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> SamplerOutput:
    """with_logprobs_c against with_logprobs; returns the kernel's output."""
    st = make_st(logits.shape[0], num_logprobs=n)
    ref = with_logprobs(logits, tokens, st)
    got = with_logprobs_c(logits, tokens, st)
    assert got.token_ids is tokens
    assert got.logprobs is not None and got.logprobs.dtype == torch.float32
    assert got.logprobs.shape == (logits.shape[0],)
    torch.testing.assert_close(got.logprobs, ref.logprobs, atol=ATOL, rtol=RTOL)
    if n == 0:
        assert got.top_ids is None and got.top_logprobs is None
        return got
    assert ref.top_ids is not None and ref.top_logprobs is not None
    assert got.top_ids is not None and got.top_logprobs is not None
    assert got.top_ids.dtype == torch.int64 and got.top_logprobs.dtype == torch.float32
    assert got.top_ids.shape == got.top_logprobs.shape == (logits.shape[0], n)
    # Values position by position (equal whatever order ties take), descending.
    torch.testing.assert_close(got.top_logprobs, ref.top_logprobs, atol=ATOL, rtol=RTOL)
    assert bool((got.top_logprobs[:, :-1] >= got.top_logprobs[:, 1:]).all())
    # Distinct ids, each with the logprob reported.
    ids_sorted = got.top_ids.sort(-1).values
    assert bool((ids_sorted[:, 1:] != ids_sorted[:, :-1]).all())
    assert bool(((got.top_ids >= 0) & (got.top_ids < logits.shape[1])).all())
    torch.testing.assert_close(reference_lp(logits).gather(-1, got.top_ids), got.top_logprobs,
                               atol=ATOL, rtol=RTOL)
    # The chosen token's value and its entry in the top n are the same number.
    same = got.top_ids == tokens[:, None]
    assert torch.equal(got.top_logprobs[same], got.logprobs[:, None].expand(-1, n)[same])
    # torch's ids wherever its value is distinct from its neighbours (-inf ones never are).
    v = ref.top_logprobs.double()
    pad = torch.full((v.shape[0], 1), INF, dtype=torch.float64)
    gap_before = (v - torch.cat([pad, v[:, :-1]], 1)).abs()
    gap_after = (v - torch.cat([v[:, 1:], -pad], 1)).abs()
    distinct = (gap_before > 4 * ATOL) & (gap_after > 4 * ATOL) & torch.isfinite(v)
    assert torch.equal(got.top_ids[distinct], ref.top_ids[distinct])
    return got


def rand_logits(b: int, v: int, seed: int) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 2.0


def random_tokens(b: int, v: int, seed: int) -> torch.Tensor:
    return torch.randint(0, v, (b,), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- ordinary rows

SHAPES = [(1, V_MODEL), (3, V_MODEL), (64, V_MODEL), (3, 1), (3, 7), (2, 1003), (5, 5003)]
# n > V is the reference's error (test_fallbacks_are_the_reference).
CASES = [(b, v, n) for b, v in SHAPES for n in (0, 1, 5, 20) if n <= v]


@pytest.mark.parametrize(("b", "v", "n"), CASES)
def test_random_rows_match_reference(kernel_only, b, v, n):
    logits = rand_logits(b, v, seed=b * 1000 + v)
    tokens = random_tokens(b, v, seed=v)
    if v > 16:
        tokens[0] = int(logits[0].argmax())  # the chosen token among the top ones
        logits[0, v - 1] = logits[0].max() + 0.5  # the maximum in the vector tail
        if b > 1:
            logits[1, 0] = logits[1].max() + 0.5  # ... in the first n tokens
    got = check(logits, tokens, n)
    assert bool(torch.isfinite(got.logprobs).all())


@pytest.mark.parametrize("scale", [0.01, 1.0, 4.0, 10.0])
def test_accuracy_against_float64(kernel_only, scale):
    """The kernel's values are within about an ulp of float64's log_softmax (its sum good to
    ~1e-7 relative), where torch's float32 reference is off by up to ~8e-6 at scale 4."""
    logits = rand_logits(8, V_MODEL, seed=18) * (scale / 2.0)
    tokens = random_tokens(8, V_MODEL, seed=19)
    got = with_logprobs_c(logits, tokens, make_st(8, num_logprobs=20))
    exact = logits.double().log_softmax(-1)
    tol = {"atol": 5e-7, "rtol": 1.2e-7}  # rtol: one ulp (2^-23) of |logprob|, halved, x2
    torch.testing.assert_close(got.logprobs.double(), exact.gather(-1, tokens[:, None])[:, 0], **tol)
    torch.testing.assert_close(got.top_logprobs.double(), exact.gather(-1, got.top_ids), **tol)


def test_ascending_row_every_token_enters_the_top(kernel_only):
    """A row in ascending order: each token displaces the smallest of the top n."""
    v = 5003
    row = torch.linspace(-20.0, 20.0, v)
    logits = torch.stack([row, row.flip(0)])
    got = check(logits, torch.tensor([v - 1, 17]), 20)
    assert got.top_ids is not None
    assert got.top_ids[0].tolist() == list(range(v - 1, v - 21, -1))
    assert got.top_ids[1].tolist() == list(range(20))


# --------------------------------------------------------------------------- hostile rows


def test_non_finite_logits(kernel_only):
    """NaN, +inf and -inf count as -inf; a row with no finite logit is -inf throughout; a row
    with fewer finite logits than n fills the rest with -inf at distinct ids."""
    v = 1003
    logits = rand_logits(4, v, seed=7)
    logits[0, 3] = NAN
    logits[0, 10] = INF
    logits[0, 11] = -INF
    logits[0, 1000] = INF  # in the scalar tail
    logits[0, 1001] = NAN
    logits[1, ::3] = NAN
    logits[1, 1::3] = INF
    logits[1, 2::3] = -INF  # nothing finite
    logits[2] = -INF
    logits[2, [5, 500, 1002]] = torch.tensor([1.0, 3.0, 2.0])  # three finite logits
    logits[3, :200] = -INF
    tokens = torch.tensor([3, 40, 500, 7])
    for n in (0, 1, 5, 20):
        got = check(logits, tokens, n)
        assert got.logprobs.tolist()[:2] == [-INF, -INF] and float(got.logprobs[3]) == -INF
        if n == 5:
            assert got.top_ids is not None and got.top_logprobs is not None
            assert bool((got.top_logprobs[1] == -INF).all())
            assert got.top_ids[2, :3].tolist() == [500, 1002, 5]
            assert got.top_logprobs[2, 3:].tolist() == [-INF, -INF]
            assert not bool(torch.isin(got.top_ids[0], torch.tensor([3, 10, 11, 1000, 1001])).any())
    chosen = with_logprobs_c(logits, torch.tensor([10, 0, 5, 300]), make_st(4, num_logprobs=0))
    assert chosen.logprobs is not None
    assert float(chosen.logprobs[0]) == -INF  # a +inf logit is never a token's
    assert abs(float(chosen.logprobs[2]) - float(torch.tensor([1.0, 3.0, 2.0]).log_softmax(0)[0])) < ATOL


def test_huge_magnitudes(kernel_only):
    """Logits of +-3e38 among ordinary ones: no overflow into NaN, ties at a huge maximum,
    differences past -FLT_MAX round to -inf as torch's do."""
    v = 1003
    logits = rand_logits(3, v, seed=8)
    logits[0, [5, 100]] = 3e38  # tied maximum: -log 2 each
    logits[0, [9, 700]] = -3e38  # x - max overflows: -inf
    logits[0, 200] = 1e38
    logits[0, 201] = -1e38
    logits[1, ::2] = -3e38  # ordinary maximum, huge negative others
    logits[2] = torch.where(torch.arange(v) % 2 == 0, 3e38, -3e38)
    logits[2, 1001] = 2.9e38  # in the tail
    tokens = torch.tensor([9, 4, 1001])
    for n in (0, 1, 5, 20):
        got = check(logits, tokens, n)
        assert float(got.logprobs[0]) == -INF
        assert bool(torch.isfinite(got.logprobs[1:]).all())
    got = check(logits, tokens, 5)
    assert got.top_ids is not None and got.top_logprobs is not None
    assert sorted(got.top_ids[0, :2].tolist()) == [5, 100]
    torch.testing.assert_close(got.top_logprobs[0, :2], torch.full((2,), -0.6931472))


def test_all_equal_logits_ties(kernel_only):
    """Ties: values equal torch's, ids distinct, each id's logprob the one reported."""
    v = 1003
    logits = torch.full((2, v), 0.5)
    logits[1] = torch.tensor([5.0, 4.0, 4.0, 4.0, 1.0, 0.0, -2.0, 4.0]).repeat(126)[:v]  # 4.0 x 502
    tokens = torch.tensor([17, 2])
    for n in (1, 5, 20):
        got = check(logits, tokens, n)
        assert got.top_logprobs is not None
        torch.testing.assert_close(got.top_logprobs[0], torch.full((n,), -float(torch.tensor(v).log())),
                                   atol=ATOL, rtol=RTOL)


def test_row_stride_of_a_wider_tensor(kernel_only):
    """Rows that are slices of a wider tensor (stride(0) > V, unit column stride)."""
    wide = rand_logits(5, 6000, seed=9)
    logits = wide[:, 100:5103]
    assert logits.stride() == (6000, 1) and not logits.is_contiguous()
    tokens = random_tokens(5, 5003, seed=10)
    for n in (0, 5, 20):
        got = check(logits, tokens, n)
        want = with_logprobs_c(logits.contiguous(), tokens, make_st(5, num_logprobs=n))
        assert torch.equal(got.logprobs, want.logprobs)
        if n:
            assert torch.equal(got.top_ids, want.top_ids)
            assert torch.equal(got.top_logprobs, want.top_logprobs)


# --------------------------------------------------------------------------- threads, dispatch


def test_result_does_not_depend_on_thread_count(kernel_only):
    logits = rand_logits(64, V_MODEL, seed=11)
    logits[::7, ::5] = NAN
    tokens = random_tokens(64, V_MODEL, seed=12)
    st = make_st(64, num_logprobs=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = with_logprobs_c(logits, tokens, st)
        torch.set_num_threads(2)
        two = with_logprobs_c(logits, tokens, st)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.logprobs, two.logprobs)
    assert torch.equal(one.top_ids, two.top_ids)
    assert torch.equal(one.top_logprobs, two.top_logprobs)


def test_no_logprobs_asked():
    logits = rand_logits(2, 100, seed=13)
    tokens = torch.tensor([1, 2])
    out = with_logprobs_c(logits, tokens, make_st(2, num_logprobs=-1))
    assert out.token_ids is tokens and out.logprobs is None and out.top_ids is None
    assert out.top_logprobs is None


def test_fallbacks_are_the_reference():
    """Inputs the kernel does not take give the reference's result, or raise its error."""
    logits = rand_logits(3, 500, seed=14)
    tokens = torch.tensor([0, 499, 250])

    def same(x, t, n):
        st = make_st(x.shape[0], num_logprobs=n)
        got, ref = with_logprobs_c(x, t, st), with_logprobs(x, t, st)
        assert torch.equal(got.logprobs, ref.logprobs)
        assert (got.top_ids is None) == (ref.top_ids is None)
        if got.top_ids is not None:
            assert torch.equal(got.top_ids, ref.top_ids)
            assert torch.equal(got.top_logprobs, ref.top_logprobs)

    same(logits.double(), tokens, 5)  # not float32
    same(logits, tokens, cpu_logprobs.MAX_TOP + 1)  # more than the kernel's buffer
    wide = rand_logits(3, 1000, seed=15)
    same(wide[:, ::2], tokens, 5)  # column stride 2
    for bad in (torch.tensor([0, 500, 1]), torch.tensor([0, -1, 1])):  # a token out of range
        with pytest.raises(RuntimeError, match="out of bounds"):
            with_logprobs(logits, bad, make_st(3, num_logprobs=5))
        with pytest.raises(RuntimeError, match="out of bounds"):
            with_logprobs_c(logits, bad, make_st(3, num_logprobs=5))
    small = rand_logits(2, 7, seed=16)
    with pytest.raises(RuntimeError):  # more alternatives than tokens: topk's error
        with_logprobs_c(small, torch.tensor([0, 1]), make_st(2, num_logprobs=8))


def test_int32_tokens_run_in_the_kernel(kernel_only):
    logits = rand_logits(2, 300, seed=17)
    got = with_logprobs_c(logits, torch.tensor([3, 4], dtype=torch.int32), make_st(2, num_logprobs=2))
    want = with_logprobs(logits, torch.tensor([3, 4]), make_st(2, num_logprobs=2))
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=ATOL, rtol=RTOL)
    assert torch.equal(got.top_ids, want.top_ids)
