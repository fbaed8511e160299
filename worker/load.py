"""One snapshot of the worker's load: the single source for our `GetLoad`, the vLLM
protocol's `GetLoads`, its KV-event load records and the Prometheus gauges, so that every
reader sees the same figures computed the same way.

Plain reads of engine state from the event loop: never blocks on the engine thread, so a
figure may be one step old.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.bridge import EngineBridge


@dataclass(frozen=True)
class Load:
    num_running: int  # in the scheduler's running set
    num_waiting: int  # queued for the engine (scheduler queue or inbox), not swapped
    num_swapped: int  # preempted to the CPU swap space
    num_total_blocks: int
    num_free_blocks: int  # free or evictable (cached, unreferenced)
    block_size: int
    kv_cache_usage: float  # fraction of blocks held by requests, 0..1
    tokens_per_second: float  # generated tokens/s over the bridge's rate window
    prefix_cache_queries: int  # admissions that looked up the prefix cache
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int  # made so far (swap or recompute), counted when made
    num_steps: int

    @property
    def num_waiting_reqs(self) -> int:
        """Waiting as vLLM v1 counts it: every admitted request not running, preempted ones
        included (recompute victims are in the waiting queue already; swapped ones are
        added here). What vllm:num_requests_waiting says to endpoint pickers."""
        return self.num_waiting + self.num_swapped

    @property
    def num_used_tokens(self) -> int:
        return (self.num_total_blocks - self.num_free_blocks) * self.block_size

    @property
    def num_total_tokens(self) -> int:
        return self.num_total_blocks * self.block_size

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0


def snapshot(bridge: EngineBridge) -> Load:
    engine = bridge.engine
    kv = engine.kv
    stats = kv.stats
    return Load(
        num_running=bridge.num_running,
        num_waiting=bridge.num_waiting,
        num_swapped=engine.scheduler.num_swapped,
        num_total_blocks=kv.num_blocks,
        num_free_blocks=kv.num_free_blocks,
        block_size=kv.block_size,
        kv_cache_usage=kv.usage,
        tokens_per_second=bridge.tokens_per_second(),
        prefix_cache_queries=stats.num_queries,
        prefix_cache_queried_tokens=stats.num_queried_tokens,
        prefix_cache_hit_tokens=stats.num_hit_tokens,
        num_preemptions=engine.num_preemptions,
        num_steps=engine.num_steps,
    )
