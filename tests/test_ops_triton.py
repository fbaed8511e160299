"""Triton kernels against their torch references.

Without a GPU the kernels run in Triton's interpreter (conftest sets
TRITON_INTERPRET=1), on small float32 shapes and one float16 case each; the
`requires_cuda` tests use bf16 and Llama-3-8B production shapes.

Tolerances, everywhere below:
- copies (KV-cache writes of v, block copies, swaps, the residual sum): exact;
- float32 elementwise: rtol = atol = 1e-6 (a few ulps: only the order of float32
  operations differs);
- float16 / bf16: the kernels compute in float32 and round once, the references
  partly in the low dtype, so the expected values are the reference run in float32
  and rounded to the dtype (RMSNorm excepted: its reference already normalises in
  float32 and its double rounding is part of the contract, so it is compared
  directly). Elementwise: 1 ulp (fp16 rtol 1e-3, bf16 rtol 2**-7 = 7.8e-3), a
  small atol for values near zero; aggregate ||got - want|| / ||want|| <= 1e-3.
"""

from __future__ import annotations

import pytest
import torch

import ops
from ops.activation import silu_and_mul_ref
from ops.norm import rms_norm_ref
from ops.rotary import RopeScaling, rope_cos_sin_cache, rotary_kv_write_ref
from tests.helpers import kernel_device, requires_cuda, requires_triton

pytestmark = requires_triton
# A missing triton skips the module (it is a test dependency, so normally it is there).
triton = pytest.importorskip("triton")

from ops.activation_triton import silu_and_mul_triton  # noqa: E402
from ops.block_copy import copy_blocks_ref, swap_blocks, swap_blocks_ref  # noqa: E402
from ops.block_copy_triton import copy_blocks_triton  # noqa: E402
from ops.norm_triton import rms_norm_triton  # noqa: E402
from ops.rotary_triton import rotary_kv_write_triton  # noqa: E402

LLAMA3_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
ULP_RTOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 2**-7}
ATOL = {torch.float32: 1e-6, torch.float16: 1e-5, torch.bfloat16: 1e-5}


def _close(got: torch.Tensor, want: torch.Tensor, *, equal_nan: bool = False) -> None:
    """Elementwise within ~1 ulp of the dtype, and aggregate relative error <= 1e-3."""
    dt = got.dtype
    torch.testing.assert_close(got, want, rtol=ULP_RTOL[dt], atol=ATOL[dt], equal_nan=equal_nan)
    g, w = got.double(), want.double()
    keep = ~torch.isnan(w)
    err = (g[keep] - w[keep]).norm() / w[keep].norm().clamp_min(1e-30)
    assert err <= 1e-3, f"aggregate relative error {err:.2e}"


def _gen(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


# ----- rotary + KV write -----


def _rotary_case(
    dev: torch.device, dtype: torch.dtype, t: int, hq: int, hkv: int, d: int, fused: bool, seed: int
) -> tuple[torch.Tensor, ...]:
    g = _gen(seed, dev)
    if fused:
        # As in Attention.forward: q, k, v are strided views of one qkv output.
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g, device=dev, dtype=dtype)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
        assert q.data_ptr() == qkv.data_ptr() and (t == 1 or not q.is_contiguous())
    else:
        qkv = torch.empty(0, device=dev)
        q, k, v = (
            torch.randn(t, h, d, generator=g, device=dev, dtype=dtype) for h in (hq, hkv, hkv)
        )
    return qkv, q, k, v


def _slots(dev: torch.device, t: int, num_slots: int, seed: int, pad_every: int) -> torch.Tensor:
    g = _gen(seed, torch.device("cpu"))
    slots = torch.randperm(num_slots, generator=g)[:t]
    slots[::pad_every] = -1  # padded rows of a captured batch
    return slots.to(dev)


