"""The CPU decode-attention kernel (ops/cpu_attention.py) against the torch reference it
replaces, and a request's result independent of the rest of its batch."""

from __future__ import annotations

import pytest
import torch

import ops.attention as attention
from ops import cpu_attention

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


def _attend(args, kernel: bool, monkeypatch) -> torch.Tensor:
    attention._last_plan = None
    with monkeypatch.context() as m:
        if not kernel:
            m.setattr(cpu_attention, "usable", lambda *a: False)
        return attention.paged_attention_ref(*args)


@pytest.mark.parametrize(("lens", "q_lens"), [
    ([1, 5, 17, 100, 33, 8, 9], [1] * 7),  # decodes only: lengths around the 8-lane tails
    ([1, 50, 17, 130, 33], [1, 20, 1, 1, 5]),  # decodes beside prefill chunks
])
def test_kernel_matches_the_reference(lens, q_lens, monkeypatch) -> None:
    args = _step(lens, q_lens, seed=len(lens))
    ref = _attend(args, kernel=False, monkeypatch=monkeypatch)
    got = _attend(args, kernel=True, monkeypatch=monkeypatch)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_requests_result_does_not_depend_on_its_batch(monkeypatch) -> None:
    lens = [40, 7, 130, 64, 1, 99]
    q, k, v, tables, seq_lens, _, _, _, scale = _step(lens, [1] * len(lens), seed=3)
    together = _attend((q, k, v, tables, seq_lens, torch.arange(len(lens) + 1, dtype=torch.int32),
                        1, max(lens), scale), kernel=True, monkeypatch=monkeypatch)
    for i, n in enumerate(lens):
        alone = _attend((q[i : i + 1], k, v, tables[i : i + 1], seq_lens[i : i + 1],
                         torch.tensor([0, 1], dtype=torch.int32), 1, n, scale), True, monkeypatch)
        assert torch.equal(alone[0], together[i]), f"request {i} differs alone"


def test_bad_lengths_are_an_error_not_a_read_past_the_table() -> None:
    q = torch.randn(1, HQ, D)
    k = torch.zeros(4, BS, HKV, D)
    with pytest.raises(RuntimeError, match="bad shapes or lengths"):
        cpu_attention.decode(q, k, k.clone(), torch.zeros(1, dtype=torch.long),
                             torch.zeros(1, 2, dtype=torch.long), torch.tensor([2 * BS + 1]),
                             1.0, torch.empty_like(q))
