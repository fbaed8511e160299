"""The sampling contract's checks, shared by the kernels' tests (tests/test_sampling_triton.py,
tests/test_sampling_c.py): a kernel with its own random stream is compared with the torch
reference (ops.sampling) through what must agree: greedy tokens exactly, the kept set of
top-k / top-p / min-p exactly (for distinct logits away from float rounding edges), the
sampled distribution statistically."""

from __future__ import annotations

import torch

from ops.sampling import (
    SAMPLING_EPS,
    SamplingTensors,
    _top_k_top_p_min_p,
    apply_penalties,
    sample_ref,
)
from tests.test_sampling import make_st, penalty_inputs, rand_logits, repeat_row

__all__ = ["penalty_inputs"]  # re-exported for the kernels' tests


def scaled_ref(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Penalized logits / temperature, as sample_ref computes them (greedy rows: T = 1)."""
    z = apply_penalties(logits, st) if st.penalty_tokens is not None else logits
    temp = torch.where(st.temperature < SAMPLING_EPS, torch.ones_like(st.temperature), st.temperature)
    return z / temp[:, None]


def kept_ref(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    return torch.isfinite(_top_k_top_p_min_p(scaled_ref(logits, st), st))


def edge_tokens(logits: torch.Tensor, st: SamplingTensors, tol: float) -> torch.Tensor:
    """[B, V] bool: tokens whose membership float32 rounding may decide, found in float64:
    p / max(p) within a relative tol of min_p, or top-p mass before the token within tol of
    top_p."""
    y = scaled_ref(logits, st).double()
    probs = y.softmax(-1)
    ratio = probs / probs.amax(-1, keepdim=True)
    min_p = st.min_p[:, None].double()
    edge = ((ratio - min_p).abs() < tol * min_p) & (min_p > 0)
    y = y.masked_fill(ratio < min_p, float("-inf"))
    sorted_y, order = y.sort(-1, descending=True)
    v = y.shape[-1]
    k = torch.where((st.top_k > 0) & (st.top_k < v), st.top_k, v)
    sorted_y = sorted_y.masked_fill(torch.arange(v)[None] >= k[:, None], float("-inf"))
    sp = sorted_y.softmax(-1)
    before = sp.cumsum(-1) - sp
    near = ((before - st.top_p[:, None].double()).abs() < tol) & (st.top_p < 1)[:, None]
    return edge | torch.zeros_like(near).scatter(-1, order, near)


def check_distribution(tok: torch.Tensor, expected: torch.Tensor, max_abs: float) -> None:
    """Chi-square goodness of fit (threshold 30: ~1e-4 upper tail for up to 7 degrees of
    freedom) plus a bound on the largest frequency error; no draw outside the support."""
    n = tok.numel()
    freq = torch.bincount(tok, minlength=expected.numel()).double() / n
    expected = expected.double()
    support = expected > 0
    assert float(freq[~support].sum()) == 0.0
    obs, exp = freq[support] * n, expected[support] * n
    assert float(exp.min()) >= 5  # the chi-square approximation holds
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < 30.0, (chi2, freq.tolist(), expected.tolist())
    assert float((freq - expected).abs().max()) < max_abs


def filtered_softmax(row: torch.Tensor, temperature: float, keep: list[int]) -> torch.Tensor:
    y = row / temperature
    out = torch.zeros_like(y)
    out[keep] = y[keep].softmax(-1)
    return out


# In the interpreter a row costs tens of milliseconds: a few hundred draws, wide tolerance
# (sigma of a frequency is at most 0.5 / sqrt(n), so 0.09 is over 4 sigma at n = 500).


def mixed_batch(pos: int, row: torch.Tensor, seed: int, step: int, row_kw: dict):
    """Six companion rows with every feature, the seeded row inserted at pos."""
    v = row.numel()
    others = rand_logits(6, v, seed=61, scale=2.0)
    batch = torch.cat([others[:pos], row[None], others[pos:]])
    prompt_mask = torch.zeros(7, v, dtype=torch.bool)
    prompt_mask[:, :50] = True
    counts = torch.zeros(7, v)
    counts[:, 10:20] = 2.0
    cols = {
        "seeds": [None, 5, None, 77, None, None], "steps": [3, 1, 4, 1, 5, 9],
        "temperature": [0.0, 0.7, 1.3, 1.0, 2.0, 0.9], "top_p": [0.3, 1.0, 0.8, 0.95, 1.0, 0.5],
        "top_k": [0, 5, 0, 40, 1, 0], "min_p": [0.0, 0.1, 0.0, 0.0, 0.05, 0.2],
        "repetition_penalty": [1.2, 1.0, 1.5, 1.0, 0.8, 1.0],
        "frequency_penalty": [0.5, 0.0, 0.1, 0.0, 0.0, 1.0],
        "presence_penalty": [0.0, 0.3, 0.0, 0.0, 1.0, 0.0],
    }
    own = {"seeds": seed, "steps": step, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
           "min_p": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
           "presence_penalty": 0.0, **row_kw}
    for name, values in cols.items():
        values.insert(pos, own[name])
    st = make_st(7, prompt_mask=prompt_mask, output_counts=counts, num_logprobs=2, **cols)
    return batch, st


def assert_kept_matches(kept: torch.Tensor, logits: torch.Tensor, st: SamplingTensors,
                        tol: float = 0.0) -> None:
    """A kernel's kept set (CPU [B, V] bool) equals the reference's on every sampling row, up
    to edge tokens (tol = 0: none allowed)."""
    want = kept_ref(logits, st)
    sampling = st.temperature >= SAMPLING_EPS
    diff = (kept ^ want) & sampling[:, None]
    if tol == 0.0:
        assert not bool(diff.any()), torch.nonzero(diff)[:10].tolist()
    else:
        edge = edge_tokens(logits, st, tol)
        assert not bool((diff & ~edge).any()), torch.nonzero(diff & ~edge)[:10].tolist()


def check_seeded_draws_vary_with_step_and_seed(tokens) -> None:
    """`tokens(logits, st)`: a kernel's draws. A seeded row's token follows its (seed, step)
    key: varied keys spread over a flat row, the same key twice in a batch draws the same."""
    v = 300
    row = rand_logits(1, v, seed=62, scale=0.3)[0]
    steps = list(range(24))
    rows = repeat_row(row, len(steps))
    by_step = tokens(rows, make_st(len(steps), seeds=[42] * len(steps), steps=steps))
    assert len(set(by_step.tolist())) > 16
    by_seed = tokens(rows, make_st(len(steps), seeds=steps, steps=0))
    assert len(set(by_seed.tolist())) > 16
    twice = tokens(repeat_row(row, 2), make_st(2, seeds=[9, 9], steps=[4, 4]))
    assert int(twice[0]) == int(twice[1])


def check_unseeded_rows_follow_global_generator(tokens) -> None:
    """Unseeded rows: reproducible under the same global seed, not tied to one another, and
    different under another seed."""
    v = 300
    row = rand_logits(1, v, seed=63, scale=0.3)[0]
    rows = repeat_row(row, 24)
    st = make_st(24)
    torch.manual_seed(5)
    a = tokens(rows, st)
    torch.manual_seed(5)
    assert torch.equal(tokens(rows, st), a)
    assert len(set(a.tolist())) > 16
    torch.manual_seed(6)
    assert not torch.equal(tokens(rows, st), a)


def check_kept_sets(check_kept) -> None:
    """`check_kept(logits, st)`: a kernel's kept sets, asserted equal to the reference's and
    returned. Top-k, top-p and min-p alone and together on distinct logits; top_k 1 keeps
    one token; the filters cut."""
    b, v = 10, 700
    logits = rand_logits(b, v, seed=11, scale=1.5)
    st = make_st(
        b,
        temperature=[1.0, 0.5, 2.0, 1.0, 0.8, 1.0, 1.0, 3.0, 0.6, 1.0],
        top_k=[5, 0, 0, 40, 0, 17, 1, 100, 0, 3],
        top_p=[1.0, 0.3, 1.0, 0.8, 0.95, 1.0, 1.0, 0.6, 0.5, 0.1],
        min_p=[0.0, 0.0, 0.1, 0.0, 0.02, 0.3, 0.0, 0.05, 0.01, 0.0],
    )
    assert not bool(edge_tokens(logits, st, 1e-4).any())  # no ambiguous boundary
    kept = check_kept(logits, st)
    counts = kept.sum(-1)
    assert int(counts[0]) == 5 and int(counts[6]) == 1 and int(counts[3]) <= 40
    assert 1 < int(counts[1]) < v and 1 < int(counts[2]) < v  # the filters really cut


def check_top_p_keeps_the_first_token(check_kept) -> None:
    """top_p below the top token's probability, tiny, or <= 0 keeps just the top token."""
    row = torch.tensor([3.0, 2.9, 0.5, -1.0, -2.0])
    top_prob = float(row.softmax(-1)[0])
    st = make_st(4, top_p=[top_prob / 2, 1e-6, 0.99, -1.0])
    kept = check_kept(repeat_row(row, 4), st)
    for r in (0, 1, 3):
        assert kept[r].tolist() == [True, False, False, False, False]


def check_ties_keep_every_tied_token(kept_of) -> None:
    """`kept_of(logits, st)`: a kernel's kept mask on the CPU. Documented difference from the
    reference, which keeps an arbitrary k of tied tokens: the kernels keep them all."""
    row = torch.tensor([5.0, 4.0, 4.0, 4.0, 1.0, 0.0, -2.0, 4.0])
    kept = kept_of(repeat_row(row, 2), make_st(2, top_k=[2, 5]))
    assert kept[0].tolist() == [True, True, True, True, False, False, False, True]
    assert kept[1].tolist() == [True, True, True, True, False, False, False, True]


def check_logprobs_match_reference(sample, n: int) -> None:
    """`sample(logits, st)`: a kernel's SamplerOutput on the CPU. The chosen token's logprob
    is of the raw logits; the top n are the reference's."""
    b, v = 6, 2100
    logits, prompt_mask, counts = penalty_inputs(80, b, v)
    st = make_st(
        b, temperature=[0.0, 1.0, 0.7, 0.0, 1.5, 1.0], top_k=[0, 0, 10, 0, 0, 3],
        repetition_penalty=1.5, presence_penalty=0.5, prompt_mask=prompt_mask,
        output_counts=counts, num_logprobs=n,
    )
    out = sample(logits, st)
    lp = logits.log_softmax(-1)  # of the raw logits, not the penalized ones
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs, lp.gather(-1, out.token_ids[:, None])[:, 0])
    if n == 0:
        assert out.top_ids is None and out.top_logprobs is None
        return
    ref = sample_ref(logits, st)
    assert out.top_ids is not None and out.top_logprobs is not None
    assert torch.equal(out.top_ids, ref.top_ids)
    torch.testing.assert_close(out.top_logprobs, ref.top_logprobs)