def _check_rotary(
    dtype: torch.dtype,
    t: int,
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    num_blocks: int,
    max_pos: int,
    base: float,
    scaling: RopeScaling | None,
    fused: bool,
    pad_every: int,
) -> None:
    dev = kernel_device()
    qkv, q, k, v = _rotary_case(dev, dtype, t, hq, hkv, d, fused, seed=t + hq + d)
    positions = torch.randint(0, max_pos, (t,), generator=_gen(1, torch.device("cpu"))).to(dev)
    cos_sin = rope_cos_sin_cache(d, max_pos, base, scaling).to(dev)
    slots = _slots(dev, t, num_blocks * bs, seed=2, pad_every=pad_every)
    k_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=dtype, device=dev)
    v_cache = torch.full_like(k_cache, float("nan"))

    # Expected: the reference run in float32, rounded to the dtype.
    kc_want = torch.full(k_cache.shape, float("nan"), device=dev)
    vc_want = torch.full_like(kc_want, float("nan"))
    q_want, k_want = rotary_kv_write_ref(
        q.float(), k.float(), v.float(), positions, cos_sin, kc_want, vc_want, slots
    )
    v_before = v.clone()

    q_got, k_got = rotary_kv_write_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slots)

    assert q_got is q and k_got is k  # rotated in place
    if fused:
        assert torch.equal(qkv[:, (hq + hkv) * d :], v_before.reshape(t, -1))
    _close(q_got, q_want.to(dtype))
    _close(k_got, k_want.to(dtype))
    assert torch.equal(v, v_before)
    _close(k_cache, kc_want.to(dtype), equal_nan=True)
    # v reaches the cache bit-exactly; NaN where nothing was written (slot -1 rows too).
    assert torch.equal(v_cache.isnan(), vc_want.isnan())
    written = ~vc_want.isnan()
    assert torch.equal(v_cache[written], vc_want.to(dtype)[written])
    flat = k_cache.reshape(-1, hkv, d)
    valid = slots[slots >= 0]
    assert not flat[valid].isnan().any()
    assert int((~flat.isnan()).all(-1).all(-1).sum()) == valid.numel()


@pytest.mark.parametrize(
    "dtype,t,hq,hkv,d,fused,scaled",
    [
        (torch.float32, 7, 4, 2, 16, False, False),
        (torch.float32, 9, 6, 2, 48, True, True),  # GQA 3:1, half head_dim not a power of 2
        (torch.float32, 5, 3, 3, 32, True, False),  # MHA, odd head count
        (torch.float16, 6, 6, 2, 32, True, True),
    ],
)
def test_rotary_kv_write_matches_reference(
    dtype: torch.dtype, t: int, hq: int, hkv: int, d: int, fused: bool, scaled: bool
) -> None:
    """Rotated q/k and both caches vs the reference (float32 1e-6; fp16 1 ulp ~1e-3);
    v and every untouched cache row exact (still NaN), slot -1 rows skipped."""
    _check_rotary(
        dtype,
        t,
        hq,
        hkv,
        d,
        bs=4,
        num_blocks=6,
        max_pos=16384 if scaled else 64,
        base=500000.0 if scaled else 10000.0,
        scaling=LLAMA3_SCALING if scaled else None,
        fused=fused,
        pad_every=3,
    )


def test_rotary_kv_write_handles_empty_batch() -> None:
    """T = 0 launches nothing and returns the inputs."""
    dev = kernel_device()
    q, k, v = (
        torch.empty(0, 4, 16, device=dev),
        torch.empty(0, 2, 16, device=dev),
        torch.empty(0, 2, 16, device=dev),
    )
    cache = torch.zeros(2, 4, 2, 16, device=dev)
    cos_sin = rope_cos_sin_cache(16, 8, 10000.0).to(dev)
    idx = torch.empty(0, dtype=torch.int64, device=dev)
    assert rotary_kv_write_triton(q, k, v, idx, cos_sin, cache, cache.clone(), idx) == (q, k)


# ----- RMSNorm -----


