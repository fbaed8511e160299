"""Prefix caching through the scheduler: hits, copy-on-write of a block-aligned full hit,
salts, blocks cached as decoding fills them, lazy LRU eviction tail first, re-admission
after recompute, resets, the on/off switch, and exact room checks with shared blocks. The
KVRunner checks every position's fake KV contents through the block tables each step."""

import pytest

from kvcache import KVCacheManager, iter_block_hashes
from scheduler import Request, SamplingParams, Scheduler
from tests.test_kvcache_runner import KVRunner, drain, expected_output, run_step

SYSTEM = list(range(100, 140))  # 40 tokens that many prompts start with


def hashes(tokens: list[int], block_size: int = 4) -> list[bytes]:
    """A request's block hashes, as `Request.block_hashes` holds them."""
    return list(iter_block_hashes(tokens, block_size))


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_num_seqs: int = 8,
    prefix: bool = True,
) -> tuple[Scheduler, KVRunner]:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    sched = Scheduler(kv, max_num_seqs, budget, 256, aging_s=None)
    return sched, KVRunner(block_size)


def req(rid: str, prompt: list[int], max_tokens: int = 4, salt: str | None = None, **kw) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(prompt), sp, cache_salt=salt, **kw)


def scheduled(out, rid: str):
    return next(s for s in out.scheduled if s.request_id == rid)


def test_second_request_reuses_the_cached_prefix():
    sched, runner = make()
    a = req("a", SYSTEM[:10])
    sched.add_request(a)
    run_step(sched, runner)  # a's prompt: blocks 0 and 1 are full and cached
    assert sched.kv.num_cached_blocks == 2 and a.num_cached_tokens == 0
    b = req("b", [*SYSTEM[:9], 7])
    sched.add_request(b)
    out = run_step(sched, runner)
    s = scheduled(out, "b")
    assert (s.start, s.num_new_tokens) == (8, 2) and b.num_cached_tokens == 8
    a_table, b_table = sched.kv.block_table("a"), sched.kv.block_table("b")
    assert b_table[:2] == a_table[:2] and b_table[2] != a_table[2]
    assert [sched.kv.pool.ref_counts[x] for x in b_table] == [2, 2, 1]
    assert out.blocks_to_copy == []
    stats = sched.kv.stats
    assert (stats.num_queries, stats.num_queried_tokens, stats.num_hit_tokens) == (2, 20, 8)
    assert stats.hit_rate == 0.4
    drain(sched, runner)
    for r in (a, b):
        assert r.output_token_ids == expected_output(runner, r) and r.num_output_tokens == 4
    assert sched.kv.num_free_blocks == 64 and sched.kv.num_cached_blocks > 0  # kept
    assert b.num_cached_tokens == 8  # still the first admission's figure


@pytest.mark.parametrize("a_done", [False, True])
def test_block_aligned_full_hit_copies_the_last_block(a_done):
    # Every token of b is cached, in 2 full blocks: b recomputes only its last token, into
    # a copy of the second block, since the shared original must not be written.
    sched, runner = make()
    a = req("a", SYSTEM[:8], max_tokens=1 if a_done else 4)
    sched.add_request(a)
    run_step(sched, runner)
    a_table = [*sched.kv.block_table("a")] or None
    assert (a.is_finished, a_table is None) == (a_done, a_done)
    src0, src1 = (
        sched.kv.pool.lookup(h) for h in sched.kv.find_cached_prefix(hashes(SYSTEM[:9]), len(SYSTEM[:9])).hashes
    )
    b = req("b", SYSTEM[:8])
    sched.add_request(b)
    out = sched.schedule()
    s = scheduled(out, "b")
    assert (s.start, s.num_new_tokens) == (7, 1) and b.num_cached_tokens == 7
    (dst,) = [t for t in s.block_table if t not in (src0, src1)]
    assert s.block_table == [src0, dst] and out.blocks_to_copy == [(src1, dst)]
    # The source is pinned for the step (a's reference, if any, plus the pin).
    assert sched.kv.pool.ref_counts[src1] == 1 + (not a_done)
    sched.update_from_output(out, runner.execute(out))
    assert sched.kv.pool.ref_counts[src1] == (not a_done)
    sched.kv.check_integrity()
    drain(sched, runner)
    assert b.output_token_ids == expected_output(runner, b)
    assert sched.kv.num_free_blocks == 64 and runner.num_copied == 1


def test_shared_blocks_are_never_written():
    kv = KVCacheManager(8, block_size=4)
    assert kv.allocate_slots("a", 6)
    kv.cache_full_blocks("a", hashes(SYSTEM[:6]), 0, 6, SYSTEM[:6])
    hit = kv.find_cached_prefix(hashes(SYSTEM[:6]), len(SYSTEM[:6]))
    assert kv.allocate_slots("b", 6, hit)
    kv.check_writable("b", 4, 6)  # its own block
    with pytest.raises(AssertionError, match="writing shared block"):
        kv.check_writable("b", 3, 6)
    kv.free("a")
    with pytest.raises(AssertionError, match="writing cached block"):
        kv.check_writable("b", 3, 6)  # b alone now, but a full cached block stays read-only


