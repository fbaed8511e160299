"""Rotary position embeddings (rotate-half layout, as Hugging Face Llama) and the
paged KV write they are fused with on the GPU.

Every RoPE variant is a table of cos and sin per position (`rope_cos_sin_cache`),
computed once at load as transformers computes its frequencies: the kernels only
read the table, so a variant costs nothing per step. A table narrower than the head
(`partial_rotary_factor`, Phi-4-mini's 0.75) rotates the head's first dimensions and
passes the rest through. YaRN's and LongRoPE's attention factor is folded into the
table (cos and sin times the factor, as transformers scales them), so q.k grows by
its square with no kernel knowing."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# rope_type values we compute (transformers' names); any other is refused at load.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Types whose frequencies depend on the longest context served (see `rope_inv_freq`).
CONTEXT_DEPENDENT = ("dynamic", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """One rope_scaling / rope_parameters entry, by transformers' field names. The first four
    fields are Llama 3's ("rope_type": "llama3", the default for positional use); `factor`
    is every scaled type's, and original_max_position_embeddings the pretrained context
    (dynamic NTK: the config's max_position_embeddings, as transformers takes it)."""

    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    rope_type: str = "llama3"
    # yarn and longrope: cos and sin times this (None: derived as transformers derives it)
    attention_factor: float | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # longrope: a divisor per rotary pair, below and beyond original_max_position_embeddings
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES or self.rope_type == "default":
            raise ValueError(f"unsupported rope_scaling type {str(self.rope_type)[:40]!r}; "
                             f"supported: {', '.join(ROPE_TYPES)}")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"rope_scaling factor must be a positive number, not {self.factor!r}")
        if self.rope_type in ("yarn", "longrope", "llama3") and self.original_max_position_embeddings < 1:
            raise ValueError(f"rope_scaling type {self.rope_type!r} needs original_max_position_embeddings")
        if self.rope_type == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise ValueError("rope_scaling type 'longrope' needs short_factor and long_factor")

    @classmethod
    def from_hf(cls, rs: Mapping[str, Any], max_position_embeddings: int,
                original_max_position_embeddings: int | None = None,
                legacy: Mapping[str, str] | None = None) -> RopeScaling | None:
        """From a config's rope_scaling (or transformers 5's rope_parameters) dict; None for
        the default type. `original_max_position_embeddings`: a config-level value that wins
        over the dict's (Phi-3 keeps it beside, as transformers reads it); `legacy`: type
        names an architecture reads as others (Phi-3's "su" and "yarn" are LongRoPE)."""
        kind = rs.get("rope_type", rs.get("type")) or "default"
        kind = (legacy or {}).get(kind, kind)
        if kind == "default":
            return None
        if kind not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {str(kind)[:40]!r}; supported: {', '.join(ROPE_TYPES)}")
        orig = original_max_position_embeddings or rs.get("original_max_position_embeddings")
        if orig is not None and (isinstance(orig, bool) or not isinstance(orig, int) or orig < 1):
            raise ValueError(f"rope_scaling original_max_position_embeddings must be a positive integer, "
                             f"not {str(orig)[:40]!r}")
        if kind == "dynamic":  # transformers scales from the config's own context
            orig = max_position_embeddings
        orig = int(orig or max_position_embeddings)
        factor = rs.get("factor")
        if factor is None:
            if kind in ("linear", "dynamic", "llama3"):
                raise ValueError(f"rope_scaling type {kind!r} needs a factor")
            factor = max_position_embeddings / orig  # as transformers, for yarn and longrope

        def opt(key: str) -> float | None:
            v = rs.get(key)
            return None if v is None else float(v)

        def factors(key: str) -> tuple[float, ...] | None:
            v = rs.get(key)
            if v is None:
                return None
            if not isinstance(v, list) or not all(isinstance(x, int | float) and x > 0 for x in v):
                raise ValueError(f"rope_scaling {key} must be a list of positive numbers, not {str(v)[:40]!r}")
            return tuple(float(x) for x in v)

        return cls(
            factor=float(factor),
            low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=orig,
            rope_type=kind,
            attention_factor=opt("attention_factor"),
            beta_fast=float(rs.get("beta_fast") or 32.0),
            beta_slow=float(rs.get("beta_slow") or 1.0),
            mscale=opt("mscale"),
            mscale_all_dim=opt("mscale_all_dim"),
            truncate=bool(rs.get("truncate", True)),
            short_factor=factors("short_factor"),
            long_factor=factors("long_factor"),
        )

    @property
    def context_length(self) -> int | None:
        """The context the scaling extends to, where the config's max_position_embeddings may
        be the pretrained one (vLLM serves original * factor for yarn, as Qwen's long-context
        instructions expect, and for dynamic NTK, whose original is the config's own);
        None: the config's."""
        if self.rope_type in ("yarn", "dynamic"):
            return int(self.original_max_position_embeddings * self.factor)
        return None

    def attention_scaling(self) -> float:
        """The factor transformers multiplies cos and sin by (1.0 for the types without)."""
        if self.rope_type == "yarn":
            if self.attention_factor is not None:
                return self.attention_factor

            def get_mscale(scale: float, m: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            if self.mscale and self.mscale_all_dim:
                return float(get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim))
            return get_mscale(self.factor)
        if self.rope_type == "longrope":
            if self.attention_factor is not None:
                return self.attention_factor
            if self.factor <= 1.0:
                return 1.0
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))
        return 1.0

    def describe(self, context: int | None = None) -> str:
        extra = ""
        if self.rope_type == "longrope":
            long = context is not None and context > self.original_max_position_embeddings
            extra = f", {'long' if long else 'short'} factors for a context of {context}"
        elif self.rope_type == "dynamic" and context is not None:
            extra = f", frequencies for a context of {context}"
        af = self.attention_scaling()
        return f"rope {self.rope_type} (factor {self.factor:g}{extra}" + (f", attention factor {af:.4f})" if af != 1 else ")")


