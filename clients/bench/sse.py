"""Server-sent events: the ``data`` of each event, from a byte stream fed in pieces.

What the OpenAI streaming APIs send: ``data: {json}`` events separated by a blank line,
ending with ``data: [DONE]``. The parser follows the event-stream format: lines end in
CRLF, LF or CR; ``data:`` lines of one event are joined with newlines (one space after the
colon is dropped); lines starting with ``:`` are comments (keep-alive pings); other fields
(``event:``, ``id:``, ``retry:``) are ignored. Bytes may split anywhere, even inside a UTF-8
character.
"""

from __future__ import annotations

import codecs
import re

_EOL = re.compile(r"\r\n|\n|\r")


class SSEParser:
    def __init__(self) -> None:
        self._decode = codecs.getincrementaldecoder("utf-8")()
        self._buf = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """The data of every event completed by `chunk`, in order."""
        self._buf += self._decode.decode(chunk)
        events: list[str] = []
        while True:
            line, ended = self._next_line()
            if not ended:
                return events
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith(":"):
                continue
            else:
                name, _, value = line.partition(":")
                if name == "data":
                    self._data.append(value.removeprefix(" "))

    def _next_line(self) -> tuple[str, bool]:
        m = _EOL.search(self._buf)
        if m is None or (m.group() == "\r" and m.end() == len(self._buf)):
            return "", False  # no whole line yet (a final CR may be half of a CRLF)
        line, self._buf = self._buf[: m.start()], self._buf[m.end() :]
        return line, True
