"""Torch references of the ops against naive, obviously-correct loops and formulas."""

from __future__ import annotations

import pytest
import torch

from ops.activation import silu_and_mul_ref
from ops.attention import StepPlan, paged_attention_ref
from ops.linear import PackedLinear, can_pack, pack_linears
from ops.norm import rms_norm_ref
from ops.rotary import apply_rotary_ref, rope_cos_sin_cache, rotary_kv_write_ref


def _naive_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale):
    bs = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    for r in range(len(seq_lens)):
        n, lo, hi = int(seq_lens[r]), int(qsl[r]), int(qsl[r + 1])
        slots = [int(tables[r, p // bs]) * bs + p % bs for p in range(n)]
        k = k_cache.reshape(-1, *k_cache.shape[2:])[slots].repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_cache.reshape(-1, *v_cache.shape[2:])[slots].repeat_interleave(group, dim=1)
        for i, t in enumerate(range(lo, hi)):
            pos = n - (hi - lo) + i
            scores = torch.einsum("hd,nhd->hn", q[t], k[: pos + 1]) * scale
            out[t] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v[: pos + 1])
    return out


@pytest.mark.parametrize("q_lens,ctx", [([1, 1, 1], [5, 40, 17]), ([1, 7, 1, 33], [9, 7, 100, 50]),
                                        ([12], [12]), ([1, 1], [1, 300])])
def test_paged_attention_matches_naive_loop(q_lens: list[int], ctx: list[int]) -> None:
    g = torch.Generator().manual_seed(sum(ctx))
    bs, hq, hkv, d, nblocks = 16, 6, 2, 32, 64
    k_cache = torch.randn(nblocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(nblocks, bs, hkv, d, generator=g)
    perm = torch.randperm(nblocks, generator=g)  # blocks scattered, not contiguous
    need = [(n + bs - 1) // bs for n in ctx]
    tables = torch.zeros(len(ctx), max(need), dtype=torch.int32)
    used = 0
    for r, m in enumerate(need):
        tables[r, :m] = perm[used : used + m]
        used += m
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    q = torch.randn(int(qsl[-1]), hq, d, generator=g)
    seq_lens = torch.tensor(ctx)
    got = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens, qsl, max(q_lens), max(ctx), d**-0.5)
    want = _naive_attention(q, k_cache, v_cache, tables, seq_lens, qsl, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_rotary_kv_write_rotates_and_scatters_by_slot() -> None:
    g = torch.Generator().manual_seed(0)
    t, hq, hkv, d, bs = 5, 4, 2, 16, 4
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    positions = torch.tensor([0, 3, 7, 2, 9])
    cos_sin = rope_cos_sin_cache(d, 32, 10000.0)
    k_cache = torch.full((6, bs, hkv, d), float("nan"))
    v_cache = torch.full((6, bs, hkv, d), float("nan"))
    slots = torch.tensor([5, -1, 0, 22, 13])  # -1: a padded row, skipped
    q_rot, k_rot = rotary_kv_write_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    # rotation by position p is the complex multiply by e^{i p theta_j} on (x_j, x_{j+d/2})
    theta = 10000.0 ** (-torch.arange(0, d, 2).float() / d)
    z = torch.complex(q[..., : d // 2], q[..., d // 2 :]) * torch.polar(
        torch.ones(t, 1, d // 2), positions[:, None, None].float() * theta)
    torch.testing.assert_close(q_rot, torch.cat([z.real, z.imag], -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_rot, apply_rotary_ref(k, positions, cos_sin))
    flat_k, flat_v = k_cache.reshape(-1, hkv, d), v_cache.reshape(-1, hkv, d)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], k_rot[i]) and torch.equal(flat_v[s], v[i])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(flat_k.shape[0]) if s not in written]
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


def test_paged_attention_step_plan_serves_one_step() -> None:
    """Layers of one step share a StepPlan (grouping, masks), built by the first call; each
    new step brings a new one, and a plan handed another step's tensors refuses (even the
    same shapes: the reference keeps no state of its own between calls)."""
    g = torch.Generator().manual_seed(3)
    bs, hq, hkv, d = 16, 6, 2, 32
    k_cache, v_cache = torch.randn(2, 32, bs, hkv, d, generator=g)
    tables = torch.tensor([[3, 7, 1], [5, 0, 9]], dtype=torch.int32)
    q = torch.randn(2, hq, d, generator=g)
    for seq_lens, qsl in (([40, 17], [0, 1, 2]), ([41, 17], [0, 1, 2]), ([40, 18], [0, 1, 2])):
        sl, starts = torch.tensor(seq_lens), torch.tensor(qsl)
        plan = StepPlan()
        want = _naive_attention(q, k_cache, v_cache, tables, sl, starts, d**-0.5)
        for _ in range(2):  # two layers of the step
            got = paged_attention_ref(q, k_cache, v_cache, tables, sl, starts, 1, max(seq_lens), d**-0.5, plan)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        with pytest.raises(AssertionError, match="one step"):
            paged_attention_ref(q, k_cache, v_cache, tables, sl.clone(), starts, 1, 41, d**-0.5, plan)
    tables[1, 0] = 11  # the same tensor object, written in place: without a plan, no stale state
    sl, starts = torch.tensor([40, 18]), torch.tensor([0, 1, 2])
    got = paged_attention_ref(q, k_cache, v_cache, tables, sl, starts, 1, 40, d**-0.5)
    torch.testing.assert_close(got, _naive_attention(q, k_cache, v_cache, tables, sl, starts, d**-0.5),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_ref_matches_its_formula(dtype: torch.dtype) -> None:
    """x / sqrt(mean(x^2) + eps) * w in float64 (the residual sum first): float32 within
    1e-6, float16 within 2 ulps (it normalises in float32 and rounds twice)."""
    g = torch.Generator().manual_seed(9)
    x, res = (torch.randn(7, 96, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.3 * torch.randn(96, generator=g)).to(dtype)
    for residual in (None, res):
        s = x if residual is None else x + residual
        xd = s.double()
        want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
        out, res_out = rms_norm_ref(x, w, 1e-5, residual)
        assert torch.equal(res_out, s)
        tol = 1e-6 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_silu_and_mul_ref_matches_its_formula() -> None:
    """[gate | up] -> gate * sigmoid(gate) * up, in float64: within 1e-6 (float32)."""
    x = torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(2)) * 4
    gate, up = x.double().chunk(2, -1)
    torch.testing.assert_close(silu_and_mul_ref(x).double(), gate / (1 + torch.exp(-gate)) * up,
                               rtol=1e-6, atol=1e-6)


needs_onednn = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32),
    reason="torch built without oneDNN",
)


@needs_onednn
def test_packed_linear_matches_f_linear_and_ignores_the_batch() -> None:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 96, generator=g), torch.randn(300, generator=g)
    x = torch.randn(70, 96, generator=g)
    lin = PackedLinear(w, b)
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
    # A row's bits do not depend on how many rows share the call (MKL's sgemm gives no such
    # promise): what makes greedy tokens the same alone and in a batch.
    full = lin(x)
    for rows in (1, 2, 5, 17, 64):
        assert torch.equal(lin(x[:rows]), full[:rows]), rows


@needs_onednn
def test_pack_linears_replaces_every_linear_once() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.Linear(16, 4, bias=False)))
    x = torch.randn(3, 8)
    want = model(x)
    assert pack_linears(model) == 2
    assert pack_linears(model) == 0  # a model shared by two runners is packed once
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


def test_backend_table_and_refusals(monkeypatch) -> None:
    """kernel_path per backend and device, as the table in ops/__init__.py states; unknown
    names and a `c` that cannot build are refused at set_backend, naming why."""
    import ops
    from ops import cpu_attention

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    triton = ops._HAS_TRITON
    before = ops.backend()
    want = {"auto": ("c", "triton" if triton else "torch"), "torch": ("torch", "torch"),
            "c": ("c", "torch"), "triton": ("triton", "triton")}
    for name, (on_cpu, on_cuda) in want.items():
        if (name == "c" and not ops.c_kernels_available()) or (name == "triton" and not triton):
            continue
        with ops.use_backend(name):
            assert (ops.kernel_path(cpu), ops.kernel_path(cuda)) == (on_cpu, on_cuda), name
    assert ops.backend() == before
    with pytest.raises(ValueError, match="auto, torch, c, triton"):
        ops.set_backend("cpu")
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    with pytest.raises(ValueError, match="cannot be built"):
        ops.set_backend("c")
    assert ops.backend() == before
