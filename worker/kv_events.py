"""Prefix-cache events for SMG's cache-aware routing: the vLLM protocol's `SubscribeKvEvents`.

    engine thread                        event loop
    step: kv.take_events() --(StepOutput, the bridge's one hop)--> KvEventHub.step:
    (stored / removed / cleared,                                  proto events, one
     recorded by the block pool)                                  KvEventBatch per step,
                                                                  sequence + 1, history
                                                                  ring, fan-out to each
                                                                  subscriber's queue

Pulled, not pushed: the block pool records events in a plain list and the engine takes
them once per step, so they ride the step's outputs through the hop the outputs already
make (vLLM's `take_events()`); nothing on the engine thread calls into this module.
Protobuf building, the load record and the fan-out all happen on the loop.

Hash mapping: our block hashes are 32-byte SHA-256 digests (`kvcache.block_hash`); the
proto's `block_hash` / `parent_block_hash` are int64. We send the digest's first 8 bytes
read as a big-endian signed integer (`to_int64`): deterministic across processes, equal
digests give equal ids, and distinct ones collide with probability ~2^-64 per pair. SMG
uses the id as a node identity and hashes `token_ids` itself, folding in `cache_salt`.

Bounds and what happens at them:

- each subscriber has a queue of `queue_size` batches. One that falls that far behind is
  dropped: its stream ends with RESOURCE_EXHAUSTED naming the next sequence number to
  resume from; resubscribing with ``start_sequence_number`` replays what the history
  still holds.
- the history keeps the last `history_size` batches; ``start_sequence_number`` N > 0
  replays the held batches numbered >= N, then goes live (a gap in the numbers tells the
  subscriber that history no longer reached back). 0 = live only, from now (no snapshot
  of blocks cached before the subscription).
- a block re-registered at a swap-in comes without tokens (the kvcache does not keep
  them); its tokens are looked up among the last `token_memory` stored blocks, and a
  block not found there is not published (SMG then misses a hit; it is never misled).
"""

from __future__ import annotations

import array
import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from smg_grpc_proto.generated import common_pb2

from kvcache.block_hash import BlockHash
from kvcache.events import AllCleared, BlocksRemoved, BlocksStored, KVEvent
from worker.load import Load

if TYPE_CHECKING:
    from worker.engine import StepOutput

log = logging.getLogger(__name__)


def to_int64(block_hash: BlockHash) -> int:
    """The proto's int64 id of a SHA-256 block hash: its first 8 bytes, big-endian, signed."""
    return int.from_bytes(block_hash[:8], "big", signed=True)


def engine_load(load: Load, max_num_seqs: int, sample: int, load_only: bool,
                extras: bool) -> common_pb2.EngineLoad:
    """The load record, from the one `Load` snapshot (the same figures as GetLoads).
    `extras`: the telemetry fields sent on the heartbeat cadence only."""
    rec = common_pb2.EngineLoad(
        running_requests=load.num_running,
        waiting_requests=load.num_waiting,
        token_usage=load.kv_cache_usage,
        # Our usage counts cached-but-unreferenced blocks as free: it is the active usage.
        active_token_usage=load.kv_cache_usage,
        gen_throughput=load.tokens_per_second,
        max_running_requests=max_num_seqs,
        age_ms=0,
        sample=sample,
        load_only=load_only,
    )
    if extras:
        rec.cache_hit_rate = load.prefix_cache_hit_rate
        rec.num_used_tokens = load.num_used_tokens
        rec.max_total_num_tokens = load.num_total_tokens
    return rec


class Overflowed(Exception):
    """The subscriber fell behind (or events were lost); the message says where to resume."""


@dataclass(eq=False)  # identity: kept in a set
class Subscription:
    queue: asyncio.Queue[common_pb2.KvEventBatch]
    error: str | None = None  # set when dropped; the stream ends with it
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    async def next(self, timeout: float) -> common_pb2.KvEventBatch | None:
        """The next batch, or None after `timeout` seconds without one; raises Overflowed
        once the subscriber was dropped (after the batches queued before it)."""
        if self.queue.empty():
            if self.error is not None:
                raise Overflowed(self.error)
            self.wake.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self.wake.wait()
            except TimeoutError:
                return None
            if self.queue.empty():
                if self.error is not None:
                    raise Overflowed(self.error)
                return None
        return self.queue.get_nowait()