def _check_rms_norm(
    dtype: torch.dtype, rows: int, hidden: int, with_residual: bool, poison: bool, seed: int
) -> None:
    dev = kernel_device()
    g = _gen(seed, dev)
    # A row stride larger than the hidden size: the kernel must honour it.
    x = torch.randn(rows, hidden + 8, generator=g, device=dev, dtype=dtype)[:, :hidden]
    residual = (
        torch.randn(rows, hidden, generator=g, device=dev, dtype=dtype) if with_residual else None
    )
    weight = (1 + 0.5 * torch.randn(hidden, generator=g, device=dev)).to(dtype)
    eps = 1e-5
    out_want, res_want = rms_norm_ref(x, weight, eps, residual)
    kwargs = {}
    if poison:
        kwargs["out"] = torch.full((rows, hidden), float("nan"), dtype=dtype, device=dev)
        if with_residual:
            kwargs["residual_out"] = torch.full_like(kwargs["out"], float("nan"))
    out, res = rms_norm_triton(x, weight, eps, residual, **kwargs)
    if poison:
        assert out is kwargs["out"]
        assert not out.isnan().any() and not res.isnan().any()
    if with_residual:
        assert torch.equal(res, res_want)  # the sum is rounded exactly as torch rounds it
        if poison:
            assert res is kwargs["residual_out"]
    else:
        assert res is x
    assert out.dtype == out_want.dtype and out.shape == out_want.shape
    if dtype == torch.float32:
        _close(out, out_want)
    else:
        # Same double rounding as the reference; a 1-ulp flip of the normalised value
        # can become 2 ulps after the weight multiply.
        torch.testing.assert_close(out, out_want, rtol=2 * ULP_RTOL[dtype], atol=ATOL[dtype])
        err = (out.double() - out_want.double()).norm() / out_want.double().norm()
        assert err <= 1e-3


@pytest.mark.parametrize("hidden", [576, 1024])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(hidden: int, with_residual: bool) -> None:
    """float32, rtol = atol = 1e-6; outputs poisoned with NaN before the call."""
    _check_rms_norm(torch.float32, 5, hidden, with_residual, poison=True, seed=hidden)


def test_rms_norm_float16_and_default_outputs() -> None:
    """float16 hidden 576 with a residual, outputs allocated by the op: 2 fp16 ulps
    elementwise vs the reference (same double rounding), aggregate <= 1e-3."""
    _check_rms_norm(torch.float16, 4, 576, True, poison=False, seed=3)


