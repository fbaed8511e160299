"""Tests of the Triton sampler (ops.sampling_triton) against the torch reference (ops.sampling).

Without a GPU the kernel runs in Triton's interpreter (one Python-level program per row), so
those tests keep batches small; the `requires_cuda` tests repeat the checks at Llama 3's
vocabulary (128256) with 64 rows, and the statistical ones with far more draws.

The kernel uses its own random stream (Philox), so draws are compared with the reference
through what must agree: greedy tokens exactly, penalized / scaled logits exactly, the kept
set of top-k / top-p / min-p exactly (for distinct logits away from float rounding edges),
the sampled distribution statistically, logprobs to float tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

import ops.sampling_triton
from ops.sampling import (
    SAMPLING_EPS,
    SamplingTensors,
    apply_penalties,
    sample_ref,
)
from ops.sampling_triton import inspect_triton, sample_triton
from tests.helpers import kernel_device, requires_cuda, requires_triton
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
    scaled_ref,
)
from tests.test_sampling import make_st, rand_logits, repeat_row

pytestmark = requires_triton

DEV = kernel_device()
ON_GPU = DEV.type == "cuda"
LLAMA3_VOCAB = 128256


@pytest.fixture(autouse=True)
def _global_rng():
    """Unseeded rows take their key from the global CPU generator: fix it, then restore it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4321)
        yield


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 1024 tokens, so that rows of a few thousand tokens span several tiles."""
    monkeypatch.setattr(ops.sampling_triton, "_MAX_BLOCK", 1024)


def on_dev(st: SamplingTensors, dev: torch.device = DEV) -> SamplingTensors:
    moved = {
        f.name: getattr(st, f.name).to(dev)
        for f in dataclasses.fields(st)
        if isinstance(getattr(st, f.name), torch.Tensor)
    }
    return dataclasses.replace(st, **moved)


def row_slice(st: SamplingTensors, rows: slice) -> SamplingTensors:
    cut = {
        f.name: getattr(st, f.name)[rows]
        for f in dataclasses.fields(st)
        if isinstance(getattr(st, f.name), torch.Tensor)
    }
    return dataclasses.replace(st, **cut, seeds=st.seeds[rows], steps=st.steps[rows])


def run(logits: torch.Tensor, st: SamplingTensors):
    return sample_triton(logits.to(DEV), on_dev(st))


def tokens(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    return run(logits, st).token_ids.cpu()


def check_kept(logits: torch.Tensor, st: SamplingTensors, tol: float = 0.0) -> torch.Tensor:
    """The kernel's kept set equals the reference's on every sampling row, up to edge tokens
    (tol = 0: none allowed). Returns the kernel's kept mask."""
    kept, _ = inspect_triton(logits.to(DEV), on_dev(st))
    kept = kept.cpu()
    assert_kept_matches(kept, logits, st, tol)
    return kept


# --------------------------------------------------------------------------- greedy


@pytest.mark.usefixtures("small_tiles")
def test_all_greedy_is_argmax_across_tiles():
    v = 3000  # three tiles
    logits = rand_logits(6, v, seed=1)
    logits[2, 2500] = logits[2].max() + 1.0  # the maximum in the last tile
    logits[3, 7] = logits[3, 2100] = logits[3].max() + 1.0  # a tie across tiles: first wins
    st = make_st(6, temperature=0.0)
    got = tokens(logits, st)
    assert torch.equal(got, sample_ref(logits, st).token_ids)
    assert int(got[2]) == 2500 and int(got[3]) == 7


