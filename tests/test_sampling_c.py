"""Tests of the CPU's C sampler (ops.cpu_sampling, cpu_kernels/sampling.c) against the torch
reference (ops.sampling).

The kernel draws from its own random stream (one 64-bit key a row, an inverse-CDF draw), so
it is compared with the reference through what must agree (tests/sampling_checks.py): greedy
tokens exactly, the kept set of top-k / top-p / min-p exactly for distinct logits, the
sampled distribution statistically (hundreds of thousands of draws: a row of a small
vocabulary costs about a microsecond here), logprobs to float tolerance.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import ops
from ops import cpu_sampling
from ops.cpu_sampling import inspect_c, penalize_c, sample_c
from ops.sampling import PenaltyTokens, apply_penalties, sample_ref
from tests.sampling_checks import (
    assert_kept_matches,
    check_distribution,
    check_distribution_with_filters_and_penalties,
    check_kept_sets,
    check_logprobs_match_reference,
    check_seeded_draws_vary_with_step_and_seed,
    check_ties_keep_every_tied_token,
    check_top_p_keeps_the_first_token,
    check_unseeded_rows_follow_global_generator,
    edge_tokens,
    filtered_softmax,
    mixed_batch,
    penalty_inputs,
)
from tests.test_sampling import make_st, rand_logits, repeat_row

pytestmark = pytest.mark.skipif(not cpu_sampling.available(), reason="no C kernels here")


@pytest.fixture(autouse=True)
def _global_rng():
    """Unseeded rows take their base key from the global generator: fix it, then restore it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2468)
        yield


def tokens(logits: torch.Tensor, st) -> torch.Tensor:
    return sample_c(logits, st).token_ids


def check_kept(logits: torch.Tensor, st, tol: float = 0.0) -> torch.Tensor:
    drawn, kept = inspect_c(logits, st)
    assert bool(kept.gather(-1, drawn[:, None]).all())  # every draw lies in its kept set
    assert_kept_matches(kept, logits, st, tol)
    return kept


# --------------------------------------------------------------------------- greedy


def test_greedy_rows_are_the_first_finite_maximum():
    v = 1203  # not a multiple of the 8-lane vectors: the tail is scalar
    logits = rand_logits(6, v, seed=1)
    logits[1, 1201] = logits[1].max() + 1.0  # the maximum in the scalar tail
    logits[2, 7] = logits[2, 900] = logits[2].max() + 1.0  # a tie: the first wins
    logits[3, 5] = float("nan")  # never the argmax, though NaN ranks first in torch
    logits[3, 6] = float("inf")
    logits[4] = float("-inf")  # nothing finite: token 0, as the reference
    logits[5, 10] = float("nan")
    st = make_st(6, temperature=[0.0, 0.0, 1e-6, 0.0, 0.0, float("nan")], all_greedy=False,
                 num_logprobs=-1)
    got = tokens(logits, st)
    ref = sample_ref(logits, make_st(6, temperature=0.0, all_greedy=False)).token_ids
    assert torch.equal(got, ref)
    assert int(got[1]) == 1201 and int(got[2]) == 7 and int(got[4]) == 0
    assert bool(torch.isfinite(logits[3, got[3]]))


def test_greedy_rows_in_mixed_batch_with_penalties():
    b, v = 8, 2500
    logits, prompt_mask, counts = penalty_inputs(5, b, v)
    temps = [0.0, 1.0, 0.0, 0.7, 0.0, 1.3, 1.0, 2.0]
    st = make_st(
        b, temperature=temps, top_k=[0, 20, 5, 0, 0, 0, 1, 0], top_p=[1, 1, 0.5, 0.9, 1, 1, 1, 0.8],
        repetition_penalty=[1.3, 1.0, 2.0, 1.1, 0.8, 1.0, 1.5, 1.2],
        presence_penalty=[0.5, 0.0, 0.2, 0.0, 1.0, 0.3, 0.0, 0.0],
        frequency_penalty=[0.3, 0.1, 0.0, 0.0, 0.4, 0.0, 1.0, 0.2],
        prompt_mask=prompt_mask, output_counts=counts,
    )
    greedy = (torch.tensor(temps) == 0) | (st.top_k == 1)  # top_k 1 is the argmax
    want = apply_penalties(logits, st).argmax(-1)
    assert not torch.equal(want[greedy], logits.argmax(-1)[greedy])  # penalties matter here
    assert torch.equal(tokens(logits, st)[greedy], want[greedy])
    st_all = make_st(
        b, temperature=0.0, repetition_penalty=st.repetition_penalty,
        presence_penalty=st.presence_penalty, frequency_penalty=st.frequency_penalty,
        prompt_mask=prompt_mask, output_counts=counts,
    )
    assert torch.equal(tokens(logits, st_all), want)


