"""Tests of the torch reference sampler (ops.sampling): greedy paths, top-k / top-p / min-p
filtering, the sampled distribution, per-row seeds, penalties and logprobs.

Only ops.sampling and torch: no model is loaded. Every test draws its own random logits
from a seeded generator and seeds the global RNG (restored afterwards) for the unseeded draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from ops.sampling import (
    SAMPLING_EPS,
    PenaltyTokens,
    SamplingTensors,
    _top_k_top_p_min_p,
    apply_penalties,
    finite_argmax,
    greedy_ids_cpu,
    sample_ref,
)


@pytest.fixture(autouse=True)
def _global_rng():
    """Unseeded rows draw from the global RNG: make that deterministic, then restore it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        yield


def rand_logits(b: int, v: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, v, generator=g) * scale
    assert bool((logits != 0).all())
    return logits


def _col(value, b: int, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    if isinstance(value, Sequence):
        assert len(value) == b
        return torch.tensor(list(value), dtype=dtype)
    return torch.full((b,), value, dtype=dtype)


def make_st(
    b: int,
    *,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    prompt_mask: torch.Tensor | None = None,
    output_counts: torch.Tensor | None = None,
    seeds: Sequence[int | None] | None = None,
    steps: Sequence[int] | int = 0,
    all_greedy: bool | None = None,
    num_logprobs: int = -1,
) -> SamplingTensors:
    """SamplingTensors for b rows; each field a scalar (all rows) or a per-row sequence.

    all_greedy defaults to greedy everywhere (temperature < SAMPLING_EPS or top_k 1).
    """
    temp = _col(temperature, b, torch.float32)
    k = _col(top_k, b, torch.int64)
    if all_greedy is None:
        all_greedy = bool(((temp < SAMPLING_EPS) | (k == 1)).all())
    return SamplingTensors(
        temperature=temp,
        top_p=_col(top_p, b, torch.float32),
        top_k=k,
        min_p=_col(min_p, b, torch.float32),
        repetition_penalty=_col(repetition_penalty, b, torch.float32),
        presence_penalty=_col(presence_penalty, b, torch.float32),
        frequency_penalty=_col(frequency_penalty, b, torch.float32),
        penalty_tokens=None if prompt_mask is None else PenaltyTokens.from_dense(prompt_mask, output_counts),
        seeds=list(seeds) if seeds is not None else [None] * b,
        steps=list(steps) if isinstance(steps, Sequence) else [steps] * b,
        all_greedy=all_greedy,
        num_logprobs=num_logprobs,
    )


def repeat_row(row: torch.Tensor, n: int) -> torch.Tensor:
    return row[None, :].expand(n, -1).contiguous()


# --------------------------------------------------------------------------- greedy


def test_all_greedy_is_argmax():
    logits = rand_logits(16, 300, seed=1)
    out = sample_ref(logits, make_st(16, temperature=0.0))
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_the_runners_greedy_shortcut_gives_sample_refs_tokens():
    """finite_argmax (sample_ref's greedy decode) and greedy_ids_cpu (the runner's for plain
    greedy steps on the CPU) give sample_ref's tokens, or decline (None) where an argmax is
    not finite and sample_ref must decide."""
    b = 8
    logits = rand_logits(b, 300, seed=4)
    logits[1, 7] = logits[1, 9] = 50.0  # a tie: the first maximum
    logits[2, :] = float("-inf")
    logits[2, 3] = 0.0  # one finite logit
    ids = greedy_ids_cpu(logits)
    assert finite_argmax(logits).tolist() == ids
    assert ids == sample_ref(logits, make_st(b, temperature=0.0)).token_ids.tolist()
    assert ids[1] == 7 and ids[2] == 3
    for bad in (float("nan"), float("inf")):
        x = logits.clone()
        x[5, 11] = bad
        assert finite_argmax(x) is None and greedy_ids_cpu(x) is None
        assert sample_ref(x, make_st(b, temperature=0.0)).token_ids[5] != 11  # never drawn
    x = logits.clone()
    x[6, :] = float("-inf")  # no finite logit at all
    assert finite_argmax(x) is None and greedy_ids_cpu(x) is None
    # bfloat16 (numpy has no view of it): torch's own argmax and check
    half = logits.bfloat16()
    assert torch.equal(finite_argmax(half), half.argmax(-1)) and greedy_ids_cpu(half) is None
    assert finite_argmax(x.bfloat16()) is None


def test_temperature_zero_rows_greedy_in_mixed_batch():
    b, v = 12, 200
    logits = rand_logits(b, v, seed=2, scale=0.5)  # flat: sampled rows rarely hit argmax
    temps = [0.0 if i % 3 == 0 else 1.5 for i in range(b)]
    st = make_st(b, temperature=temps, top_p=[0.9 if i % 2 else 1.0 for i in range(b)])
    assert not st.all_greedy
    greedy = torch.tensor([t == 0 for t in temps])
    argmax = logits.argmax(-1)
    sampled_hits_argmax = []
    for _ in range(20):
        tok = sample_ref(logits, st).token_ids
        assert torch.equal(tok[greedy], argmax[greedy])
        sampled_hits_argmax.append(tok[~greedy] == argmax[~greedy])
    # The sampled rows really are sampled (otherwise the check above proves nothing).
    assert torch.cat(sampled_hits_argmax).float().mean() < 0.5


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0, 10.0])
def test_top_k_one_is_argmax_at_any_temperature(temperature):
    b = 64
    logits = rand_logits(b, 500, seed=3, scale=0.5)
    # all_greedy=False forces the sampling path (the runner would take the greedy shortcut).
    st = make_st(b, temperature=temperature, top_k=1, all_greedy=False)
    for _ in range(5):
        assert torch.equal(sample_ref(logits, st).token_ids, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 5.0])
