"""worker.weights.gguf_reader against the gguf package's own reader, and against damaged files."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from worker.weights import default_model_path
from worker.weights.gguf_file import dequantize_tensor
from worker.weights.gguf_reader import GGUFFile


def _same_as_the_gguf_package(path: Path) -> GGUFFile:
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    # The package also lists the header ("GGUF.version", ...) as fields; we keep it apart.
    ref_fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(ref_fields)
    for key, value in ref_fields.items():
        mine = ours.fields[key]
        if mine and isinstance(mine, list) and isinstance(mine[0], list):  # the package flattens
            mine = [x for item in mine for x in item]
        assert mine == value, key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.tensor_type, a.shape, a.n_bytes, a.offset) == (
            b.tensor_type, tuple(int(d) for d in b.shape), b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
    return ours


def test_the_default_model_reads_as_the_gguf_package_reads_it() -> None:
    ours = _same_as_the_gguf_package(default_model_path())
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert {t.tensor_type.name for t in ours.tensors} >= {"Q4_1", "F32"}


def _write(path: Path) -> Path:
    """Every metadata value type, and tensors held as elements and as blocks."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓ \x00 end")
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.strs", ["a", "", "ĠĠ", "日本"])
    w.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_type_reads_as_the_gguf_package_reads_it(tmp_path: Path) -> None:
    ours = _same_as_the_gguf_package(_write(tmp_path / "t.gguf"))
    assert ours.fields["t.u64"] == 2**63 + 5 and ours.fields["t.nested"] == [[1, 2], [3]]
    assert ours.fields["t.str"] == "héllo ✓ \x00 end"
    q8 = next(t for t in ours.tensors if t.name == "q8")
    assert q8.data.shape == (4, 64 // 32 * 34)  # [rows, bytes per row]


def test_every_truncation_is_a_value_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.gguf")
    whole = path.read_bytes()
    end = max(t.offset + t.n_bytes for t in GGUFFile(path).tensors)  # then only padding
    cut = tmp_path / "cut.gguf"
    for n in range(1, end):
        cut.write_bytes(whole[:n])
        with pytest.raises(ValueError):
            GGUFFile(cut)


def _header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _string(s: bytes, n: int | None = None) -> bytes:
    return struct.pack("<Q", len(s) if n is None else n) + s


@pytest.mark.parametrize(("data", "complaint"), [
    (b"", "cannot map"),
    (b"GGML" + bytes(40), "no GGUF magic"),
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    (_header(0, 0, version=9), "version 9"),
    (_header(0, 2**60), "cannot fit"),
    (_header(0, 1) + _string(b"k", 2**62) + bytes(64), "cannot fit"),
    (_header(0, 1) + _string(b"k") + struct.pack("<I", 99) + bytes(64), "unknown metadata value type 99"),
    (_header(0, 1) + _string(b"k") + struct.pack("<IIQ", 9, 8, 2**61) + bytes(64), "cannot fit"),
    (_header(0, 1) + _string(b"k") + struct.pack("<IIQ", 9, 4, 2**61) + bytes(64), "cannot fit"),
    (_header(0, 2) + (_string(b"k") + struct.pack("<IB", 0, 1)) * 2 + bytes(8), "appears twice"),
    (_header(0, 1) + _string(b"k") + struct.pack("<I", 8) + _string(b"\xff\xfe") + bytes(8), "not UTF-8"),
    (_header(1, 0) + _string(b"t") + struct.pack("<I", 9) + bytes(64), "9 dimensions"),
    (_header(1, 0) + _string(b"t") + struct.pack("<IQIQ", 1, 4, 77, 0) + bytes(64), "unknown type 77"),
    (_header(1, 0) + _string(b"t") + struct.pack("<IQIQ", 1, 2**40, 0, 0) + bytes(64), "run past"),
    (_header(1, 0) + _string(b"t") + struct.pack("<IQIQ", 1, 33, 8, 0) + bytes(64), "not whole Q8_0 blocks"),
    (_header(0, 1) + _string(b"general.alignment") + struct.pack("<II", 4, 24) + bytes(8), "power of two"),
    # A string of megabytes (a chat template, say) is refused before it is decoded.
    (_header(0, 1) + _string(b"k") + struct.pack("<I", 8) + _string(b"x" * (2 << 20)), "a metadata string of 2097152"),
    # Two F32 tensors where the second's data begins 32 bytes after the first's 16 values:
    # the size the first's type and shape give (64 bytes) overlaps the second.
    (_header(2, 0) + _string(b"a") + struct.pack("<IQIQ", 1, 16, 0, 0) + _string(b"b")
     + struct.pack("<IQIQ", 1, 8, 0, 32) + bytes(128), "'a': 64 bytes .* overlap tensor 'b'"),
    (_header(1, 0) + _string(b"t") + struct.pack("<IQIQ", 1, 8, 0, 4) + bytes(128), "not a multiple of the alignment"),
])
def test_damaged_files_name_what_is_wrong(tmp_path: Path, data: bytes, complaint: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=complaint):
        GGUFFile(path)


def test_arrays_nest_only_so_deep(tmp_path: Path) -> None:
    vtype, payload = 0, b"\x01"  # a u8; then an array of one of it, six times over
    for _ in range(6):
        vtype, payload = 9, struct.pack("<IQ", vtype, 1) + payload
    path = tmp_path / "deep.gguf"
    path.write_bytes(_header(0, 1) + _string(b"k") + struct.pack("<I", vtype) + payload + bytes(8))
    with pytest.raises(ValueError, match="nested deeper"):
        GGUFFile(path)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0"])
def test_dequantize_gives_the_gguf_package_s_bits(qtype: str) -> None:
    """Block types dequantized over the whole tensor (and one left to the package): any bytes,
    any scales (random ones include infinities and NaNs), the same float32 bits."""
    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    data = np.random.default_rng(1).integers(0, 256, (24, 8 * size), dtype=np.uint8)
    with np.errstate(invalid="ignore"):  # inf x 0
        ours = dequantize_tensor(data, t)
        ref = gguf.quants.dequantize(data, t).astype(np.float32)
    assert ours.shape == ref.shape == (24, 8 * block) and ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    with np.errstate(invalid="ignore"):  # a 1-D tensor of blocks, shaped as its bytes are
        flat = dequantize_tensor(data.reshape(-1), t)
    assert flat.shape == (24 * 8 * block,) and np.array_equal(flat.view(np.uint32), ref.reshape(-1).view(np.uint32))


def test_the_default_model_dequantizes_to_the_gguf_package_s_bits() -> None:
    for t in GGUFFile(default_model_path()).tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        assert np.array_equal(dequantize_tensor(t.data, t.tensor_type).view(np.uint32), ref.view(np.uint32)), t.name


# ----- at load: the same files through load_model, refused with the file named -----

def _tensor_infos(path: Path) -> dict[str, int]:
    """Where each tensor's type field (u32) sits in the file, by name."""
    f = GGUFFile(path)
    data, out = path.read_bytes(), {}
    for t in f.tensors:
        name = struct.pack("<Q", len(t.name)) + t.name.encode()
        at = data.index(name) + len(name)
        (n_dims,) = struct.unpack_from("<I", data, at)
        out[t.name] = at + 4 + 8 * n_dims
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tests.gguf_tiny import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def test_the_tiny_model_loads(tiny: Path) -> None:
    from worker.weights import load_model

    loaded = load_model(str(tiny))
    assert loaded.source == "gguf" and loaded.config.num_layers == 1


def _refused(path: Path, complaint: str) -> None:
    from worker.weights import ModelLoadError, load_model

    with pytest.raises(ModelLoadError, match=complaint) as e:
        load_model(str(path))
    assert str(path) in str(e.value)


def test_a_truncated_file_is_refused_at_load(tiny: Path, tmp_path: Path) -> None:
    data = tiny.read_bytes()
    cut = tmp_path / "cut.gguf"
    for n in (len(data) - 1, len(data) // 2, 40):
        cut.write_bytes(data[:n])
        _refused(cut, "is not a readable GGUF file: (truncated|tensor .* run past|.* cannot fit)")


@pytest.mark.parametrize(("tensor", "type_id", "complaint"), [
    ("blk.0.ffn_up.weight", 99, "tensor 'blk.0.ffn_up.weight' has unknown type 99"),
    # attn_q retyped F32: its 64 x 64 values then need 16 KiB, the file holds its Q8_0's 4.25,
    # so it would read the next tensors' bytes.
    ("blk.0.attn_q.weight", 0, "tensor 'blk.0.attn_q.weight': 16384 bytes \\(F32, shape \\[64, 64\\]\\) at .* overlap"),
    # The last tensor retyped F32: no neighbour to overlap, its 32 KiB run past the file's end.
    ("blk.0.ffn_down.weight", 0, "tensor 'blk.0.ffn_down.weight': 32768 bytes at .* run past the file's"),
    # A norm stored as I8 (it fits) has no dequantizer: refused by name before anything is built.
    ("output_norm.weight", 24, "tensor 'output_norm.weight' has type I8, which this worker cannot read"),
])
def test_a_tensor_of_a_wrong_type_is_refused_at_load(tiny: Path, tmp_path: Path, tensor: str, type_id: int,
                                                     complaint: str) -> None:
    """An unknown type id, a size the type and shape disagree with, a type no one reads."""
    data = bytearray(tiny.read_bytes())
    struct.pack_into("<I", data, _tensor_infos(tiny)[tensor], type_id)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    _refused(bad, complaint)


def test_a_megabyte_chat_template_is_refused_at_load(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_chat_template("{{ x }}" * (300 << 10))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _refused(tmp_path / "t.gguf", "a metadata string of 2150400 bytes")


def test_an_unknown_pre_tokenizer_is_refused_at_load(tmp_path: Path) -> None:
    from tests.gguf_tiny import write_tiny_llama

    _refused(write_tiny_llama(tmp_path / "t.gguf", pre="gpt9"), "GGUF pre-tokenizer 'gpt9' is not supported")
