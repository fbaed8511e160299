"""Per-request block tables over one `BlockPool`, with prefix caching and CPU swap space.

A request's block table lists the blocks that hold its tokens' keys and values, in
position order. It grows one block at a time as the request's tokens are computed.

    block_size = 4, block_table = [7, 2, 5]

    position   0  1  2  3 |  4  5  6  7 |  8  9 10 11
    block      7          |  2          |  5
    slot      28 29 30 31 |  8  9 10 11 | 20 21 22 23

    slot = block_table[pos // block_size] * block_size + pos % block_size

A slot is the row of the flat KV tensor ``[num_blocks * block_size, ...]`` that the runner
writes position `pos` into.

A request's blocks go through these states (the scheduler drives them):

    find_cached_prefix + allocate_slots   table = shared cached blocks + fresh ones
    cache_full_blocks (after each step)   blocks that just filled are registered under
                                          their hash (the request's own, computed once)
    free                                  refs dropped tail first; cached ones stay
                                          reusable until an allocation evicts them
    swap_out / swap_in                    computed blocks to CPU blocks and back into
                                          fresh GPU blocks
    fork                                  a parallel sample takes a reference to every
                                          block of its leader's table; the half-full
                                          block they share is copied by each that writes
                                          it while others still hold it (copy-on-write)
    pin (before free)                     a prompt handed to another worker: its blocks
                                          are referenced by a pin under a lease
                                          (`kvcache.pins`) until pulled, released or
                                          expired; `free_pins` drops those references

Moves (swap and copy-on-write) accumulate during `schedule()`, which hands them to the
runner with `take_moves()` and calls `moves_done()` once the runner made them (see
`kvcache.moves` for why one step's moves cannot trample each other).

Swapping shared blocks: a victim's computed blocks are all copied to its own CPU blocks,
shared ones included, and its GPU references dropped like a free. Other holders keep the
shared blocks; the CPU copy is private to the victim. That costs CPU space for shared
prefixes but keeps ref counts simple: a CPU block has exactly one owner.
"""

from collections import Counter
from collections.abc import Sequence

