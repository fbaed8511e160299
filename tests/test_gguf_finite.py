"""A GGUF whose numbers are not finite (worker/weights/gguf_finite.py): a block's float16 scale,
an F16/BF16/F32 element, set to inf or NaN in a file gguf-py's GGUFWriter wrote, is refused at
load naming the tensor, its row and block; quants of any bits still load."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tests.gguf_tiny import write_tiny_llama
from worker.weights import ModelLoadError, load_model
from worker.weights.gguf_finite import F16_FIELDS, check_blocks, check_floats
from worker.weights.gguf_reader import GGUFFile

NAN16, INF16, NINF16 = 0x7E00, 0x7C00, 0xFC00
TENSOR = "blk.0.ffn_down.weight"  # [hidden, 2 hidden]: rows of two blocks or more (of 256 or of 32)


def _tiny(tmp_path: Path, qtype: str) -> Path:
    hidden = 256 if GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0] == 256 else 64
    return write_tiny_llama(tmp_path / f"{qtype}.gguf", qtype=qtype, hidden=hidden)


def _set(src: Path, dst: Path, tensor: str, row: int, at: int, raw: bytes) -> Path:
    """`src` with bytes `raw` at byte `at` of row `row` of `tensor`'s data."""
    t = next(t for t in GGUFFile(src).tensors if t.name == tensor)
    row_bytes = t.n_bytes // t.shape[1] if len(t.shape) == 2 else t.n_bytes
    data = bytearray(src.read_bytes())
    pos = t.offset + row * row_bytes + at
    data[pos : pos + len(raw)] = raw
    dst.write_bytes(data)
    return dst


def _refused(path: Path, complaint: str) -> None:
    with pytest.raises(ModelLoadError, match=complaint):
        load_model(str(path))


@pytest.mark.parametrize("qtype", sorted(F16_FIELDS))
def test_every_scale_field_that_is_not_finite_is_refused(tmp_path: Path, qtype: str) -> None:
    src = _tiny(tmp_path, qtype)
    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]
    load_model(str(src))  # the file as written loads
    for field, bits in zip(F16_FIELDS[qtype], (NAN16, INF16), strict=False):
        for row, block in ((0, 0), (5, 1)):
            bad = _set(src, tmp_path / "bad.gguf", TENSOR, row, block * block_bytes + field, bits.to_bytes(2, "little"))
            _refused(bad, f"tensor '{TENSOR}' \\({qtype}\\): row {row}: block {block} holds a float16 scale "
                          "that is inf or NaN: a damaged file")


@pytest.mark.parametrize(("qtype", "bits"), [("F16", NINF16), ("BF16", 0x7FC0)])
def test_a_float16_or_bfloat16_element_that_is_not_finite_is_refused(tmp_path: Path, qtype: str, bits: int) -> None:
    src = _tiny(tmp_path, qtype)
    load_model(str(src))
    bad = _set(src, tmp_path / "bad.gguf", TENSOR, 3, 2 * 7, bits.to_bytes(2, "little"))
    _refused(bad, f"tensor '{TENSOR}' \\({qtype}\\): row 3: element 7 is inf or NaN")


def test_a_float32_norm_that_is_not_finite_is_refused(tmp_path: Path) -> None:
    src = _tiny(tmp_path, "Q8_0")
    bad = _set(src, tmp_path / "bad.gguf", "output_norm.weight", 0, 4 * 5, np.float32("nan").tobytes())
    _refused(bad, "tensor 'output_norm.weight' \\(F32\\): row 0: element 5 is inf or NaN")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # gguf-py: inf x 0
def test_a_dequantized_type_s_values_are_checked(tmp_path: Path) -> None:
    """TQ2_0 has no native kernel: dequantized at load, its floats are what is checked (its d
    at byte 64 of a block; gguf-py quantizes it)."""
    src = _tiny(tmp_path, "TQ2_0")
    load_model(str(src))
    bad = _set(src, tmp_path / "bad.gguf", TENSOR, 2, 66 + 64, INF16.to_bytes(2, "little"))
    _refused(bad, f"tensor '{TENSOR}' \\(TQ2_0\\): row 2: element \\d+ is inf or NaN")


def test_quants_of_any_bits_load(tmp_path: Path) -> None:
    """Every byte of a Q8_0 block but its scale set at random: still a valid block."""
    src = _tiny(tmp_path, "Q8_0")
    rng = random.Random(0)
    path = src
    for i in range(20):
        row, block, at = rng.randrange(128), rng.randrange(2), rng.randrange(2, 34)
        path = _set(path, tmp_path / f"q{i % 2}.gguf", TENSOR, row, block * 34 + at, bytes([rng.randrange(256)]))
    load_model(str(path))


def test_the_first_bad_item_is_found_past_the_first_chunk() -> None:
    """Checked a chunk of rows at a time (no tensor-sized temporary): the row is the tensor's."""
    blocks = np.zeros((5000, 34 * 8), dtype=np.uint8)  # Q8_0, 256 columns: 5000 rows > a chunk
    blocks[4321, 34 * 6 : 34 * 6 + 2] = np.frombuffer(np.uint16(NAN16).tobytes(), np.uint8)
    with pytest.raises(ValueError, match="row 4321: block 6 holds"):
        check_blocks("w", "Q8_0", blocks)
    values = np.zeros((3000, 512), dtype=np.float32)
    values[2999, 511] = np.inf
    with pytest.raises(ValueError, match="row 2999: element 511 is inf"):
        check_floats("w", "F32", values)
    check_floats("w", "F32", np.zeros((0, 4), dtype=np.float32))
    check_blocks("w", "Q8_0", np.zeros((4, 34), dtype=np.uint8))  # zero scales: finite


def test_every_native_gguf_type_has_its_scale_fields() -> None:
    """A GGUF type the CPU kernels take natively is read as blocks (not dequantized), so its
    scales must be listed, or a file of it would fail at load with a KeyError."""
    from ops.quant_records import TYPES

    native = {t for t in TYPES if t in GGMLQuantizationType.__members__} - {"F16", "BF16"}
    assert native == set(F16_FIELDS)
    for qtype, fields in F16_FIELDS.items():
        block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]
        assert block_bytes % 2 == 0 and all(o % 2 == 0 and o + 2 <= block_bytes for o in fields), qtype


def test_iq1_m_s_split_scale_that_is_not_finite_is_refused(tmp_path: Path) -> None:
    """IQ1_M's d is no field of its own: its nibbles are the top of the four scale words at byte
    48 of a block (SPLIT_F16). NaN there (exponent nibbles 2 and 3 all ones) is refused; the same
    words with their low bits changed (the 3-bit scales) still load."""
    src = _tiny(tmp_path, "IQ1_M")
    load_model(str(src))
    t = next(t for t in GGUFFile(src).tensors if t.name == TENSOR)
    row = np.asarray(t.data)[5].reshape(-1, 56)
    words = row[1, 48:56].copy().view(np.uint16)
    nan = words.copy()
    nan[2] |= 0xC000  # d's bits 10, 11
    nan[3] |= 0x7000  # d's bits 12-14: its exponent all ones
    bad = _set(src, tmp_path / "bad.gguf", TENSOR, 5, 56 + 48, nan.tobytes())
    _refused(bad, f"tensor '{TENSOR}' \\(IQ1_M\\): row 5: block 1 holds a float16 scale that is inf or NaN")
    fine = words.copy()
    fine ^= 0x0FFF
    load_model(str(_set(src, tmp_path / "fine.gguf", TENSOR, 5, 56 + 48, fine.tobytes())))