def test_rms_norm_float32_weight_promotes_like_the_reference() -> None:
    """A float32 weight on float16 activations gives a float32 output, as `weight * x` does."""
    dev = kernel_device()
    g = _gen(4, dev)
    x = torch.randn(3, 576, generator=g, device=dev).half()
    w = torch.randn(576, generator=g, device=dev)
    out, _ = rms_norm_triton(x, w, 1e-6)
    want, _ = rms_norm_ref(x, w, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


# ----- SiLU and mul -----


@pytest.mark.parametrize(
    "dtype,shape",
    [
        (torch.float32, (5, 2 * 1500)),  # d > one 1024 tile, not a multiple of it
        (torch.float32, (2, 3, 2 * 96)),  # leading dims are kept
        (torch.float16, (4, 2 * 700)),
    ],
)
def test_silu_and_mul_matches_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """vs the reference in float32 rounded to the dtype (float32 1e-6; fp16 1 ulp ~1e-3);
    the output is poisoned with NaN first and must be fully written."""
    dev = kernel_device()
    g = _gen(sum(shape), dev)
    # Padded rows: a row stride larger than 2d.
    x = torch.randn(*shape[:-1], shape[-1] + 16, generator=g, device=dev, dtype=dtype)[
        ..., : shape[-1]
    ]
    x = x * 4  # reach deep into silu's tails
    want = silu_and_mul_ref(x.float()).to(dtype)
    out = torch.full(want.shape, float("nan"), dtype=dtype, device=dev)
    got = silu_and_mul_triton(x, out=out)
    assert got is out and not got.isnan().any()
    _close(got, want)
    _close(silu_and_mul_triton(x), want)


# ----- block copies -----


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_copy_blocks_triton_matches_reference(dtype: torch.dtype, as_tensor: bool) -> None:
    """Bit-exact; destination blocks poisoned with NaN first, other blocks untouched."""
    dev = kernel_device()
    cache = torch.randn(10, 4, 2, 8, generator=_gen(5, dev), device=dev).to(dtype)
    src, dst = [1, 7, 3, 4], [0, 5, 9, 2]
    cache[dst] = float("nan")
    want = cache.clone()
    copy_blocks_ref(want, src, dst)
    ids = (
        (torch.tensor(src, device=dev), torch.tensor(dst, device=dev)) if as_tensor else (src, dst)
    )
    with ops.use_backend("triton"):
        ops.copy_blocks(cache, *ids)
    assert torch.equal(_bits(cache), _bits(want))
    assert not cache.isnan().any()


def test_copy_blocks_dispatch_and_empty(monkeypatch) -> None:
    """torch (and auto on the CPU) take the reference (the kernel is not called), triton
    the kernel; no pairs is a no-op; mismatched pairs raise. On the GPU when there is one
    (Triton runs CPU tensors only in its interpreter, which is off there)."""
    import ops.block_copy_triton as bct

    calls = []
    monkeypatch.setattr(bct, "copy_blocks_triton", lambda *a: calls.append(a) or copy_blocks_triton(*a))
    ops._load.cache_clear()  # the dispatch looks the kernel up again, finding the spy
    dev = kernel_device()
    try:
        cache = torch.randn(4, 2, 1, 4, device=dev)
        want = cache.clone()
        want[3] = want[0]
        for name in ("auto", "torch") if dev.type == "cpu" else ("torch",):
            with ops.use_backend(name):
                ops.copy_blocks(cache, [0], [3])
        assert calls == [] and torch.equal(cache, want)
        want[2] = want[1]
        with ops.use_backend("triton"):
            ops.copy_blocks(cache, [1], [2])
        assert len(calls) == 1 and torch.equal(cache, want)
        copy_blocks_triton(cache, [], [])
        assert torch.equal(cache, want)
        with pytest.raises(ValueError):
            ops.copy_blocks(cache, [0, 1], [2])
    finally:
        ops._load.cache_clear()


@pytest.mark.parametrize("as_tensor", [False, True])
def test_swap_blocks_on_one_device_matches_reference(as_tensor: bool) -> None:
    """Bit-exact, one gather and one scatter; other destination blocks untouched."""
    g = _gen(6, torch.device("cpu"))
    src_cache = torch.randn(8, 4, 2, 8, generator=g)
    dst_cache = torch.full((6, 4, 2, 8), float("nan"))
    src, dst = [7, 0, 3], [2, 5, 0]
    want = dst_cache.clone()
    swap_blocks_ref(src_cache, want, src, dst)
    ids = (torch.tensor(src), torch.tensor(dst)) if as_tensor else (src, dst)
    swap_blocks(src_cache, dst_cache, *ids)
    assert torch.equal(dst_cache.isnan(), want.isnan())
    assert torch.equal(dst_cache[[2, 5, 0]], src_cache[[7, 0, 3]])
    with pytest.raises(ValueError):
        swap_blocks(src_cache, dst_cache.half(), src, dst)


# ----- the dispatch point -----


def test_each_op_dispatches_to_its_backend(monkeypatch) -> None:
    """ops.<op> under `triton` loads and runs the op's own Triton kernel (same result as
    calling it directly), under `torch` and `c` (CPU tensors) the reference (or the C op
    for attention). On the GPU when there is one."""
    loaded: list[tuple[str, str]] = []
    real_load = ops._load.__wrapped__
    monkeypatch.setattr(ops, "_load", lambda m, n: loaded.append((m, n)) or real_load(m, n))
    dev = kernel_device()
    g = _gen(0, dev)
    x = torch.randn(3, 64, generator=g, device=dev)
    w = torch.randn(64, generator=g, device=dev)
    want_norm, _ = rms_norm_ref(x, w, 1e-6)
    want_act = silu_and_mul_ref(x)
    with ops.use_backend("triton"):
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6)[0], want_norm, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ops.silu_and_mul(x), want_act, rtol=1e-6, atol=1e-6)
    assert loaded == [("ops.norm_triton", "rms_norm_triton"),
                      ("ops.activation_triton", "silu_and_mul_triton")]
    loaded.clear()
    for name in ("torch", "c") if ops.c_kernels_available() and dev.type == "cpu" else ("torch",):
        with ops.use_backend(name):
            assert torch.equal(ops.rms_norm(x, w, 1e-6)[0], want_norm)
            assert torch.equal(ops.silu_and_mul(x), want_act)
    assert loaded == []