def check_distribution_with_filters_and_penalties(tokens, check_kept, n: int) -> None:
    """n draws of one row with penalties, temperature, top-k and min-p: the kept set is the
    reference's and the draws follow its renormalized softmax (max_abs 0.006: over 5 sigma
    at n = 200,000)."""
    v = 8
    row = torch.tensor([1.5, 0.1, -0.3, 0.9, -2.0, 0.5, 0.0, -1.0])
    mask = torch.zeros(n, v, dtype=torch.bool)
    mask[:, 3] = True  # token 3 in the prompt: 0.9 / 1.5 = 0.6
    counts = torch.zeros(n, v)
    counts[:, 0] = 1.0  # token 0 generated once: 1.5 / 1.5 - 0.1 - 0.2 = 0.7
    pen = {"repetition_penalty": 1.5, "presence_penalty": 0.2, "frequency_penalty": 0.1}
    st = make_st(n, temperature=0.8, top_k=4, min_p=0.5, prompt_mask=mask, output_counts=counts, **pen)
    z = apply_penalties(row[None], make_st(1, prompt_mask=mask[:1], output_counts=counts[:1], **pen))[0]
    # y = z / 0.8 = [0.875, 0.125, ., 0.75, ., 0.625, 0, .]: top-k 4 keeps {0, 3, 5, 1},
    # min-p 0.5 (y >= 0.875 - log 2 = 0.18) keeps {0, 3, 5}.
    one = make_st(1, temperature=0.8, top_k=4, min_p=0.5, prompt_mask=mask[:1],
                  output_counts=counts[:1], **pen)
    assert torch.nonzero(check_kept(row[None], one)[0]).flatten().tolist() == [0, 3, 5]
    check_distribution(tokens(repeat_row(row, n), st), filtered_softmax(z, 0.8, [0, 3, 5]), max_abs=0.006)