def test_cache_salt_isolates_tenants():
    sched, runner = make()
    sched.add_request(req("a", SYSTEM[:20], salt="tenant-1"))
    run_step(sched, runner)
    others = {
        "same tenant": req("b", SYSTEM[:20], salt="tenant-1"),
        "other tenant": req("c", SYSTEM[:20], salt="tenant-2"),
        "no tenant": req("d", SYSTEM[:20]),
    }
    for r in others.values():
        sched.add_request(r)
    run_step(sched, runner)
    hits = {k: r.num_cached_tokens for k, r in others.items()}
    assert hits == {"same tenant": 19, "other tenant": 0, "no tenant": 0}
    tables = {k: set(sched.kv.block_table(r.request_id)) for k, r in others.items()}
    assert tables["same tenant"] & set(sched.kv.block_table("a"))
    assert not tables["other tenant"] & tables["no tenant"]
    assert not (tables["other tenant"] | tables["no tenant"]) & set(sched.kv.block_table("a"))
    drain(sched, runner)


def test_prefix_differences_anywhere_before_a_block_stop_the_hit():
    sched, runner = make()
    sched.add_request(req("a", SYSTEM[:12]))
    run_step(sched, runner)
    # Block 1 and 2 tokens equal a's, block 0 differs: no hit at all.
    b = req("b", [0, *SYSTEM[1:12], 5])
    c = req("c", [*SYSTEM[:5], 0, *SYSTEM[6:12], 5])  # differs in block 1: block 0 hits
    for r in (b, c):
        sched.add_request(r)
    run_step(sched, runner)
    assert (b.num_cached_tokens, c.num_cached_tokens) == (0, 4)
    drain(sched, runner)


def test_generated_tokens_are_cached_as_blocks_fill():
    sched, runner = make()
    a = req("a", SYSTEM[:3], max_tokens=10)
    sched.add_request(a)
    drain(sched, runner)
    assert a.num_tokens == 13  # 12 computed: blocks 0..2 full, two of them decoded
    b = req("b", [*a.all_token_ids[:12], 1, 2])
    sched.add_request(b)
    run_step(sched, runner)
    assert b.num_cached_tokens == 12
    drain(sched, runner)
    assert b.output_token_ids == expected_output(runner, b)


def test_eviction_is_lazy_lru_and_takes_chain_tails_first():
    sched, runner = make(num_blocks=6, budget=64)
    a = req("a", SYSTEM[:17], max_tokens=1)  # 4 full blocks + 1 partial
    sched.add_request(a)
    out = run_step(sched, runner)
    a_table = scheduled(out, "a").block_table
    assert a.is_finished and sched.kv.num_cached_blocks == 4 and sched.kv.num_free_blocks == 6
    # c needs 3 blocks: the never-used block and a's partial tail are free of hashes and go
    # first, then the least recently used cached block: a's last full block (freed first).
    c = req("c", [1] * 9, max_tokens=1)
    sched.add_request(c)
    out = run_step(sched, runner)
    assert set(scheduled(out, "c").block_table) == {5, a_table[4], a_table[3]}
    assert sched.kv.num_cached_blocks == 3 + 2  # a's head survives; c's 2 full blocks join
    b = req("b", SYSTEM[:17], max_tokens=1)
    sched.add_request(b)
    out = run_step(sched, runner)
    assert b.num_cached_tokens == 12 and scheduled(out, "b").block_table[:3] == a_table[:3]
    drain(sched, runner)


def test_recompute_preemption_readmits_from_its_own_cached_blocks():
    # 5 blocks of 4. a and b take 2 each; a takes the last free one, then b needs one more
    # and, the later arrival, is recomputed. a's 4th block evicts b's tail; b's head stays
    # cached while a finishes, so b resumes from it.
    sched, runner = make(num_blocks=5, budget=64)
    a = req("a", SYSTEM[:8], max_tokens=7, arrival_time=0.0)
    b = req("b", list(range(8)), max_tokens=7, arrival_time=1.0)
    sched.add_request(a)
    sched.add_request(b)
    outs = drain(sched, runner)
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    i = next(i for i, o in enumerate(outs) if "b" in o.preempted_ids)
    resumed = next(
        scheduled(o, "b") for o in outs[i + 1 :] if any(s.request_id == "b" for s in o.scheduled)
    )
    assert resumed.start == 4  # not a full recompute: its first block hit
    assert b.num_cached_tokens == 0  # first admission's figure: nothing was cached then
    for r in (a, b):
        assert r.output_token_ids == expected_output(runner, r)


