"""The CPU kernels' records for pre-quantized checkpoints' int4 and int8 weights (Q4_G128,
Q4_G32, Q8_CH: float32 scales and mins, `hf_quantized.checkpoint_records`; the layouts in
ops/cpu_kernels/quant_types.h), on the float32 and the integer kernels: each against a
float64 reference of the checkpoint's dequantized weight (s (q - z), q s), within the bound
of its activations' arithmetic (the GGUF types' bounds, tests/test_quantized_linear.py), and
against the integer kernels' own arithmetic in float64; a row's bits alone equal its bits in
any batch; quants and digits at their extremes (int8's -128 included) stay exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ops import quantized_linear as ql
from ops.quant_records import TYPES
from ops.scaled_linear import ScaledWeight, dequantize, pack_int4, unpack_int4
from worker.weights.hf_quantized import checkpoint_records, cpu_record_type, cpu_records

pytestmark = pytest.mark.skipif(not ql.available(), reason="the CPU kernels do not build here")


def int4_weight(n: int, k: int, group: int, symmetric: bool, scale_dtype: torch.dtype, seed: int) -> ScaledWeight:
    """A random int4 checkpoint weight: quants 0..15, positive scales of `scale_dtype` (as the
    checkpoint stores them), zero points 0..15 (None: symmetric, zero 8)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    s = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(scale_dtype).to(torch.float32)
    z = None if symmetric else torch.randint(0, 16, (n, k // group), dtype=torch.uint8, generator=g)
    return ScaledWeight("int4", pack_int4(u), s, (n, k), zero=z, group_size=group)


def int8_weight(n: int, k: int, seed: int) -> ScaledWeight:
    """A random int8 per-channel weight (-128..127: compressed-tensors' range) with float32 scales."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    q[0], q[1] = -128, 127  # whole rows at either extreme
    return ScaledWeight("int8", q, torch.rand(n, generator=g) * 0.01 + 1e-4, (n, k))


WEIGHTS = {
    "Q4_G128": lambda: int4_weight(64, 384, 128, False, torch.float16, 1),  # AWQ / GPTQ with zeros
    "Q4_G128-bf16": lambda: int4_weight(32, 256, 256, False, torch.bfloat16, 2),  # 2 records a group
    "Q4_G128-f32": lambda: int4_weight(32, 256, 128, False, torch.float32, 3),  # m = -s z rounded once
    "Q4_G32": lambda: int4_weight(64, 192, 32, False, torch.float16, 4),
    "Q8_CH": lambda: int8_weight(96, 256, 5),
}


def _fields(w: ScaledWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per block of 32: the quants q [n, k/32, 32] as the kernels take them (unsigned int4,
    signed int8), d [n, k/32] and m (int4) in float64, from the checkpoint, not the records."""
    n, k = w.shape
    if w.kind == "int8":
        d = w.scale.double()[:, None].expand(n, k // 32)
        return w.qweight.double().reshape(n, -1, 32), d, None
    per = w.group_size // 32
    s = w.scale.double().repeat_interleave(per, 1)
    z = 8.0 if w.zero is None else w.zero.double().repeat_interleave(per, 1)
    m = (-s * z).float().double()  # as held: float32
    return unpack_int4(w.qweight).double().reshape(n, -1, 32), s.float().double(), m


def _integer_reference(w: ScaledWeight, x: torch.Tensor, planes: int) -> torch.Tensor:
    """The integer kernels' arithmetic in float64: x per block of 32 as integers of `planes`
    bytes (round(x lim / max|x|) in float32, lim = 127 256^(planes-1)), exact dot products
    with the quants, times d dx, plus m times the block's sum of x (int4)."""
    q, d, m = _fields(w)
    xb = x.reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    lim = torch.tensor(127.0 * 256 ** (planes - 1))
    ints = torch.round(xb * torch.where(amax > 0, lim / amax, 0)).double()
    dx = (amax / lim).double()[..., 0]
    y = (torch.einsum("rbk,nbk->rnb", ints, q) * d[None] * dx[:, None, :]).sum(-1)
    if m is not None:
        y = y + (m[None] * xb.double().sum(-1)[:, None, :]).sum(-1)
    return y


@pytest.mark.parametrize("name", list(WEIGHTS))
def test_records_hold_the_checkpoint_weight(name) -> None:
    """The records' bytes are the type's (the planner's), and a row read back from them is
    the dequantized checkpoint weight: bit for bit where the scales are fp16 / bf16 (d q + m
    is then exact in float32) and int8's, within float32's rounding for float32 scales."""
    w = WEIGHTS[name]()
    qw = checkpoint_records(w)
    assert qw is not None and qw.qtype == name.split("-")[0]
    n, k = w.shape
    t = TYPES[qw.qtype]
    layer = ql.QuantLinear(qw)
    assert layer.packed.numel() == n // 32 * (k // t.k_multiple) * t.record
    assert ql.held_bytes(qw.qtype, qw.blocks.nbytes, "float32") == layer.packed.numel()
    rows = ql.QuantEmbedding(qw)(torch.arange(n))
    if name.endswith("f32"):
        exact = dequantize(w).double()
        assert ((rows.double() - exact).abs() <= 2 ** -22 * exact.abs().amax(-1, keepdim=True)).all()
    else:
        assert torch.equal(rows, dequantize(w))


@pytest.mark.parametrize("activations", list(ql.ACTIVATIONS))
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_kernels_against_the_float64_reference(name, activations) -> None:
    w = WEIGHTS[name]()
    qw = checkpoint_records(w)
    x = torch.randn(13, w.shape[1], generator=torch.Generator().manual_seed(7))
    x[:, 5] *= 50  # an outlier, as real activations have
    got = ql.QuantLinear(qw, activations=activations)(x).double()
    exact = F.linear(x.double(), dequantize(w).double())
    err = ((got - exact).abs().max() / exact.abs().max()).item()
    assert err < {"float32": 2e-6, "int8": 5e-2, "int16": 2e-4, "int24": 2e-6}[activations], err
    if activations != "float32":
        ref = _integer_reference(w, x, ql.ACTIVATIONS[activations])
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-6


@pytest.mark.parametrize("activations", list(ql.ACTIVATIONS))
@pytest.mark.parametrize("name", ["Q4_G128", "Q8_CH"])
def test_a_rows_bits_do_not_depend_on_its_batch(name, activations) -> None:
    """Rows alone and in batches of every register blocking (and their remainders) of every
    kernel give identical bits."""
    w = WEIGHTS[name]()
    layer = ql.QuantLinear(checkpoint_records(w), activations=activations)
    x = torch.randn(24, w.shape[1], generator=torch.Generator().manual_seed(8))
    alone = torch.cat([layer(x[i : i + 1]) for i in range(24)])
    # few rows (2..4, AVX-512 VNNI's up to 16), groups of 2, 3, 4 or 6 and their remainders
    for m in (2, 3, 4, 5, 7, 9, 11, 16, 17, 24):
        rows = [(3 * m + i) % 24 for i in range(m)]
        assert torch.equal(layer(x[rows]), alone[rows]), f"{m} rows differ from the rows alone"


@pytest.mark.parametrize("activations", ["int8", "int16", "int24"])
def test_int8_extremes_stay_exact(activations) -> None:
    """Quants of -128 and 127 against digits at their largest of either sign, where an int16
    pair sum (AVX2's vpmaddubsw) would overflow first: the integer reference on every row."""
    n, k = 64, 256
    q = torch.full((n, k), 127, dtype=torch.int8)
    q[n // 2 :] = -128
    q[::3, ::2] = -q[::3, ::2] - 1  # 127 <-> -128 in every third row's even columns
    w = ScaledWeight("int8", q, torch.rand(n) + 0.5, (n, k))
    x = torch.full((4, k), 3.0)
    x[1] = -3.0
    x[2, ::2] = -3.0
    x[3] = torch.randn(k) * 1e-30
    got = ql.QuantLinear(checkpoint_records(w), activations=activations)(x).double()
    ref = _integer_reference(w, x, ql.ACTIVATIONS[activations])
    assert ((got - ref).abs() <= 1e-6 * ref.abs().amax(-1, keepdim=True)).all()


def test_which_weights_take_which_records() -> None:
    """Symmetric int4 with fp16-exact scales (fp16, bf16 ones) stays Q4_0 (no m term), with
    float32 ones Q4_G128; int8 needs in_features a multiple of 128, int4 groups of a multiple
    of 32; fp8 is dequantized (None). The planner's choice from the format alone is the
    loader's."""
    cases = [(int4_weight(32, 256, 128, True, torch.float16, 9), "Q4_0", True),
             (int4_weight(32, 256, 128, True, torch.bfloat16, 9), "Q4_0", True),
             (int4_weight(32, 256, 128, True, torch.float32, 9), "Q4_G128", False),
             (WEIGHTS["Q4_G128"](), "Q4_G128", True), (WEIGHTS["Q4_G128-bf16"](), "Q4_G128", True),
             (WEIGHTS["Q4_G32"](), "Q4_G32", True), (WEIGHTS["Q8_CH"](), "Q8_CH", False)]
    for w, qtype, fp16 in cases:
        assert cpu_records(w).qtype == qtype
        assert cpu_record_type(w.kind, w.zero is None, w.group_size, w.shape[1], fp16) == qtype
    assert checkpoint_records(int8_weight(32, 192, 1)) is None
    assert cpu_record_type("int8", True, 0, 192, False) is None
    assert checkpoint_records(int4_weight(32, 256, 16, False, torch.float16, 1)) is None
    fp8 = ScaledWeight("fp8", torch.zeros(32, 128, dtype=torch.float8_e4m3fn), torch.ones(32), (32, 128))
    assert cpu_records(fp8) is None and cpu_record_type("fp8", True, 0, 128, False) is None
