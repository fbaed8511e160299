"""Linear layers over pre-quantized checkpoint weights: FP8, INT8 and INT4 with their scales.

Every checkpoint format the loader reads (worker/weights/quant_config.py: compressed-tensors,
native `fp8`, `fbgemm_fp8`, `awq`, `gptq`) is converted at load into one `ScaledWeight` of
three kinds, which the kernels read::

    kind  qweight                           scale                               zero
    fp8   [N, K] float8_e4m3fn              [N] per channel, or [N/bn, K/bk]     -
                                            per block (float32)
    int8  [N, K] int8                       [N] per channel (float32)            -
    int4  [N, K/8] int32, packed along K:   [N, K/G] per group of G inputs       [N, K/G] uint8
          nibble i of word j is input 8j+i, (float32: the checkpoint's fp16 or    (0..15; None:
          unsigned u in 0..15              bf16 scales exactly)                   8, symmetric)

    w[n, k] = q[n, k] * scale[n]                 (fp8, int8 per channel)
    w[n, k] = q[n, k] * scale[n // bn, k // bk]  (fp8 blocks)
    w[n, k] = (u[n, k] - zero[n, k // G]) * scale[n, k // G]   (int4)

`act` is how the activations are quantized before the product, as the checkpoint says:
None (weight-only: activations stay in the model's dtype), "token" (dynamic, one scale per
row: amax / 448 for fp8, amax / 127 for int8, as vLLM's kernels take them) or "group" (fp8,
one scale per row and group of `act_group` inputs, DeepSeek's per-token-group). For fp8 a
scale is amax / 448 (`act_scale_ub` first clamps a row's amax, fbgemm's bound), and x / scale
is rounded to float8_e4m3fn; int8 rounds x / scale to the nearest integer (ties to even).

`scaled_linear_ref` is the pure-torch reference (dequantize, quantize the activations, one
float32 product); the Triton kernels are ops/scaled_linear_triton.py, picked by
`ops.scaled_linear` on CUDA. The CPU dequantizes these weights at load (worker/weights).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
INT8_MAX = 127.0
KINDS = ("fp8", "int8", "int4")
ACTS = (None, "token", "group")
# A zero amax would divide by zero: scales are at least this (vLLM's per-token-group eps).
SCALE_EPS = 1e-10


@dataclass(frozen=True)
class ScaledWeight:
    """One linear's quantized weight in the kernels' layout (see the module docstring)."""

    kind: str
    qweight: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, int]  # (N out_features, K in_features)
    zero: torch.Tensor | None = None
    block: tuple[int, int] | None = None  # fp8 per-block scales: (rows, cols) of a block
    group_size: int = 0  # int4: inputs per scale
    act: str | None = None
    act_group: int = 128
    act_scale_ub: float | None = None

    def __post_init__(self) -> None:
        n, k = self.shape
        assert self.kind in KINDS and self.act in ACTS, (self.kind, self.act)
        if self.kind == "int4":
            assert self.qweight.dtype == torch.int32 and tuple(self.qweight.shape) == (n, k // 8), self.qweight.shape
            assert self.group_size > 0 and k % self.group_size == 0 and self.act is None
            assert tuple(self.scale.shape) == (n, k // self.group_size), self.scale.shape
            assert self.zero is None or tuple(self.zero.shape) == tuple(self.scale.shape)
        else:
            assert tuple(self.qweight.shape) == (n, k), self.qweight.shape
            if self.block is None:
                assert tuple(self.scale.shape) == (n,), self.scale.shape
            else:
                bn, bk = self.block
                assert tuple(self.scale.shape) == (-(-n // bn), -(-k // bk)), self.scale.shape
        if self.act == "group":
            assert self.kind == "fp8" and k % self.act_group == 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.qweight, self.scale, self.zero) if t is not None)

    def to(self, device: torch.device) -> ScaledWeight:
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return replace(self, qweight=move(self.qweight), scale=move(self.scale), zero=move(self.zero))

    def describe(self) -> str:
        if self.kind == "int4":
            how = f"int4 groups of {self.group_size}, {'asymmetric' if self.zero is not None else 'symmetric'}"
        elif self.block is not None:
            how = f"{self.kind} {self.block[0]}x{self.block[1]} blocks"
        else:
            how = f"{self.kind} per channel"
        act = {None: "16-bit activations", "token": f"dynamic per-token {self.kind} activations",
               "group": f"dynamic per-group ({self.act_group}) fp8 activations"}[self.act]
        return f"{how}, {act}"


def for_device(w: ScaledWeight, device: torch.device) -> ScaledWeight:
    """`w` as `device` runs it: a GPU without fp8 tensor cores (compute capability below 8.9:
    A100, A10) multiplies fp8 weights weight-only, dequantized into 16-bit tiles, its
    activations unquantized (vLLM runs them weight-only there too)."""
    if w.kind == "fp8" and w.act is not None and device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 9):
            return replace(w, act=None)
    return w


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """[N, K/8] int32 -> [N, K] uint8 nibbles (input 8j + i is nibble i of word j)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    return ((qweight[..., None] >> shifts) & 0xF).to(torch.uint8).flatten(-2)


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K/8] int32, the inverse of `unpack_int4`."""
    n, k = u.shape
    assert k % 8 == 0
    words = u.to(torch.int64).reshape(n, k // 8, 8) << torch.arange(0, 32, 4, dtype=torch.int64, device=u.device)
    packed = words.sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _expand(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    n, k = shape
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def dequantize(w: ScaledWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] in float32 by the formulas above (exact: every quant and scale is a
    float32 value and each weight one product), then rounded once to `dtype`."""
    if w.kind == "int4":
        u = unpack_int4(w.qweight).to(torch.float32)
        zero = 8.0 if w.zero is None else w.zero.to(torch.float32).repeat_interleave(w.group_size, 1)
        out = (u - zero) * w.scale.to(torch.float32).repeat_interleave(w.group_size, 1)
    elif w.block is not None:
        out = w.qweight.to(torch.float32) * _expand(w.scale.to(torch.float32), w.block, w.shape)
    else:
        out = w.qweight.to(torch.float32) * w.scale.to(torch.float32)[:, None]
    return out.to(dtype)