@pytest.mark.usefixtures("small_tiles")
def test_greedy_rows_in_mixed_batch_with_penalties():
    b, v = 8, 2500
    logits, prompt_mask, counts = penalty_inputs(5, b, v)
    temps = [0.0, 1.0, 0.0, 0.7, 0.0, 1.3, 0.0, 2.0]
    st = make_st(
        b, temperature=temps, top_k=[0, 20, 5, 0, 0, 0, 1, 0], top_p=[1, 1, 0.5, 0.9, 1, 1, 1, 0.8],
        repetition_penalty=[1.3, 1.0, 2.0, 1.1, 0.8, 1.0, 1.5, 1.2],
        presence_penalty=[0.5, 0.0, 0.2, 0.0, 1.0, 0.3, 0.0, 0.0],
        frequency_penalty=[0.3, 0.1, 0.0, 0.0, 0.4, 0.0, 1.0, 0.2],
        prompt_mask=prompt_mask, output_counts=counts,
    )
    greedy = torch.tensor(temps) == 0
    want = apply_penalties(logits, st).argmax(-1)
    assert not torch.equal(want[greedy], logits.argmax(-1)[greedy])  # penalties matter here
    got = tokens(logits, st)
    assert torch.equal(got[greedy], want[greedy])
    # The runner's shortcut (every row greedy) takes the same tokens.
    st_all = make_st(
        b, temperature=0.0, repetition_penalty=st.repetition_penalty,
        presence_penalty=st.presence_penalty, frequency_penalty=st.frequency_penalty,
        prompt_mask=prompt_mask, output_counts=counts,
    )
    assert torch.equal(tokens(logits, st_all), want)
    assert torch.equal(tokens(logits, st_all), sample_ref(logits, st_all).token_ids)


# --------------------------------------------------------------------------- penalties


@pytest.mark.usefixtures("small_tiles")
def test_penalized_scaled_logits_equal_reference():
    """Bit for bit: the kernel rounds penalties and temperature as torch does."""
    b, v = 5, 2200
    logits, prompt_mask, counts = penalty_inputs(70, b, v)
    st = make_st(
        b, temperature=[1.0, 0.7, 1.0, 1.9, 0.3],
        min_p=1e-30,  # a filter that keeps every token, so the kernel stores its scaled row
        repetition_penalty=[1.0, 1.3, 2.0, 0.7, 1.1], presence_penalty=[0.0, 0.5, 0.0, 1.2, 0.3],
        frequency_penalty=[0.0, 0.0, 0.4, 0.25, -0.5], prompt_mask=prompt_mask,
        output_counts=counts,
    )
    _, scaled = inspect_triton(logits.to(DEV), on_dev(st))
    assert torch.equal(scaled.cpu(), scaled_ref(logits, st))


# --------------------------------------------------------------------------- kept sets


def test_kept_set_top_k_top_p_min_p():
    check_kept_sets(check_kept)


@pytest.mark.usefixtures("small_tiles")
def test_kept_set_across_tiles_with_penalties():
    b, v = 4, 5000  # five tiles
    logits, prompt_mask, counts = penalty_inputs(13, b, v)
    st = make_st(
        b, temperature=[1.0, 0.7, 1.5, 1.0], top_k=[300, 0, 50, 2500],
        top_p=[0.9, 0.5, 1.0, 0.97], min_p=[0.0, 0.0, 0.001, 0.0],
        repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
        prompt_mask=prompt_mask, output_counts=counts,
    )
    assert not bool(edge_tokens(logits, st, 1e-5).any())
    check_kept(logits, st)


def test_top_p_first_token_always_kept_and_tiny_p():
    check_top_p_keeps_the_first_token(check_kept)


def test_ties_at_boundary_keep_every_tied_token():
    check_ties_keep_every_tied_token(lambda x, st: inspect_triton(x.to(DEV), on_dev(st))[0].cpu())


def test_kept_set_extreme_logit_ranges():
    """Boundaries far below the value range's resolution: the search falls back to halving
    the float32 bit pattern and still finds the exact boundary."""
    v = 64
    a = torch.linspace(-1e4, 1e4, v)
    a[10], a[11], a[12] = 3e-20, 2e-20, 1e-20  # the 33rd..35th largest lie between these
    a[30], a[31], a[32], a[33] = 1e-38, -1e-38, 5e-39, 0.0  # and around zero, subnormals too
    order = a.argsort(descending=True)
    kth_tiny = int((order == 11).nonzero()) + 1  # k putting the boundary at 2e-20
    kth_sub = int((order == 32).nonzero()) + 1  # k putting the boundary at 5e-39
    rows = repeat_row(a, 3)
    rows[2] = a * 1e-3  # temperatures are applied before the search
    st = make_st(3, top_k=[kth_tiny, kth_sub, 7], temperature=[1.0, 1.0, 1e-3])
    kept = check_kept(rows, st)
    assert bool(kept[0, 11]) and not bool(kept[0, 12])
    assert bool(kept[1, 32]) and not bool(kept[1, 33])


