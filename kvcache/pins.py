"""KV blocks held for a prefill/decode handoff, under a lease.

A prefill worker that finishes a prompt tagged for remote decode keeps a reference to each
block holding the prompt's keys and values (`KVCacheManager.pin`), as a request's block
table would: the blocks stay out of the free queues, and full ones stay findable in the
prefix cache (read-only, shareable). The references are filed under a handle, a random
URL-safe string that names them to the decode worker, which pulls them over the network.

A pin ends in exactly one way, after which its references are dropped:

    pulled     a pull claimed it (single use: a second claim is refused) and ended
    released   the decode said it does not need them (it had the prefix, or gave up)
    expired    the lease passed unclaimed (a renewal pushes it back)

Threads. The transport claims, renews and releases from its own threads while the engine
thread pins, expires and frees, so the table takes a lock; the pool's reference counts are
touched only on the engine thread (`KVCacheManager.free_pins`), which frees what the others
marked released. A claimed pin never expires: its pull is reading the blocks (the
transport's own deadline ends it).
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass

HANDLE_BYTES = 32  # 256 random bits: unguessable
MAX_SPENT = 4096  # handles remembered after they end, to say "already used" of a replay


@dataclass
class Pin:
    handle: str
    request_id: str
    blocks: tuple[int, ...]  # position order, the prompt's first block first
    num_tokens: int  # prompt tokens whose keys and values the blocks hold
    key: bytes  # what a pull must present (the prompt's digest): a stolen handle reads nothing
    expires_at: float
    claimed: bool = False


class PinRefused(Exception):
    """A claim that cannot be granted; `reason` is one of unknown, expired, used, key."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class KVPins:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, Pin] = {}
        self._ended: list[Pin] = []  # released, expired or pulled: references still held
        self._spent: OrderedDict[str, str] = OrderedDict()  # handle -> how it ended
        self.num_pinned = 0  # pins made
        self.num_pulled = 0
        self.num_released = 0
        self.num_expired = 0

    @staticmethod
    def new_handle() -> str:
        return secrets.token_urlsafe(HANDLE_BYTES)

    # -- engine thread ---------------------------------------------------------------------

    def add(self, pin: Pin) -> None:
        with self._lock:
            assert pin.handle not in self._live and pin.handle not in self._spent
            self._live[pin.handle] = pin
            self.num_pinned += 1

    def expire(self, now: float) -> int:
        """End the unclaimed pins whose lease passed; returns how many."""
        with self._lock:
            gone = [p for p in self._live.values() if not p.claimed and p.expires_at <= now]
            for p in gone:
                self._end(p, "expired")
            self.num_expired += len(gone)
            return len(gone)

    def take_ended(self) -> list[Pin]:
        """Pins whose references the engine thread must now drop."""
        with self._lock:
            ended, self._ended = self._ended, []
            return ended

    # -- any thread ------------------------------------------------------------------------

    def claim(self, handle: str, key: bytes, now: float) -> Pin:
        """The pin under `handle`, for one pull; raises PinRefused. A wrong key does not use
        the pin up (the rightful decode may still come)."""
        with self._lock:
            pin = self._live.get(handle)
            if pin is None:
                fate = self._spent.get(handle)
                if fate == "expired":
                    raise PinRefused("expired", "the handoff's lease expired before the pull")
                if fate is not None:
                    raise PinRefused("used", f"the handoff was already {fate}")
                raise PinRefused("unknown", "no such handoff on this worker")
            if pin.claimed:
                raise PinRefused("used", "the handoff is being pulled already")
            if not secrets.compare_digest(pin.key, key):
                raise PinRefused("key", "the handoff belongs to another prompt")
            if pin.expires_at <= now:
                self._end(pin, "expired")
                self.num_expired += 1
                raise PinRefused("expired", "the handoff's lease expired before the pull")
            pin.claimed = True
            return pin

    def renew(self, handle: str, until: float) -> Pin | None:
        """Push an unclaimed pin's lease to `until` (never back); None when it is gone."""
        with self._lock:
            pin = self._live.get(handle)
            if pin is None:
                return None
            pin.expires_at = max(pin.expires_at, until)
            return pin

    def release(self, handle: str, pulled: bool = False) -> bool:
        """End the pin (after its pull, or because the decode needs it no more); False when
        it had ended already."""
        with self._lock:
            pin = self._live.get(handle)
            if pin is None:
                return False
            self._end(pin, "pulled" if pulled else "released")
            if pulled:
                self.num_pulled += 1
            else:
                self.num_released += 1
            return True

    # -- figures ---------------------------------------------------------------------------

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def num_ended(self) -> int:
        """Ended pins whose references the engine thread has still to drop."""
        return len(self._ended)

    def num_blocks(self) -> int:
        """Blocks referenced by pins not yet freed (live or ended)."""
        with self._lock:
            return sum(len(p.blocks) for p in (*self._live.values(), *self._ended))

    def held_blocks(self) -> list[int]:
        """Every reference the pins hold, a block once per pin (for check_integrity)."""
        with self._lock:
            return [b for p in (*self._live.values(), *self._ended) for b in p.blocks]

    def next_expiry(self) -> float | None:
        with self._lock:
            return min((p.expires_at for p in self._live.values() if not p.claimed), default=None)

    # -- internals -------------------------------------------------------------------------

    def _end(self, pin: Pin, fate: str) -> None:
        del self._live[pin.handle]
        self._ended.append(pin)
        self._spent[pin.handle] = fate
        while len(self._spent) > MAX_SPENT:
            self._spent.popitem(last=False)
