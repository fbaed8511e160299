"""Hostile sampling values, on both samplers (the torch reference and the Triton kernel, in
the interpreter without a GPU): whatever the SamplingTensors and the logits hold, the token
drawn is a valid id of a finite-logit token and no logprob is NaN; a temperature below
SAMPLING_EPS is greedy, and a row whose logits / temperature overflow is greedy over its
penalized logits (the old failure: NaN probabilities and a stream of token 0).

The extremes fed to every parameter: the smallest positive float32 and float64 values
(1e-45, 5e-324, which is 0 in float32), the smallest normal float32 (1e-38), the largest
(3e38, and 1.7e308, which is inf in float32), their negatives, 0 and NaN.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from ops.sampling import SAMPLING_EPS, SamplingTensors, apply_penalties, sample_ref, seed_key
from tests.helpers import kernel_device
from tests.test_sampling import make_st, rand_logits, repeat_row

EXTREMES = [1e-45, 5e-324, 1e-38, 3e38, 1.7e308, -1e-45, -3e38, -1.7e308, 0.0, float("nan")]
FLOAT_PARAMS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty"]
TOP_KS = [2**63 - 1, -(2**63), -1, 0, 1, 10**12]
SEEDS = [2**64 - 1, 2**63, -(2**63), -1, 0, 2**200 + 5]
V = 96

HAS_TRITON = importlib.util.find_spec("triton") is not None
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton"))]


@pytest.fixture(autouse=True)
def _global_rng():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(99)
        yield


def _sample(backend: str, logits: torch.Tensor, st: SamplingTensors):
    if backend == "torch":
        return sample_ref(logits, st)
    from ops.sampling_triton import sample_triton

    dev = kernel_device()
    moved = {f.name: getattr(st, f.name).to(dev) for f in dataclasses.fields(st)
             if isinstance(getattr(st, f.name), torch.Tensor)}
    out = sample_triton(logits.to(dev), dataclasses.replace(st, **moved))
    return dataclasses.replace(out, **{k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                       for k, v in dataclasses.asdict(out).items()})


def _hostile_logits(b: int, seed: int) -> torch.Tensor:
    """Random logits; every third row has +-inf entries, every third other row NaNs and
    +inf, one row finite only at its last token, and one row huge (1e37) values."""
    logits = rand_logits(b, V, seed=seed, scale=3.0)
    logits[0::3, 5::7] = float("-inf")
    logits[0::3, 9::11] = float("inf")
    logits[1::3, 3::5] = float("nan")
    logits[1::3, 4::13] = float("inf")
    logits[2, :-1] = float("-inf")
    logits[5] *= 1e37
    return logits


def _penalty_state(b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.rand(b, V, generator=g) < 0.5
    counts = torch.randint(0, 3, (b, V), generator=g).float()
    return prompt_mask, counts


def _check(logits: torch.Tensor, out, what: str) -> None:
    tok = out.token_ids
    assert tok.dtype == torch.int64 and bool(((tok >= 0) & (tok < V)).all()), (what, tok.tolist())
    picked = logits.gather(-1, tok[:, None])[:, 0]
    bad = (~torch.isfinite(picked)).nonzero().flatten().tolist()
    assert not bad, f"{what}: rows {bad} drew non-finite logits {picked[bad].tolist()}"
    for name in ("logprobs", "top_logprobs"):
        lp = getattr(out, name)
        if lp is not None:
            assert not bool(lp.isnan().any()), f"{what}: NaN {name}"
    if out.logprobs is not None:
        assert bool((out.logprobs <= 0).all()) and bool(torch.isfinite(out.logprobs).all()), what


def _rows(param: str) -> list[dict]:
    """One row per extreme value of `param`; the other parameters ordinary and sampling."""
    base = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3,
            "presence_penalty": 0.5, "frequency_penalty": 0.5}
    values = TOP_KS if param == "top_k" else EXTREMES
    return [{**base, param: v} for v in values]


def _batch(rows: list[dict], seeds: list[int | None], penalties: bool, num_logprobs: int, seed: int):
    b = len(rows)
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    prompt_mask, counts = _penalty_state(b, seed) if penalties else (None, None)
    st = make_st(b, **cols, prompt_mask=prompt_mask, output_counts=counts, seeds=seeds,
                 steps=list(range(b)), all_greedy=False, num_logprobs=num_logprobs)
    return _hostile_logits(b, seed), st


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("param", [*FLOAT_PARAMS, "top_k"])
@pytest.mark.parametrize("penalties", [True, False])
def test_extreme_values_of_every_parameter_draw_finite_tokens(backend: str, param: str,
                                                              penalties: bool) -> None:
    rows = _rows(param)
    seeds = [SEEDS[i % len(SEEDS)] if i % 2 else None for i in range(len(rows))]
    logits, st = _batch(rows, seeds, penalties, num_logprobs=3, seed=len(param))
    for _ in range(3):  # fresh draws
        _check(logits, _sample(backend, logits, st), f"{param} {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", EXTREMES)
def test_every_parameter_extreme_at_once(backend: str, value: float) -> None:
    """All float parameters of every row at one extreme (top_k at one of its own), with
    penalties, logprobs, and the all-greedy flag both ways."""
    b = 6
    rows = [{p: value for p in FLOAT_PARAMS} | {"top_k": TOP_KS[i]} for i in range(b)]
    logits, st = _batch(rows, SEEDS[:b], penalties=True, num_logprobs=2, seed=7)
    for all_greedy in (False, True):
        st = dataclasses.replace(st, all_greedy=all_greedy)
        _check(logits, _sample(backend, logits, st), f"all at {value} {backend}")
    no_pen = dataclasses.replace(st, penalty_tokens=None, all_greedy=True, num_logprobs=-1)
    _check(logits, _sample(backend, logits, no_pen), f"greedy shortcut {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_temperatures_below_eps_are_greedy(backend: str) -> None:
    """The old failure: logits / 1e-40 overflowed, the probabilities were NaN and every
    row drew token 0. Below SAMPLING_EPS (and NaN) a row is greedy; at SAMPLING_EPS it
    samples."""
    temps = [1e-45, 5e-324, 1e-38, 1e-20, SAMPLING_EPS * 0.99, float("nan")]
    row = rand_logits(1, V, seed=3, scale=0.3)[0]  # flat: a sampling row rarely hits the argmax
    row[0] = float(row.min()) - 1  # token 0 is the least likely
    n = len(temps)
    st = make_st(n, temperature=temps, all_greedy=False)
    for _ in range(3):
        got = _sample(backend, repeat_row(row, n), st).token_ids
        assert got.tolist() == [int(row.argmax())] * n
    m = 32
    sampled = _sample(backend, repeat_row(row, m), make_st(m, temperature=1.0)).token_ids
    assert len(set(sampled.tolist())) > 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflowing_rows_are_greedy_over_penalized_logits(backend: str) -> None:
    """Scaled logits past float32: huge logits at a small temperature above SAMPLING_EPS,
    and a repetition penalty of 1e-45 (penalized logits saturate at FLT_MAX; / 0.5 is inf).
    Each such row takes the argmax of its penalized logits, the others still sample."""
    b = 6
    logits = rand_logits(b, V, seed=4, scale=1.0)
    logits[0] *= 1e34  # / 2e-5 overflows
    logits[1] *= 3e33
    logits[2:4] *= 10
    prompt_mask, counts = _penalty_state(b, 5)
    st = make_st(b, temperature=[2e-5, 1e-4, 0.5, 0.5, 1.0, 1.0], top_k=[0, 5, 0, 30, 0, 0],
                 repetition_penalty=[1.0, 1.0, 1e-45, 1e-45, 1.0, 1.0], prompt_mask=prompt_mask,
                 output_counts=counts, num_logprobs=1)
    z = apply_penalties(logits, st)
    greedy = z.argmax(-1)
    # The penalty pushes the penalized rows' seen positive logits past FLT_MAX / 2 (some to
    # FLT_MAX), so / 0.5 overflows.
    assert bool((z[2:4].amax(-1) > torch.finfo(torch.float32).max / 2).all())
    draws = [_sample(backend, logits, st) for _ in range(8)]
    for out in draws:
        _check(logits, out, backend)
        assert out.token_ids[:4].tolist() == greedy[:4].tolist()
    assert len({int(o.token_ids[4]) for o in draws} | {int(o.token_ids[5]) for o in draws}) > 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_with_no_finite_logit_gives_no_nan(backend: str) -> None:
    """Nothing can be drawn: any id, and logprobs of -inf, never NaN."""
    logits = rand_logits(3, V, seed=6)
    logits[1] = float("-inf")
    logits[1, ::2] = float("nan")
    st = make_st(3, temperature=[1.0, 1.0, 0.0], num_logprobs=2, all_greedy=False)
    out = _sample(backend, logits, st)
    assert 0 <= int(out.token_ids[1]) < V
    assert not out.logprobs.isnan().any() and not out.top_logprobs.isnan().any()
    _check(logits[[0, 2]], dataclasses.replace(
        out, token_ids=out.token_ids[[0, 2]], logprobs=out.logprobs[[0, 2]],
        top_logprobs=out.top_logprobs[[0, 2]]), backend)


# --------------------------------------------------------------------------- seeds


def test_seed_key_uses_every_bit() -> None:
    """Flipping any one of a seed's 64 bits, or of the step's, changes the key's low 32
    bits (all the CPU generator keeps) and its high 32 (Philox keeps both)."""
    for s, t in ((12345, 0), (2**63 + 7, 9), (0, 2**40)):
        key = seed_key(s, t)
        for bit in range(64):
            for other in (seed_key(s ^ (1 << bit), t), seed_key(s, t ^ (1 << bit))):
                assert (key ^ other) & 0xFFFF_FFFF and (key ^ other) >> 32, (s, t, bit)
    assert seed_key(-1, 3) == seed_key(2**64 - 1, 3)  # a seed is its 64 bits
    assert 0 <= seed_key(2**200, 2**70) < 2**64


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeds_differing_in_high_bits_draw_differently(backend: str) -> None:
    """On a flat distribution, s, s + 2**63 and s ^ (1 << 62) give different draws over
    12 steps; the same seed gives the same draws, alone and in a batch."""
    row = torch.zeros(V)  # uniform
    steps = list(range(12))
    n = len(steps)

    def draws(seed: int) -> list[int]:
        st = make_st(n, seeds=[seed] * n, steps=steps)
        return _sample(backend, repeat_row(row, n), st).token_ids.tolist()

    for s in (5, 2**62 + 1):
        base = draws(s)
        assert draws(s + 2**63) != base
        assert draws(s ^ (1 << 62)) != base
        assert draws(s) == base
        for step in (0, 7):
            # Alone, then in a batch beside unseeded and other-seeded rows.
            alone = _sample(backend, row[None], make_st(1, seeds=[s], steps=[step])).token_ids
            batch = _sample(backend, repeat_row(row, 4),
                            make_st(4, seeds=[None, s + 2**63, s, 3], steps=[0, step, step, 1])).token_ids
            assert int(alone[0]) == base[step] == int(batch[2])
