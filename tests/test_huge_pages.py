"""The CPU model's weights moved into 2 MB pages (ops/huge_pages.py): every tensor keeps its
values and its ties, nothing is moved twice, and the engine's outputs are the same bits with
and without (--no-cpu-huge-pages)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ops import huge_pages
from ops import quantized_linear as ql
from scheduler.request import SamplingParams
from worker.config import ModelConfig, WorkerConfig
from worker.engine import Engine
from worker.weights import load_model


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(512, 256), requires_grad=False)
        self.register_buffer("table", torch.arange(300_000, dtype=torch.int32))
        self.packed = torch.randint(0, 255, (200_000,), dtype=torch.uint8)  # a plain attribute
        self.small = torch.randn(16)  # under MIN_BYTES: stays


def test_every_tensor_keeps_its_values_and_its_ties() -> None:
    m = _Tied()
    m.rows = m.weight[100:200]  # a view: it must stay a view of the moved weight
    before = {k: v.clone() for k, v in [("weight", m.weight), ("table", m.table), ("packed", m.packed),
                                        ("small", m.small), ("rows", m.rows)]}
    small_ptr = m.small.data_ptr()
    moved, huge = huge_pages.move_to_huge_pages(m)
    assert moved >= m.weight.nbytes + m.table.nbytes + m.packed.nbytes
    assert 0 <= huge <= moved + huge_pages.HUGE
    for name, value in before.items():
        assert torch.equal(getattr(m, name), value), name
    for t in (m.weight, m.table, m.packed, m.rows):
        assert huge_pages.in_arena(t.data_ptr())
        assert t.data_ptr() % huge_pages.ALIGN == 0 or t is m.rows
    assert m.small.data_ptr() == small_ptr
    assert isinstance(m.weight, nn.Parameter) and not m.weight.requires_grad
    # The view still shares the weight's memory.
    assert m.rows.data_ptr() == m.weight.data_ptr() + 100 * 256 * 4
    m.weight[150, 0] = 7.0
    assert m.rows[50, 0] == 7.0
    # A second move finds everything in place: nothing moves, and it reports the same arena
    # (a second engine on the same load says where its weights are, not "0 of 0 MiB").
    ptrs = [t.data_ptr() for t in (m.weight, m.table, m.packed)]
    again, huge_again = huge_pages.move_to_huge_pages(m)
    assert [t.data_ptr() for t in (m.weight, m.table, m.packed)] == ptrs
    assert again == moved and 0 <= huge_again <= again + huge_pages.HUGE


def test_the_arena_is_2mb_aligned_and_zeroed() -> None:
    t = huge_pages.arena(3 << 20)
    assert t.data_ptr() % huge_pages.HUGE == 0 and t.numel() == 3 << 20
    assert int(t.count_nonzero()) == 0
    assert huge_pages.huge_bytes_at(t.data_ptr()) <= 4 << 20


@pytest.mark.skipif(not ql.available(), reason="no gcc or no AVX2/FMA/F16C here")
def test_the_engine_gives_the_same_bits_with_and_without() -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outputs, kernels = [], []
    for on in (True, False):
        engine = Engine(WorkerConfig(model=ModelConfig(cpu_huge_pages=on)), loaded=load_model("default"))
        kernels.append(engine.runner.describe_kernels())
        engine.submit(engine.make_request(list(range(300, 340)), params, request_id="r"))
        tokens, logprobs = [], []
        while len(tokens) < 12:
            for out in engine.step().outputs:
                tokens += out.new_token_ids
                logprobs += [(lp.logprob, lp.top_logprobs) for lp in out.logprobs or ()]
        outputs.append((tokens, logprobs))
    assert len(outputs[0][0]) == 12 and len(outputs[0][1]) == 12
    assert outputs[0] == outputs[1]
    assert "2 MB pages" in kernels[0] and "2 MB pages" not in kernels[1]


def test_a_freed_arena_is_forgotten() -> None:
    """Once an arena's tensors are gone its mapping is unmapped and its addresses may be handed
    out again: a storage later allocated there must be moved, not taken as already placed (a
    stale range once left a later test's weights unmoved)."""
    import gc

    t = huge_pages.arena(4 << 20)
    lo = t.data_ptr()
    assert huge_pages.in_arena(lo)
    view = t[1 << 20:]
    del t
    gc.collect()
    assert huge_pages.in_arena(lo), "a view still holds the arena"
    del view
    gc.collect()
    assert not huge_pages.in_arena(lo)
