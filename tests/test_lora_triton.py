"""The Triton LoRA kernels (ops/lora_triton.py) against the torch reference on fresh random
inputs: float32 within 1e-4 (Triton's interpreter on the CPU, natively on a GPU)."""

from __future__ import annotations

import pytest
import torch

from ops.lora import LoraRows, lora_add_ref
from tests.helpers import kernel_device, requires_triton


@requires_triton
@pytest.mark.parametrize(("slices", "rank", "token_slots"), [
    ((96, 32, 32), 16, [2, -1, 0, 2, 2, -1, 3, 0, 1]),    # fused q/k/v, every slot used
    ((48,), 8, [-1, 1, 1, -1, 3] + [1] * 20),               # one slice, some slots, a long segment
    ((64, 64), 16, [0] * 3 + [-1] * 2),                     # gate/up, one adapter
])
def test_lora_add_triton_matches_the_reference(slices, rank, token_slots) -> None:
    from ops.lora_triton import lora_add_triton

    dev = kernel_device()
    g = torch.Generator().manual_seed(len(token_slots))
    num_slots, n_in = 4, 40  # in not a multiple of the kernel's K block
    a = torch.randn(num_slots, len(slices) * rank, n_in, generator=g).to(dev)
    bs = [torch.randn(num_slots, o, rank, generator=g).to(dev) for o in slices]
    x = torch.randn(len(token_slots), n_in, generator=g).to(dev)
    y = torch.randn(len(token_slots), sum(slices), generator=g).to(dev)
    rows = LoraRows.build(token_slots, num_slots, dev)
    assert rows is not None
    want = lora_add_ref(y.clone(), x, a, bs, rows)
    got = lora_add_triton(y.clone(), x, a, bs, rows)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    base = [i for i, s in enumerate(token_slots) if s < 0]
    assert torch.equal(got[base], y[base]), "a base row changed"
