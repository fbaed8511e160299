"""The C backend's attention (ops/cpu_attention.py: decodes in the C kernel, prefill chunks
through the reference's path) against the pure torch reference, on fresh random inputs.

Tolerance: float32, rtol = atol = 1e-5 (the kernel sums in another order than SDPA).
A spy on the kernel checks that it really ran (and ran once per call, over every decode),
and the kernel is also called alone on a NaN-poisoned output: a stub that returned the
reference, or wrote nothing, fails.
"""

from __future__ import annotations

import pytest
import torch

import ops
from ops import cpu_attention
from ops.attention import StepPlan, paged_attention_ref
from ops.cpu_attention import paged_attention_c

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no gcc or no AVX2/FMA/F16C here")

BS, HKV, HQ, D, NUM_BLOCKS = 16, 3, 9, 64, 200


def _step(lens: list[int], q_lens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g)
    v = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g)
    max_blocks = max(-(-n // BS) for n in lens) + 1
    tables = torch.randperm(NUM_BLOCKS, generator=g)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], HQ, D, generator=g)
    return (q, k, v, tables.int(), torch.tensor(lens, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32), max(q_lens), max(lens), D**-0.5)


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """Number of decodes of each call of the C kernel."""
    calls: list[int] = []
    real = cpu_attention.decode

    def spy(q, k_cache, v_cache, rows, *rest, **kw):
        calls.append(rows.shape[0])
        return real(q, k_cache, v_cache, rows, *rest, **kw)

    monkeypatch.setattr(cpu_attention, "decode", spy)
    return calls


@pytest.mark.parametrize(("lens", "q_lens"), [
    ([1, 5, 17, 100, 33, 8, 9], [1] * 7),  # decodes only: lengths around the 8-lane tails
    ([1, 50, 17, 130, 33], [1, 20, 1, 1, 5]),  # decodes beside prefill chunks
    ([300, 2, 64], [1, 2, 64]),  # a whole prefill, a 2-token chunk, one long decode
    # a 1,500-token decode (chunks of 375 keys: the vector max, eight-key sums and their
    # tails, chunks shared among threads) beside a one-token one
    ([1500, 1], [1, 1]),
])
def test_c_attention_matches_the_pure_reference(lens, q_lens, kernel_calls) -> None:
    args = _step(lens, q_lens, seed=len(lens) + sum(q_lens))
    ref = paged_attention_ref(*args)
    assert kernel_calls == []  # the reference is pure torch
    got = paged_attention_c(*args)
    assert kernel_calls == [q_lens.count(1)]  # every decode in one call of the kernel
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("softcap", [1.5, 50.0])
def test_soft_capped_scores_match_the_reference(softcap, kernel_calls) -> None:
    """Gemma 2's c tanh(s / c) on the scores (the kernel's vector tanh, the reference's
    torch.tanh): 1.5 bites on these N(0, 1) scores; lengths around the 8-lane tails."""
    lens, q_lens = [1, 5, 17, 100, 33, 8, 9, 300], [1] * 8
    args = _step(lens, q_lens, seed=99)
    ref = paged_attention_ref(*args, softcap=softcap)
    got = paged_attention_c(*args, softcap=softcap)
    assert kernel_calls == [len(lens)]
    if softcap < 2:  # the cap changes the result: a kernel that skipped it fails
        assert (paged_attention_ref(*args) - ref).abs().max() > 1e-2
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_the_kernel_alone_writes_exactly_the_decode_rows() -> None:
    """cpu_attention.decode on an output poisoned with NaN: the decode rows match the
    reference, every other row is left alone."""
    lens, q_lens = [40, 9, 77, 130], [1, 9, 1, 1]
    q, k, v, tables, seq_lens, starts, *_, scale = _step(lens, q_lens, seed=11)
    ref = paged_attention_ref(q, k, v, tables, seq_lens, starts, 9, 130, scale)
    rows = torch.tensor([0, 10, 11])
    out = torch.full_like(q, float("nan"))
    cpu_attention.decode(q, k, v, rows, tables[[0, 2, 3]].long().contiguous(),
                         seq_lens[[0, 2, 3]].long(), scale, out)
    torch.testing.assert_close(out[rows], ref[rows], rtol=1e-5, atol=1e-5)
    assert out[1:10].isnan().all()


def test_backends_through_the_dispatch(kernel_calls) -> None:
    """ops.paged_attention: `torch` never calls the kernel, `c` and `auto` (on the CPU) do;
    all three agree within the tolerance."""
    args = _step([33, 12, 70], [1, 12, 1], seed=5)
    with ops.use_backend("torch"):
        ref = ops.paged_attention(*args)
    assert kernel_calls == []
    for name in ("c", "auto"):
        with ops.use_backend(name):
            torch.testing.assert_close(ops.paged_attention(*args), ref, rtol=1e-5, atol=1e-5)
    assert kernel_calls == [2, 2]


def test_a_step_plan_is_shared_by_the_layers_of_one_step(kernel_calls) -> None:
    """Layers of one step pass the same StepPlan: it is built once and gives each layer's
    (different) caches the same answer as a plan of its own."""
    q, k, v, tables, seq_lens, starts, mq, ms, scale = _step([20, 8, 45], [1, 8, 1], seed=8)
    plan = StepPlan()
    assert not plan.built
    for layer in range(3):
        k_l, v_l = k.roll(layer, 0), v.roll(2 * layer, 0)  # another layer's cache
        got = paged_attention_c(q, k_l, v_l, tables, seq_lens, starts, mq, ms, scale, plan)
        assert plan.built
        want = paged_attention_ref(q, k_l, v_l, tables, seq_lens, starts, mq, ms, scale)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError, match="one step"):  # another step's metadata
        paged_attention_c(q, k, v, tables.clone(), seq_lens, starts, mq, ms, scale, plan)


def test_a_requests_result_does_not_depend_on_its_batch() -> None:
    lens = [40, 7, 130, 64, 1, 99]
    q, k, v, tables, seq_lens, _, _, _, scale = _step(lens, [1] * len(lens), seed=3)
    together = paged_attention_c(q, k, v, tables, seq_lens, torch.arange(len(lens) + 1, dtype=torch.int32),
                                 1, max(lens), scale)
    for i, n in enumerate(lens):
        alone = paged_attention_c(q[i : i + 1], k, v, tables[i : i + 1], seq_lens[i : i + 1],
                                  torch.tensor([0, 1], dtype=torch.int32), 1, n, scale)
        assert torch.equal(alone[0], together[i]), f"request {i} differs alone"


def test_other_dtypes_take_the_reference(kernel_calls) -> None:
    """float64 is not the kernel's: paged_attention_c runs the reference (no kernel call)."""
    args = _step([30, 5], [1, 5], seed=4)
    args64 = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    got = paged_attention_c(*args64)
    assert kernel_calls == [] and got.dtype == torch.float64
    torch.testing.assert_close(got, paged_attention_ref(*args64))


def test_bad_lengths_are_an_error_not_a_read_past_the_table() -> None:
    q = torch.randn(1, HQ, D)
    k = torch.zeros(4, BS, HKV, D)
    with pytest.raises(RuntimeError, match="bad shapes or lengths"):
        cpu_attention.decode(q, k, k.clone(), torch.zeros(1, dtype=torch.long),
                             torch.zeros(1, 2, dtype=torch.long), torch.tensor([2 * BS + 1]),
                             1.0, torch.empty_like(q))
