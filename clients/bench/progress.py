"""A one-line progress bar on stderr: ``label |#####-----| 12/64 ok 12 failed 0 3.1 req/s 4s``.

On a terminal it redraws in place (at most 10 times a second); into a file or pipe it
writes a line at each tenth of the way, so logs stay short. Disabled, it writes nothing.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 30


class Progress:
    def __init__(
        self, total: int, label: str = "", *, enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.total = max(total, 0)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.done = self.failed = 0
        self.start = time.perf_counter()
        self._drawn_at = 0.0
        self._tenths = 0

    def update(self, ok: bool = True) -> None:
        self.done += 1
        self.failed += not ok
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._drawn_at >= 0.1 or self.done == self.total:
                self._drawn_at = now
                self.stream.write("\r" + self.line(now))
                self.stream.flush()
        elif self.total and self.done * 10 // self.total > self._tenths:
            self._tenths = self.done * 10 // self.total
            self.stream.write(self.line(now) + "\n")
            self.stream.flush()

    def line(self, now: float | None = None) -> str:
        elapsed = (now or time.perf_counter()) - self.start
        filled = WIDTH * self.done // self.total if self.total else WIDTH
        bar = "#" * filled + "-" * (WIDTH - filled)
        rate = self.done / elapsed if elapsed > 0 else 0.0
        return (
            f"{self.label} |{bar}| {self.done}/{self.total} ok {self.done - self.failed} "
            f"failed {self.failed} {rate:.2f} req/s {elapsed:.0f}s"
        ).lstrip()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
