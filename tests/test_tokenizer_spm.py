"""SentencePiece vocabularies in GGUF files (tokenizer.ggml.model "llama": Llama 2, Mistral,
Gemma 2/3, Phi-3-mini), worker/tokenizer_spm.py, against the tools users use.

Tiny SentencePiece BPE models are trained here as such models are (byte fallback, identity
normalization, spaces kept; Llama's space prefix or Gemma's none; control and user-defined
symbols), then written into a GGUF two ways: by GGUFWriter as llama.cpp's converter writes
them (_create_vocab_sentencepiece: pieces, scores, token types; the user-defined pieces as
USER_DEFINED, as a folder's added_tokens_decoder makes them) -- these tests need only gguf,
sentencepiece and tokenizers and run in CI -- and by convert_hf_to_gguf.py itself from tiny
Gemma 2, Llama and Phi-3 checkpoints (and a Unigram model's; skipped where the converter is
not found).

References: SentencePiece's own processor on the model (text without special tokens), an
independent re-implementation of llama.cpp's SPM tokenizer (llama-vocab.cpp: special-token
fragments, the space prefix on each, merges by score, byte fallback, Phi-3's strip) for text
with special and user-defined tokens, llama.cpp itself (libllama through ctypes, where the
tree find_converter finds has it built) on the converter's files, and transformers'
AutoTokenizer on the GGUF and on the folder.

Where they disagree (asserted below, so a change shows):
- after a user-defined token ("<tool>") in text, llama.cpp gives the next text its space
  prefix again; SentencePiece does not. We follow llama.cpp.
- transformers' GGUF tokenizer under Llama's prefix (Metaspace, prepend "first") gives a text
  that already starts with a space no second "▁" (" hi" -> "▁hi"; SentencePiece and llama.cpp:
  "▁▁hi"), and no "▁" to the text after a special token ("<s>hi": llama.cpp "▁hi"). We follow
  SentencePiece and llama.cpp. On Gemma's vocabularies (no prefix) all agree.
- a Unigram SentencePiece model is written by the converter the same way and llama.cpp
  tokenizes it by merges, not by Unigram's best segmentation: our tokens are llama.cpp's
  (the re-implementation's), not SentencePiece's.
"""

from __future__ import annotations

import heapq
import io
import json
import random
import shutil
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
spm = pytest.importorskip("sentencepiece")

from worker.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError  # noqa: E402

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
USER_SYMBOLS = ["<tool>"]
CONTROL_SYMBOLS = ["<mask>", "<start_of_turn>", "<end_of_turn>"]

_WORDS = ("the quick brown fox jumps over lazy dog hello world tokenizer merges scores space prefix "
          "byte fallback Ünïcödé straße café naïve def return class import if else").split()


