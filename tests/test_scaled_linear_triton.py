"""The Triton kernels of pre-quantized linears (ops/scaled_linear_triton.py) against the
pure-torch reference (ops/scaled_linear.py), at decode (1, 3 rows) and prefill (40 rows)
shapes, in Triton's interpreter on the CPU (FP8 included: the interpreter loads, multiplies
and converts float8_e4m3fn as the GPU does) and natively on a GPU.

Weights are made here by a quantizer of the test's own (amax scales, random int4 quants,
scales and zero points), not by the loader. Tolerances: the activation quantization is
exact (the same scales and quants, bit for bit); a product's aggregate relative error
||got - want|| / ||want|| <= 2e-6 in float32 (only the order of float32 sums differs; an
int8 product is an exact integer sum) and <= 2e-3 in float16 / bfloat16 (one rounding of
the output, and of the dequantized weight tile into 16 bits, as the reference rounds it).
"""

from __future__ import annotations

import pytest
import torch

from ops.scaled_linear import ScaledWeight, pack_int4, quantize_activations, scaled_linear_ref
from tests.helpers import kernel_device, requires_cuda, requires_triton

pytestmark = requires_triton
triton = pytest.importorskip("triton")

from ops.scaled_linear_triton import quantize_activations_triton, scaled_linear_triton  # noqa: E402

N, K = 200, 256  # N not a multiple of the tiles, K two fp8 blocks / int4 groups


def _weight(kind: str, n: int, k: int, device: torch.device, *, block: bool = False, act: str | None = None,
            group: int = 128, zero: bool = False, ub: float | None = None, seed: int = 0) -> ScaledWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    if kind == "int4":
        u = torch.randint(0, 16, (n, k), generator=g)
        scale = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
        z = torch.randint(0, 16, (n, k // group), generator=g).to(torch.uint8) if zero else None
        sw = ScaledWeight("int4", pack_int4(u), scale, (n, k), zero=z, group_size=group)
    elif block:
        bs = (128, 128)
        amax = w.abs().reshape(-1, 1).new_zeros(-(-n // 128), k // 128)
        for i in range(amax.shape[0]):
            for j in range(amax.shape[1]):
                amax[i, j] = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max()
        scale = amax / 448
        full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
        sw = ScaledWeight("fp8", (w / full).to(torch.float8_e4m3fn), scale, (n, k), block=bs, act=act)
    else:
        top = 448.0 if kind == "fp8" else 127.0
        scale = w.abs().amax(1) / top
        y = w / scale[:, None]
        q = y.to(torch.float8_e4m3fn) if kind == "fp8" else y.round().clamp(-127, 127).to(torch.int8)
        sw = ScaledWeight(kind, q, scale, (n, k), act=act, act_scale_ub=ub)
    return sw.to(device)


CASES = {
    "fp8 channel, token": dict(kind="fp8", act="token"),
    "fp8 block, group": dict(kind="fp8", block=True, act="group"),
    "fp8 block, token": dict(kind="fp8", block=True, act="token"),
    "fbgemm fp8 (amax bound)": dict(kind="fp8", act="token", ub=1.5),
    "int8 channel, token": dict(kind="int8", act="token"),
    "fp8 channel, weight-only": dict(kind="fp8"),
    "fp8 block, weight-only": dict(kind="fp8", block=True),
    "int8 weight-only": dict(kind="int8"),
    "int4 symmetric, groups of 128": dict(kind="int4"),
    "int4 zero points, groups of 128": dict(kind="int4", zero=True),
    "int4 zero points, groups of 64": dict(kind="int4", zero=True, group=64),
}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_kernel_against_reference(case: str, rows: int) -> None:
    dev = kernel_device()
    w = _weight(n=N, k=K, device=dev, **CASES[case])
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, K, generator=g) * 2).to(dev)
    x[0, :7] *= 40  # an outlier row: its scale differs from the others'
    bias = torch.randn(N, generator=g).to(dev) if rows == 3 else None
    got = scaled_linear_triton(x, w, bias)
    want = scaled_linear_ref(x, w, bias)
    assert got.shape == (rows, N) and got.dtype == x.dtype
    assert _rel(got, want) <= 2e-6, _rel(got, want)


@pytest.mark.parametrize("case", ["fp8 block, group", "int8 channel, token", "int4 zero points, groups of 128"])
def test_float16_activations(case: str) -> None:
    dev = kernel_device()
    w = _weight(n=N, k=K, device=dev, **CASES[case])
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1)).to(dev, torch.float16)
    got = scaled_linear_triton(x, w)
    assert got.dtype == torch.float16
    assert _rel(got, scaled_linear_ref(x, w)) <= 2e-3


@pytest.mark.parametrize("case", ["fp8 channel, token", "fp8 block, group", "int8 channel, token",
                                  "fbgemm fp8 (amax bound)"])
def test_activation_quantization_is_the_reference(case: str) -> None:
    dev = kernel_device()
    w = _weight(n=N, k=K, device=dev, **CASES[case])
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(2)).to(dev) * 3
    x[2] = 0.0  # a zero row: the eps scale, zero quants
    q, s = quantize_activations_triton(x, w)
    rq, rs = quantize_activations(x, w)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("case", ["fp8 block, group", "int8 channel, token", "int4 zero points, groups of 128"])
def test_a_rows_result_does_not_depend_on_its_batch(case: str) -> None:
    dev = kernel_device()
    w = _weight(n=N, k=K, device=dev, **CASES[case])
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(3)).to(dev)
    whole = scaled_linear_triton(x, w)
    for rows in (1, 2, 17):
        assert torch.equal(scaled_linear_triton(x[:rows], w), whole[:rows]), rows


def test_fused_shards_are_the_shards_side_by_side() -> None:
    """A fused q/k/v (ops.scaled_linear.cat) computes each shard's columns as the shard alone."""
    from ops.scaled_linear import cat

    dev = kernel_device()
    parts = [_weight("fp8", n, K, dev, block=True, act="group", seed=i) for i, n in enumerate((256, 128, 128))]
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(4)).to(dev)
    fused = scaled_linear_triton(x, cat(parts))
    alone = torch.cat([scaled_linear_triton(x, p) for p in parts], dim=1)
    assert torch.equal(fused, alone)


@requires_cuda
@pytest.mark.parametrize("case", ["fp8 channel, token", "fp8 block, group", "int8 channel, token",
                                  "int4 zero points, groups of 128"])
@pytest.mark.parametrize("rows", [1, 16, 512])
def test_llama_3_8b_shapes_bf16_on_the_gpu(case: str, rows: int) -> None:
    """Llama-3-8B's gate/up (28672 x 4096) in bfloat16, and a CUDA graph's replay."""
    dev = torch.device("cuda")
    w = _weight(n=28672, k=4096, device=dev, **CASES[case])
    x = torch.randn(rows, 4096, device=dev, dtype=torch.bfloat16)
    got = scaled_linear_triton(x, w)
    assert _rel(got, scaled_linear_ref(x, w)) <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = scaled_linear_triton(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, got)
