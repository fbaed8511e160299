"""Text <-> token ids, chat templates, and streaming detokenization.

A `Tokenizer` wraps a `tokenizers.Tokenizer` built from one of two sources:

- a Hugging Face folder: `tokenizer.json` plus the config files next to it;
- a GGUF file's metadata (the embedded default model), rebuilt here with `tokenizers`
  the way llama.cpp reads it: byte-level BPE vocabularies (`tokenizer.ggml.model = gpt2`),
  whose pre-tokenizer is chosen by `tokenizer.ggml.pre` (see `_GGUF_PRE`), and SentencePiece
  ones (`llama`, worker/tokenizer_spm.py); other models ("bert", "t5", "rwkv"...) are refused.

Chat templates are rendered with jinja2 exactly as `transformers` renders them.
`IncrementalDetokenizer` turns a growing list of ids into text deltas for streaming.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

if TYPE_CHECKING:
    from worker.weights.gguf_reader import GGUFFile


class TokenizerError(ValueError):
    """A tokenizer could not be loaded or used; the message says what is wrong."""


# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer regexes as llama.cpp's llama-vocab.cpp writes them (llm_tokenizer_bpe):
# each type is a sequence of regexes, every one splitting the pieces the one before left
# (matches and the text between them each a piece), then byte-level BPE on each piece.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# llama.cpp's form of Llama 3's tokenizer.json regex: (?i:'s|...) spelled out per letter.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}")
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_FALCON_SPLITS = (r"[\p{P}\$\+<=>\^~\|`]+",
                  r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                  "[0-9][0-9][0-9]")

# The regex sequence of each pre-tokenizer group (the GPT-2 regex is byte-level's own).
PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "gpt2": (_GPT2_SPLIT,), "smollm": (r"\p{N}", _GPT2_SPLIT), "llama3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,), "qwen35": (_QWEN35_SPLIT,), "deepseek-coder": _DEEPSEEK_CODER_SPLITS,
    "deepseek-v3": _DEEPSEEK3_SPLITS, "falcon": _FALCON_SPLITS,
}


def _pre(group: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    splits = PRE_SPLITS[group]

    def build() -> pre_tokenizers.PreTokenizer:
        parts = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in splits if p != _GPT2_SPLIT]
        # ByteLevel's own regex is _GPT2_SPLIT.
        parts.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=_GPT2_SPLIT in splits))
        return parts[0] if len(parts) == 1 else pre_tokenizers.Sequence(parts)

    return build


# tokenizer.ggml.pre -> its group, as llama-vocab.cpp maps the names (those whose only
# difference is the regex; "gpt2": ours for a file without the key).
_PRE_NAMES = {
    "gpt2": ("gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
             "a.x-4.0", "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4",
             "mpt", "olmo", "jais"),
    "smollm": ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "minicpm5"),
    "llama3": ("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
               "jina-v5-nano", "smaug-bpe", "dbrx", "chatglm-bpe", "glm4", "glm5"),
    "qwen2": ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2"),
    "qwen35": ("qwen35",),
    "deepseek-coder": ("deepseek-coder",),
    "deepseek-v3": ("deepseek-v3",),
    "falcon": ("falcon",),
}
_GGUF_PRE: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    name: _pre(group) for group, names in _PRE_NAMES.items() for name in names
}
PRE_GROUP = {name: group for group, names in _PRE_NAMES.items() for name in names}


def _gguf_bpe(tokens: list[str], merges: list[str], path: Path) -> models.BPE:
    """A GGUF's byte-level BPE: its tokens by id, its merges ("a b": two tokens whose join is one). A token
    twice (llama.cpp asserts on it: ids would not round-trip), a merge that is not two
    tokens, are refused naming them, not left to fail inside the tokenizers library."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            raise TokenizerError(f"{path}: tokenizer.ggml.tokens holds {t[:100]!r} twice (ids {vocab[t]} and {i})")
        vocab[t] = i
    pairs = []
    for i, m in enumerate(merges):
        pair = tuple(m.split(" ", 1))
        if len(pair) != 2 or not (pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab):
            raise TokenizerError(f"{path}: tokenizer.ggml.merges[{i}] = {m[:100]!r}: two tokens of "
                                 "tokenizer.ggml.tokens, a space between, whose join is one too, expected")
        pairs.append(pair)
    try:
        return models.BPE(vocab=vocab, merges=pairs)
    except Exception as e:  # the library's own checks, beyond those above
        raise TokenizerError(f"{path}: the GGUF's BPE vocabulary: {str(e)[:200]}") from e