from kvcache.block_hash import BlockHash
from kvcache.block_pool import BlockPool
from kvcache.events import BlocksStored, KVEvent
from kvcache.moves import KVMoves
from kvcache.pins import KVPins, Pin
from kvcache.prefix_cache import PrefixCacheStats, PrefixHit, find_cached_prefix
from kvcache.swap_space import SwapSpace


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
    ) -> None:
        assert block_size > 0, f"block_size must be > 0, got {block_size}"
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.swap_space = SwapSpace(num_cpu_blocks)
        self.block_tables: dict[str, list[int]] = {}  # running requests (GPU blocks)
        self.cpu_tables: dict[str, list[int]] = {}  # swapped-out requests (CPU blocks)
        self.stats = PrefixCacheStats()
        self._moves = KVMoves()
        self._written: set[int] = set()  # GPU blocks this step's moves write
        self._pins: list[int] = []  # copy sources, held until the runner made the moves
        # Forked requests (`fork`) -> the index of the half-full block they share, copied
        # before their first write into it while another request still holds it.
        self._cow: dict[str, int] = {}
        # This step's copies into a request's table: request -> (index in its table, source,
        # destination). A request preempted in the step it copied has its copy undone.
        self._copies: dict[str, tuple[int, int, int]] = {}
        self.handoff_pins = KVPins()  # blocks held for KV handoffs (prefill/decode disaggregation)

    # -- figures ---------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash, in use or free (evictable)."""
        return self.pool.num_cached_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.swap_space.num_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.swap_space.num_free_blocks

    def blocks_in_use(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's GPU block table (empty for an unknown id)."""
        return list(self.block_tables.get(request_id, ()))

    def cpu_block_table(self, request_id: str) -> list[int]:
        """A copy of a swapped-out request's CPU block table (empty otherwise)."""
        return list(self.cpu_tables.get(request_id, ()))

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.cpu_tables

    # -- allocation ------------------------------------------------------------------------

    def find_cached_prefix(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> PrefixHit:
        """What a request with no blocks could reuse (`kvcache.prefix_cache`), from the
        request's hashes of its full blocks. Changes nothing; pass the result to
        `allocate_slots`. Always empty when caching is off."""
        if not self.enable_prefix_caching:
            return PrefixHit(num_queried_tokens=num_tokens)
        return find_cached_prefix(self.pool, block_hashes, num_tokens, self.block_size)

    def num_blocks_needed(
        self, request_id: str, num_total_tokens: int, hit: PrefixHit | None = None
    ) -> int:
        """Free blocks an allocation for positions ``0..num_total_tokens-1`` would take:
        new blocks, plus the free (evictable) cached blocks of `hit` it takes back."""
        fresh, taken = self._demand(request_id, num_total_tokens, hit)
        return fresh + sum(1 for b in taken if self.pool.ref_counts[b] == 0)

    def can_allocate(
        self,
        request_id: str,
        num_total_tokens: int,
        hit: PrefixHit | None = None,
        freeing: Sequence[str] = (),
    ) -> bool:
        """Whether `allocate_slots` (or `swap_in`, for a swapped request) would succeed once
        the requests in `freeing` released their GPU blocks. Exact with shared blocks: a
        block frees only when all its holders are among them."""
        fresh, taken = self._demand(request_id, num_total_tokens, hit)
        refs = self.pool.ref_counts
        if not freeing:  # the common case, once per running request and step
            return fresh + sum(refs[b] == 0 for b in taken) <= self.pool.num_free_blocks
        dropped = Counter(b for rid in freeing for b in self.block_tables.get(rid, ()))
        freed = sum(1 for b, k in dropped.items() if refs[b] == k)
        revived = sum(1 for b in taken if refs[b] == dropped[b])  # free by then: taken back
        return fresh + revived <= self.pool.num_free_blocks + freed

    def allocate_slots(
        self, request_id: str, num_total_tokens: int, hit: PrefixHit | None = None
    ) -> bool:
        """Grow the table to cover `num_total_tokens` positions, starting a request with no
        blocks from `hit` (its cached prefix) when given. All or nothing: returns False and
        changes nothing when there are not enough free blocks."""
        assert request_id not in self.cpu_tables, f"{request_id}: swapped out, swap_in first"
        if hit is not None and hit.num_tokens:
            if not self.can_allocate(request_id, num_total_tokens, hit):
                return False
            self._take_hit(request_id, hit)
        else:  # the common case (a running request's next block), kept short
            have = len(self.block_tables.get(request_id, ()))
            copy = request_id in self._cow and self._shared_tail(request_id) is not None
            if cdiv(num_total_tokens, self.block_size) - have + copy > self.pool.num_free_blocks:
                return False
            if request_id in self._cow:
                self._copy_on_write(request_id)
        if hit is not None and self.enable_prefix_caching:
            self.stats.record(hit)
        table = self.block_tables.setdefault(request_id, [])
        n = cdiv(num_total_tokens, self.block_size) - len(table)
        if n > 0:
            table.extend(self.pool.allocate(n))
        return True

    def cache_full_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_computed_before: int,
        num_computed_tokens: int,
        token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Register the request's blocks that filled with computed tokens (prompt or
        generated) while it went from `num_computed_before` to `num_computed_tokens`, under
        the request's own hashes, so later requests can hit them. Call once their keys and
        values are written, i.e. after the step ran. Blocks full before were registered
        then (or came from the cache). `token_ids` and `cache_salt` only label the event."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first, end = num_computed_before // bs, num_computed_tokens // bs
        if end <= first:
            return
        assert len(block_hashes) >= end, f"{request_id}: {end} full blocks, {len(block_hashes)} hashes"
        table = self.block_tables[request_id]
        stored: list[int] = []  # indexes of blocks registered now, for the event
        for i in range(first, end):
            b, h = table[i], block_hashes[i]
            known = self.pool.block_hashes[b]
            if known is None:
                # False for a duplicate (e.g. a copy-on-write copy)
                if self.pool.cache(b, h):
                    stored.append(i)
            else:
                assert known == h, f"{request_id}: block {b} is cached under another prefix"
        if stored and self.pool.events is not None:
            self._record_stored(block_hashes, stored, token_ids, cache_salt)

    def check_writable(self, request_id: str, start: int, end: int) -> None:
        """Positions ``start..end-1`` are about to be written: their blocks must belong to
        this request alone (a copy source's pin aside, read before the write) and be
        uncached (full blocks are never written again)."""
        table = self.block_tables[request_id]
        for i in range(start // self.block_size, cdiv(end, self.block_size)):
            b = table[i]
            refs = self.pool.ref_counts[b] - (self._pins.count(b) if self._pins else 0)
            assert refs == 1, f"{request_id}: writing shared block {b}"
            assert self.pool.block_hashes[b] is None, f"{request_id}: writing cached block {b}"

    def free(self, request_id: str) -> None:
        """Release the request's blocks, GPU or CPU; a no-op for an unknown id."""
        self._undo_copy(request_id)
        self._cow.pop(request_id, None)
        table = self.block_tables.pop(request_id, None)
        if table:
            # Tail first: the tail is the least shareable part of a chain, so it should be
            # evicted first (see `BlockPool`).
            self.pool.free(reversed(table))
        cpu = self.cpu_tables.pop(request_id, None)
        if cpu:
            self.swap_space.free(cpu)

    # -- KV handoff pins -------------------------------------------------------------------

    def pin(self, request_id: str, num_tokens: int, key: bytes, expires_at: float,
            max_blocks: int) -> Pin | None:
        """Reference the blocks holding the request's first `num_tokens` positions (its
        computed prompt) under a new handle, before the request frees them; None (nothing
        held) when that would take the pins past `max_blocks` blocks."""
        table = self.block_tables[request_id]
        n = cdiv(num_tokens, self.block_size)
        assert 0 < n <= len(table), f"{request_id}: pin of {num_tokens} tokens, {len(table)} blocks"
        if self.handoff_pins.num_blocks() + n > max_blocks:
            return None
        blocks = tuple(table[:n])
        self.pool.incref(blocks)
        pin = Pin(KVPins.new_handle(), request_id, blocks, num_tokens, key, expires_at)
        self.handoff_pins.add(pin)
        return pin

    def free_pins(self, now: float) -> int:
        """Expire pins whose lease passed and drop the references of every pin that ended
        (pulled, released, expired). Engine thread only. Returns the blocks let go."""
        self.handoff_pins.expire(now)
        ended = self.handoff_pins.take_ended()
        for p in ended:
            self.pool.free(reversed(p.blocks))  # tail first, as a request frees
        return sum(len(p.blocks) for p in ended)

    # -- swap ------------------------------------------------------------------------------

    def can_swap_out(self, request_id: str, num_computed_tokens: int) -> bool:
        """Whether the request's computed blocks fit in the free CPU blocks (a request with
        nothing computed has nothing to swap)."""
        n = cdiv(num_computed_tokens, self.block_size)
        return request_id in self.block_tables and 0 < n <= self.swap_space.num_free_blocks

    def swap_out(self, request_id: str, num_computed_tokens: int) -> None:
        """Copy the blocks holding the request's computed tokens to CPU blocks and release
        its GPU blocks (like `free`; blocks past the computed ones hold nothing yet)."""
        assert self.can_swap_out(request_id, num_computed_tokens), f"{request_id}: no room"
        n = cdiv(num_computed_tokens, self.block_size)
        self._undo_copy(request_id)  # its copy is not written yet: step 1 reads the source
        self._cow.pop(request_id, None)  # shared blocks are read like any other; back private
        table = self.block_tables.pop(request_id)
        assert not self._written.intersection(table[:n]), (
            f"{request_id}: swapped out in the step whose moves write its blocks"
        )
        cpu = self.swap_space.allocate(n)
        self._moves.swap_out.extend(zip(table[:n], cpu, strict=True))
        self.cpu_tables[request_id] = cpu
        self.pool.free(reversed(table))

    def swap_in(
        self, request_id: str, num_total_tokens: int, block_hashes: Sequence[BlockHash] = ()
    ) -> bool:
        """Bring a swapped-out request back into fresh GPU blocks, enough for
        `num_total_tokens` positions. All or nothing, like `allocate_slots`. Its computed
        full blocks, whose hashes are `block_hashes`, are cached again at once (the swap-in
        runs before anything reads them)."""
        cpu = self.cpu_tables[request_id]
        if not self.can_allocate(request_id, num_total_tokens):
            return False
        gpu = self.pool.allocate(max(len(cpu), cdiv(num_total_tokens, self.block_size)))
        self._moves.swap_in.extend(zip(cpu, gpu[: len(cpu)], strict=True))
        self._written.update(gpu[: len(cpu)])
        self.swap_space.free_after_step(cpu)
        del self.cpu_tables[request_id]
        self.block_tables[request_id] = gpu
        if self.enable_prefix_caching:
            assert len(block_hashes) <= len(cpu), f"{request_id}: hashes of blocks not swapped"
            stored = [i for i, (h, b) in enumerate(zip(block_hashes, gpu, strict=False))
                      if self.pool.cache(b, h)]
            if stored and self.pool.events is not None:
                self._record_stored(block_hashes, stored, None, None)
        return True

    # -- parallel sampling ----------------------------------------------------------------

    def fork(self, parent_id: str, child_id: str, num_computed_tokens: int) -> None:
        """`child_id` (no blocks yet) shares every block of `parent_id`'s table, which holds
        exactly its `num_computed_tokens` computed positions: one more reference each, no
        copy now. When the last block is half full both will write into it: each copies it
        on its next `allocate_slots` while someone else still holds it (the copy a
        `blocks_to_copy` move, its source pinned until the runner made it), and the last
        holder writes in place. Full blocks are never written again, so stay shared."""
        assert child_id not in self.block_tables and child_id not in self.cpu_tables, child_id
        table = self.block_tables[parent_id]
        bs = self.block_size
        assert len(table) == cdiv(num_computed_tokens, bs), (
            f"{parent_id}: {len(table)} blocks for {num_computed_tokens} computed tokens")
        self.pool.incref(table)
        self.block_tables[child_id] = list(table)
        if num_computed_tokens % bs:
            self._cow[parent_id] = self._cow[child_id] = num_computed_tokens // bs

    def _shared_tail(self, request_id: str) -> int | None:
        """The block a forked request must copy before writing it: its half-full shared
        block while another request (not a pin) still holds it; else None."""
        i = self._cow[request_id]
        b = self.block_tables[request_id][i]
        pins = self._pins.count(b) if self._pins else 0
        return b if self.pool.ref_counts[b] - pins > 1 else None

    def _copy_on_write(self, request_id: str) -> None:
        """Give the request its own copy of its shared half-full block (a free block must
        be there: `allocate_slots` checked). Its reference to the source becomes the pin
        that keeps the source alive until the runner copied it (`kvcache.moves`)."""
        src = self._shared_tail(request_id)
        i = self._cow.pop(request_id)
        if src is None:
            return  # the others copied or left: the block is this request's alone
        (dst,) = self.pool.allocate(1)
        self._pins.append(src)
        self._moves.copy.append((src, dst))
        self._written.add(dst)
        self.block_tables[request_id][i] = dst
        self._copies[request_id] = (i, src, dst)

    def _undo_copy(self, request_id: str) -> None:
        """Take back this step's copy into the request's table, before the request is
        preempted in the same step (a forked sample that copied its shared block, then was
        displaced by a more urgent arrival): the copy would be written after step 1 read
        the table (swap) or into a block freed and handed out again (recompute). The table
        holds the source again, with the reference the pin held; the destination is freed
        unwritten."""
        undo = self._copies.pop(request_id, None)
        if undo is None:
            return
        i, src, dst = undo
        table = self.block_tables[request_id]
        assert table[i] == dst, f"{request_id}: its copy left its table"
        table[i] = src
        self._pins.remove(src)  # that reference is the table's again
        self._moves.copy.remove((src, dst))
        self._written.discard(dst)
        self.pool.free([dst])

    def take_events(self) -> list[KVEvent]:
        """The prefix-cache events since the last call (`kvcache.events`); the engine takes
        them once per step. Empty unless `pool.record_events()` was called."""
        return self.pool.take_events()

    # -- per step --------------------------------------------------------------------------

    def take_moves(self) -> KVMoves:
        """This step's swap-outs, swap-ins and copies, for the runner (`kvcache.moves`)."""
        moves, self._moves = self._moves, KVMoves()
        moves.check()
        self._written.clear()
        self._copies.clear()
        return moves

    def moves_done(self) -> None:
        """The runner made the moves taken last: unpin copy sources, free swapped-in CPU
        blocks. Idempotent."""
        self.pool.free(self._pins)
        self._pins.clear()
        self.swap_space.step_done()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, so that no lookup after the reset finds keys and values
        computed before it. Refused (False, nothing changed) while any request holds blocks,
        GPU or CPU (or a copy source is pinned): that KV was computed before the reset and
        would be cached again as its blocks fill or swap back in. Otherwise drops the
        hashes of all (then free) cached blocks and returns True."""
        if self.blocks_in_use() or self.cpu_tables:
            return False
        self.pool.drop_all_hashes()
        return True

    # -- checks ----------------------------------------------------------------------------

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Slots of positions ``start..end-1`` (see the module docstring)."""
        table = self.block_tables.get(request_id, [])
        bs = self.block_size
        assert 0 <= start <= end <= len(table) * bs, (
            f"{request_id}: positions [{start}, {end}) outside {len(table)} blocks of {bs}"
        )
        return [table[pos // bs] * bs + pos % bs for pos in range(start, end)]

    def check_integrity(self) -> None:
        """Prove no block, GPU or CPU, is leaked or double-owned, and that the prefix cache
        agrees with the tables. Raises AssertionError on violation."""
        pool = self.pool
        pool.check_integrity()
        owners = [0] * pool.num_blocks
        for rid, table in self.block_tables.items():
            for b in table:
                assert 0 <= b < pool.num_blocks, f"{rid}: block id {b} out of range"
                owners[b] += 1
        for b in self._pins:
            owners[b] += 1
        for b in self.handoff_pins.held_blocks():
            owners[b] += 1
        free = set(pool.free_blocks)
        for b in range(pool.num_blocks):
            refs = pool.ref_counts[b]
            assert refs == owners[b], f"block {b}: ref count {refs} != {owners[b]} owners"
            assert b in free or owners[b], f"block {b} is neither free nor owned (leaked)"
        assert self._cow.keys() <= self.block_tables.keys(), "copy-on-write for no table"
        both = self.block_tables.keys() & self.cpu_tables.keys()
        assert not both, f"{both}: both on GPU and swapped out"
        self.swap_space.check_integrity(b for t in self.cpu_tables.values() for b in t)

    # -- internals -------------------------------------------------------------------------

    def _record_stored(self, hashes: Sequence[BlockHash], stored: list[int],
                       token_ids: Sequence[int] | None, cache_salt: str | None) -> None:
        """Record the blocks at indexes `stored` (ascending) of a chain as stored, one
        event per run of consecutive blocks (a run's parent is the block before)."""
        bs = self.block_size
        start = 0
        for k in range(1, len(stored) + 1):
            if k < len(stored) and stored[k] == stored[k - 1] + 1:
                continue
            first, last = stored[start], stored[k - 1]
            self.pool.add_event(BlocksStored(
                tuple(hashes[first : last + 1]),
                hashes[first - 1] if first else None,
                None if token_ids is None else tuple(token_ids[first * bs : (last + 1) * bs]),
                cache_salt,
            ))
            start = k

    def _demand(
        self, request_id: str, num_total_tokens: int, hit: PrefixHit | None
    ) -> tuple[int, list[int]]:
        """(new blocks to allocate, cached blocks to take a reference to)."""
        want = cdiv(num_total_tokens, self.block_size)
        cpu = self.cpu_tables.get(request_id)
        if cpu is not None:
            return max(len(cpu), want), []
        if request_id in self._cow and self._shared_tail(request_id) is not None:
            return max(0, want - len(self.block_tables[request_id])) + 1, []
        if hit is not None and hit.num_tokens:
            assert request_id not in self.block_tables, f"{request_id}: hit for a live table"
            taken = [*hit.blocks, *([] if hit.cow_src is None else [hit.cow_src])]
            return want - len(hit.blocks), taken
        return max(0, want - len(self.block_tables.get(request_id, ()))), []

    def _take_hit(self, request_id: str, hit: PrefixHit) -> None:
        self.pool.touch(hit.blocks)
        table = list(hit.blocks)
        if hit.cow_src is not None:
            # Pin the source first, so the copy's own allocation cannot evict it.
            self.pool.touch([hit.cow_src])
            self._pins.append(hit.cow_src)
            (dst,) = self.pool.allocate(1)
            self._moves.copy.append((hit.cow_src, dst))
            self._written.add(dst)
            self._copies[request_id] = (len(table), hit.cow_src, dst)
            table.append(dst)
        self.block_tables[request_id] = table