def _training_lines(seed: int = 0) -> list[str]:
    """Text of the words, with single and double spaces, tabs and newlines, and digits; no
    CJK or emoji (their characters must fall back to bytes)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(400):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        lines.append(rng.choice([" ", " ", " ", "  ", "\t", "\n"]).join(words) + rng.choice(["", ".", "!", " 123", " 42."]))
    return lines


def train_spm(gemma: bool, model_type: str = "bpe", byte_fallback: bool = True,
              control: tuple[str, ...] = ()) -> bytes:
    """A tiny SentencePiece model (tokenizer.model bytes) shaped like Gemma's (ids pad 0, eos 1,
    bos 2, unk 3; no space prefix) or Llama 2's (unk 0, bos 1, eos 2; the space prefix);
    `control`: more control symbols."""
    ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3) if gemma else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    pieces = dict(pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>") if gemma else {}
    size = (520 if byte_fallback else 270) if model_type == "bpe" else (340 if byte_fallback else 90)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_training_lines()), model_writer=buf, vocab_size=size, model_type=model_type,
        character_coverage=1.0, byte_fallback=byte_fallback, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=not gemma, allow_whitespace_only_pieces=True,
        split_digits=True, user_defined_symbols=USER_SYMBOLS, control_symbols=CONTROL_SYMBOLS + list(control),
        minloglevel=2, **ids, **pieces)
    return buf.getvalue()


def vocab_of(model: bytes) -> tuple[list[str], list[float], list[int]]:
    """Pieces, scores and GGUF token types as llama.cpp's converter reads them
    (_create_vocab_sentencepiece), the user-defined pieces USER_DEFINED (as the folder's
    tokenizer_config added_tokens_decoder marks them)."""
    sp = spm.SentencePieceProcessor(model_proto=model)
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        ty = NORMAL
        if sp.IsUnknown(i):
            ty = UNKNOWN
        elif sp.IsControl(i):
            ty = CONTROL
        elif sp.IsUnused(i):
            ty = UNUSED
        elif sp.IsByte(i):
            ty = BYTE
        elif sp.IdToPiece(i) in USER_SYMBOLS:
            ty = USER_DEFINED
        tokens.append(sp.IdToPiece(i))
        scores.append(sp.GetScore(i))
        types.append(ty)
    return tokens, scores, types


_DROP = object()


def write_gguf(path: Path, proto: bytes, gemma: bool, **keys) -> Path:
    """A metadata-only GGUF of the SentencePiece model `proto` as the converter writes it;
    `keys` (tokenizer.ggml.* names without the prefix) replace entries, `_DROP` removes one."""
    tokens, scores, types = vocab_of(proto)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    meta = {"model": "llama", "pre": "default", "tokens": tokens, "scores": scores, "token_type": types,
            "bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "unknown_token_id": sp.unk_id(),
            "add_bos_token": True, "add_eos_token": False}
    if gemma:
        meta |= {"padding_token_id": sp.pad_id(), "add_space_prefix": False}
    meta |= keys
    w = gguf.GGUFWriter(str(path), "gemma2" if gemma else "llama")
    for key, value in meta.items():
        if value is _DROP:
            continue
        name = f"tokenizer.ggml.{key}"
        if isinstance(value, bool):
            w.add_bool(name, value)
        elif isinstance(value, int):
            w.add_uint32(name, value)
        elif isinstance(value, str):
            w.add_string(name, value)
        elif key == "scores":
            w.add_array(name, [float(v) for v in value])
        else:
            w.add_array(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llamacpp_spm(tokens: list[str], scores: list[float], types: list[int], text: str, *,
                 add_space_prefix: bool, parse_special: bool, phi3: bool = False) -> list[int]:
    """llama.cpp's SPM tokenize (llama-vocab.cpp), re-implemented: the text cut at special
    tokens (longest first; control and unknown ones only when parsing special tokens,
    user-defined ones always), each text fragment prefixed with a space when the space prefix
    is on (a fragment follows a token or starts the text), spaces escaped to "▁", then
    llm_tokenizer_spm_session: characters merged pairwise, the best-scored resulting token
    first, leftmost on ties; a symbol that is no token as its bytes' <0xNN> tokens. `phi3`:
    the whitespace after a special token (not <unk>, <s>, <|endoftext|>) dropped (RSTRIP)."""
    ids = {t: i for i, t in enumerate(tokens)}
    kinds = (CONTROL, UNKNOWN, USER_DEFINED) if parse_special else (USER_DEFINED,)
    specials = sorted((i for i, ty in enumerate(types) if ty in kinds), key=lambda i: -len(tokens[i].encode()))
    fragments: list[str | int] = [text] if text else []
    for sid in specials:
        out: list[str | int] = []
        for f in fragments:
            if isinstance(f, int):
                out.append(f)
                continue
            strip = phi3 and tokens[sid] not in ("<unk>", "<s>", "<|endoftext|>")
            for j, piece in enumerate(f.split(tokens[sid])):
                if j:
                    out.append(sid)
                    piece = piece.lstrip(" \t\n\v\f\r") if strip else piece  # C's isspace
                if piece:
                    out.append(piece)
        fragments = out
    result: list[int] = []
    prev_special = True
    for f in fragments:
        if isinstance(f, int):
            result.append(f)
            prev_special = True
            continue
        escaped = ((" " if add_space_prefix and prev_special else "") + f).replace(" ", "\u2581")
        result += _spm_session(escaped, ids, scores)
        prev_special = False
    return result


def _spm_session(text: str, ids: dict[str, int], scores: list[float]) -> list[int]:
    syms = list(text)
    nxt = [i + 1 for i in range(len(syms))]
    nxt[-1] = -1
    prev = [i - 1 for i in range(len(syms))]
    heap: list[tuple[float, int, int, int]] = []

    def bigram(left: int, right: int) -> None:
        if left != -1 and right != -1 and (t := syms[left] + syms[right]) in ids:
            heapq.heappush(heap, (-scores[ids[t]], left, right, len(t)))

    for i in range(1, len(syms)):
        bigram(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != size:
            continue  # one of them merged since
        syms[left], syms[right] = syms[left] + syms[right], ""
        nxt[left] = nxt[right]
        if nxt[right] != -1:
            prev[nxt[right]] = left
        bigram(prev[left], left)
        bigram(left, nxt[left])
    out: list[int] = []
    i = 0
    while i != -1:
        s = syms[i]
        if s in ids:
            out.append(ids[s])
        else:  # byte_to_token: <0xNN>, else the byte itself as a token
            out += [ids[f"<0x{b:02X}>"] if f"<0x{b:02X}>" in ids else ids[chr(b)] for b in s.encode()]
        i = nxt[i]
    return out


TEXTS = [
    "",
    "Hello",
    "hello world",
    " hello world",
    "  two leading spaces",
    "   leading and trailing   ",
    " ",
    "  ",
    "\n",
    "the quick  brown\tfox\n\njumps over\r\nthe lazy dog",
    "a  b   c\n\n\n  d\t\t e \u00a0f\u3000g   ",
    "def f(x):\n    if x:\n\treturn [i ** 2 for i in x]\n",
    "12345 and 3.14159, 1,000,000.00",
    "Ünïcödé straße café naïve, Ελληνικά, русский текст",
    "你好，世界！日本語のテキストです。한국어 문장도 있습니다.",
    "Family: 👨\u200d👩\u200d👧, llama: 🦙, skin tones: 👍🏽, flags 🇫🇷",
    "مرحبا بالعالم",
    "x <tool> y<tool>z",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "not special: <start_of_turn <end_of_turn> <|im_start|> <mask>",
    "<bos>hello<eos> <unk> <pad>",
]
PLAIN = [t for t in TEXTS if not any(s in t for s in USER_SYMBOLS)]  # SentencePiece's own matcher differs there


@pytest.fixture(scope="module", params=["gemma", "llama"])
def made(request, tmp_path_factory) -> tuple[str, bytes, Path]:
    gemma = request.param == "gemma"
    model = train_spm(gemma)
    path = write_gguf(tmp_path_factory.mktemp("spm") / f"{request.param}.gguf", model, gemma)
    return request.param, model, path


def test_metadata(made) -> None:
    name, model, path = made
    sp = spm.SentencePieceProcessor(model_proto=model)
    tok = Tokenizer.from_gguf(path)
    assert tok.vocab_size == sp.vocab_size()
    # EOS, and <end_of_turn> by its text as llama.cpp (the file has no tokenizer.ggml.eot_token_id)
    end = sp.PieceToId("<end_of_turn>")
    assert (tok.bos_token_id, tok.eos_token_ids, tok.unk_token_id) == (sp.bos_id(), (sp.eos_id(), end), sp.unk_id())
    assert tok.pad_token_id == (0 if name == "gemma" else None)
    assert tok.add_bos and not tok.add_eos
    special = {i for i in range(tok.vocab_size) if tok.is_special(i)}
    tokens, _, types = vocab_of(model)
    assert special == {i for i, ty in enumerate(types) if ty in (CONTROL, UNKNOWN)}
    assert {tokens[i] for i in special} >= {"<start_of_turn>", "<end_of_turn>", "<unk>", tokens[sp.bos_id()]}
    assert not tok.is_special(tokens.index("<tool>"))


@pytest.mark.parametrize("text", PLAIN)
def test_encode_as_sentencepiece(made, text: str) -> None:
    """Text (special-token strings in it as text) as SentencePiece tokenizes it; with BOS when
    asked, as SentencePiece's add_bos."""
    _, model, path = made
    sp = spm.SentencePieceProcessor(model_proto=model)
    tok = Tokenizer.from_gguf(path)
    assert tok.encode(text, parse_special_tokens=False) == sp.encode(text)
    assert tok.encode(text, add_special_tokens=True, parse_special_tokens=False) == sp.encode(text, add_bos=True)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("parse_special", [True, False])