def test_draws_stay_in_kept_set_and_cover_it():
    row = rand_logits(1, 40, seed=13, scale=0.6)[0]
    n = 48
    st = make_st(n, top_k=6, top_p=0.9, temperature=1.4)
    kept = check_kept(row[None], make_st(1, top_k=6, top_p=0.9, temperature=1.4))[0]
    drawn = set(tokens(repeat_row(row, n), st).tolist())
    assert drawn <= set(torch.nonzero(kept).flatten().tolist())
    assert len(drawn) >= min(4, int(kept.sum()))


def test_negative_infinity_logits_never_drawn():
    v = 50
    row = rand_logits(1, v, seed=14, scale=0.3)[0]
    row[::2] = float("-inf")  # e.g. a masked vocabulary
    n = 24
    st = make_st(n, top_p=[1.0, 0.9] * (n // 2), top_k=[0, 0, 30, 0] * (n // 4))
    got = tokens(repeat_row(row, n), st)
    assert bool(torch.isfinite(row[got]).all())


# --------------------------------------------------------------------------- distribution


N_INTERP = 500


def test_distribution_matches_softmax_interpreter_sized():
    v, temperature = 8, 0.7
    row = rand_logits(1, v, seed=50, scale=0.5)[0]
    expected = (row / temperature).softmax(-1)
    tok = tokens(repeat_row(row, N_INTERP), make_st(N_INTERP, temperature=temperature))
    check_distribution(tok, expected, max_abs=0.09)


def test_distribution_filtered_renormalizes_interpreter_sized():
    row = torch.tensor([1.2, 0.1, -0.3, 0.9, -2.0, 0.5, 0.0, -1.0])
    n = 200
    # top-k 4 keeps {0, 3, 5, 1}; top-p 0.85 then drops token 1 (mass before it > 0.85).
    st = make_st(n, top_k=4, top_p=0.85)
    kept = check_kept(row[None], make_st(1, top_k=4, top_p=0.85))[0]
    assert torch.nonzero(kept).flatten().tolist() == [0, 3, 5]
    check_distribution(tokens(repeat_row(row, n), st), filtered_softmax(row, 1.0, [0, 3, 5]),
                        max_abs=0.15)


# --------------------------------------------------------------------------- seeds


@pytest.mark.parametrize("row_kw", [{}, {"top_k": 30, "temperature": 0.8}])
def test_seeded_row_independent_of_batch_and_calls(row_kw):
    v = 300
    rows = rand_logits(3, v, seed=60, scale=0.3)  # flat: the draw is close to uniform
    for i in range(rows.shape[0]):
        seed, step = 1000 + 7 * i, i % 5
        single = make_st(1, seeds=[seed], steps=[step], **{k: [x] for k, x in row_kw.items()})
        torch.manual_seed(i)
        alone = int(tokens(rows[i][None], single)[0])
        torch.manual_seed(i + 100)  # the global RNG state must not matter
        assert int(tokens(rows[i][None], single)[0]) == alone
        for pos in (0, 6):
            batch, st = mixed_batch(pos, rows[i], seed, step, row_kw)
            assert int(tokens(batch, st)[pos]) == alone, (i, pos)


def test_seeded_draws_vary_with_step_and_seed():
    check_seeded_draws_vary_with_step_and_seed(tokens)


def test_unseeded_rows_follow_global_generator():
    check_unseeded_rows_follow_global_generator(tokens)


# --------------------------------------------------------------------------- logprobs


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("n", [0, 1, 5])
def test_logprobs_match_reference(n):
    def sample(logits, st):
        out = run(logits, st)
        return dataclasses.replace(out, **{f.name: getattr(out, f.name).cpu() for f in dataclasses.fields(out)
                                           if getattr(out, f.name) is not None})

    check_logprobs_match_reference(sample, n)


def test_logprobs_off():
    logits = rand_logits(3, 100, seed=81)
    out = run(logits, make_st(3, temperature=[0.0, 1.0, 0.5]))
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None
    assert out.token_ids.shape == (3,) and out.token_ids.dtype == torch.int64


# --------------------------------------------------------------------------- GPU, full size


def _llama3_batch(b: int = 64, seed: int = 90):
    """Peaked logits (as a model's are) with every feature spread over the rows."""
    v = LLAMA3_VOCAB
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, v, generator=g) * 3.0
    prompt_mask = torch.rand(b, v, generator=g) < 0.01
    counts = torch.randint(0, 3, (b, v), generator=g).float()
    counts[torch.rand(b, v, generator=g) < 0.99] = 0.0
    rows = torch.arange(b)
    st = make_st(
        b,
        temperature=[0.0 if i % 5 == 0 else 0.3 + (i % 7) * 0.3 for i in range(b)],
        top_k=[[0, 1, 20, 50, 1000, 40000][i % 6] for i in range(b)],
        top_p=[[1.0, 0.9, 0.5, 0.95, 0.999][i % 5] for i in range(b)],
        min_p=[[0.0, 0.0, 0.05, 0.2][i % 4] for i in range(b)],
        repetition_penalty=(1.0 + 0.1 * (rows % 3)).tolist(),
        presence_penalty=(0.2 * (rows % 2)).tolist(),
        frequency_penalty=(0.1 * (rows % 4)).tolist(),
        prompt_mask=prompt_mask, output_counts=counts,
        seeds=[i if i % 3 == 0 else None for i in range(b)], steps=(rows % 11).tolist(),
        num_logprobs=5,
    )
    return logits, st


@requires_cuda
def test_gpu_llama3_vocab_against_reference():
    logits, st = _llama3_batch()
    dev_logits, dev_st = logits.to(DEV), on_dev(st)
    out = sample_triton(dev_logits, dev_st)
    ref = sample_ref(dev_logits, dev_st)
    greedy = st.temperature < SAMPLING_EPS
    assert torch.equal(out.token_ids.cpu()[greedy], ref.token_ids.cpu()[greedy])
    kept, scaled = inspect_triton(dev_logits, dev_st)
    filtered = (st.temperature >= SAMPLING_EPS) & ((st.top_k > 0) | (st.top_p < 1) | (st.min_p > 0))
    assert torch.equal(scaled.cpu()[filtered], scaled_ref(logits, st)[filtered])
    check_kept(logits, st, tol=1e-5)
    # Every row's token lies in its kept set.
    assert bool(kept.cpu().gather(-1, out.token_ids.cpu()[:, None]).all())
    lp = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs.cpu(), lp.gather(-1, out.token_ids.cpu()[:, None])[:, 0])
    assert torch.equal(out.top_ids.cpu(), ref.top_ids.cpu())
    torch.testing.assert_close(out.top_logprobs.cpu(), ref.top_logprobs.cpu())


