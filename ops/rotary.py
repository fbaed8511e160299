"""Rotary position embeddings (rotate-half layout, as Hugging Face Llama) and the
paged KV write they are fused with on the GPU."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def rope_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None,
                  freq_factors: Sequence[float] | None = None) -> torch.Tensor:
    """Each pair of rotary dimensions' frequency. `freq_factors` (a GGUF's rope_freqs tensor,
    llama.cpp's freq_factors): a divisor per pair, as llama.cpp applies it (theta_i / factor_i),
    in place of `scaling`."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:
        assert scaling is None and len(freq_factors) == head_dim // 2, (scaling, len(freq_factors))
        return inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the
    # band between is interpolated smoothly.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin_cache(
    head_dim: int, max_positions: int, base: float, scaling: RopeScaling | None = None,
    freq_factors: Sequence[float] | None = None,
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second."""
    inv_freq = rope_inv_freq(head_dim, base, scaling, freq_factors)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _cos_sin_rows(cos_sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ([cos | cos], [-sin | sin]) as [T, 1, head_dim], for `_rotate`."""
    half = cos_sin.shape[-1] // 2
    cs = cos_sin.index_select(0, positions).to(dtype)
    cos, sin = cs[:, :half], cs[:, half:]
    return torch.cat([cos, cos], -1)[:, None], torch.cat([-sin, sin], -1)[:, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half: [x1 cos - x2 sin | x2 cos + x1 sin], computed as x * [cos | cos] +
    [x2 | x1] * [-sin | sin] (the same bits: negation is exact), in four ops instead of ten."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin


def apply_rotary_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotate each token by its position."""
    return _rotate(x, *_cos_sin_rows(cos_sin, positions, x.dtype))


def rotary_kv_write_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k, scatter k and v into the paged cache; return (q, k) rotated.

    q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D];
    slot_mapping: [T] int64, slot = block * block_size + offset; a slot < 0 is
    skipped (padding in a captured graph batch). An fp8 cache stores k / k_scale and
    v / v_scale (`to_cache`).
    """
    # q and k rotate together: one set of ops over Hq + Hkv heads.
    qk = _rotate(torch.cat([q, k], 1), *_cos_sin_rows(cos_sin, positions, q.dtype))
    q, k = qk.split([q.shape[1], k.shape[1]], 1)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q, k


FP8_MAX = 448.0


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as a cache of `dtype` holds it: for fp8 (--kv-cache-dtype fp8, vLLM's per-tensor
    scale) x / scale in float32, clamped to +-448 (saturating, as vLLM's cache write) and
    rounded to float8_e4m3fn; else x in `dtype`."""
    if dtype == torch.float8_e4m3fn:
        return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    for x, cache, s in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x = to_cache(x, cache.dtype, s)
        if cache.dtype == torch.float8_e4m3fn:  # (index_copy_ has no fp8 kernel everywhere)
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x)