def test_tiny_top_p_is_argmax(temperature):
    b = 64
    logits = rand_logits(b, 500, seed=4, scale=0.5)
    st = make_st(b, temperature=temperature, top_p=1e-6)
    for _ in range(5):
        assert torch.equal(sample_ref(logits, st).token_ids, logits.argmax(-1))


# --------------------------------------------------------------------------- filters

N_DRAWS = 2000


@pytest.mark.parametrize("k", [2, 5, 12])
@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_top_k_draws_within_k_largest(k, temperature):
    row = rand_logits(1, 60, seed=10 + k, scale=0.7)[0]
    tok = sample_ref(repeat_row(row, N_DRAWS), make_st(N_DRAWS, temperature=temperature, top_k=k))
    top = set(row.topk(k).indices.tolist())
    drawn = set(tok.token_ids.tolist())
    assert drawn <= top
    assert drawn == top  # flat logits, 2000 draws: every one of the k tokens shows up


def _nucleus(probs: torch.Tensor, p: float) -> set[int]:
    """Smallest set of top tokens whose cumulative probability reaches p (float64)."""
    sp, order = probs.double().sort(descending=True)
    cum = sp.cumsum(0)
    # The set's boundary must not sit on a float rounding edge, or the test is ambiguous.
    assert float((cum - p).abs().min()) > 1e-4
    n = int((cum < p).sum()) + 1
    return set(order[:n].tolist())


@pytest.mark.parametrize("p", [0.2, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_top_p_draws_within_nucleus(p, temperature):
    row = rand_logits(1, 30, seed=20, scale=1.0)[0]
    nucleus = _nucleus((row / temperature).softmax(-1), p)
    st = make_st(N_DRAWS, temperature=temperature, top_p=p)
    drawn = set(sample_ref(repeat_row(row, N_DRAWS), st).token_ids.tolist())
    assert drawn <= nucleus
    assert drawn == nucleus


def test_top_p_first_token_always_allowed():
    row = torch.tensor([3.0, 2.9, 0.5, -1.0, -2.0])
    # p below the top token's probability: only the top token survives.
    top_prob = float(row.softmax(-1)[0])
    st = make_st(200, top_p=top_prob / 2)
    assert set(sample_ref(repeat_row(row, 200), st).token_ids.tolist()) == {0}


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.6])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_min_p_draws_above_threshold(min_p, temperature):
    row = rand_logits(1, 40, seed=30, scale=1.0)[0]
    probs = (row / temperature).softmax(-1)  # min-p applies after temperature
    limit = min_p * float(probs.max())
    allowed = set(torch.nonzero(probs >= limit).flatten().tolist())
    assert float((probs - limit).abs().min()) > 1e-6  # no token on the edge
    st = make_st(N_DRAWS, temperature=temperature, min_p=min_p)
    drawn = sample_ref(repeat_row(row, N_DRAWS), st).token_ids
    assert bool((probs[drawn] >= limit).all())
    assert set(drawn.tolist()) <= allowed
    if float(probs[list(allowed)].min() / probs[list(allowed)].sum()) > 0.005:
        assert set(drawn.tolist()) == allowed