@requires_cuda
def test_gpu_no_host_sync():
    logits, st = _llama3_batch()
    dev_logits, dev_st = logits.to(DEV), on_dev(st)
    sample_triton(dev_logits, dev_st)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for all_greedy in (False, True):
            sample_triton(dev_logits, dataclasses.replace(dev_st, all_greedy=all_greedy))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@requires_cuda
def test_gpu_seeded_rows_independent_of_batch():
    logits, st = _llama3_batch()
    dev_logits, dev_st = logits.to(DEV), on_dev(st)
    first = sample_triton(dev_logits, dev_st).token_ids.cpu()
    seeded = [i for i, s in enumerate(st.seeds) if s is not None and st.temperature[i] > 0]
    for i in seeded[:6]:
        one = row_slice(st, slice(i, i + 1))
        assert int(sample_triton(dev_logits[i : i + 1], on_dev(one)).token_ids[0]) == int(first[i])
    torch.manual_seed(99)
    again = sample_triton(dev_logits, dev_st).token_ids.cpu()
    assert torch.equal(again[seeded], first[seeded])


N_GPU = 200_000  # sigma of a frequency <= 0.0011; the 0.006 bound is over 5 sigma


@requires_cuda
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("seeded", [False, True])
def test_gpu_distribution_matches_softmax(temperature, seeded):
    v = 8
    row = rand_logits(1, v, seed=52, scale=1.0)[0]
    seeds = list(range(N_GPU)) if seeded else None
    st = make_st(N_GPU, temperature=temperature, seeds=seeds, steps=3)
    tok = tokens(repeat_row(row, N_GPU), st)
    check_distribution(tok, (row / temperature).softmax(-1), max_abs=0.006)


@requires_cuda
def test_gpu_distribution_with_filters_and_penalties():
    check_distribution_with_filters_and_penalties(tokens, check_kept, N_GPU)