def test_overflowing_temperature_is_greedy():
    """A row whose logits / temperature overflow float32 takes its argmax (as the reference)."""
    row = torch.tensor([3e38, 1e38, -2e38, 5.0])
    st = make_st(4, temperature=[1e-3, 0.5, float("inf"), 1e-5])
    got = tokens(repeat_row(row, 4), st)
    assert got.tolist()[:2] == [0, 0] and int(got[3]) == 0
    # temperature inf (clamped to FLT_MAX): y is tiny but finite, and every token can come.
    assert 0 <= int(got[2]) < 4


# --------------------------------------------------------------------------- kept sets


def test_kept_set_top_k_top_p_min_p():
    check_kept_sets(check_kept)


def test_kept_set_across_blocks_with_penalties():
    b, v = 4, 5000  # ten of the walk's blocks
    logits, prompt_mask, counts = penalty_inputs(13, b, v)
    st = make_st(
        b, temperature=[1.0, 0.7, 1.5, 1.0], top_k=[300, 0, 50, 2500],
        top_p=[0.9, 0.5, 1.0, 0.97], min_p=[0.0, 0.0, 0.001, 0.0],
        repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
        prompt_mask=prompt_mask, output_counts=counts,
    )
    assert not bool(edge_tokens(logits, st, 1e-5).any())
    check_kept(logits, st)


def test_kept_set_reaching_below_the_candidate_floor():
    """Kept prefixes that take tokens of weight below 2^-20 of the top one (the candidates
    gathered first): every token with weight > 0 becomes a candidate, and the sets stay
    exact."""
    v = 3000
    row = torch.full((v,), -12.5)  # weights e^-14.5..e^-14 (5e-7..8e-7) < 2^-20 ~ 9.5e-7
    row[:4] = torch.tensor([2.0, 1.0, 0.5, 0.0])
    row[4:3000] += torch.linspace(0.0, 0.5, 2996)  # distinct: no ties at the boundary
    mass_low = float((row[4:] - 2.0).exp().sum() / (row - 2.0).exp().sum())
    assert 1e-4 < mass_low < 0.05
    st = make_st(3, top_k=[2000, 0, 10], top_p=[1.0, 1 - mass_low / 2, 1.0])
    # The reference's float32 cumsum over ~1,500 tiny probabilities near 1 blurs its top-p
    # boundary by up to ~5e-5 of mass: tokens that close to it may go either way.
    kept = check_kept(repeat_row(row, 3), st, tol=5e-5)
    assert int(kept[0].sum()) == 2000 and int(kept[2].sum()) == 10
    assert 4 < int(kept[1].sum()) < v


def test_top_p_first_token_always_kept_and_tiny_p():
    check_top_p_keeps_the_first_token(check_kept)


def test_ties_at_boundary_keep_every_tied_token():
    check_ties_keep_every_tied_token(lambda x, st: inspect_c(x, st)[1])


def test_off_values_and_nan_settings():
    """top_k <= 0 or >= V, top_p >= 1 or NaN, min_p NaN or <= 0: no filter; min_p > 1 is 1."""
    v = 40
    row = rand_logits(1, v, seed=3, scale=0.5)[0]
    st = make_st(6, top_k=[0, -5, v, 10**9, 0, 0],
                 top_p=[1.0, float("nan"), 2.0, 1.0, 1.0, 1.0],
                 min_p=[float("nan"), -1.0, 0.0, 0.0, 0.0, 7.0])
    _, kept = inspect_c(repeat_row(row, 6), st)
    assert bool(kept[:5].all())
    assert kept[5].tolist() == (row == row.max()).tolist()  # min_p 1: the top token only