def quantize_activations(x: torch.Tensor, w: ScaledWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] fp8 or int8, scales [M, groups] float32) as `w.act` says."""
    x = x.to(torch.float32)
    m, k = x.shape
    groups = k // w.act_group if w.act == "group" else 1
    xg = x.reshape(m, groups, k // groups)
    amax = xg.abs().amax(-1)
    if w.act_scale_ub is not None:
        amax = amax.clamp_max(w.act_scale_ub)
    top = FP8_MAX if w.kind == "fp8" else INT8_MAX
    scale = amax.clamp_min(SCALE_EPS * top) / top
    y = xg / scale[..., None]
    if w.kind == "fp8":
        q = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        q = torch.round(y).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.reshape(m, k), scale


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    m, k = q.shape
    groups = scale.shape[1]
    return (q.to(torch.float32).reshape(m, groups, k // groups) * scale[..., None]).reshape(m, k)


def scaled_linear_ref(x: torch.Tensor, w: ScaledWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + bias for x [..., K], in float32, rounded once to x's dtype. Weight-only
    weights are rounded to x's dtype first (as the kernel dequantizes them into its tiles)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if w.act is None:
        wd = dequantize(w, x.dtype).to(torch.float32)
        xs = x2.to(torch.float32)
    else:
        wd = dequantize(w)
        xs = dequantize_activations(*quantize_activations(x2, w))
    y = xs @ wd.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*shape[:-1], w.shape[0])


def cat(weights: list[ScaledWeight]) -> ScaledWeight:
    """Weights stacked by rows (a fused q/k/v or gate/up), as one weight; they must agree in
    everything but their rows (fp8 blocks: every part a whole number of blocks)."""
    first = weights[0]
    if len(weights) == 1:
        return first
    for w in weights[1:]:
        if _scheme(w) != _scheme(first) or w.shape[1] != first.shape[1] or (w.zero is None) != (first.zero is None):
            raise ValueError("the fused shards are quantized differently: "
                             f"{first.describe()} and {w.describe()}")
    if first.block is not None:
        bad = [w.shape[0] for w in weights[:-1] if w.shape[0] % first.block[0]]
        if bad:
            raise ValueError(f"a fused shard of {bad[0]} rows is not a whole number of "
                             f"{first.block[0]}-row scale blocks")
    rows = sum(w.shape[0] for w in weights)
    zero = None if first.zero is None else torch.cat([w.zero for w in weights])
    return replace(first, qweight=torch.cat([w.qweight for w in weights]),
                   scale=torch.cat([w.scale for w in weights]), zero=zero,
                   shape=(rows, first.shape[1]))


def _scheme(w: ScaledWeight) -> tuple:
    return (w.kind, w.block, w.group_size, w.act, w.act_group, w.act_scale_ub, w.qweight.dtype, w.scale.dtype)


class ScaledLinear(nn.Module):
    """`y = x @ W.T + bias` over a `ScaledWeight` (ops.scaled_linear: Triton on CUDA, the
    reference elsewhere)."""

    def __init__(self, weight: ScaledWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import ops

        return ops.scaled_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.weight.describe()}"
