"""Random GGUF weights of any block type, for the kernel tests (tests/test_gguf_kernels.py)
and kernel timings: any bit pattern with finite scales is a valid block."""

from __future__ import annotations

import numpy as np

from ops.quantized_linear import QuantizedWeight

# Bytes (from a block's start) of each type's fp16 scales and of its fp16 mins.
FP16_SCALES = {"Q4_0": [0], "Q4_1": [0], "Q5_0": [0], "Q5_1": [0], "Q8_0": [0], "IQ4_NL": [0], "Q4_K": [0],
               "Q5_K": [0], "Q6_K": [208], "IQ4_XS": [0], "Q3_K": [108], "Q2_K": [80],
               **{q: [0] for q in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S")}}
FP16_MINS = {"Q4_1": 2, "Q5_1": 2, "Q4_K": 2, "Q5_K": 2, "Q2_K": 82}


def set_iq1m_d(raw: np.ndarray, d: np.ndarray) -> None:
    """IQ1_M blocks [..., 56] given d [...] (as fp16) in their scale words' top nibbles."""
    bits = d.astype(np.float16).view(np.uint16)
    words = np.ascontiguousarray(raw[..., 48:56]).view(np.uint16)
    for i in range(4):
        words[..., i] = (words[..., i] & 0x0FFF) | (((bits >> (4 * i)) & 15) << 12)
    raw[..., 48:56] = words.view(np.uint8)


def random_weight(qtype: str, n: int, k: int, seed: int, scale: float = 1.0) -> QuantizedWeight:
    """A weight of random GGUF blocks: random bytes, their fp16 scales and mins replaced by
    random finite values of either sign (d about 0.05 `scale` per step of a 32-block's quants;
    F16 and BF16: random normal values of 0.05 `scale`)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(seed)
    if qtype in ("F16", "BF16"):
        w = (rng.standard_normal((n, k)) * 0.05 * scale).astype(np.float32)
        if qtype == "F16":
            return QuantizedWeight(qtype, w.astype(np.float16).view(np.uint8), (n, k))
        return QuantizedWeight(qtype, (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8), (n, k))
    size, block = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, (n, k // size, block), dtype=np.uint8)

    def fp16(lo: int, magnitude: float) -> None:
        v = rng.uniform(0.1, 1.0, raw.shape[:2]) * magnitude * scale * rng.choice([-1, 1], raw.shape[:2])
        raw[..., lo : lo + 2] = v.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)

    for lo in FP16_SCALES.get(qtype, []):
        fp16(lo, 0.05 * 32 / size)  # a 256-block's d multiplies 6-bit sub-scales
    if qtype == "IQ1_M":  # its d in the top nibbles of the scale words at byte 48
        set_iq1m_d(raw, rng.uniform(0.1, 1.0, raw.shape[:2]) * 0.05 * 32 / size * scale * rng.choice([-1, 1], raw.shape[:2]))
    if qtype in FP16_MINS:
        fp16(FP16_MINS[qtype], 0.4 if size == 32 else 0.01)
    return QuantizedWeight(qtype, raw.reshape(n, -1), (n, k))