def test_non_finite_logits_never_drawn():
    v = 50
    row = rand_logits(1, v, seed=14, scale=0.3)[0]
    row[::2] = float("-inf")  # e.g. a masked vocabulary
    row[1] = float("nan")
    row[3] = float("inf")
    n = 2000
    st = make_st(n, top_p=[1.0, 0.9] * (n // 2), top_k=[0, 0, 30, 0] * (n // 4))
    got = tokens(repeat_row(row, n), st)
    assert bool(torch.isfinite(row[got]).all())
    assert len(set(got.tolist())) > 10


# --------------------------------------------------------------------------- distribution

N = 200_000  # sigma of a frequency <= 0.0011; the 0.006 bound is over 5 sigma


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("seeded", [False, True])
def test_distribution_matches_softmax(temperature, seeded):
    v = 8
    row = rand_logits(1, v, seed=52, scale=1.0)[0]
    seeds = list(range(N)) if seeded else None
    st = make_st(N, temperature=temperature, seeds=seeds, steps=3)
    check_distribution(tokens(repeat_row(row, N), st), (row / temperature).softmax(-1), max_abs=0.006)


def test_distribution_with_filters_and_penalties():
    check_distribution_with_filters_and_penalties(tokens, check_kept, N)


def test_distribution_top_p_renormalizes():
    row = torch.tensor([1.2, 0.1, -0.3, 0.9, -2.0, 0.5, 0.0, -1.0])
    # top-k 4 keeps {0, 3, 5, 1}; top-p 0.85 then drops token 1 (mass before it > 0.85).
    st = make_st(N, top_k=4, top_p=0.85)
    kept = check_kept(row[None], make_st(1, top_k=4, top_p=0.85))[0]
    assert torch.nonzero(kept).flatten().tolist() == [0, 3, 5]
    check_distribution(tokens(repeat_row(row, N), st), filtered_softmax(row, 1.0, [0, 3, 5]),
                       max_abs=0.006)


def test_distribution_over_a_large_vocabulary():
    """The unfiltered draw walks block sums (512 tokens each), then one block: eight groups
    of a 6000-token row, each spanning blocks, drawn as often as their mass says."""
    v, n = 6000, 60_000
    row = rand_logits(1, v, seed=54, scale=1.0)[0]
    row[4321] = 6.0  # one token with a fair share of the mass, inside a block
    got = tokens(repeat_row(row, n), make_st(n))
    groups = torch.arange(v) * 8 // v
    probs = row.double().softmax(-1)
    expected = torch.zeros(8, dtype=torch.float64).index_add_(0, groups, probs)
    observed = torch.bincount(groups[got], minlength=8).double()
    chi2 = float(((observed - n * expected) ** 2 / (n * expected)).sum())
    assert chi2 < 30.0, (chi2, observed.tolist(), (n * expected).tolist())
    share = float((got == 4321).double().mean())
    assert abs(share - float(probs[4321])) < 5 * math.sqrt(float(probs[4321]) / n)


# --------------------------------------------------------------------------- seeds


@pytest.mark.parametrize("row_kw", [{}, {"top_k": 30, "temperature": 0.8}, {"top_p": 0.7}])
def test_seeded_row_independent_of_batch_threads_and_calls(row_kw):
    v = 300
    rows = rand_logits(3, v, seed=60, scale=0.3)  # flat: the draw is close to uniform
    threads = torch.get_num_threads()
    try:
        for i in range(rows.shape[0]):
            seed, step = 1000 + 7 * i, i % 5
            single = make_st(1, seeds=[seed], steps=[step], **{k: [x] for k, x in row_kw.items()})
            torch.manual_seed(i)
            alone = int(tokens(rows[i][None], single)[0])
            torch.manual_seed(i + 100)  # the global RNG state must not matter
            assert int(tokens(rows[i][None], single)[0]) == alone
            for pos, n_threads in ((0, 1), (6, 2)):
                torch.set_num_threads(n_threads)
                batch, st = mixed_batch(pos, rows[i], seed, step, row_kw)
                assert int(tokens(batch, st)[pos]) == alone, (i, pos)
    finally:
        torch.set_num_threads(threads)


def test_seeded_draws_vary_with_step_and_seed():
    check_seeded_draws_vary_with_step_and_seed(tokens)


def test_unseeded_rows_follow_global_generator():
    check_unseeded_rows_follow_global_generator(tokens)


# --------------------------------------------------------------------------- logprobs, dispatch


@pytest.mark.parametrize("n", [0, 1, 5])
def test_logprobs_match_reference(n):
    check_logprobs_match_reference(sample_c, n)


def test_the_c_backend_samples_with_the_kernel_and_others_fall_back():
    logits = rand_logits(4, 500, seed=90)
    st = make_st(4, temperature=[1.0, 0.5, 0.0, 1.2], seeds=[1, 2, 3, 4], steps=0)
    before = ops.backend()
    try:
        ops.set_backend("c")
        assert torch.equal(ops.sample(logits, st).token_ids, tokens(logits, st))
        ops.set_backend("torch")
        assert torch.equal(ops.sample(logits, st).token_ids, sample_ref(logits, st).token_ids)
    finally:
        ops.set_backend(before)
    # Logits the kernel does not take (float64) are the reference's.
    assert torch.equal(sample_c(logits.double(), st).token_ids, sample_ref(logits.double(), st).token_ids)


# ----- penalties at the seen tokens alone (penalize_c, cpu_kernels/penalties.c) -------------


def _seen_tokens(b: int, v: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """Per row: prompt tokens (with repeats) and output tokens (repeats: counts up to 4);
    row 1 sees nothing, row 2 only a prompt, row 3 only an output."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for r in range(b):
        prompt = torch.randint(0, v, (int(torch.randint(1, 300, (1,), generator=g)),), generator=g).tolist()
        output = torch.randint(0, v, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        output += output[: len(output) // 3] * 3  # repeated output tokens
        output += prompt[:5]  # some tokens in both
        rows.append(([] if r in (1, 3) else prompt, [] if r in (1, 2) else output))
    return rows


def _hostile_logits(b: int, v: int, rows) -> torch.Tensor:
    """Logits whose seen tokens include +-3e38, NaN, +inf, -inf, zeros of both signs."""
    logits = rand_logits(b, v, seed=31, scale=4.0)
    for r, (prompt, output) in enumerate(rows):
        seen = prompt + output
        for j, x in zip(seen[::7], [3e38, -3e38, float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-45], strict=False):
            logits[r, j] = x
    return logits


def _assert_same_where_finite(got: torch.Tensor, want: torch.Tensor) -> None:
    """The reference's finite logits exactly; where it has -inf (a non-finite logit), a
    non-finite one (never drawn either way)."""
    finite = torch.isfinite(want)
    assert torch.equal(got[finite], want[finite])
    assert not bool(torch.isfinite(got[~finite]).any())


@pytest.mark.parametrize("v", [24, 49152])
def test_penalties_at_seen_tokens_match_the_reference(v):
    b = 9
    rows = _seen_tokens(b, v, seed=v)
    logits = _hostile_logits(b, v, rows)
    st = make_st(
        b, temperature=0.8,
        repetition_penalty=[1.3, 1.3, 0.7, 1.0, 1e-45, 3e38, float("nan"), 1.1, 2.0],
        presence_penalty=[0.5, 0.5, -0.4, 1.0, 3e38, 0.0, -3e38, float("nan"), 0.2],
        frequency_penalty=[0.2, 0.2, 0.3, -1.0, 0.0, -3e38, 3e38, 0.5, float("nan")],
    )
    st.penalty_tokens = PenaltyTokens.from_lists(rows)
    want = apply_penalties(logits, st)
    got = penalize_c(logits, st)
    _assert_same_where_finite(got, want)
    assert not torch.equal(got, logits)  # it did penalize
    unseen = torch.ones(b, v, dtype=torch.bool)
    for r, (prompt, output) in enumerate(rows):
        unseen[r, prompt + output] = False
    finite_unseen = unseen & logits.isfinite()
    assert torch.equal(got[finite_unseen], logits[finite_unseen])  # untouched
    # the same bits on one thread as on two, and from rows that are a slice of wider ones
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(penalize_c(logits, st).nan_to_num(), got.nan_to_num())
    finally:
        torch.set_num_threads(threads)
    wide = torch.cat([logits, torch.zeros(b, 5)], dim=1)[:, :v]
    assert wide.stride(0) == v + 5
    assert torch.equal(penalize_c(wide, st).nan_to_num(), got.nan_to_num())


def test_penalties_skip_token_ids_outside_the_vocabulary():
    """The door admits none, but a stray id must not write outside the row."""
    v = 50
    logits = rand_logits(2, v, seed=4)
    st = make_st(2, repetition_penalty=1.5, frequency_penalty=0.5)
    st.penalty_tokens = PenaltyTokens.from_lists([([3, v, -1, 2**31 - 1], [7, v + 1, 7]), ([], [-5, 9])])
    st_clean = make_st(2, repetition_penalty=1.5, frequency_penalty=0.5)
    st_clean.penalty_tokens = PenaltyTokens.from_lists([([3], [7, 7]), ([], [9])])
    assert torch.equal(penalize_c(logits, st), apply_penalties(logits, st_clean))


def test_sampled_tokens_with_penalties_equal_the_dense_penalties():
    """The draw reads the sparse penalties: the same tokens as from the reference's dense
    penalized logits, for seeded sampled rows and greedy ones."""
    b, v = 9, 49152
    rows = _seen_tokens(b, v, seed=5)
    logits = rand_logits(b, v, seed=6, scale=3.0)
    cols = dict(temperature=[0.0, 0.7, 1.0, 0.0, 0.9, 1.2, 0.6, 0.0, 0.8], top_p=0.9,
                repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                seeds=list(range(b)), steps=3)
    st = make_st(b, **cols)
    st.penalty_tokens = PenaltyTokens.from_lists(rows)
    dense = apply_penalties(logits, st)
    plain = make_st(b, **{**cols, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0})
    assert torch.equal(tokens(logits, st), tokens(dense, plain))
    assert not torch.equal(tokens(logits, st), tokens(logits, plain))


def test_sample_plain_draws_sample_c_tokens():
    """The runner's plain path (no penalties, no logprobs, not all greedy) calls the kernel
    from lists: every row's token must be sample_c's, seeded and unseeded rows mixed, with the
    global generator in the same state, including controls float32 rounds (0.1, 1/3)."""
    b, v = 9, 3000
    logits = rand_logits(b, v, seed=11, scale=3.0)
    temperature = [0.7, 1.0, 0.1, 1.3, 0.0, 2.0, 1 / 3, 0.9, 0.5]  # one greedy row among them
    top_p = [0.9, 1.0, 0.5, 0.95, 1.0, 0.1, 1.0, 0.8, 1.0]
    top_k = [0, 40, 0, 5, 0, 0, 100, 1, 0]  # top_k 1: greedy too
    min_p = [0.0, 0.05, 0.0, 0.0, 0.2, 0.0, 0.1, 0.0, 0.3]
    seeds = [None, 7, None, -3, 5, None, 2**63 - 1, 11, None]
    steps = [0, 3, 1, 0, 9, 2, 4, 0, 17]
    for trial in range(20):
        torch.manual_seed(100 + trial)
        want = tokens(logits, make_st(b, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                      seeds=seeds, steps=steps))
        torch.manual_seed(100 + trial)
        got = cpu_sampling.sample_plain(logits, temperature, top_p, top_k, min_p, seeds, steps)
        assert got == want.tolist()
    # a row of logits that is a strided view (index_select of some rows keeps rows whole; a
    # column slice does not): the kernel reads a contiguous copy, the same tokens
    wide = torch.cat([logits, logits], dim=1)[:, :v]
    torch.manual_seed(5)
    want = tokens(logits, make_st(b, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                  seeds=seeds, steps=steps))
    torch.manual_seed(5)
    assert cpu_sampling.sample_plain(wide, temperature, top_p, top_k, min_p, seeds, steps) == want.tolist()
    # a finite temperature past float32's range is inf on both paths, with no warning
    hot = [1e300, *temperature[1:]]
    torch.manual_seed(9)
    want = tokens(logits, make_st(b, temperature=hot, top_p=top_p, top_k=top_k, min_p=min_p, seeds=seeds,
                                  steps=steps))
    torch.manual_seed(9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_sampling.sample_plain(logits, hot, top_p, top_k, min_p, seeds, steps) == want.tolist()
    # not the kernel's: float64 logits
    assert cpu_sampling.sample_plain(logits.double(), temperature, top_p, top_k, min_p, seeds, steps) is None