def test_encode_as_llamacpp(made, text: str, parse_special: bool) -> None:
    """All texts, special and user-defined tokens in them, as llama.cpp tokenizes them."""
    name, model, path = made
    tok = Tokenizer.from_gguf(path)
    tokens, scores, types = vocab_of(model)
    want = llamacpp_spm(tokens, scores, types, text, add_space_prefix=name == "llama", parse_special=parse_special)
    assert tok.encode(text, parse_special_tokens=parse_special) == want


def test_where_sentencepiece_and_llamacpp_disagree(made) -> None:
    """After a user-defined token llama.cpp prefixes the next text with a space again
    (Llama's prefix only); we follow llama.cpp."""
    name, model, path = made
    sp = spm.SentencePieceProcessor(model_proto=model)
    tok = Tokenizer.from_gguf(path)
    pieces = [sp.IdToPiece(i) for i in tok.encode("x <tool> y")]
    if name == "llama":
        assert pieces == ["▁", "x", "▁", "<tool>", "▁▁", "y"]
        assert [sp.IdToPiece(i) for i in sp.encode("x <tool> y")] == ["▁", "x", "▁", "<tool>", "▁", "y"]
    else:
        assert tok.encode("x <tool> y") == sp.encode("x <tool> y")


def test_special_tokens_parse_only_in_trusted_text(made) -> None:
    _, model, path = made
    tok = Tokenizer.from_gguf(path)
    tokens, _, _ = vocab_of(model)
    start, tool = tokens.index("<start_of_turn>"), tokens.index("<tool>")
    assert start in tok.encode("<start_of_turn>user")
    assert start not in tok.encode("<start_of_turn>user", parse_special_tokens=False)
    assert tool in tok.encode("a<tool>b", parse_special_tokens=False)  # user-defined: always whole
    assert tok.has_special_text("hi <end_of_turn>") and not tok.has_special_text("hi <tool>")


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_as_sentencepiece(made, text: str, skip: bool) -> None:
    """SentencePiece's decode (control tokens dropped, "▁" to spaces, bytes reassembled, the
    prefix's space stripped) of SentencePiece's own tokens, and of ours; without skipping,
    the text itself back (the prefix's space stripped) where the special tokens parse."""
    name, model, path = made
    sp = spm.SentencePieceProcessor(model_proto=model)
    tok = Tokenizer.from_gguf(path)
    ids = sp.encode(text)
    if name == "llama" and text not in PLAIN:
        return  # llama.cpp's prefix after a user-defined token is an extra space (above)
    if skip:
        assert tok.decode(ids) == sp.decode(ids)
        ours = tok.encode(text, add_special_tokens=True, parse_special_tokens=False)
        assert tok.decode(ours) == sp.decode(ours)
    elif "<unk>" not in text:  # SentencePiece decodes <unk> as " ⁇ "
        assert tok.decode(tok.encode(text, parse_special_tokens=False), skip_special_tokens=False) == text