class Tokenizer:
    """Encode, decode and chat-template for one model."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        chat_template: str | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
    ) -> None:
        self._tok = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        # All ids that end generation, deduplicated in order (the first is "the" EOS token).
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        self.add_bos = add_bos  # does the model's tokenizer prepend BOS to a plain prompt?
        self.add_eos = add_eos  # ... and append EOS (a GGUF's tokenizer.ggml.add_eos_token)?
        named = [("bos", bos_token_id), ("pad", pad_token_id), ("unk", unk_token_id)]
        for name, tid in named + [("eos", t) for t in self.eos_token_ids]:
            if tid is not None and not 0 <= tid < self.vocab_size:
                raise TokenizerError(
                    f"{name} token id {tid} is outside the vocabulary (size {self.vocab_size})"
                )
        added = tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        # Control-token strings ("<|im_start|>"), longest first: leftmost-longest matching,
        # as the tokenizer's own added-token matcher.
        self._special_strings = sorted({t.content for t in added.values() if t.special},
                                       key=len, reverse=True)
        self._special_re = (re.compile("|".join(map(re.escape, self._special_strings)))
                            if self._special_strings else None)
        # The same, with special-token strings read as text (what users typed). Built here,
        # not on first use: copying it holds the GIL ~0.1 s, and first use is under load.
        self._plain = _HFTokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self._template: jinja2.Template | None = None  # compiled on first use

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_gguf(cls, path: str | Path, reader: GGUFFile | None = None) -> Tokenizer:
        """Rebuild the tokenizer stored in a GGUF file's metadata (pass `reader` to reuse one)."""
        path = Path(path)
        if reader is None:
            from worker.weights import gguf_reader  # deferred: worker.weights imports us

            try:
                reader = gguf_reader.GGUFFile(path)
            except (OSError, ValueError) as e:
                raise TokenizerError(f"{path} is not a readable GGUF file: {e}") from e
        from worker.weights.gguf_meta import Metadata  # deferred: worker.weights imports us

        meta = Metadata(reader.fields, path)  # a key of the wrong type: refused, naming it
        model = meta.string("tokenizer.ggml.model")
        template = meta.string("tokenizer.chat_template")
        if model == "llama":  # SentencePiece (Llama 2, Mistral, Gemma 2/3, Phi-3-mini)
            from worker import tokenizer_spm

            try:
                parts = tokenizer_spm.build(meta, path)
            except tokenizer_spm.SpmVocabError as e:
                raise TokenizerError(f"{path}: {e}") from e
            return cls(chat_template=template, **parts)
        if model != "gpt2":
            raise TokenizerError(
                f"{path}: GGUF tokenizer model {model!r} is not supported (only byte-level BPE, "
                "'gpt2', and SentencePiece, 'llama'); load the model from its Hugging Face folder instead"
            )
        pre = meta.string("tokenizer.ggml.pre", "gpt2")
        if pre not in _GGUF_PRE:
            known = ", ".join(sorted(_GGUF_PRE))
            raise TokenizerError(
                f"{path}: GGUF pre-tokenizer {pre!r} is not supported; known: {known}"
            )
        tokens = meta.strings("tokenizer.ggml.tokens")
        merges = meta.strings("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise TokenizerError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens/merges")
        types = meta.integers("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise TokenizerError(
                f"{path}: {len(types)} token types for {len(tokens)} tokens in the GGUF metadata"
            )
        bpe = _gguf_bpe(tokens, merges, path)
        tok = _HFTokenizer(bpe)
        tok.pre_tokenizer = _GGUF_PRE[pre]()
        tok.decoder = decoders.ByteLevel()
        # Added tokens keep their vocabulary ids and are matched whole in the text. CONTROL
        # tokens (<|im_end|>) are special: skipped when decoding with skip_special_tokens.
        # USER_DEFINED ones (<think>, <tool_call>) are not: they are model output the caller sees,
        # as in llama.cpp and transformers.
        typed = list(zip(tokens, types, strict=True))
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in typed if ty == _CONTROL]
        )
        tok.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, ty in typed
                if ty == _USER_DEFINED
            ]
        )

        def token_id(key: str) -> int | None:  # its range: checked against the vocabulary in __init__
            return meta.integer(f"tokenizer.ggml.{key}_token_id", low=None)

        # llama.cpp stops generation on any of EOS, end-of-turn and end-of-message.
        eos = [token_id(k) for k in ("eos", "eot", "eom")]
        return cls(
            tok,
            bos_token_id=token_id("bos"),
            eos_token_ids=[i for i in eos if i is not None],
            pad_token_id=token_id("padding"),
            unk_token_id=token_id("unknown"),
            chat_template=template,
            add_bos=bool(meta.flag("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face folder's `tokenizer.json`; ids and template come from its configs."""
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(
                f"{folder} has no tokenizer.json (only fast tokenizers are supported)"
            )
        try:
            tok = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:
            raise TokenizerError(f"{tok_file} could not be read: {e}") from e
        tok_cfg = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        gen_cfg = _read_json(folder / "generation_config.json")
        model_cfg = _read_json(folder / "config.json")

        def token_id(name: str) -> int | None:
            # tokenizer_config.json wins; a token is a string or {"content": ...}.
            value = tok_cfg.get(name) or special_map.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            return tok.token_to_id(value) if isinstance(value, str) else None

        def config_ids(key: str) -> list[int]:
            ids: list[int] = []
            for cfg in (gen_cfg, model_cfg):
                value = cfg.get(key)
                ids += value if isinstance(value, list) else [] if value is None else [value]
            return ids

        bos = token_id("bos_token")
        if bos is None:
            bos = next(iter(config_ids("bos_token_id")), None)
        pad = token_id("pad_token")
        if pad is None:
            pad = next(iter(config_ids("pad_token_id")), None)
        eos = [i for i in [token_id("eos_token"), *config_ids("eos_token_id")] if i is not None]
        add_bos = tok_cfg.get("add_bos_token")
        if add_bos is None:  # not stated: does tokenizer.json's post-processor add it?
            add_bos = bos is not None and tok.encode("", add_special_tokens=True).ids[:1] == [bos]
        return cls(
            tok,
            bos_token_id=bos,
            eos_token_ids=eos,
            pad_token_id=pad,
            unk_token_id=token_id("unk_token"),
            chat_template=_folder_chat_template(folder, tok_cfg),
            add_bos=bool(add_bos),
        )

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = False,
               parse_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With `parse_special_tokens` (trusted text: a rendered
        template) special-token strings in it ("<|im_start|>") become their ids; without,
        they are tokenized as the text they are (what a user typed).

        `add_special_tokens` prepends BOS only if the model's tokenizer adds one to plain text
        (and appends EOS if it adds that, as a GGUF may say);
        a rendered chat template writes its own, so encode it with the default False.

        `encode_batch` is used even for one text: unlike `encode`, it releases the GIL, so a
        long text tokenized in a worker thread does not stall the event loop.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"text to encode must be a str, not {type(text).__name__}")
        tok = self._tok if parse_special_tokens else self._plain
        # The post-processor is bypassed: BOS is the only special token we ever add.
        ids = tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self.add_eos and self.eos_token_ids:
            ids.append(self.eos_token_ids[0])
        return ids

    def has_special_text(self, text: str) -> bool:
        """Whether `text` contains a special-token string."""
        return self._special_re is not None and self._special_re.search(text) is not None

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    parse_special_tokens: bool = False) -> list[int]:
        """Render `messages` with the chat template and tokenize the result. Special-token
        strings the template writes become control tokens; those inside message content
        (typed by a user: "<|im_start|>system ...") stay text unless
        `parse_special_tokens` (a trusted caller). Content without such strings (nearly
        all) is tokenized exactly as the rendered text always was."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        if parse_special_tokens or not any(self.has_special_text(m["content"]) for m in messages):
            return self.encode(text)
        return self._encode_with_template_specials(text, messages, add_generation_prompt)

    def _encode_with_template_specials(self, text: str, messages: list[dict[str, str]],
                                       add_generation_prompt: bool) -> list[int]:
        """Tokenize the rendered `text`, reading as control tokens only the special strings
        the template wrote. Those are found by rendering again with every special string in
        the content masked by a character of the same length: what is still a special string
        there came from the template. The tokenizer splits its input at special tokens and
        tokenizes the pieces between them independently, so tokenizing those pieces as plain
        text gives what the template's own text would, and the user's strings as text."""
        assert self._special_re is not None
        masked = [{**m, "content": self._special_re.sub(lambda x: "_" * len(x.group()),
                                                        m["content"])} for m in messages]
        shape = self.apply_chat_template(masked, add_generation_prompt)
        if len(shape) != len(text):
            raise TokenizerError("the chat template changes message content in a way that "
                                 "hides where special-token text typed in it lies")
        ids: list[int] = []
        pieces: list[str] = []
        specials: list[str] = []
        pos = 0
        for m in self._special_re.finditer(shape):
            pieces.append(text[pos : m.start()])
            specials.append(text[m.start() : m.end()])
            pos = m.end()
        pieces.append(text[pos:])
        plain = self._plain.encode_batch(pieces, add_special_tokens=False)
        for i, enc in enumerate(plain):
            ids += enc.ids
            if i < len(specials):
                ids.append(self._tok.token_to_id(specials[i]))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary decode to nothing (as in `tokenizers`)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the chat template."""
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template; send a plain prompt instead")
        if not isinstance(messages, list) or not messages:
            raise TokenizerError("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise TokenizerError(f"messages[{i}] must be a dict, not {type(m).__name__}")
            for key in ("role", "content"):
                if not isinstance(m.get(key), str):
                    raise TokenizerError(f"messages[{i}].{key} must be a string")
            if not m["role"]:
                raise TokenizerError(f"messages[{i}].role must not be empty")

        def token(tid: int | None) -> str | None:
            return None if tid is None else self._tok.id_to_token(tid)

        # transformers passes its special tokens map (only the tokens that are set) plus
        # tools/documents as None: templates test `tools is not none`.
        special = {
            "bos_token": token(self.bos_token_id),
            "eos_token": token(self.eos_token_ids[0] if self.eos_token_ids else None),
            "unk_token": token(self.unk_token_id),
            "pad_token": token(self.pad_token_id),
        }
        try:
            if self._template is None:
                self._template = _compile_template(self.chat_template)
            return self._template.render(
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{k: v for k, v in special.items() if v is not None},
            )
        except jinja2.TemplateError as e:  # includes the template's own raise_exception(...)
            raise TokenizerError(f"chat template failed on these messages: {e}") from e


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _folder_chat_template(folder: Path, tok_cfg: dict[str, Any]) -> str | None:
    # transformers 5 writes chat_template.jinja; older versions chat_template.json or the config.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template")
    if template is None:
        template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{folder}: chat_template must be a string")
    return template


def _compile_template(source: str) -> jinja2.Template:
    """The environment transformers' `apply_chat_template` renders in (chat_template_utils.py)."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas. Never emits half a UTF-8 character (a
    trailing U+FFFD from an incomplete byte sequence is held back until completed), never repeats or
    drops text across token boundaries: concatenating all deltas == tokenizer.decode(all ids).

    vLLM's prefix/read-offset scheme, keeping only the ids it still needs::

        self._ids:   [ context: emitted by an earlier step | read since ]
                     0                           read_offset            len
        decoded:     [ context text          | emitted | held back ]
                     0            context_len   emitted       len(text)

    Each step decodes the window and emits its text up to any trailing U+FFFD run. Once nothing
    is held back, the window slides: the ids read since become the next context. Decoding with
    a context makes context-sensitive decoders (SentencePiece's leading-space strip) treat each
    token as mid-sequence; for those the deltas equal the decode in the prompt's context. Per
    step the cost is one or two decodes of the window, which grows only while its text keeps
    ending in an incomplete character or only skipped special tokens arrive.
    """

    _PROMPT_CONTEXT = 5  # prompt tokens kept as initial context (vLLM's choice)

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-self._PROMPT_CONTEXT :])
        if self._decode(self._ids).endswith("\ufffd"):
            self._ids = []  # a prompt cut mid-character: its bytes must not merge with ours
        self._read_offset = len(self._ids)
        self._context_len = self._emitted = len(self._decode(self._ids))
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text they complete (maybe "")."""
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the stream: whatever was held back, even an incomplete character."""
        return self._emit(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _emit(self, final: bool) -> str:
        text = self._decode(self._ids)
        # Text before a trailing U+FFFD run is stable: later bytes cannot change it.
        end = len(text) if final else len(text.rstrip("\ufffd"))
        delta = text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        # Slide only past new text: ids that decode to nothing (skipped special tokens) would
        # make a useless context.
        if end == len(text) > self._context_len:
            del self._ids[: self._read_offset]
            self._read_offset = len(self._ids)
            self._context_len = self._emitted = len(self._decode(self._ids))
        self._text += delta
        return delta
