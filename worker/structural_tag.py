"""Structural tags (what SMG and vLLM send for tool calls) -> one llguidance Lark grammar.

Two shapes are read, both as vLLM takes them:

- xgrammar's: ``{"type": "structural_tag", "format": FORMAT}``, a tree of formats. What
  SMG's tool parsers build (e.g. ``triggered_tags`` -> ``tags_with_separator`` -> ``tag``
  -> ``json_schema`` for Mistral's ``[TOOL_CALLS] [...]``).
- the older one: ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}],
  "triggers": [...]}``: free text, and a structure wherever its trigger is written.

Free text with tags in it is llguidance's lazy lexeme::

    start: seg* tail                      (triggered_tags)
    seg:   trig_0 ( "rest of begin" %json {...} "end" | ... )
    trig_0[lazy]: TEXT "<trigger>"         matched as soon as the trigger is complete, so a
    TEXT: /(.|\\n)*/                       written trigger always enters its tags

Unbounded content inside a tag (``any_text``, ``triggered_tags``) ends at the tag's end
string, as xgrammar does: a lazy lexeme ``TEXT "end"``. Token-level formats and non-JSON
argument styles are refused (ConstraintError, naming the path in the tag).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

MAX_DEPTH = 16  # formats nest at most this deep (a tool call needs 4)
_ANY = r"/(.|\n)*/"


class StructuralTagError(ValueError):
    """What is wrong with a structural tag, and where (a path like ``format.tags[0]``)."""


def _lit(s: str) -> str:
    return json.dumps(s)  # a JSON string is a Lark string literal for llguidance


def _one_of(strings: list[str]) -> str:
    """A Lark group matching any one of `strings` (a tag's end strings)."""
    return "(" + " | ".join(map(_lit, strings)) + ")"


def _regex(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"


class _Builder:
    def __init__(self, json_defaults: dict[str, Any] | None = None) -> None:
        self.json_defaults = json_defaults or {}  # x-guidance options of every JSON schema
        self.rules: list[str] = []
        self.side: list[dict[str, str]] = []  # grammars referenced as @name (EBNF formats)
        self._n = 0

    def rule(self, body: str, *, prefix: str = "r", lazy: bool = False, terminal: bool = False,
             max_tokens: int | None = None) -> str:
        self._n += 1
        name = f"{prefix}_{self._n}"
        name = name.upper() if terminal else name
        attrs = (["lazy"] if lazy else []) + ([f"max_tokens={max_tokens}"] if max_tokens is not None else [])
        self.rules.append(f"{name}{'[' + ', '.join(attrs) + ']' if attrs else ''}: {body}")
        return name

    def text(self, excludes: list[str]) -> str:
        """A terminal for free text, without any of `excludes` in it."""
        body = _ANY
        if excludes:
            body += " & ~/(.|\\n)*(" + "|".join(_escape_re(e) for e in excludes) + ")(.|\\n)*/"
        return self.rule(body, prefix="text", terminal=True)

    # -- formats ----------------------------------------------------------------------

    def fmt(self, node: Any, path: str, depth: int, end: list[str] | None = None) -> str:
        """A Lark expression for `node`. `end`: the enclosing tag's end strings when the
        node is its whole content; an unbounded node then ends at them (and includes them:
        the caller does not add them again; see `ends_itself`)."""
        if depth > MAX_DEPTH:
            raise StructuralTagError(f"{path}: nests deeper than {MAX_DEPTH} formats")
        if not isinstance(node, dict):
            raise StructuralTagError(f"{path}: must be an object, got {type(node).__name__}")
        kind = node.get("type")
        handler = _FORMATS.get(kind)  # type: ignore[arg-type]
        if handler is None:
            raise StructuralTagError(f"{path}.type: {_bounded(kind)} is not supported (one of "
                                     f"{', '.join(sorted(_FORMATS))})")
        return handler(self, node, path, depth, end)

    def const_string(self, node: dict, path: str, depth: int, end: list[str] | None) -> str:
        return _lit(_str(node, "value", path))

    def json_schema(self, node: dict, path: str, depth: int, end: list[str] | None) -> str:
        style = node.get("style", "json")
        if style != "json":
            raise StructuralTagError(f"{path}.style: {_bounded(style)} is not supported (json)")
        if node.get("any_order"):
            raise StructuralTagError(f"{path}.any_order: is not supported")
        schema = node.get("json_schema")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as e:  # RecursionError: nested past Python's stack
                raise StructuralTagError(f"{path}.json_schema: is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise StructuralTagError(f"{path}.json_schema: must be a JSON schema object")
        if self.json_defaults:
            schema = {**schema, "x-guidance": {**self.json_defaults,
                                               **schema.get("x-guidance", {})}}
        return self.rule("%json " + json.dumps(schema))

    def grammar(self, node: dict, path: str, depth: int, end: list[str] | None) -> str:
        import llguidance as llg

        text = _str(node, "grammar", path)
        try:
            lark = llg.grammar_from("grammar", text)
        except (ValueError, TypeError) as e:
            raise StructuralTagError(f"{path}.grammar: does not parse: {e}") from None
        name = f"g_{len(self.side) + 1}"
        self.side.append({"name": name, "lark_grammar": lark})
        return "@" + name

    def regex(self, node: dict, path: str, depth: int, end: list[str] | None) -> str:
        return _regex(_str(node, "pattern", path))

    def any_text(self, node: dict, path: str, depth: int, end: list[str] | None) -> str:
        text = self.text(_strs(node.get("excludes", []), f"{path}.excludes"))
        max_tokens = _max_tokens(node, path)
        if end is not None:  # up to the tag's end, lazily: the first end string ends it
            return self.rule(f"{text} {_one_of(end)}", prefix="until", lazy=True,
                             max_tokens=max_tokens)
        return text if max_tokens is None else self.rule(text, max_tokens=max_tokens)

    def sequence(self, node: dict, path: str, depth: int, end: list[str] | None) -> str:
        elements = _list(node, "elements", path)
        return " ".join(self.fmt(e, f"{path}.elements[{i}]", depth + 1)
                        for i, e in enumerate(elements)) or '""'

    def or_(self, node: dict, path: str, depth: int, end: list[str] | None) -> str:
        elements = _list(node, "elements", path)
        if not elements:
            raise StructuralTagError(f"{path}.elements: is empty")
        return "(" + " | ".join(self.fmt(e, f"{path}.elements[{i}]", depth + 1)
                                for i, e in enumerate(elements)) + ")"

    def _repeat(self, node: dict, path: str, depth: int, suffix: str) -> str:
        return "(" + self.fmt(node.get("content"), f"{path}.content", depth + 1) + ")" + suffix

    def optional(self, node: dict, path: str, depth: int, end: list[str] | None) -> str:
        return self._repeat(node, path, depth, "?")

    def plus(self, node: dict, path: str, depth: int, end: list[str] | None) -> str:
        return self._repeat(node, path, depth, "+")

    def star(self, node: dict, path: str, depth: int, end: list[str] | None) -> str:
        return self._repeat(node, path, depth, "*")

    def repeat(self, node: dict, path: str, depth: int, end: list[str] | None) -> str:
        lo, hi = node.get("min"), node.get("max")
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo and (hi == -1 or lo <= hi)):
            raise StructuralTagError(f"{path}: min and max must be ints with 0 <= min <= max "
                                     f"(max -1: unbounded), got {_bounded(lo)}, {_bounded(hi)}")
        return self._repeat(node, path, depth, f"{{{lo},}}" if hi == -1 else f"{{{lo},{hi}}}")

    def tag(self, node: dict, path: str, depth: int, end: list[str] | None) -> str:
        begin = node.get("begin")
        if not isinstance(begin, str):
            raise StructuralTagError(f"{path}.begin: must be a string (token-level tags are "
                                     "not supported)")
        ends = node.get("end")
        ends = [ends] if isinstance(ends, str) else ends
        ends = _strs(ends, f"{path}.end")
        content = node.get("content")
        body = self.fmt(content, f"{path}.content", depth + 1, ends)
        tail = "" if ends_itself(content) else " " + _one_of(ends)
        return (_lit(begin) + " " if begin else "") + body + tail

    def triggered_tags(self, node: dict, path: str, depth: int, end: list[str] | None) -> str:
        triggers = _strs(node.get("triggers"), f"{path}.triggers")
        if not triggers or any(not t for t in triggers):
            raise StructuralTagError(f"{path}.triggers: needs at least one non-empty trigger")
        tags = _list(node, "tags", path)
        if not tags:
            raise StructuralTagError(f"{path}.tags: is empty")
        text = self.text(_strs(node.get("excludes", []), f"{path}.excludes"))
        by_trigger: dict[str, list[str]] = {t: [] for t in triggers}
        for i, tag in enumerate(tags):
            tpath = f"{path}.tags[{i}]"
            if not isinstance(tag, dict) or not isinstance(tag.get("begin"), str):
                raise StructuralTagError(f"{tpath}.begin: must be a string")
            matching = [t for t in triggers if tag["begin"].startswith(t)]
            if len(matching) != 1:
                raise StructuralTagError(f"{tpath}.begin: must start with exactly one trigger, "
                                         f"{len(matching)} match {_bounded(tag['begin'])}")
            rest = dict(tag, begin=tag["begin"][len(matching[0]):])
            by_trigger[matching[0]].append(self.tag(rest, tpath, depth + 1, None))
        with_text, bare = [], []  # a tag after free text; a tag right away
        for trigger, bodies in by_trigger.items():
            if not bodies:
                continue
            branch = self.rule(" | ".join(bodies), prefix="tags")
            lead = self.rule(f"{text} {_lit(trigger)}", prefix="trig", lazy=True)
            with_text.append(self.rule(f"{lead} {branch}", prefix="seg"))
            bare.append(self.rule(f"{_lit(trigger)} {branch}", prefix="first"))
        seg, first = " | ".join(with_text), " | ".join(bare)
        tail = text if end is None else self.rule(f"{text} {_one_of(end)}", prefix="until",
                                                  lazy=True)
        end_lit = "" if end is None else " " + _one_of(end)
        at_least_one, stop = bool(node.get("at_least_one")), bool(node.get("stop_after_first"))
        if at_least_one and stop:
            body = f"({first}){end_lit}"
        elif at_least_one:
            body = f"({first}) ({seg})* {tail}"
        elif stop:
            body = f"(({seg}){end_lit} | {tail})"
        else:
            body = f"({seg})* {tail}"
        return self.rule(body, prefix="triggered")

    def tags_with_separator(self, node: dict, path: str, depth: int, end: list[str] | None) -> str:
        tags = _list(node, "tags", path)
        if not tags:
            raise StructuralTagError(f"{path}.tags: is empty")
        sep = _lit(_str(node, "separator", path))
        alt = self.rule(" | ".join(self.tag(t, f"{path}.tags[{i}]", depth + 1, None)
                                   if isinstance(t, dict) else self.fmt(t, f"{path}.tags[{i}]", depth)
                                   for i, t in enumerate(tags)), prefix="tag")
        at_least_one, stop = bool(node.get("at_least_one")), bool(node.get("stop_after_first"))
        if stop:
            return alt if at_least_one else f"({alt})?"
        return f"{alt} ({sep} {alt})*" if at_least_one else f"({alt} ({sep} {alt})*)?"

    def to_lark(self, start: str) -> str:
        lark = "%llguidance {}\nstart: " + start + "\n" + "\n".join(self.rules) + "\n"
        if not self.side:
            return lark
        return json.dumps({"grammars": [{"name": "structural_tag", "lark_grammar": lark},
                                        *self.side]})


_FORMATS: dict[str, Callable[..., str]] = {
    "const_string": _Builder.const_string, "json_schema": _Builder.json_schema,
    "grammar": _Builder.grammar, "regex": _Builder.regex, "any_text": _Builder.any_text,
    "sequence": _Builder.sequence, "or": _Builder.or_, "optional": _Builder.optional,
    "plus": _Builder.plus, "star": _Builder.star, "repeat": _Builder.repeat,
    "tag": _Builder.tag, "triggered_tags": _Builder.triggered_tags,
    "tags_with_separator": _Builder.tags_with_separator,
}


def ends_itself(content: Any) -> bool:
    """Whether a tag's content, being unbounded, ends at (and includes) the tag's end."""
    return isinstance(content, dict) and content.get("type") in ("any_text", "triggered_tags")


def to_lark(text: str, json_defaults: dict[str, Any] | None = None) -> str:
    """The llguidance grammar of a structural tag (its JSON text), for `LLMatcher`;
    `json_defaults`: llguidance's JSON options ("x-guidance") for its JSON schemas.
    Raises StructuralTagError naming what is wrong and where."""
    try:
        tag = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: nested past Python's stack
        raise StructuralTagError(f"is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise StructuralTagError("must be a JSON object")
    if tag.get("type", "structural_tag") != "structural_tag":
        raise StructuralTagError(f"type: must be \"structural_tag\", got {_bounded(tag['type'])}")
    b = _Builder(json_defaults)
    if "format" in tag:
        return b.to_lark(b.fmt(tag["format"], "format", 1))
    if "structures" in tag:  # the older shape: each structure is a tag behind its trigger
        structures = tag["structures"]
        if not isinstance(structures, list) or not structures:
            raise StructuralTagError("structures: must be a non-empty list")
        tags = []
        for i, s in enumerate(structures):
            if not isinstance(s, dict) or "schema" not in s:
                raise StructuralTagError(f"structures[{i}]: needs begin, schema and end")
            tags.append({"type": "tag", "begin": s.get("begin"), "end": s.get("end"),
                         "content": {"type": "json_schema", "json_schema": s["schema"]}})
        fmt = {"type": "triggered_tags", "triggers": tag.get("triggers"), "tags": tags}
        return b.to_lark(b.fmt(fmt, "structures", 1))
    raise StructuralTagError("needs a \"format\" (or the older \"structures\" and \"triggers\")")


def _escape_re(s: str) -> str:
    out = []
    for ch in s:
        out.append("\\" + ch if ch in r"\.^$|?*+()[]{}/" else ("\\n" if ch == "\n" else ch))
    return "".join(out)


def _max_tokens(node: dict, path: str) -> int | None:
    """any_text's token budget (llguidance's max_tokens on its rule)."""
    if node.get("max_chars") is not None:
        raise StructuralTagError(f"{path}.max_chars: is not supported (max_tokens is)")
    n = node.get("max_tokens")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise StructuralTagError(f"{path}.max_tokens: must be an int >= 0, got {_bounded(n)}")
    return n


def _str(node: dict, key: str, path: str) -> str:
    value = node.get(key)
    if not isinstance(value, str):
        raise StructuralTagError(f"{path}.{key}: must be a string, got {_bounded(value)}")
    return value


def _strs(value: Any, path: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise StructuralTagError(f"{path}: must be a list of strings, got {_bounded(value)}")
    return value


def _list(node: dict, key: str, path: str) -> list:
    value = node.get(key)
    if not isinstance(value, list):
        raise StructuralTagError(f"{path}.{key}: must be a list, got {_bounded(value)}")
    return value


def _bounded(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:64] + "..."