def test_byte_fallback(made) -> None:
    """A character outside the vocabulary is its UTF-8 bytes' tokens, back to it when decoded."""
    _, model, path = made
    tok = Tokenizer.from_gguf(path)
    tokens, _, _ = vocab_of(model)
    pieces = [tokens[i] for i in tok.encode("🦙", parse_special_tokens=False)]
    assert pieces[-4:] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert tok.decode(tok.encode("a🦙b")) == "a🦙b"


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int], **kwargs) -> list[str]:
    det = IncrementalDetokenizer(tok, **kwargs)
    deltas, start = [], 0
    for n in chunks:
        deltas.append(det.add_tokens(ids[start: start + n]))
        start += n
    deltas.append(det.flush())
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_streaming_equals_a_whole_decode(made, skip: bool) -> None:
    """Deltas (one token at a time, and in random chunks after a chat prompt's tail) add up to
    the whole decode, never a broken character on the way (emoji are four byte tokens)."""
    _, _, path = made
    tok = Tokenizer.from_gguf(path)
    rng = random.Random(5)
    prompt = tok.encode("<start_of_turn>user\nhi 🦙<end_of_turn>\n<start_of_turn>model\n")
    for text in TEXTS:
        ids = tok.encode(text)
        one = _stream(tok, ids, [1] * len(ids), skip_special_tokens=skip)
        assert "".join(one) == tok.decode(ids, skip_special_tokens=skip)
        full = tok.decode(ids, skip_special_tokens=skip)
        if "\ufffd" not in full:
            assert not any("\ufffd" in d for d in one)
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(min(rng.randint(1, 4), len(ids) - sum(chunks)))
        deltas = _stream(tok, ids, chunks, prompt_token_ids=prompt, skip_special_tokens=skip)
        # With a prompt as context the first token keeps its leading space (mid-sequence).
        assert "".join(deltas) == tok.decode(prompt[-5:] + ids, skip_special_tokens=skip)[
            len(tok.decode(prompt[-5:], skip_special_tokens=skip)):]