def test_reset_prefix_cache_refused_while_blocks_are_held():
    sched, runner = make()
    a = req("a", SYSTEM[:12], max_tokens=3)
    sched.add_request(a)
    run_step(sched, runner)
    cached = sched.kv.num_cached_blocks
    result = sched.reset_prefix_cache()
    assert not result and result.num_requeued == 0 and sched.kv.num_cached_blocks == cached
    drain(sched, runner)
    result = sched.reset_prefix_cache()  # idle now
    assert result and result.num_blocks_dropped == cached and sched.kv.num_cached_blocks == 0
    b = req("b", SYSTEM[:12])
    sched.add_request(b)
    run_step(sched, runner)
    assert b.num_cached_tokens == 0  # forgotten


def test_reset_prefix_cache_with_requeue_recomputes_running_requests():
    sched, runner = make()
    a, b = req("a", SYSTEM[:12], max_tokens=5), req("b", SYSTEM[:9], max_tokens=5)
    for r in (a, b):
        sched.add_request(r)
    run_step(sched, runner)
    run_step(sched, runner)
    result = sched.reset_prefix_cache(requeue=True)
    assert result and result.num_requeued == 2 and sched.kv.num_cached_blocks == 0
    assert sched.num_running == 0 and [r.request_id for r in sched.waiting] == ["a", "b"]
    assert a.num_computed_tokens == 0 and a.num_preemptions == 1 and a.num_output_tokens == 2
    out = run_step(sched, runner)
    assert out.preempted_ids == ["a", "b"]  # the runner drops their state
    assert [(s.request_id, s.start) for s in out.scheduled] == [("a", 0), ("b", 0)]
    drain(sched, runner)
    for r in (a, b):
        assert r.output_token_ids == expected_output(runner, r)
    assert sched.kv.num_free_blocks == 64


def test_prefix_caching_off():
    sched, runner = make(prefix=False)
    for rid in ("a", "b"):
        sched.add_request(req(rid, SYSTEM[:12]))
        run_step(sched, runner)
    assert sched.get_request("b").num_cached_tokens == 0
    assert sched.kv.num_cached_blocks == 0 and sched.kv.stats.num_queries == 0
    drain(sched, runner)
    assert sched.kv.pool.cached == {}


def test_room_check_counts_shared_blocks_once():
    # a and b share 2 cached blocks and own 1 each; the pool is full. Freeing b alone frees
    # only its own block; freeing both frees all 4.
    kv = KVCacheManager(4, block_size=4)
    assert kv.allocate_slots("a", 10)
    kv.cache_full_blocks("a", hashes(SYSTEM[:10]), 0, 10, SYSTEM[:10])
    assert kv.allocate_slots("b", 10, kv.find_cached_prefix(hashes(SYSTEM[:10]), len(SYSTEM[:10])))
    assert kv.num_free_blocks == 0
    assert kv.can_allocate("c", 4, freeing=["b"]) and not kv.can_allocate("c", 8, freeing=["b"])
    assert kv.can_allocate("c", 16, freeing=["a", "b"])
    # A hit on the shared blocks needs only the fresh block once a frees... its own block.
    hit = kv.find_cached_prefix(hashes([*SYSTEM[:8], 1, 2]), len([*SYSTEM[:8], 1, 2]))
    assert hit.num_tokens == 8 and kv.num_blocks_needed("c", 10, hit) == 1
    assert kv.can_allocate("c", 10, hit, freeing=["a"])
    assert not kv.can_allocate("c", 10, hit)
    kv.free("a")
    kv.free("b")
    # Now the hit blocks are free (cached): taking them back uses up free blocks too.
    assert kv.num_blocks_needed("c", 10, hit) == 3
    kv.check_integrity()


def test_urgent_request_displaces_requests_sharing_a_prefix():
    # Low-priority l1 and l2 share SYSTEM[:8] (2 blocks) and own 1 block each; 5 blocks.
    # An urgent request needs 3 blocks: preempting l2 alone frees 1, so l1 goes too.
    sched, runner = make(num_blocks=5, budget=64)
    l1 = req("l1", [*SYSTEM[:8], 1], max_tokens=3, priority=5, arrival_time=0.0)
    l2 = req("l2", [*SYSTEM[:8], 2], max_tokens=3, priority=5, arrival_time=1.0)
    sched.add_request(l1)
    run_step(sched, runner)
    sched.add_request(l2)
    run_step(sched, runner)
    assert sched.kv.num_free_blocks == 1
    u = req("u", list(range(12)), max_tokens=1, priority=0, arrival_time=2.0)
    sched.add_request(u)
    out = run_step(sched, runner)
    assert out.preempted_ids == ["l2", "l1"] and "u" in [s.request_id for s in out.scheduled]
    drain(sched, runner)
    for r in (l1, l2, u):
        assert r.output_token_ids == expected_output(runner, r)