def test_filters_off_keep_every_token_in_mixed_batch():
    """A row with top-k, top-p and min-p off loses no token, whatever the other rows ask for.

    Peaked logits over a large vocab make the float32 cumulative sum reach 1.0 before the
    tail; a top_p=1 row must still keep its tail (else its draw depends on its companions).
    """
    v = 32000
    logits = rand_logits(4, v, seed=40, scale=8.0)
    st = make_st(4, top_p=[0.5, 1.0, 0.9, 1.0], top_k=[0, 0, 50, 0], min_p=[0.0, 0.0, 0.0, 0.1])
    filtered = _top_k_top_p_min_p(logits, st)
    assert bool(torch.isfinite(filtered[1]).all())
    assert torch.equal(filtered[1], logits[1])
    # The other rows really filter.
    assert bool(torch.isinf(filtered[0]).any())
    assert int(torch.isfinite(filtered[2]).sum()) <= 50
    assert bool(torch.isinf(filtered[3]).any())


# --------------------------------------------------------------------------- distribution


def _freqs(tokens: torch.Tensor, v: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=v).double() / tokens.numel()


def _check_matches(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    v = expected.numel()
    n = tokens.numel()
    freq = _freqs(tokens, v)
    expected = expected.double()
    assert float((freq - expected).abs().max()) < 0.015
    # Chi-square over the tokens with nonzero expected mass; the rest must never appear.
    support = expected > 0
    assert float(freq[~support].sum()) == 0.0
    obs = freq[support] * n
    exp = expected[support] * n
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = int(support.sum()) - 1
    # ~ 1e-4 upper tail for dof <= 7 (chi2_7 at 1e-4 is 29.9); with seeded RNG this is fixed.
    assert chi2 < 30.0, (chi2, dof)


N_DIST = 20_000


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_distribution_matches_softmax(temperature):
    v = 8
    row = rand_logits(1, v, seed=50, scale=1.0)[0]
    expected = (row / temperature).softmax(-1)
    # The check can tell the temperatures apart.
    assert float((expected - row.softmax(-1)).abs().max()) > 0.05 or temperature == 1.0
    tokens = sample_ref(repeat_row(row, N_DIST), make_st(N_DIST, temperature=temperature))
    _check_matches(tokens.token_ids, expected)


def test_distribution_top_k_renormalizes():
    v, k = 8, 3
    row = rand_logits(1, v, seed=51, scale=1.0)[0]
    keep = row.topk(k).indices
    expected = torch.zeros(v)
    expected[keep] = row[keep].softmax(-1)
    tokens = sample_ref(repeat_row(row, N_DIST), make_st(N_DIST, top_k=k))
    _check_matches(tokens.token_ids, expected)


def test_distribution_seeded_rows_match_softmax():
    """Seeded draws (one generator per row) are distributed as the unseeded ones."""
    v = 8
    row = rand_logits(1, v, seed=52, scale=1.0)[0]
    n = 4000  # one generator per row is slower; tolerance below is wider accordingly
    st = make_st(n, seeds=list(range(n)), steps=7)
    freq = _freqs(sample_ref(repeat_row(row, n), st).token_ids, v)
    assert float((freq - row.softmax(-1).double()).abs().max()) < 0.03


# --------------------------------------------------------------------------- seeds


def _seeded_draw(row: torch.Tensor, seed: int, step: int) -> int:
    st = make_st(1, seeds=[seed], steps=[step])
    return int(sample_ref(row[None], st).token_ids[0])


def test_seeded_row_independent_of_batch():
    v = 1000
    rows = rand_logits(10, v, seed=60, scale=0.3)  # flat: the draw is close to uniform
    others = rand_logits(6, v, seed=61, scale=2.0)
    prompt_mask = torch.zeros(7, v, dtype=torch.bool)
    prompt_mask[:, :50] = True
    counts = torch.zeros(7, v)
    counts[:, 10:20] = 2.0
    for i in range(rows.shape[0]):
        seed, step = 1000 + 7 * i, i % 5
        alone = _seeded_draw(rows[i], seed, step)
        for pos in (0, 3, 6):
            torch.manual_seed(i * 10 + pos)  # the global RNG state must not matter
            batch = torch.cat([others[:pos], rows[i][None], others[pos:]])
            seeds: list[int | None] = [None, 5, None, 77, None, None]
            seeds.insert(pos, seed)
            steps = [3, 1, 4, 1, 5, 9]
            steps.insert(pos, step)
            temps = [0.0, 0.7, 1.3, 1.0, 2.0, 0.9]
            temps.insert(pos, 1.0)
            top_p = [0.3, 1.0, 0.8, 0.95, 1.0, 0.5]
            top_p.insert(pos, 1.0)
            top_k = [0, 5, 0, 40, 1, 0]
            top_k.insert(pos, 0)
            min_p = [0.0, 0.1, 0.0, 0.0, 0.05, 0.2]
            min_p.insert(pos, 0.0)
            rep = [1.2, 1.0, 1.5, 1.0, 0.8, 1.0]
            rep.insert(pos, 1.0)
            freq = [0.5, 0.0, 0.1, 0.0, 0.0, 1.0]
            freq.insert(pos, 0.0)
            pres = [0.0, 0.3, 0.0, 0.0, 1.0, 0.0]
            pres.insert(pos, 0.0)
            st = make_st(
                7, temperature=temps, top_p=top_p, top_k=top_k, min_p=min_p,
                repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                prompt_mask=prompt_mask, output_counts=counts, seeds=seeds, steps=steps,
                num_logprobs=3,
            )
            assert int(sample_ref(batch, st).token_ids[pos]) == alone, (i, pos)
        # The same row, batched with copies of itself under other seeds.
        st = make_st(4, seeds=[1, seed, 2, None], steps=[step, step, step, step])
        assert int(sample_ref(repeat_row(rows[i], 4), st).token_ids[1]) == alone


def test_seeded_draws_vary_with_step_and_seed():
    v = 1000
    row = rand_logits(1, v, seed=62, scale=0.3)[0]
    by_step = [_seeded_draw(row, 42, step) for step in range(60)]
    assert len(set(by_step)) > 40
    assert by_step == [_seeded_draw(row, 42, step) for step in range(60)]  # reproducible
    by_seed = [_seeded_draw(row, seed, 0) for seed in range(60)]
    assert len(set(by_seed)) > 40
    # Neighbouring (seed, step) pairs do not collapse onto each other.
    pairs = {(s, t): _seeded_draw(row, s, t) for s in range(3) for t in range(3)}
    assert len(set(pairs.values())) > 5


def test_unseeded_rows_not_affected_by_seeded_rows():
    v = 1000
    logits = rand_logits(5, v, seed=63, scale=0.3)
    unseeded = torch.tensor([True, False, True, False, True])

    def run(seeds, global_seed):
        torch.manual_seed(global_seed)
        tok = sample_ref(logits, make_st(5, seeds=seeds, steps=[0, 3, 0, 8, 0])).token_ids
        after = torch.rand(4)  # global RNG state after the call
        return tok, after

    a, after_a = run([None, 11, None, 12, None], 99)
    b, after_b = run([None, 500, None, None, None], 99)
    c, after_c = run([None] * 5, 99)
    assert torch.equal(a[unseeded], b[unseeded])
    assert torch.equal(a[unseeded], c[unseeded])
    # Seeded rows do not consume or reseed the global generator.
    assert torch.equal(after_a, after_b) and torch.equal(after_a, after_c)
    # Unseeded rows do follow the global generator.
    draws = {tuple(run([None, 11, None, 12, None], g)[0][unseeded].tolist()) for g in range(10)}
    assert len(draws) > 1
    # Unseeded rows with the same logits as a seeded row are not tied to its generator.
    same = repeat_row(logits[0], 200)
    seeds = [7 if i % 2 else None for i in range(200)]
    tok = sample_ref(same, make_st(200, seeds=seeds, steps=0)).token_ids
    assert len(set(tok[1::2].tolist())) == 1  # every seeded row: same (seed, step)
    assert len(set(tok[0::2].tolist())) > 50


# --------------------------------------------------------------------------- penalties


def _reference_penalties(logits, prompt_mask, counts, rep, pres, freq) -> torch.Tensor:
    out = logits.clone()
    b, v = logits.shape
    for i in range(b):
        for t in range(v):
            x = float(logits[i, t])
            c = float(counts[i, t])
            if bool(prompt_mask[i, t]) or c > 0:
                x = x / rep[i] if x > 0 else x * rep[i]
            x -= freq[i] * c
            if c > 0:
                x -= pres[i]
            out[i, t] = x
    return out


def penalty_inputs(seed: int, b: int = 5, v: int = 24):
    """Logits with a prompt mask and output counts for penalties (tests/sampling_checks.py too)."""
    g = torch.Generator().manual_seed(seed)
    logits = rand_logits(b, v, seed=seed, scale=3.0)
    prompt_mask = torch.rand(b, v, generator=g) < 0.3
    counts = torch.randint(0, 4, (b, v), generator=g).float()
    counts[torch.rand(b, v, generator=g) < 0.5] = 0.0
    return logits, prompt_mask, counts


def test_penalty_tokens_give_the_prompt_mask_and_output_counts():
    """Row 0: a prompt with a repeat and an output with repeats; row 1: nothing; row 2: a
    token in both. dense() is what the reference and the Triton kernel read; from_dense is
    its inverse up to the order of a row's tokens."""
    v = 10
    pt = PenaltyTokens.from_lists([([4, 2, 4], [7, 7, 1, 7]), ([], []), ([3], [3, 9])])
    assert pt.ids.tolist() == [4, 2, 4, 7, 7, 1, 7, 3, 3, 9]
    assert pt.starts.tolist() == [0, 7, 7, 10] and pt.prompt_lens.tolist() == [3, 0, 1]
    mask, counts = pt.dense(v, torch.device("cpu"))
    want_mask = torch.zeros(3, v, dtype=torch.bool)
    want_mask[0, [2, 4]] = True
    want_mask[2, 3] = True
    want_counts = torch.zeros(3, v)
    want_counts[0, 7], want_counts[0, 1], want_counts[2, 3], want_counts[2, 9] = 3, 1, 1, 1
    assert torch.equal(mask, want_mask) and torch.equal(counts, want_counts)
    again = PenaltyTokens.from_dense(mask, counts).dense(v, torch.device("cpu"))
    assert torch.equal(again[0], want_mask) and torch.equal(again[1], want_counts)
    with pytest.raises(AssertionError):
        PenaltyTokens.from_dense(mask, counts * 0.5)  # counts are whole occurrences
    # Ids outside the vocabulary (a tokenizer larger than the model's head) count nowhere,
    # as in the C kernel, and shift no other row's tokens.
    odd = PenaltyTokens.from_lists([([4, 2, 10, 4], [7, -1, 7, 1, 7, 99]), ([], []), ([3], [3, 9])])
    odd_mask, odd_counts = odd.dense(v, torch.device("cpu"))
    assert torch.equal(odd_mask, want_mask) and torch.equal(odd_counts, want_counts)


def test_apply_penalties_matches_reference_loop():
    logits, prompt_mask, counts = penalty_inputs(70)
    rep = [1.0, 1.3, 2.0, 0.7, 1.1]
    pres = [0.0, 0.5, 0.0, 1.2, 0.3]
    freq = [0.0, 0.0, 0.4, 0.25, -0.5]
    st = make_st(
        5, repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq,
        prompt_mask=prompt_mask, output_counts=counts,
    )
    got = apply_penalties(logits, st)
    want = _reference_penalties(logits, prompt_mask, counts, rep, pres, freq)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_repetition_penalty_semantics():
    logits, prompt_mask, counts = penalty_inputs(71)
    st = make_st(
        5, repetition_penalty=1.5, prompt_mask=prompt_mask, output_counts=counts
    )
    got = apply_penalties(logits, st)
    seen = prompt_mask | (counts > 0)
    assert bool(seen.any()) and bool((~seen).any())
    assert torch.equal(got[~seen], logits[~seen])
    pos, neg = seen & (logits > 0), seen & (logits < 0)
    assert bool(pos.any()) and bool(neg.any())
    assert bool((got[pos] < logits[pos]).all())
    assert bool((got[pos] > 0).all())  # divided, not flipped
    assert bool((got[neg] < logits[neg]).all())
    torch.testing.assert_close(got[pos], logits[pos] / 1.5)
    torch.testing.assert_close(got[neg], logits[neg] * 1.5)
    # Prompt-only and output-only tokens are both penalized.
    prompt_only = prompt_mask & (counts == 0)
    output_only = ~prompt_mask & (counts > 0)
    assert bool(prompt_only.any()) and bool(output_only.any())
    assert bool((got[prompt_only] != logits[prompt_only]).all())
    assert bool((got[output_only] != logits[output_only]).all())


def test_frequency_and_presence_penalty_semantics():
    logits, prompt_mask, counts = penalty_inputs(72)
    assert bool((counts > 1).any())
    f, p = 0.3, 0.8
    got_f = apply_penalties(
        logits, make_st(5, frequency_penalty=f, prompt_mask=prompt_mask, output_counts=counts)
    )
    torch.testing.assert_close(got_f, logits - f * counts)
    got_p = apply_penalties(
        logits, make_st(5, presence_penalty=p, prompt_mask=prompt_mask, output_counts=counts)
    )
    torch.testing.assert_close(got_p, logits - p * (counts > 0).float())
    # Neither touches tokens that occur only in the prompt.
    prompt_only = prompt_mask & (counts == 0)
    assert torch.equal(got_f[prompt_only], logits[prompt_only])
    assert torch.equal(got_p[prompt_only], logits[prompt_only])


def test_penalties_steer_greedy_choice():
    logits = torch.tensor([[4.0, 3.5, 1.0, -1.0]])
    counts = torch.tensor([[2.0, 0.0, 0.0, 0.0]])
    mask = torch.zeros(1, 4, dtype=torch.bool)
    plain = sample_ref(logits, make_st(1, temperature=0.0, prompt_mask=mask, output_counts=counts))
    assert int(plain.token_ids[0]) == 0
    for kw in ({"repetition_penalty": 1.5}, {"frequency_penalty": 0.5}, {"presence_penalty": 1.0}):
        for all_greedy in (True, False):
            st = make_st(
                1, temperature=0.0, prompt_mask=mask, output_counts=counts,
                all_greedy=all_greedy, **kw,
            )
            assert int(sample_ref(logits, st).token_ids[0]) == 1, kw


# --------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("n", [1, 5])
def test_logprobs_top_n_and_chosen(n):
    b, v = 6, 100
    logits = rand_logits(b, v, seed=80)
    st = make_st(b, temperature=[0.0, 1.0, 0.7, 0.0, 1.5, 1.0], top_k=[0, 0, 10, 0, 0, 3],
                 num_logprobs=n)
    out = sample_ref(logits, st)
    lp = logits.log_softmax(-1)
    want_lp, want_ids = lp.topk(n, dim=-1)
    assert out.top_ids is not None and out.top_logprobs is not None and out.logprobs is not None
    assert out.top_ids.shape == (b, n) and out.top_logprobs.shape == (b, n)
    assert torch.equal(out.top_ids, want_ids)
    torch.testing.assert_close(out.top_logprobs, want_lp)
    torch.testing.assert_close(out.logprobs, lp.gather(-1, out.token_ids[:, None]).squeeze(-1))
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())  # best first


