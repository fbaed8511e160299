"""What one request did, as the client saw it, and the interface every backend implements.

A backend notes the time of each streamed chunk that carries at least one token, relative to
the moment it sent the request. Everything else follows from those times, as in
``vllm bench serve``: TTFT is the first, the end-to-end latency the last, and ITL the gaps
between consecutive chunks (one gap per chunk, however many tokens it carries).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Protocol

from clients.bench.dataset import BenchRequest


@dataclass
class RequestRecord:
    index: int
    expected_output_tokens: int
    success: bool = False
    error: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    sent_at: float = 0.0  # perf_counter() when sent; the runner makes it relative
    chunk_times: list[float] = field(default_factory=list)  # s after sending
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per chunk; 0 = unknown

    def add_chunk(self, t: float, num_tokens: int) -> None:
        self.chunk_times.append(t)
        self.chunk_tokens.append(num_tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def latency(self) -> float | None:
        """Send to the last chunk carrying a token (a trailing usage message is not one)."""
        return self.chunk_times[-1] if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        """(latency - TTFT) / (output tokens - 1); None with one output token or none."""
        if self.output_tokens <= 1 or not self.chunk_times:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    def to_json(self, start: float = 0.0) -> dict[str, Any]:
        """Times in milliseconds; `send_time_s` relative to `start` (the run's start)."""

        def ms(x: float | None) -> float | None:
            return None if x is None else round(x * 1e3, 4)

        return {
            "index": self.index,
            "success": self.success,
            "error": self.error,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "expected_output_tokens": self.expected_output_tokens,
            "send_time_s": round(self.sent_at - start, 6),
            "ttft_ms": ms(self.ttft),
            "tpot_ms": ms(self.tpot),
            "e2el_ms": ms(self.latency),
            "itl_ms": [ms(x) for x in self.itl],
            "chunk_tokens": self.chunk_tokens,
        }


class Backend(Protocol):
    """A server under test. `send` never raises for a failed request: it returns a record
    with ``success=False`` and the error, so failures are counted, never dropped."""

    name: str

    async def describe(self) -> dict[str, Any]: ...

    async def send(self, req: BenchRequest) -> RequestRecord: ...

    async def close(self) -> None: ...