# ----- GPU: bf16, Llama-3-8B shapes -----


@requires_cuda
@pytest.mark.parametrize("t", [1, 37, 8192])
def test_rotary_kv_write_cuda_llama3_8b(t: int) -> None:
    """bf16, Hq 32 / Hkv 8 / D 128, fused qkv views, Llama-3.1 scaled rope to 131072:
    1 bf16 ulp elementwise vs float32 reference, aggregate <= 1e-3; v exact."""
    _check_rotary(
        torch.bfloat16,
        t,
        32,
        8,
        128,
        bs=16,
        num_blocks=t // 16 + 64,
        max_pos=131072,
        base=500000.0,
        scaling=LLAMA3_SCALING,
        fused=True,
        pad_every=97,
    )


@requires_cuda
@pytest.mark.parametrize("t,hidden", [(8192, 4096), (1, 4096), (300, 576), (64, 8192)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_cuda_bf16(t: int, hidden: int, with_residual: bool) -> None:
    """bf16: 2 ulps elementwise vs the reference (same double rounding), aggregate
    <= 1e-3; the residual sum exact; outputs poisoned."""
    _check_rms_norm(torch.bfloat16, t, hidden, with_residual, poison=True, seed=t)


@requires_cuda
@pytest.mark.parametrize("t", [1, 8192])
def test_silu_and_mul_cuda_llama3_8b(t: int) -> None:
    """bf16, intermediate 14336: 1 ulp vs float32 reference, aggregate <= 1e-3."""
    g = _gen(t, torch.device("cuda"))
    x = torch.randn(t, 2 * 14336, generator=g, device="cuda", dtype=torch.bfloat16) * 3
    want = silu_and_mul_ref(x.float()).bfloat16()
    out = torch.full_like(want, float("nan"))
    assert silu_and_mul_triton(x, out=out) is out
    _close(out, want)


@requires_cuda
def test_copy_blocks_cuda_bf16_exact() -> None:
    """bf16 cache [2048, 16, 8, 128], 300 pairs, auto backend (Triton on CUDA): bit-exact."""
    cache = torch.randn(2048, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(2048, device="cuda")
    src, dst = perm[:300], perm[300:600]
    cache[dst] = float("nan")
    want = cache.clone()
    want[dst] = want[src]
    ops.copy_blocks(cache, src, dst)
    assert torch.equal(_bits(cache), _bits(want))


@requires_cuda
@pytest.mark.parametrize("pinned", [True, False])
def test_swap_blocks_cuda_host_roundtrip(pinned: bool) -> None:
    """bf16 blocks GPU -> host (pinned or pageable) -> GPU, bit-exact, the host read
    right after the call returns (the swap out is synchronised) and the swap in read
    on the same stream; equal to the per-block reference."""
    shape = (1024, 16, 8, 128)
    gpu = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    host = torch.full((512, *shape[1:]), float("nan"), dtype=torch.bfloat16, pin_memory=pinned)
    g = torch.Generator().manual_seed(7)
    src = torch.randperm(1024, generator=g)[:200].tolist()
    dst = torch.randperm(512, generator=g)[:200].tolist()
    host_want = host.clone()
    swap_blocks_ref(gpu, host_want, src, dst)
    torch.cuda.synchronize()
    swap_blocks(gpu, host, src, dst)
    assert torch.equal(_bits(host), _bits(host_want))  # no sync by the test
    back = torch.full_like(gpu, float("nan"))
    targets = torch.randperm(1024, generator=g)[:200]
    swap_blocks(host, back, torch.tensor(dst), targets)
    host[dst] = float("nan")  # the host blocks may be reused once the call returns
    assert torch.equal(_bits(back[targets.cuda()]), _bits(gpu[src]))
    assert back.isnan().sum() == (1024 - 200) * 16 * 8 * 128