def test_transformers_gguf_tokenizer(made, tmp_path) -> None:
    """transformers' AutoTokenizer on the same GGUF: equal on every text but, under Llama's
    prefix, those starting with a space (its Metaspace adds no second "▁"; we are
    SentencePiece's) and those with special tokens (it prefixes only the first text, llama.cpp
    each after a token: test_encode_as_llamacpp); equal decodes."""
    transformers = pytest.importorskip("transformers")
    name, model, path = made
    shutil.copy(path, tmp_path / path.name)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    tok = Tokenizer.from_gguf(path)
    sp = spm.SentencePieceProcessor(model_proto=model)
    differ = []
    for text in PLAIN:
        ours, theirs = tok.encode(text, add_special_tokens=True), ref.encode(text)
        if ours != theirs:
            differ.append(text)
        assert tok.decode(ours) == ref.decode(ours, skip_special_tokens=True), text
    want = [t for t in PLAIN if name == "llama" and (t.startswith(" ") or tok.has_special_text(t))]
    assert differ == want
    for text in want:
        if not tok.has_special_text(text):
            assert tok.encode(text, parse_special_tokens=False) == sp.encode(text)


# ----- hostile files -----


@pytest.mark.parametrize("keys, says", [
    ({"scores": _DROP}, "no tokenizer.ggml.scores"),
    ({"scores": [0.0] * 5}, "tokenizer.ggml.scores has 5 entries for"),
    ({"token_type": _DROP}, "no tokenizer.ggml.token_type"),
    ({"token_type": [1] * 7}, "tokenizer.ggml.token_type has 7 entries for"),
    ({"tokens": _DROP}, "no tokenizer.ggml.tokens"),
    ({"unknown_token_id": 100000}, "tokenizer.ggml.unknown_token_id 100000 is outside"),
    ({"bos_token_id": 100000}, "bos token id 100000 is outside"),
])
def test_bad_vocabulary_is_refused_naming_the_key(tmp_path, keys, says) -> None:
    path = write_gguf(tmp_path / "bad.gguf", train_spm(True), True, **keys)
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_gguf(path)
    assert says in str(e.value)


def test_duplicate_tokens_and_bad_byte_tokens_are_refused(tmp_path) -> None:
    model = train_spm(True)
    tokens, _, types = vocab_of(model)
    dup = list(tokens)
    dup[10] = dup[11]
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.tokens holds .* twice"):
        Tokenizer.from_gguf(write_gguf(tmp_path / "d.gguf", model, True, tokens=dup))
    typed = list(types)
    typed[tokens.index("<tool>")] = BYTE
    with pytest.raises(TokenizerError, match="marks '<tool>' as a byte token"):
        Tokenizer.from_gguf(write_gguf(tmp_path / "b.gguf", model, True, token_type=typed))


def test_no_byte_tokens_maps_unknown_characters_as_sentencepiece(tmp_path) -> None:
    """A model trained without byte fallback: a character outside it is the unknown token (a
    run of them one), as SentencePiece encodes it; without an unknown token id, refused."""
    model = train_spm(False, byte_fallback=False)
    sp = spm.SentencePieceProcessor(model_proto=model)
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "nb.gguf", model, False))
    for text in ["hello 你好 world", "🦙🦙 x", "straße"]:
        assert tok.encode(text, parse_special_tokens=False) == sp.encode(text), text
    assert sp.unk_id() in tok.encode("你好")
    with pytest.raises(TokenizerError, match=r"no byte tokens .* and no tokenizer\.ggml\.unknown_token_id"):
        Tokenizer.from_gguf(write_gguf(tmp_path / "nu.gguf", model, False, unknown_token_id=_DROP))


def test_other_tokenizer_models_are_refused_by_name(tmp_path) -> None:
    for model in ("bert", "t5", "rwkv"):
        path = write_gguf(tmp_path / f"{model}.gguf", train_spm(True), True, model=model)
        with pytest.raises(TokenizerError, match=f"GGUF tokenizer model '{model}' is not supported"):
            Tokenizer.from_gguf(path)