def rope_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None,
                  freq_factors: Sequence[float] | None = None, context: int | None = None) -> torch.Tensor:
    """Each pair of rotary dimensions' frequency, op for op as transformers computes it
    (modeling_rope_utils), so the table's bits are transformers'. `head_dim`: the rotary
    dimensions (partial rotary: fewer than the head's). `freq_factors` (a GGUF's rope_freqs
    tensor, llama.cpp's freq_factors): a divisor per pair, as llama.cpp applies it
    (theta_i / factor_i), in place of `scaling`.

    `context`: the longest context served (--max-model-len). transformers recomputes two
    types' frequencies in each forward pass from its longest position: dynamic NTK's base
    grows past the original context, and LongRoPE takes its long factors there (Phi-3's
    generate even recomputes the cache on crossing). A paged cache keeps keys rotated once,
    so here the choice is made once for the served context, as llama.cpp makes LongRoPE's
    from its n_ctx: the same as transformers on every prompt on that side of the boundary."""
    dim = head_dim
    arange = torch.arange(0, dim, 2, dtype=torch.int64).float()
    if freq_factors is not None:
        assert scaling is None and len(freq_factors) == dim // 2, (scaling, len(freq_factors))
        return 1.0 / (base ** (arange / dim)) / torch.tensor(freq_factors, dtype=torch.float32)
    kind = scaling.rope_type if scaling is not None else "default"
    if kind == "default":
        return 1.0 / (base ** (arange / dim))
    assert scaling is not None
    if kind == "linear":
        return 1.0 / (base ** (arange / dim)) / scaling.factor
    if kind == "dynamic":
        orig = scaling.original_max_position_embeddings
        seq_len = max(context or orig, orig)
        f = scaling.factor
        base = base * ((f * seq_len / orig) - (f - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** (arange / dim))
    if kind == "longrope":
        long = context is not None and context > scaling.original_max_position_embeddings
        ext = scaling.long_factor if long else scaling.short_factor
        assert ext is not None
        if len(ext) != dim // 2:
            raise ValueError(f"rope_scaling {'long' if long else 'short'}_factor has {len(ext)} entries "
                             f"for {dim // 2} rotary pairs")
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base ** (arange / dim))
    if kind == "yarn":
        return _yarn_inv_freq(dim, base, scaling)
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the
    # band between is interpolated smoothly.
    inv_freq = 1.0 / (base ** (arange / dim))
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


def _yarn_inv_freq(dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters): the fast-rotating pairs extrapolated,
    the slow ones interpolated by `factor`, a linear ramp between the pairs whose wavelength
    fits beta_fast and beta_slow turns in the original context."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def rope_cos_sin_cache(
    head_dim: int, max_positions: int, base: float, scaling: RopeScaling | None = None,
    freq_factors: Sequence[float] | None = None, context: int | None = None,
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second, times
    the scaling's attention factor. `head_dim`: the rotary dimensions (see rope_inv_freq)."""
    inv_freq = rope_inv_freq(head_dim, base, scaling, freq_factors, context)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    af = scaling.attention_scaling() if scaling is not None else 1.0
    if af != 1.0:
        cos, sin = cos * af, sin * af
    return torch.cat([cos, sin], dim=-1)


def _cos_sin_rows(cos_sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ([cos | cos], [-sin | sin]) as [T, 1, rotary_dim], for `_rotate`."""
    half = cos_sin.shape[-1] // 2
    cs = cos_sin.index_select(0, positions).to(dtype)
    cos, sin = cs[:, :half], cs[:, half:]
    return torch.cat([cos, cos], -1)[:, None], torch.cat([-sin, sin], -1)[:, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half: [x1 cos - x2 sin | x2 cos + x1 sin], computed as x * [cos | cos] +
    [x2 | x1] * [-sin | sin] (the same bits: negation is exact), in four ops instead of ten.
    A table narrower than x (partial rotary) rotates x's first dimensions, the rest as given."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([_rotate(x[..., :rot], cos, sin), x[..., rot:]], -1)
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
