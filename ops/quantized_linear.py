"""Linear layers on the CPU over GGUF-quantized weights (Q4_1, Q8_0), computed in float32.

A decode step reads every weight once, so on the CPU its floor is the weights' bytes over
memory bandwidth: 538 MB in float32 for the default model, 96 MB as the GGUF stores it.
`QuantLinear` keeps the file's blocks (repacked into tiles, `cpu_kernels/quant_matmul.c`)
and dequantizes them on the fly exactly as gguf-py does (the same float32 weights the
model would otherwise hold), then multiplies in float32 with one accumulator per output
taken over K in order: a row's result does not depend on its batch.

The kernel is C (AVX2, FMA, F16C; built on first use, `ops/cpu_kernels`); `available()`
is False where there is no compiler or no AVX2, and the runner then falls back to float32
weights.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ops import cpu_kernels

TILE = 32  # output rows per tile
QBLOCK = 32  # weights per quantization block (both types)
# Bytes of one GGUF block, and of one repacked (tile, block) record.
_GGUF_BLOCK = {"Q4_1": 20, "Q8_0": 34}
_RECORD = {"Q4_1": 640, "Q8_0": 1088}



@dataclass(frozen=True)
class QuantizedWeight:
    """A GGUF weight as the file stores it: `blocks` is [out_features, bytes per row]."""

    qtype: str  # "Q4_1" | "Q8_0"
    blocks: np.ndarray  # uint8
    shape: tuple[int, int]  # (out_features, in_features)


def supports(qtype: str, shape: tuple[int, ...]) -> bool:
    return qtype in _RECORD and len(shape) == 2 and shape[0] % TILE == 0 and shape[1] % QBLOCK == 0


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_kernels.load("quant_matmul")
    if lib is not None:
        p, i32 = ctypes.c_void_p, ctypes.c_int  # pointers as the tensors' data_ptr()
        for name in ("q4_1_matmul", "q8_0_matmul"):
            fn = getattr(lib, name)
            fn.argtypes = [p, i32, i32, p, i32, p, i32]
            fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _library() is not None


def repack(w: QuantizedWeight) -> torch.Tensor:
    """GGUF blocks [N, K/32 blocks] -> tile records (layout in quant_matmul.c), as uint8."""
    n, k = w.shape
    if not supports(w.qtype, w.shape):
        raise ValueError(f"cannot repack a {w.qtype} weight of shape {w.shape}")
    nb, size = k // QBLOCK, _GGUF_BLOCK[w.qtype]
    blocks = np.ascontiguousarray(w.blocks).reshape(n // TILE, TILE, nb, size)

    def halves(lo: int) -> np.ndarray:  # the fp16 scale at bytes lo:lo+2 -> [T, nb, 32 n] bytes
        h = blocks[..., lo : lo + 2].copy().view(np.uint16)[..., 0].transpose(0, 2, 1)
        return np.ascontiguousarray(h).view(np.uint8)

    d = halves(0)
    if w.qtype == "Q4_1":
        m = halves(2)
        qs = blocks[..., 4:20]  # [T, n, nb, 16]: byte j holds k = j (low) and k = j + 16 (high)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [T, n, nb, 32 k]
        q = q.transpose(0, 2, 3, 1)  # [T, nb, k, n]
        packed = q[..., :16] | (q[..., 16:] << 4)  # [T, nb, k, 16]
        parts = [d, m, packed.reshape(*packed.shape[:2], -1)]
    else:
        q = blocks[..., 2:34].transpose(0, 2, 3, 1)  # [T, nb, k, n] int8 as uint8
        parts = [d, np.ascontiguousarray(q).reshape(*q.shape[:2], -1)]
    parts = [np.ascontiguousarray(p).reshape(n // TILE, nb, -1) for p in parts]
    out = np.concatenate(parts, axis=-1)
    assert out.shape[-1] == _RECORD[w.qtype], out.shape
    return torch.from_numpy(np.ascontiguousarray(out).reshape(-1))


class QuantLinear(nn.Module):
    """`y = x @ W.T + bias` for x: [rows, in_features] float32, W kept quantized."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        lib = _library()
        assert lib is not None, "QuantLinear needs the compiled kernel (see available())"
        self.out_features, self.in_features = weight.shape
        self.qtype = weight.qtype
        self.packed = repack(weight)
        self.bias = None if bias is None else bias.detach().to(torch.float32).clone()
        self._fn = lib.q4_1_matmul if weight.qtype == "Q4_1" else lib.q8_0_matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == torch.float32 and x.device.type == "cpu", (x.dtype, x.device)
        shape = x.shape
        x = x.reshape(-1, self.in_features).contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        if x.shape[0]:
            rc = self._fn(x.data_ptr(), x.shape[0], self.in_features, self.packed.data_ptr(),
                          self.out_features, y.data_ptr(), torch.get_num_threads())
            if rc:
                raise RuntimeError(f"quantized matmul failed ({rc})")
        if self.bias is not None:
            y += self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype}"


class QuantEmbedding(nn.Module):
    """`nn.Embedding` over a Q8_0 weight's tile records (`repack`), the same records a tied
    head's `QuantLinear` multiplies with, so a tied model holds its table once. A looked-up
    row is dequantized as gguf-py does (`d*q`, exact in float32): the float32 table's row bit
    for bit. Row r lives in tile r // 32, lane r % 32 of every block's record::

        record (tile t, block b): d[32 lanes] fp16 | q[32 k][32 lanes] int8
        row r, block b:           d[t, b, r % 32] * q[t, b, :, r % 32]
    """

    def __init__(self, weight: QuantizedWeight, packed: torch.Tensor | None = None) -> None:
        super().__init__()
        assert weight.qtype == "Q8_0", weight.qtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.packed = repack(weight) if packed is None else packed
        records = self.packed.view(self.num_embeddings // TILE, self.embedding_dim // QBLOCK, -1)
        self._d = records[:, :, : 2 * TILE].view(torch.float16)  # [T, nb, 32 lanes]
        self._q = records[:, :, 2 * TILE :].view(torch.int8).unflatten(-1, (QBLOCK, TILE))

    @classmethod
    def of_head(cls, head: QuantLinear, weight: QuantizedWeight) -> QuantEmbedding:
        """The lookup sharing a tied head's records."""
        assert head.qtype == weight.qtype and (head.out_features, head.in_features) == weight.shape
        return cls(weight, head.packed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        tile, lane = flat // TILE, flat % TILE
        rows = self._d[tile, :, lane].float().unsqueeze(-1) * self._q[tile, :, :, lane].float()
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, Q8_0"


def quantize_linears(model: nn.Module, quantized: Mapping[str, QuantizedWeight]) -> int:
    """Replace every `nn.Linear` of `model` whose name has a weight in `quantized` by a
    `QuantLinear` of it; returns how many were replaced (0 when already done)."""
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name in quantized:
            qw = quantized[name]
            assert qw.shape == tuple(module.weight.shape), (name, qw.shape, module.weight.shape)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, QuantLinear(qw, module.bias))
            count += 1
    return count


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight, as gguf-py computes it (the reference for tests)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    w = gguf_dequantize(weight.blocks, GGMLQuantizationType[weight.qtype])
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(weight.shape))