def test_logprobs_are_of_raw_logits():
    b, v = 8, 50
    logits, prompt_mask, counts = penalty_inputs(81, b=b, v=v)
    st = make_st(
        b, temperature=[0.5, 2.0, 0.0, 1.0, 0.3, 1.0, 0.8, 0.0], top_k=[0, 4, 0, 0, 2, 0, 0, 0],
        top_p=[1.0, 1.0, 1.0, 0.5, 1.0, 0.9, 1.0, 1.0], min_p=[0.0] * 6 + [0.2, 0.0],
        repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.4,
        prompt_mask=prompt_mask, output_counts=counts, num_logprobs=4,
    )
    out = sample_ref(logits, st)
    raw_lp = logits.log_softmax(-1)
    want_lp, want_ids = raw_lp.topk(4, dim=-1)
    assert torch.equal(out.top_ids, want_ids)
    torch.testing.assert_close(out.top_logprobs, want_lp)
    torch.testing.assert_close(out.logprobs, raw_lp.gather(-1, out.token_ids[:, None]).squeeze(-1))
    # The processed distribution is really different, so the check above means something.
    processed = (apply_penalties(logits, st) / 0.5).log_softmax(-1)
    assert not torch.allclose(processed.topk(4, dim=-1).values, want_lp)


def test_logprobs_off_and_chosen_only():
    b, v = 4, 64
    logits = rand_logits(b, v, seed=82)
    off = sample_ref(logits, make_st(b, temperature=[0.0, 1.0, 1.0, 0.5], num_logprobs=-1))
    assert off.logprobs is None and off.top_ids is None and off.top_logprobs is None
    assert off.token_ids.shape == (b,)
    chosen = sample_ref(logits, make_st(b, temperature=[0.0, 1.0, 1.0, 0.5], num_logprobs=0))
    assert chosen.top_ids is None and chosen.top_logprobs is None
    assert chosen.logprobs is not None and chosen.logprobs.shape == (b,)
    lp = logits.log_softmax(-1)
    torch.testing.assert_close(chosen.logprobs, lp.gather(-1, chosen.token_ids[:, None])[:, 0])
    greedy = sample_ref(logits, make_st(b, temperature=0.0, num_logprobs=0))
    torch.testing.assert_close(greedy.logprobs, lp.max(-1).values)