def test_phi3_s_special_tokens_strip_the_whitespace_after_them(tmp_path) -> None:
    """llama.cpp's rule for a model named Phi-3 (general.name): whitespace after a special or
    user-defined token is dropped (not after <unk>, <s>, <|endoftext|>); other names keep it."""
    model = train_spm(False)
    for i, (name, strips) in enumerate((("Phi-3 Mini 4k Instruct", True), ("Llama 2 7b", False))):
        tok = Tokenizer.from_gguf(_named(tmp_path / f"{i}.gguf", model, name))
        assert (tok.encode("<start_of_turn> \n user") == tok.encode("<start_of_turn>user")) == strips, name
        assert (tok.encode("<tool>\tx", parse_special_tokens=False) == tok.encode("<tool>x")) == strips, name
        assert tok.encode("<unk>  x") != tok.encode("<unk>x")


def _named(path: Path, model: bytes, name: str) -> Path:
    """A Phi-3 file of the model's vocabulary (the space prefix on) named `name`."""
    tokens, scores, types = vocab_of(model)
    sp = spm.SentencePieceProcessor(model_proto=model)
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_name(name)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_defaults_when_keys_are_missing(tmp_path) -> None:
    """llama.cpp's SPM defaults: BOS 1, EOS 2 (and <end_of_turn>, by its text), add BOS, the
    space prefix."""
    model = train_spm(False)
    path = write_gguf(tmp_path / "d.gguf", model, False, bos_token_id=_DROP, eos_token_id=_DROP,
                      add_bos_token=_DROP, add_eos_token=True)
    tok = Tokenizer.from_gguf(path)
    sp = spm.SentencePieceProcessor(model_proto=model)
    end = sp.PieceToId("<end_of_turn>")
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos, tok.add_eos) == (1, (2, end), True, True)
    assert tok.encode("hi", add_special_tokens=True) == [1, *tok.encode("hi"), 2]
    assert tok.encode(" hi") == sp.encode(" hi")  # the prefix: "▁▁hi"


def test_a_unigram_model_tokenizes_as_llamacpp_does(tmp_path) -> None:
    """The converter writes a Unigram model as it writes BPE ones; llama.cpp merges its pieces
    by score, which is not Unigram's segmentation: ours are llama.cpp's, not SentencePiece's."""
    model = train_spm(False, model_type="unigram")
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "u.gguf", model, False))
    tokens, scores, types = vocab_of(model)
    sp = spm.SentencePieceProcessor(model_proto=model)
    for text in PLAIN + _training_lines(1)[:20]:
        assert tok.encode(text) == llamacpp_spm(tokens, scores, types, text, add_space_prefix=True,
                                                parse_special=True), text
    assert [sp.IdToPiece(i) for i in sp.encode("hello world")] == ["▁hello", "▁world"]
    assert len(tok.encode("hello world")) > 2  # no chain of merges reaches "▁hello"


# ----- the converter's files -----


def spm_folder(folder: Path, model: bytes, gemma: bool, chat_template: str | None = None) -> None:
    """`tokenizer.model` and the tokenizer_config.json a Gemma/Llama repository ships
    (added_tokens_decoder: the control pieces special, the user-defined ones not; the chat
    template if given)."""
    tokens, _, types = vocab_of(model)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / f).unlink(missing_ok=True)
    (folder / "tokenizer.model").write_bytes(model)
    added = {str(i): {"content": t, "special": ty in (CONTROL, UNKNOWN), "normalized": False, "lstrip": False,
                      "rstrip": False, "single_word": False}
             for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty in (CONTROL, UNKNOWN, USER_DEFINED)}
    sp = spm.SentencePieceProcessor(model_proto=model)
    cfg = {"tokenizer_class": "GemmaTokenizer" if gemma else "LlamaTokenizer", "added_tokens_decoder": added,
           "bos_token": tokens[sp.bos_id()], "eos_token": tokens[sp.eos_id()], "unk_token": tokens[sp.unk_id()],
           "add_bos_token": True, "add_eos_token": False}
    if gemma:
        cfg["pad_token"] = "<pad>"
    else:
        cfg["legacy"] = True  # Llama 2's: a space prefix on every text, as SentencePiece
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module", params=["gemma2", "llama", "phi3", "llama-unigram"])
def converted(request, tmp_path_factory) -> tuple[str, bytes, Path, Path]:
    """A tiny checkpoint of the family with the SentencePiece model (a Unigram one for
    "llama-unigram"), and its GGUF by convert_hf_to_gguf.py."""
    pytest.importorskip("transformers")
    from benchmarks import make_gguf_models as made
    from tests.helpers import save_tiny_checkpoint

    tools = made.find_converter()
    if tools is None:
        pytest.skip("convert_hf_to_gguf.py not found (benchmarks/make_gguf_models.py: find_converter)")
    from transformers import Gemma2Config, LlamaConfig, Phi3Config

    gemma = request.param == "gemma2"
    # (llama.cpp's Phi-3 rule looks <|endoftext|> up: a Phi-3 vocabulary without it fails to load there)
    model = train_spm(gemma, "unigram" if request.param == "llama-unigram" else "bpe",
                      control=("<|endoftext|>",) if request.param == "phi3" else ())
    n = spm.SentencePieceProcessor(model_proto=model).vocab_size()
    shape = dict(vocab_size=n + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128)
    if gemma:
        config = Gemma2Config(**shape, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    elif request.param == "phi3":  # (the folder's name, "phi3...", names the model Phi-3 in the file)
        config = Phi3Config(**{k: v for k, v in shape.items() if k != "head_dim"}, pad_token_id=None,
                            bos_token_id=1, eos_token_id=2)
    else:
        config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2)
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny_checkpoint(config, folder)
    spm_folder(folder, model, gemma)
    path = folder.parent / f"{request.param}.gguf"
    tools.run_convert(folder, path)
    return request.param, model, folder, path