class KvEventHub:
    """Publishes each step's prefix-cache events (a `worker.bridge.StepObserver`) as
    numbered `KvEventBatch`es to subscribers. Everything here runs on the event loop."""

    def __init__(self, block_size: int, load: Callable[[], Load], max_num_seqs: int, *,
                 queue_size: int = 1024, history_size: int = 1024,
                 token_memory: int = 1 << 14) -> None:
        self.block_size = block_size
        self.load = load
        self.max_num_seqs = max_num_seqs
        self.queue_size = queue_size
        self.token_memory = token_memory
        self.sequence = 0  # of the last batch published
        self.subscribers: set[Subscription] = set()
        self.history: collections.deque[common_pb2.KvEventBatch] = collections.deque(
            maxlen=history_size)
        self._event_ids = itertools.count(1)
        self._samples = itertools.count(1)
        # hash -> (token ids packed, cache salt) of recently stored blocks, for swap-ins.
        self._tokens: collections.OrderedDict[BlockHash, tuple[array.array, str | None]] = (
            collections.OrderedDict())

    def step(self, step: StepOutput, t: float) -> None:
        """A step's events become one batch (a step without events sends none)."""
        if step.kv_events:
            self.publish(step.kv_events)

    def publish(self, raw: Sequence[KVEvent]) -> None:
        events = [ev for e in raw if (ev := self._convert(e)) is not None]
        if not events:
            return
        self.sequence += 1
        batch = common_pb2.KvEventBatch(sequence_number=self.sequence, timestamp=time.time(),
                                        events=events, dp_rank=0)
        batch.load.CopyFrom(self.load_record(load_only=False, extras=False))
        self.history.append(batch)
        for sub in list(self.subscribers):
            self._deliver(sub, batch)

    def _convert(self, event: KVEvent) -> common_pb2.KvCacheEvent | None:
        if isinstance(event, AllCleared):
            return common_pb2.KvCacheEvent(event_id=next(self._event_ids),
                                           cleared=common_pb2.KvCacheCleared())
        if isinstance(event, BlocksRemoved):
            return common_pb2.KvCacheEvent(
                event_id=next(self._event_ids),
                removed=common_pb2.KvBlocksRemoved(
                    block_hashes=[to_int64(h) for h in event.hashes],
                    tier=common_pb2.KV_CACHE_TIER_DEVICE))
        assert isinstance(event, BlocksStored)
        hashes, parent, token_ids, salt = (event.hashes, event.parent, event.token_ids,
                                           event.cache_salt)
        bs = self.block_size
        if token_ids is None:  # a swap-in: tokens from memory, or not published
            known = [self._tokens.get(h) for h in hashes]
            if any(k is None for k in known):
                log.debug("not publishing %d re-stored blocks with unknown tokens", len(hashes))
                return None
            per_block = [list(k[0]) for k in known]  # type: ignore[index]
            salt = known[0][1]  # type: ignore[index]
        else:
            per_block = [list(token_ids[i * bs:(i + 1) * bs]) for i in range(len(hashes))]
        for h, toks in zip(hashes, per_block, strict=True):
            self._tokens[h] = (array.array("l", toks), salt)
            self._tokens.move_to_end(h)
        while len(self._tokens) > self.token_memory:
            self._tokens.popitem(last=False)
        stored = common_pb2.KvBlocksStored(
            blocks=[common_pb2.KvBlock(block_hash=to_int64(h), token_ids=toks, block_size=bs)
                    for h, toks in zip(hashes, per_block, strict=True)],
            tier=common_pb2.KV_CACHE_TIER_DEVICE,
            locality=common_pb2.KV_CACHE_LOCALITY_LOCAL,
        )
        if parent is not None:
            stored.parent_block_hash = to_int64(parent)
        if salt is not None:
            stored.cache_salt = salt
        return common_pb2.KvCacheEvent(event_id=next(self._event_ids), stored=stored)

    def load_record(self, load_only: bool, extras: bool) -> common_pb2.EngineLoad:
        return engine_load(self.load(), self.max_num_seqs, next(self._samples), load_only,
                           extras)

    def subscribe(self, start_sequence_number: int = 0) -> Subscription:
        """A new subscriber; N > 0 first replays the held batches numbered >= N."""
        sub = Subscription(asyncio.Queue(maxsize=self.queue_size))
        if start_sequence_number > 0:
            for batch in self.history:
                if batch.sequence_number >= start_sequence_number:
                    self._deliver(sub, batch)
        if sub.error is None:
            self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self.subscribers.discard(sub)

    def _deliver(self, sub: Subscription, batch: common_pb2.KvEventBatch) -> None:
        try:
            sub.queue.put_nowait(batch)
        except asyncio.QueueFull:
            self._drop(sub, f"the subscriber fell {self.queue_size} batches behind; "
                            f"resubscribe with start_sequence_number "
                            f"{batch.sequence_number} to resume")
            return
        sub.wake.set()

    def _drop(self, sub: Subscription, error: str) -> None:
        sub.error = error
        self.subscribers.discard(sub)
        sub.wake.set()
