"""SentencePiece vocabularies in GGUF files (`tokenizer.ggml.model = "llama"`), rebuilt with
`tokenizers` to tokenize as llama.cpp's SPM tokenizer does (llm_tokenizer_spm in
src/llama-vocab.cpp), which is SentencePiece's own BPE encoding:

- spaces become "▁" and, with `tokenizer.ggml.add_space_prefix` (true unless the file says
  otherwise; Gemma's converter writes false), every piece of text between special tokens gets
  one leading "▁" (llama.cpp prefixes each such fragment, even one that starts with a space);
- the text is cut into characters and adjacent symbols are merged, best-scored result first
  (`tokenizer.ggml.scores`), while their concatenation is a token; ties go to the leftmost.
  That is a byte-pair encoding whose merges are every split of every token into two tokens,
  ranked by the token's score, which is what is built here (the file stores no merges);
- a character outside the vocabulary becomes its UTF-8 bytes as the <0xNN> tokens (type BYTE);
  a vocabulary without byte tokens maps it to its unknown token, as SentencePiece does
  (llama.cpp would fail on such text);
- decoding turns "▁" back into spaces, reassembles byte tokens into UTF-8 and, with the
  space prefix, drops the first leading space (SentencePiece's decode, and transformers');
- CONTROL and UNKNOWN tokens are special (matched in trusted text only, skipped when decoding
  with skip_special_tokens); USER_DEFINED ones are always matched whole in the raw text, as
  in llama.cpp (Gemma's whitespace-run tokens are stored with real spaces for this); for a
  model named Phi-3 the whitespace after them is dropped, as llama.cpp does;
- generation ends on EOS, the end-of-turn and end-of-message ids, and the tokens llama.cpp
  recognises by their text (<end_of_turn>, <|end|>...: Gemma's and Phi-3's files name no
  end-of-turn id); ids and flags default as llama.cpp's (BOS 1, EOS 2, add BOS).

Checked against llama.cpp itself (libllama) on the converter's files: tests/test_tokenizer_spm.py.

Known differences from llama.cpp, all in vocabularies no converter writes: two different
tokens of equal score merge in rank order here, leftmost first there; a character outside
the vocabulary that would merge with a neighbour into a token is byte-encoded first here;
special tokens are matched leftmost-longest here, longest token first there.

A Unigram SentencePiece model is written by llama.cpp's converter the same way ("llama") and
tokenized by llama.cpp with these merges, not by Unigram's best segmentation: served from a
GGUF it tokenizes as llama.cpp does, which may differ from SentencePiece's own tokenization.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as _HFTokenizer

if TYPE_CHECKING:  # worker.weights imports worker.tokenizer, which imports this
    from worker.weights.gguf_meta import Metadata

log = logging.getLogger(__name__)

SPACE = "\u2581"  # "▁": SentencePiece's escaped space
# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")
# The texts llama.cpp (llama-vocab.cpp, special_eog_ids) ends generation on, in any file.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[")


class SpmVocabError(ValueError):
    """The file's SentencePiece vocabulary cannot be used; the message names the key."""


def _array(meta: Metadata, key: str, n: int | None, kind: type | tuple[type, ...]) -> list[Any]:
    """The array at `key`: present, of `n` entries (when given), each of `kind`."""
    value = meta.raw(key)
    if value is None:
        raise SpmVocabError(f"no {key}: a SentencePiece vocabulary needs it")
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise SpmVocabError(f"{key} must be an array of {getattr(kind, '__name__', 'numbers')}")
    if n is not None and len(value) != n:
        raise SpmVocabError(f"{key} has {len(value)} entries for {n} tokens (tokenizer.ggml.tokens)")
    return value


def _merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best-scored token first (then lowest id, then
    leftmost split): llama.cpp merges two adjacent symbols when their concatenation is a
    token, of any type, the best-scored such token first."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, t in enumerate(tokens):
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in ids and b in ids:
                ranked.append((-scores[i], i, k, a, b))
    ranked.sort()
    return [(a, b) for _, _, _, a, b in ranked]


