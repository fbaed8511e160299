"""Structured outputs: a constraint on what a request may generate (a JSON schema, a
regular expression, a choice among strings, a Lark or GBNF grammar), compiled by
llguidance into a matcher over the model's vocabulary.

    door (its executor, never the loop)          engine thread (each step)
    Constraint --GrammarCompiler.compile--> Grammar (cached by (kind, text))
                                              | .matcher(), at admission
                                              v
                                            req.grammar: GrammarMatcher
                                              fill its row of the token bitmask
                                              (worker.logits_masks) -> sample -> accept(token)
                                              -> done? the request finishes with "stop"

Compiling (the lexer over the vocabulary, the grammar's checks) is the heavy part and
happens once per distinct constraint; a request gets a copy of the compiled matcher (a few
microseconds). A constraint that does not compile, or one llguidance does not support, is
`ConstraintError` (the door's INVALID_ARGUMENT) before the request is queued, never a
failure mid-stream.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance as llg

from worker.structural_tag import StructuralTagError, to_lark
from worker.tokenizer import Tokenizer

# kind -> what it holds. "grammar" is either syntax (vLLM's `grammar` field: Lark or
# EBNF/GBNF, told apart by llguidance's converter); "lark" and "gbnf" are explicit;
# "structural_tag" is free text with constrained regions (tool calls; worker.structural_tag).
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "lark", "gbnf",
         "structural_tag")
# JSON is written as json.dumps writes it (", " and ": ", no other whitespace). Flexible
# whitespace (llguidance's default) lets a small model run away in newlines between tokens
# until max_tokens (measured: 4 of 64 greedy schema outputs, and tool-call arrays through
# SMG). A schema's own "x-guidance" options override this.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ERROR_CHARS = 200  # the most of llguidance's error message an error quotes
DEFAULT_CACHE_SIZE = 128  # compiled grammars kept (least recently used dropped first)


class ConstraintError(ValueError):
    """A constraint that cannot be used; `problem` says why (the caller names the field)."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


@dataclass(frozen=True)
class Constraint:
    """One request's constraint, as the wire sent it. `text` is the schema, regex or grammar;
    `choices` the strings of a choice (`text` empty)."""

    kind: str
    text: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind
        object.__setattr__(self, "choices", tuple(self.choices))

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object", '{"type": "object"}')

    @property
    def num_bytes(self) -> int:
        """Its size as the limit counts it: UTF-8 bytes of the text, or of the choices (3
        more each, for the quotes and the separator: a list of empty strings has a size)."""
        if self.kind == "choice":
            return sum(len(c.encode()) + 3 for c in self.choices)
        return len(self.text.encode())

    @property
    def key(self) -> tuple[str, str]:
        """The compile cache's key: kind and text (choices as their JSON list)."""
        return self.kind, self.source

    @property
    def source(self) -> str:
        return json.dumps(list(self.choices)) if self.kind == "choice" else self.text


def _head(message: str) -> str:
    """An llguidance error without the matcher's state dump it may end with."""
    return message.split("<state>", 1)[0].strip()


def _bounded(message: str) -> str:
    message = " ".join(_head(message).split())  # llguidance's messages span lines with carets
    return message if len(message) <= ERROR_CHARS else message[:ERROR_CHARS] + "..."


class Grammar:
    """A compiled constraint: a matcher at its start state, copied for each request."""

    def __init__(self, constraint: Constraint, template: llg.LLMatcher,
                 compile_s: float) -> None:
        self.constraint = constraint
        self._template = template
        self.compile_s = compile_s  # how long compiling took (for the figures)

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self.constraint.kind)