def test_the_converter_s_file(converted) -> None:
    """The converter's GGUF (the vocabulary padded to the config's size with [PADn]
    tokens) tokenizes as SentencePiece on plain text, as llama.cpp on the rest, and decodes as
    SentencePiece; its ids and flags are the folder's."""
    from worker.weights.gguf_reader import GGUFFile

    name, model, _, path = converted
    if name == "llama-unigram":
        pytest.skip("a Unigram model: test_a_unigram_model_tokenizes_as_llamacpp_does, and llama.cpp's own below")
    sp = spm.SentencePieceProcessor(model_proto=model)
    reader = GGUFFile(path)
    f = reader.fields
    tok = Tokenizer.from_gguf(path, reader)
    assert f["tokenizer.ggml.model"] == "llama" and len(f["tokenizer.ggml.tokens"]) == sp.vocab_size() + 4
    assert f.get("tokenizer.ggml.add_space_prefix", True) == (name != "gemma2")
    assert (tok.bos_token_id, tok.eos_token_ids[0]) == (sp.bos_id(), sp.eos_id()) and tok.add_bos
    for text in PLAIN:
        ids = tok.encode(text, parse_special_tokens=False)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids)
    tokens, scores, types = (f[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    assert ("phi3" in str(f["general.name"]).lower()) == (name == "phi3")
    for text in TEXTS:
        assert tok.encode(text) == llamacpp_spm(tokens, scores, types, text, add_space_prefix=name != "gemma2",
                                                parse_special=True, phi3=name == "phi3"), text


def test_the_converter_s_file_against_transformers(converted) -> None:
    """transformers on the folder and on the GGUF: equal ids on all text with Gemma's
    vocabulary; with Llama's space prefix, equal but where its Metaspace adds no second "▁" to
    a text piece that starts with a space (the folder's, legacy, prefixes each piece after a
    special token as llama.cpp; its GGUF tokenizer only the first: the module docstring).
    Equal decodes."""
    from transformers import AutoTokenizer

    name, _, folder, path = converted
    if name == "llama-unigram":
        pytest.skip("a Unigram model: llama.cpp's tokens are not transformers' (test_a_unigram_model...)")
    tok = Tokenizer.from_gguf(path)
    on_folder = AutoTokenizer.from_pretrained(str(folder))
    on_gguf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in PLAIN:
        if name == "phi3" and tok.has_special_text(text):
            continue  # llama.cpp's whitespace strip after Phi-3's special tokens (test_..._as_llama_cpp_itself)
        ours = tok.encode(text, add_special_tokens=True)
        pieces = tok._special_re.split(text) if tok._special_re else [text]
        llama = name != "gemma2"
        if name == "phi3":  # transformers builds Phi-3's GGUF tokenizer with llama.cpp's prefix rule
            assert ours == on_folder.encode(text) == on_gguf.encode(text), text
            continue
        assert (ours == on_folder.encode(text)) != (llama and any(p.startswith(" ") for p in pieces)), text
        assert (ours == on_gguf.encode(text)) != (llama and (text.startswith(" ") or tok.has_special_text(text))), text
        assert tok.decode(ours) == on_folder.decode(ours, skip_special_tokens=True), text


def _libllama():
    """llama.cpp's own tokenizer (libllama.so of the tree find_converter finds, loaded with
    ctypes; the model's vocabulary only): `load(path)` gives `tokenize(text, add_special,
    parse_special)`; None where the library is not built."""
    import ctypes

    from benchmarks import make_gguf_models as made

    tools = made.find_converter()
    lib_dir = tools.convert.parent / "build" / "bin" if tools else None
    if lib_dir is None or not (lib_dir / "libllama.so").is_file():
        return None

    class ModelParams(ctypes.Structure):  # llama.h's struct llama_model_params
        _fields_ = [("devices", ctypes.c_void_p), ("tensor_buft_overrides", ctypes.c_void_p),
                    ("n_gpu_layers", ctypes.c_int32), ("split_mode", ctypes.c_int), ("load_mode", ctypes.c_int),
                    ("lazy_mode", ctypes.c_int), ("main_gpu", ctypes.c_int32), ("tensor_split", ctypes.c_void_p),
                    ("progress_callback", ctypes.c_void_p), ("progress_callback_user_data", ctypes.c_void_p),
                    ("kv_overrides", ctypes.c_void_p), ("vocab_only", ctypes.c_bool), ("check_tensors", ctypes.c_bool),
                    ("use_extra_bufts", ctypes.c_bool), ("no_host", ctypes.c_bool), ("no_alloc", ctypes.c_bool),
                    ("load_mtp", ctypes.c_bool)]

    for dep in ("libggml-base.so", "libggml-cpu.so", "libggml.so"):
        ctypes.CDLL(str(lib_dir / dep), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(lib_dir / "libllama.so"))
    quiet = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *_: None)
    lib.llama_log_set(quiet, None)
    lib.llama_backend_init()
    lib.llama_model_default_params.restype = ModelParams
    lib.llama_model_load_from_file.restype = ctypes.c_void_p
    lib.llama_model_load_from_file.argtypes = [ctypes.c_char_p, ModelParams]
    lib.llama_model_get_vocab.restype = ctypes.c_void_p
    lib.llama_model_get_vocab.argtypes = [ctypes.c_void_p]
    lib.llama_tokenize.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                                   ctypes.c_int32, ctypes.c_bool, ctypes.c_bool]
    lib.llama_vocab_is_eog.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    lib.llama_vocab_is_eog.restype = ctypes.c_bool
    lib.llama_vocab_n_tokens.argtypes = [ctypes.c_void_p]

    def load(path: Path):
        params = lib.llama_model_default_params()
        params.vocab_only = True
        model = lib.llama_model_load_from_file(str(path).encode(), params)
        assert model, f"libllama could not load {path}"
        vocab = lib.llama_model_get_vocab(model)

        def tokenize(text: str, add_special: bool, parse_special: bool) -> list[int]:
            data = text.encode()
            out = (ctypes.c_int32 * (len(data) + 8))()
            n = lib.llama_tokenize(vocab, data, len(data), out, len(out), add_special, parse_special)
            assert n >= 0
            return list(out[:n])

        eog = {i for i in range(lib.llama_vocab_n_tokens(vocab)) if lib.llama_vocab_is_eog(vocab, i)}
        return tokenize, eog, quiet  # (the callback must outlive the library's use of it)

    return load


def test_the_converter_s_file_as_llama_cpp_itself(converted) -> None:
    """llama.cpp's own tokenizer (libllama, where built) on the converter's file: our ids,
    with and without BOS, special tokens parsed or not, and our end-of-generation tokens; a
    Unigram model's too."""
    load = _libllama()
    if load is None:
        pytest.skip("llama.cpp's libllama.so is not built (shared/tools/build_llamacpp.sh)")
    _, _, _, path = converted
    llama_tokenize, eog, _keep = load(path)
    tok = Tokenizer.from_gguf(path)
    assert set(tok.eos_token_ids) == eog
    for text in TEXTS + _training_lines(2)[:30]:
        for add_special in (False, True):
            for parse_special in (True, False):
                assert tok.encode(text, add_special, parse_special) == llama_tokenize(text, add_special, parse_special), \
                    (text, add_special, parse_special)