def build(meta: Metadata, path: Path) -> dict[str, Any]:
    """The `tokenizers` backend of the file's SentencePiece vocabulary and the keyword
    arguments of worker.tokenizer.Tokenizer (ids, add_bos/add_eos) that go with it.
    `meta`: the file's metadata, read by type (a key of the wrong type is refused)."""
    tokens = _array(meta, "tokenizer.ggml.tokens", None, str)
    if not tokens:
        raise SpmVocabError("tokenizer.ggml.tokens is empty")
    n = len(tokens)
    scores = [float(s) for s in _array(meta, "tokenizer.ggml.scores", n, (int, float))]
    types = _array(meta, "tokenizer.ggml.token_type", n, int)
    # llama.cpp renames an empty token so that it can be looked up (and never matched).
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in vocab:  # llama.cpp asserts on this: ids would not round-trip
            raise SpmVocabError(f"tokenizer.ggml.tokens holds {t!r} twice (ids {vocab[t]} and {i})")
        vocab[t] = i

    def token_id(key: str, default: int | None) -> int | None:
        value = meta.integer(f"tokenizer.ggml.{key}", low=None)  # (its range: the Tokenizer's)
        if value is None:  # llama.cpp's SPM defaults (bos 1, eos 2), where they exist
            return default if default is not None and default < n else None
        return value

    bos, eos, unk = token_id("bos_token_id", 1), token_id("eos_token_id", 2), token_id("unknown_token_id", None)
    if unk is not None and not 0 <= unk < n:
        raise SpmVocabError(f"tokenizer.ggml.unknown_token_id {unk} is outside the vocabulary (size {n})")
    byte_tokens = [t for t, ty in zip(tokens, types, strict=True) if ty == BYTE]
    if any(not _BYTE_TOKEN.fullmatch(t) for t in byte_tokens):
        bad = next(t for t in byte_tokens if not _BYTE_TOKEN.fullmatch(t))
        raise SpmVocabError(f"tokenizer.ggml.token_type marks {bad!r} as a byte token: not <0xNN>")
    if not byte_tokens and unk is None:
        raise SpmVocabError("no byte tokens (<0x00>..<0xFF>, tokenizer.ggml.token_type 6) and no "
                            "tokenizer.ggml.unknown_token_id: text outside the vocabulary could not be tokenized")
    if byte_tokens and len(byte_tokens) < 256:
        log.warning("%s: %d of the 256 byte tokens: a character needing a missing one becomes %s", path,
                    len(byte_tokens), "the unknown token" if unk is not None else "nothing")
    if not byte_tokens:
        log.warning("%s: no byte tokens: characters outside the vocabulary become the unknown token %r, as "
                    "SentencePiece does (llama.cpp fails on such text)", path, tokens[unk])

    bpe = models.BPE(vocab=vocab, merges=_merges(tokens, scores), byte_fallback=bool(byte_tokens),
                     unk_token=tokens[unk] if unk is not None else None, fuse_unk=True)
    tok = _HFTokenizer(bpe)
    prefix = meta.flag("tokenizer.ggml.add_space_prefix", True)
    # A normalizer, not a pre-tokenizer: it runs on each piece between added tokens, so each
    # gets its "▁" as llama.cpp's fragments do, even one that starts with a space ("▁▁hi").
    escape = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if prefix else escape
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))

    # llama.cpp strips the whitespace after Phi-3's special tokens, chosen by the model's name
    # (llama-vocab.cpp: "phi-3"/"phi3" in general.name), as Phi-3's tokenizer.json does.
    name = (meta.string("general.name") or "").lower()
    phi3 = "phi-3" in name or "phi3" in name

    def rstrip(t: str) -> bool:
        return phi3 and t not in ("<unk>", "<s>", "<|endoftext|>")

    typed = list(zip(tokens, types, strict=True))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, rstrip=rstrip(t))
                            for t, ty in typed if ty in (CONTROL, UNKNOWN)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False, rstrip=rstrip(t))
                    for t, ty in typed if ty == USER_DEFINED])
    add_bos, add_eos = meta.flag("tokenizer.ggml.add_bos_token"), meta.flag("tokenizer.ggml.add_eos_token")
    # llama.cpp stops generation on any of EOS, end-of-turn and end-of-message, and on the
    # tokens its text list names: Gemma 2/3's and Phi-3's files carry no end-of-turn id, and
    # their chat turns end with <end_of_turn> and <|end|>.
    keyed = (eos, token_id("eot_token_id", None), token_id("eom_token_id", None))
    eos_ids = [i for i in keyed if i is not None] + [vocab[t] for t in EOG_TEXTS if t in vocab]
    return {
        "tokenizer": tok,
        "bos_token_id": bos,
        "eos_token_ids": eos_ids,
        "pad_token_id": token_id("padding_token_id", None),
        "unk_token_id": unk,
        "add_bos": True if add_bos is None else bool(add_bos),  # llama.cpp's SPM default
        "add_eos": bool(add_eos),
    }