class GrammarMatcher:
    """One request's place in its grammar. Used on the engine thread only (the bitmask fill
    reads it while the engine thread waits for the model, see worker.logits_masks)."""

    def __init__(self, matcher: llg.LLMatcher, kind: str = "") -> None:
        self.matcher = matcher
        self.kind = kind  # the constraint's kind (KINDS), for the metrics
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False when the grammar does not allow it (the
        matcher is then in its error state for good: `error`)."""
        ok = self.matcher.consume_token(token_id)
        self.num_accepted += ok
        return ok

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but EOS may follow (or the matcher failed)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return _bounded(self.matcher.get_error())

    @property
    def over_limit(self) -> bool:
        """Whether the refusal was one of llguidance's limits (the mask allowed the token,
        but advancing past it was too much): the constraint's doing, not the worker's."""
        return grammar_limit(self.matcher.get_error())


# llguidance's words when consuming a token its mask allowed takes it past one of its limits.
_LIMIT = re.compile(r"(?i)\btoo many\b|\blimit\b")


def grammar_limit(error: str) -> bool:
    """Whether an llguidance error is one of its limits: not a token it does not allow
    ("Parser Error: token ..." quotes the token, which may spell anything), and said before
    the matcher's state dump."""
    head = _head(error)
    return not head.startswith("Parser Error: token") and bool(_LIMIT.search(head))


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary; thread-safe. The llguidance tokenizer
    (about 0.3 s to build from ours) is made on first use, in the caller's thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: ids past the tokenizer's never match
        self._eos = list(eos_token_ids)
        self._ll: llg.LLTokenizer | None = None
        self._ll_lock = threading.Lock()  # held while it is built: not the cache's lock
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self.cache_size = cache_size
        self.num_compiled = 0  # cache misses
        self.num_hits = 0

    def ll_tokenizer(self) -> llg.LLTokenizer:
        with self._ll_lock:
            if self._ll is None:
                # n_vocab: the model's width, so that a mask row covers the logits and the
                # padding ids past the tokenizer's vocabulary are never allowed.
                self._ll = llg.LLTokenizer(self._tokenizer._tok.to_str(),
                                           n_vocab=self.vocab_size, eos_token=self._eos)
            return self._ll

    def cached(self, constraint: Constraint) -> Grammar | None:
        """The compiled grammar if it is in the cache (cheap: fine on the event loop)."""
        with self._lock:
            grammar = self._cache.get(constraint.key)
            if grammar is not None:
                self._cache.move_to_end(constraint.key)
                self.num_hits += 1
            return grammar

    def compile(self, constraint: Constraint) -> Grammar:
        """The compiled grammar, from the cache or compiled now (slow: not on the loop).
        Raises ConstraintError quoting at most ERROR_CHARS of llguidance's message."""
        grammar = self.cached(constraint)
        if grammar is not None:
            return grammar
        grammar = self._compile(constraint)
        with self._lock:
            self.num_compiled += 1
            self._cache[constraint.key] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, constraint: Constraint) -> Grammar:
        if self._tokenizer.vocab_size > self.vocab_size:  # a mask row must cover the logits
            raise ConstraintError(f"cannot be served by this model: its tokenizer has "
                                  f"{self._tokenizer.vocab_size} tokens, its logits "
                                  f"{self.vocab_size}")
        ll = self.ll_tokenizer()
        start = time.perf_counter()
        if constraint.kind == "choice":
            if not constraint.choices:
                raise ConstraintError("is empty: send at least one string")
            if any(not c for c in constraint.choices):
                raise ConstraintError("holds an empty string")
        elif not constraint.text:
            raise ConstraintError("is empty")
        if constraint.kind in ("json_schema", "json_object"):
            try:
                schema = json.loads(constraint.text)
            except (ValueError, RecursionError) as e:  # nested past Python's stack
                raise ConstraintError(f"is not valid JSON: {_bounded(str(e))}") from None
            # llguidance ignores options it cannot read (a structural tag's schema refuses them)
            if isinstance(schema, dict) and not isinstance(schema.get("x-guidance", {}), dict):
                raise ConstraintError("x-guidance must be an object of llguidance's JSON options")
        try:
            if constraint.kind in ("json_schema", "json_object"):
                spec = llg.LLMatcher.grammar_from_json_schema(constraint.text,
                                                              defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
            elif constraint.kind == "structural_tag":
                spec = to_lark(constraint.text, JSON_DEFAULTS)
            else:
                spec = llg.grammar_from(constraint.kind, constraint.source)  # type: ignore[arg-type]
        except StructuralTagError as e:
            raise ConstraintError(f"is not a structural tag we can serve: {_bounded(str(e))}") from None
        except (ValueError, TypeError) as e:
            raise ConstraintError(f"does not compile: {_bounded(str(e))}") from None
        # The constructor releases the GIL while it builds; errors leave it in an error state.
        matcher = llg.LLMatcher(ll, spec, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"does not compile: {_bounded(matcher.get_error())}")
        # The first mask builds lazy lexer state that the requests' copies share: built
        # here, off the engine thread.
        matcher.compute_bitmask()
        if matcher.is_error():
            if _head(matcher.get_error()) == "NoExtensionBias":  # no token may begin it
                raise ConstraintError("allows no output: no token can begin it")
            raise ConstraintError(f"does not compile: {_bounded(matcher.get_error())}")
        return Grammar(constraint, matcher, time.perf_counter() - start)
