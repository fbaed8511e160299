"""The KV transfer's figures, one set per worker, written from the transport's threads, the
event loop and the engine thread (hence the lock), read by Prometheus (worker.metrics) and
GetServerStatus. The prefill side's pin counts are the pin table's own
(`kvcache.pins.KVPins`); the prompt-token sources are the engine's."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

# Seconds of one pull (vLLM's NIXL transfer-time histogram has no fixed buckets we could
# share; these span a small prompt on loopback to a long one over a slow link).
PULL_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                        5.0, 10.0, 30.0)


@dataclass
class KVTransferStats:
    # Decode side: pulls that succeeded, what they moved, how long they took.
    num_pulls: int = 0
    num_pulled_blocks: int = 0
    num_pulled_bytes: int = 0
    pull_seconds: list[int] = field(default_factory=lambda: [0] * (len(PULL_SECONDS_BUCKETS) + 1))
    pull_seconds_sum: float = 0.0
    # Handoffs not pulled, by why: the prompt was computed here (a fallback, never silent).
    fallbacks: dict[str, int] = field(default_factory=dict)
    num_skipped: int = 0  # handoffs unneeded: the prefix cache here held what they had
    num_pulls_aborted: int = 0  # the request ended during its pull
    # Prefill side: tagged prompts that got a handoff, and those that did not (pin limit).
    num_handoffs: int = 0
    num_handoffs_refused: int = 0
    num_served_pulls: int = 0
    num_served_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def pulled(self, blocks: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.num_pulls += 1
            self.num_pulled_blocks += blocks
            self.num_pulled_bytes += nbytes
            self.pull_seconds_sum += seconds
            i = next((i for i, le in enumerate(PULL_SECONDS_BUCKETS) if seconds <= le),
                     len(PULL_SECONDS_BUCKETS))
            self.pull_seconds[i] += 1

    def fallback(self, reason: str) -> None:
        with self._lock:
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> KVTransferStats:
        """A consistent copy, for one scrape or status answer."""
        with self._lock:
            return KVTransferStats(
                self.num_pulls, self.num_pulled_blocks, self.num_pulled_bytes,
                list(self.pull_seconds), self.pull_seconds_sum, dict(self.fallbacks),
                self.num_skipped, self.num_pulls_aborted, self.num_handoffs,
                self.num_handoffs_refused, self.num_served_pulls, self.num_served_bytes)

    @property
    def num_fallbacks(self) -> int:
        return sum(self.fallbacks.values())
