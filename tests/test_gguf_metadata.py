"""A GGUF's metadata of the wrong type or range (worker/weights/gguf_meta.py): refused at load,
the message naming the key and quoting a bounded prefix of what the file holds; files written
by gguf-py's GGUFWriter, one key replaced (add_key_value overwrites), and files whose header
bytes are changed at random."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import pytest

from tests.gguf_tiny import write_tiny_llama
from worker.weights import ModelLoadError, load_model
from worker.weights.gguf_meta import Metadata, MetadataError
from worker.weights.gguf_reader import GGUFFile

V = gguf.GGUFValueType


def _with(key: str, value: object, vtype: V, sub: V | None = None):
    return lambda w: w.add_key_value(key, value, vtype, sub_type=sub)


def _refused(path: Path, complaint: str) -> str:
    with pytest.raises(ModelLoadError, match=complaint) as e:
        load_model(str(path))
    assert str(path) in str(e.value)
    return str(e.value)


def _tiny_tokens(path: Path) -> list[str]:
    return GGUFFile(write_tiny_llama(path)).fields["tokenizer.ggml.tokens"]


@pytest.mark.parametrize(("key", "value", "vtype", "sub", "complaint"), [
    # the tokenizer's
    ("tokenizer.ggml.bos_token_id", "0", V.STRING, None, r"bos_token_id = '0' \(str\): an integer expected"),
    ("tokenizer.ggml.eos_token_id", 1.5, V.FLOAT32, None, r"eos_token_id = 1.5 \(float\): an integer expected"),
    ("tokenizer.ggml.eot_token_id", [1, 2], V.ARRAY, V.UINT32, r"eot_token_id = \[1, 2\] \(2 items\): an integer"),
    ("tokenizer.ggml.add_bos_token", "no", V.STRING, None, r"add_bos_token = 'no' \(str\): a bool expected"),
    ("tokenizer.chat_template", 5, V.UINT32, None, r"chat_template = 5 \(int\): a string expected"),
    ("tokenizer.ggml.pre", ["gpt2"], V.ARRAY, V.STRING, r"tokenizer.ggml.pre = \['gpt2'\] \(1 items\): a string"),
    ("tokenizer.ggml.tokens", list(range(288)), V.ARRAY, V.INT32,
     r"tokenizer.ggml.tokens = \[0, 1, 2, \.\.\.\] \(288 items\): an array of strings expected"),
    ("tokenizer.ggml.token_type", ["1"] * 288, V.ARRAY, V.STRING, r"token_type = .* an array of integers"),
    ("tokenizer.ggml.merges", ["Ġt"], V.ARRAY, V.STRING,
     r"tokenizer.ggml.merges\[0\] = 'Ġt': two tokens of tokenizer.ggml.tokens, a space between"),
    ("tokenizer.ggml.merges", ["Ġ t", "Ġ x"], V.ARRAY, V.STRING, r"tokenizer.ggml.merges\[1\] = 'Ġ x'"),
    ("tokenizer.ggml.merges", ["t t"], V.ARRAY, V.STRING, r"merges\[0\] = 't t': .* whose join is one too"),
    # the model's shape and arithmetic
    ("general.architecture", ["llama"], V.ARRAY, V.STRING, r"general.architecture = \['llama'\] \(1 items\)"),
    ("llama.vocab_size", "288", V.STRING, None, r"llama.vocab_size = '288' \(str\): an integer of at least 1"),
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), V.FLOAT32, None,
     r"layer_norm_rms_epsilon = nan \(float\): a finite number above 0 expected"),
    ("llama.rope.freq_base", -1.0, V.FLOAT32, None, r"llama.rope.freq_base = -1.0 \(float\): a finite number"),
    ("llama.rope.freq_base", "1e4", V.STRING, None, r"llama.rope.freq_base = '1e4' \(str\)"),
    ("llama.expert_count", "8", V.STRING, None, r"llama.expert_count = '8' \(str\): an integer of at least 0"),
    ("llama.attention.value_length", 0, V.UINT32, None, r"value_length = 0 \(int\): an integer of at least 1"),
])
def test_a_key_of_the_wrong_type_is_refused_naming_it(tmp_path: Path, key: str, value: object, vtype: V,
                                                      sub: V | None, complaint: str) -> None:
    _refused(write_tiny_llama(tmp_path / "t.gguf", more=_with(key, value, vtype, sub)), complaint)


def test_rope_scaling_s_numbers_are_numbers(tmp_path: Path) -> None:
    def more(w: gguf.GGUFWriter) -> None:
        w.add_key_value("llama.rope.scaling.type", "linear", V.STRING)
        w.add_key_value("llama.rope.scaling.factor", "4", V.STRING)

    _refused(write_tiny_llama(tmp_path / "t.gguf", more=more), r"llama.rope.scaling.factor = '4' \(str\)")


def test_a_token_twice_is_refused_as_llama_cpp_refuses_it(tmp_path: Path) -> None:
    tokens = _tiny_tokens(tmp_path / "ref.gguf")
    tokens[1] = tokens[0]  # "<|begin|>" at ids 0 and 1: ids would not round-trip
    path = write_tiny_llama(tmp_path / "t.gguf", more=_with("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING))
    _refused(path, r"tokenizer.ggml.tokens holds '<\|begin\|>' twice \(ids 0 and 1\)")


def test_a_changed_token_that_a_merge_names_is_refused(tmp_path: Path) -> None:
    """What a byte changed in the vocabulary's strings does (found by the random changes
    below): the merge "Ġ t" then joins to no token; the tokenizers library's own message
    ("Token `Ġt` out of vocabulary", an Exception) was what reached the caller."""
    tokens = _tiny_tokens(tmp_path / "ref.gguf")
    tokens[tokens.index("Ġt")] = "Ġu"
    path = write_tiny_llama(tmp_path / "t.gguf", more=_with("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING))
    _refused(path, r"tokenizer.ggml.merges\[0\] = 'Ġ t'")


def test_a_wrong_value_is_quoted_in_bounded_prefix() -> None:
    """A megabyte string, a vocabulary-sized list, nested lists: the message stays short."""
    meta = Metadata({"s": "x" * (1 << 20), "l": ["y" * 1000] * 150_000, "n": [[1, 2]] * 9}, "/f.gguf")
    for read, key, shown in ((meta.integer, "s", "'" + "x" * 100 + "'... (str)"),
                             (meta.integers, "l", "(150000 items)"), (meta.strings, "n", "(9 items)"),
                             (meta.flag, "l", "(150000 items): a bool expected")):
        with pytest.raises(MetadataError, match=f"^/f.gguf: GGUF {key} = ") as e:
            read(key)
        assert shown in str(e.value) and len(str(e.value)) < 600, str(e.value)[:700]


@pytest.mark.parametrize(("fields", "read", "expected"), [
    ({"k": True}, "integer", "an integer"),  # a bool is not a count
    ({"k": 2}, "flag", "a bool"),
    ({"k": float("inf")}, "number", "a finite number"),
    ({"k": 0}, "number", "a finite number above 0"),
    ({"k": [1, "2"]}, "integers", "an array of integers"),
    ({"k": ["a", 2]}, "strings", "an array of strings"),
    ({"k": b"x"}, "string", "a string"),
])
def test_each_read_refuses_what_is_not_its_type(fields: dict, read: str, expected: str) -> None:
    with pytest.raises(MetadataError, match=f"GGUF k = .*: {expected}"):
        getattr(Metadata(fields), read)("k")


def test_absent_keys_give_their_defaults_and_right_ones_pass() -> None:
    meta = Metadata({"i": 3, "f": 2, "s": "a", "b": False, "li": [1], "ls": ["a"]})
    assert (meta.integer("i"), meta.number("f"), meta.string("s"), meta.flag("b")) == (3, 2.0, "a", False)
    assert (meta.integers("li"), meta.strings("ls")) == ([1], ["a"])
    assert (meta.integer("no", 7), meta.number("no"), meta.string("no", "d"), meta.flag("no", True)) == (
        7, None, "d", True)
    assert meta.integer("i", low=None) == 3 and Metadata({"i": -5}).integer("i", low=None) == -5
    with pytest.raises(MetadataError, match="at least 4"):
        meta.integer("i", low=4)


def test_random_changes_to_the_header_load_or_are_refused(tmp_path: Path) -> None:
    """Bytes of the metadata and tensor infos set at random (one to four a file, 500 files):
    each load gives a model or a ModelLoadError, never another exception."""
    src = write_tiny_llama(tmp_path / "tiny.gguf")
    data, head = src.read_bytes(), GGUFFile(src).data_start
    rng = random.Random(0)  # its changes include one the old code let out as the tokenizers library's Exception
    outcomes: dict[str, int] = {}
    bad = tmp_path / "bad.gguf"
    for _ in range(500):
        b = bytearray(data)
        for _ in range(rng.choice((1, 1, 2, 4))):
            at = rng.randrange(head)
            b[at] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
        bad.write_bytes(b)
        try:
            load_model(str(bad))
            outcome = "loaded"
        except ModelLoadError:
            outcome = "refused"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes.get("refused", 0) > 200, outcomes  # the changes were seen


def test_a_sentencepiece_token_id_of_the_wrong_type_is_quoted_bounded() -> None:
    """The SentencePiece vocabulary's ids are read as the byte-level one's: a list of 100,000
    ids as the BOS id is refused naming the key, its first items and length, not all of it."""
    from worker.tokenizer import Tokenizer

    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581a"]
    fields = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.scores": [0.0] * len(tokens),
              "tokenizer.ggml.token_type": [2, 3, 3, *[6] * 256, 1]}
    reader = type("Reader", (), {"fields": fields})()
    assert Tokenizer.from_gguf("/f.gguf", reader).bos_token_id == 1  # llama.cpp's default
    fields["tokenizer.ggml.bos_token_id"] = list(range(100_000))
    with pytest.raises(ValueError, match=r"^/f.gguf: GGUF tokenizer.ggml.bos_token_id = \[0, 1, 2, \.\.\.\] "
                                         r"\(100000 items\): an integer expected$"):
        Tokenizer.from_gguf("/f.gguf", reader)
