"""A GGUF file's metadata read by the type each key must have.

The reader (gguf_reader.py) returns each value as the file typed it: an int, a float, a bool,
a string or a list of them. A damaged or hostile file can give any key any of those, and a
value of the wrong type would otherwise fail far from the file (a TypeError inside the
tokenizers library, a float("...") naming no key) or, worse, be taken silently (bool("no")
is True; 1.5 a token id; a NaN epsilon). Here each read names the type it expects and a
value of another is refused, naming the key and a bounded prefix of what the file holds.
An absent key gives the default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_SHOWN = 100  # characters of a wrong value quoted in the message


class MetadataError(ValueError):
    """A metadata key holds a value of the wrong type or range; the message names the key."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shown(value: Any) -> str:
    """A bounded quote of a value: a long string cut, a list's first items and its length
    (a vocabulary's 150,000 strings are not turned into one)."""
    if isinstance(value, list):
        return f"[{', '.join(_shown(v) for v in value[:3])}{', ...' if len(value) > 3 else ''}]"
    if isinstance(value, str):
        return repr(value[:_SHOWN]) + ("..." if len(value) > _SHOWN else "")
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


class Metadata:
    """Typed reads of `fields` (a GGUF file's metadata, as GGUFFile.fields holds it); errors
    start with `where` (the file's path), when given."""

    def __init__(self, fields: Mapping[str, Any], where: str | Path | None = None) -> None:
        self.fields = fields
        self._where = f"{where}: " if where is not None else ""

    def bad(self, key: str, value: Any, expected: str) -> MetadataError:
        kind = f"{len(value)} items" if isinstance(value, list) else type(value).__name__
        return MetadataError(f"{self._where}GGUF {key} = {_shown(value)} ({kind}): {expected} expected")

    def raw(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def integer(self, key: str, default: int | None = None, *, low: int | None = 0) -> int | None:
        """An integer (not a bool), at least `low` (None: any)."""
        v = self.fields.get(key, default)
        if v is None:
            return None
        if not _is_int(v) or (low is not None and v < low):
            raise self.bad(key, v, "an integer" if low is None else f"an integer of at least {low}")
        return v

    def number(self, key: str, default: float | None = None, *, positive: bool = True) -> float | None:
        """A finite float (an integer taken as one); above 0 where `positive`."""
        v = self.fields.get(key, default)
        if v is None:
            return None
        if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v) or (positive and v <= 0):
            raise self.bad(key, v, "a finite number above 0" if positive else "a finite number")
        return float(v)

    def string(self, key: str, default: str | None = None) -> str | None:
        v = self.fields.get(key, default)
        if v is not None and not isinstance(v, str):
            raise self.bad(key, v, "a string")
        return v

    def flag(self, key: str, default: bool | None = None) -> bool | None:
        v = self.fields.get(key, default)
        if v is not None and not isinstance(v, bool):
            raise self.bad(key, v, "a bool")
        return v

    def strings(self, key: str) -> list[str] | None:
        v = self.fields.get(key)
        if v is not None and not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            raise self.bad(key, v, "an array of strings")
        return v

    def integers(self, key: str) -> list[int] | None:
        v = self.fields.get(key)
        if v is not None and not (isinstance(v, list) and all(_is_int(i) for i in v)):
            raise self.bad(key, v, "an array of integers")
        return v
