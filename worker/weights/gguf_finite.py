"""A GGUF tensor's numbers are finite: its blocks' float16 scales, or its float elements.

Any bit pattern of a block's quants is a valid block; a scale that is inf or NaN is not, and
one such scale makes every logit NaN from the first layer that reads it (a tiny Llama with one
NaN scale in attn_q: token 0 for every request, greedy or sampled, finished as if fine). So a
damaged file is refused at load, naming the tensor, the row and the block, as llama.cpp's
`--check-tensors` (ggml_validate_row_data) refuses it; there it is off by default, here the
scales are a few bytes a block and are checked as each tensor is read (float elements: every
one, a chunk of rows at a time, so no tensor-sized temporary).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF type -> the byte offsets of the float16 fields of one block (ggml-common.h's block_*
# structs: d, and dmin / m where there is one). The CPU kernels' native types (ops/quant_records.py);
# other types are dequantized at load and their floats checked instead.
F16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,), "IQ1_M": (),
}
# A float16 held in pieces: IQ1_M's d is the top nibbles of the four 16-bit scale words at this
# byte (block_iq1_m's iq1m_scale_t), the lowest nibble first.
SPLIT_F16: dict[str, int] = {"IQ1_M": 48}
# float16 / bfloat16: all exponent bits set is inf or NaN
_F16_EXP, _BF16_EXP = 0x7C00, 0x7F80
_CHUNK = 1 << 20  # elements (or bytes of blocks) checked at once


def _first_bad(data: np.ndarray, bad_in: Callable[[np.ndarray], np.ndarray]) -> tuple[int, int] | None:
    """(row, index within the row) of the first item `bad_in(rows)` marks in [rows, ...] `data`,
    a chunk of rows at a time."""
    step = max(1, _CHUNK // max(1, data[0].size))
    for r0 in range(0, len(data), step):
        bad = bad_in(data[r0 : r0 + step])
        if bad.any():
            r, i = np.unravel_index(int(np.argmax(bad)), bad.shape)
            return r0 + int(r), int(i)
    return None


def _refuse(name: str, qtype: str, where: tuple[int, int] | None, what: str) -> None:
    if where is not None:
        row, i = where
        raise ValueError(f"tensor {name[:100]!r} ({qtype}): row {row}: {what.format(i=i)}: a damaged file")


def _rows(data: np.ndarray) -> np.ndarray:
    return data.reshape(1, -1) if data.ndim == 1 else data.reshape(data.shape[0], -1)


def check_blocks(name: str, qtype: str, data: np.ndarray) -> None:
    """Refuse a tensor whose rows, as the reader gives them ([rows, bytes] blocks, float16
    elements for F16, bytes for BF16), hold a float16 scale or an element that is inf or NaN."""
    if data.size == 0:
        return
    rows = _rows(data)
    if qtype in ("F16", "BF16"):
        exp = _F16_EXP if qtype == "F16" else _BF16_EXP

        def bad_elements(part: np.ndarray) -> np.ndarray:
            return (np.ascontiguousarray(part).view(np.uint16) & exp) == exp

        return _refuse(name, qtype, _first_bad(rows, bad_elements), "element {i} is inf or NaN")
    fields, block_bytes = F16_FIELDS[qtype], GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]

    def bad_blocks(part: np.ndarray) -> np.ndarray:
        # every block size and field offset is even: the fields are strided views, not copies
        halves = part.view(np.uint16).reshape(part.shape[0], -1, block_bytes // 2)
        scales = [halves[..., o // 2] for o in fields]
        if qtype in SPLIT_F16:
            w = [halves[..., SPLIT_F16[qtype] // 2 + i] >> 12 for i in range(4)]
            scales.append(w[0] | w[1] << 4 | w[2] << 8 | w[3] << 12)
        bad = None
        for f in scales:
            b = (f & _F16_EXP) == _F16_EXP
            bad = b if bad is None else bad | b
        return bad

    _refuse(name, qtype, _first_bad(rows, bad_blocks), "block {i} holds a float16 scale that is inf or NaN")


def check_floats(name: str, qtype: str, values: np.ndarray) -> None:
    """Refuse a tensor whose values (float32: F32's own, or dequantized from `qtype`) are not
    all finite."""
    if values.size:
        _refuse(name, qtype, _first_bad(_rows(values), lambda part: ~np.isfinite(part)), "element {i} is inf or NaN")
