"""Preemption by swapping to CPU blocks: the round trip of KV contents, resume order,
fallback to recompute, aborts, shared blocks, the step-ordering hazards, and outputs that
are the same under every preemption mode. The KVRunner moves its fake KV between GPU and
CPU exactly as the real runner must and checks every position after each step."""

import random

import pytest

from kvcache import KVCacheManager, iter_block_hashes
from scheduler import Request, RequestStatus, SamplingParams, Scheduler
from tests.test_kvcache_runner import KVRunner, drain, expected_output, fingerprints, run_step

BS = 4


def hashes(tokens: list[int]) -> list[bytes]:
    """A request's block hashes, as `Request.block_hashes` holds them."""
    return list(iter_block_hashes(tokens, BS))


def make(
    num_blocks: int = 5,
    num_cpu_blocks: int = 8,
    mode: str = "swap",
    prefix: bool = True,
    budget: int = 64,
    max_num_seqs: int = 8,
) -> tuple[Scheduler, KVRunner]:
    kv = KVCacheManager(num_blocks, BS, prefix, num_cpu_blocks)
    sched = Scheduler(kv, max_num_seqs, budget, 256, aging_s=None, preemption_mode=mode)
    return sched, KVRunner(BS)


def req(rid: str, prompt: list[int], max_tokens: int, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kw)


def two_then_preempt(**cfg):
    """5 blocks: a and b prefill 2 blocks each; next step a takes the last free block and b,
    the later arrival, needing one too, is preempted. Returns (sched, runner, a, b, out of
    that step, b's table before it)."""
    sched, runner = make(**cfg)
    a = req("a", list(range(100, 108)), 7, arrival_time=0.0)
    b = req("b", list(range(200, 208)), 7, arrival_time=1.0)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched, runner)
    b_table = sched.kv.block_table("b")
    out = run_step(sched, runner, now=1.0)
    assert out.preempted_ids == ["b"] and [s.request_id for s in out.scheduled] == ["a"]
    return sched, runner, a, b, out, b_table


def test_swap_round_trip_keeps_kv_and_progress():
    sched, runner, a, b, out, b_table = two_then_preempt()
    kv = sched.kv
    cpu = kv.cpu_block_table("b")
    assert out.blocks_to_swap_out == list(zip(b_table, cpu, strict=True)) and len(cpu) == 2
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 8
    assert sched.num_swapped == 1 and sched.num_waiting == 0 and kv.block_table("b") == []
    assert kv.num_free_cpu_blocks == 6 and b.num_preemptions == 1
    fp = fingerprints(b.all_token_ids, 8)  # the CPU copy holds b's keys and values
    assert [runner.cpu[c * BS + o] for c in cpu for o in range(BS)] == list(enumerate(fp))
    outs = drain(sched, runner, now=2.0)
    i = next(i for i, o in enumerate(outs) if o.blocks_to_swap_in)
    s = next(s for s in outs[i].scheduled if s.request_id == "b")
    assert outs[i].blocks_to_swap_in == list(zip(cpu, s.block_table[:2], strict=True))
    assert s.start == 8  # resumes where it was, no recompute
    assert b.output_token_ids == expected_output(runner, b) and b.num_output_tokens == 7
    assert a.output_token_ids == expected_output(runner, a)
    assert kv.num_free_cpu_blocks == 8 and kv.num_free_blocks == 5
    assert runner.num_swapped_out == runner.num_swapped_in == 2


def test_swapped_request_resumes_before_anything_ranked_behind_it():
    sched, runner = make(num_blocks=5)
    a = req("a", list(range(100, 108)), 7, priority=0, arrival_time=0.0)
    b = req("b", list(range(200, 208)), 4, priority=1, arrival_time=1.0)
    for r in (a, b):
        sched.add_request(r)
    run_step(sched, runner, now=0.0)
    assert run_step(sched, runner, now=1.0).preempted_ids == ["b"]
    d = req("d", [1, 2, 3, 4], 1, priority=-1, arrival_time=2.0)  # more urgent than b
    c = req("c", [5, 6, 7, 8], 1, priority=2, arrival_time=2.0)  # less urgent, would fit
    for r in (c, d):
        sched.add_request(r)
    out = run_step(sched, runner, now=2.0)
    assert [s.request_id for s in out.scheduled] == ["a", "d"]
    assert b.status is RequestStatus.SWAPPED and c.status is RequestStatus.WAITING
    outs = drain(sched, runner, now=3.0)
    i = next(i for i, o in enumerate(outs) if o.blocks_to_swap_in)
    assert c.first_scheduled_time >= 3.0 + i  # not before b came back
    assert [s.request_id for s in outs[i].scheduled][-2:] == ["b", "c"]
    for r in (a, b, c, d):
        assert r.output_token_ids == expected_output(runner, r)


@pytest.mark.parametrize(
    ("mode", "num_cpu_blocks"), [("auto", 1), ("swap", 1), ("auto", 0), ("recompute", 8)]
)
def test_recompute_when_swap_does_not_fit_or_is_off(mode, num_cpu_blocks):
    sched, runner, _, b, out, _ = two_then_preempt(mode=mode, num_cpu_blocks=num_cpu_blocks)
    assert out.blocks_to_swap_out == [] and sched.num_swapped == 0
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    drain(sched, runner, now=2.0)
    assert b.output_token_ids == expected_output(runner, b) and runner.num_swapped_out == 0


def test_mode_validation():
    with pytest.raises(ValueError, match="needs swap space"):
        make(num_cpu_blocks=0, mode="swap")
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        make(mode="sometimes")


def test_abort_of_a_swapped_request_frees_its_cpu_blocks():
    sched, runner, a, b, *_ = two_then_preempt()
    assert sched.kv.num_free_cpu_blocks == 6
    (done,) = sched.abort_requests(["b"])
    assert done is b and b.finish_reason == "abort" and sched.num_swapped == 0
    assert sched.kv.num_free_cpu_blocks == 8 and not sched.kv.is_swapped("b")
    sched.kv.check_integrity()
    out = run_step(sched, runner)
    assert out.finished_ids == ["b"]
    drain(sched, runner)
    assert a.output_token_ids == expected_output(runner, a)


def test_reset_prefix_cache_with_swapped_requests():
    sched, runner, _, b, *_ = two_then_preempt()
    sched.abort_requests(["a"])
    assert not sched.reset_prefix_cache()  # b's CPU blocks predate the reset
    result = sched.reset_prefix_cache(requeue=True)
    assert result and result.num_requeued == 1 and sched.kv.num_free_cpu_blocks == 8
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    drain(sched, runner)
    assert b.output_token_ids == expected_output(runner, b)


def test_integrity_check_covers_the_cpu_pool():
    sched, *_ = two_then_preempt()
    kv = sched.kv
    kv.cpu_tables["b"].append(kv.swap_space.free_blocks[0])
    with pytest.raises(AssertionError, match="twice"):
        kv.check_integrity()
    kv.cpu_tables["b"].pop()
    kv.check_integrity()
    del kv.cpu_tables["b"]
    with pytest.raises(AssertionError, match="leaked"):
        kv.check_integrity()


def test_shared_blocks_are_swapped_out_as_private_copies():
    # a and b share 2 cached blocks. When b is swapped out, all 4 of its computed blocks
    # are copied to CPU; the shared ones stay a's. b comes back into blocks of its own.
    sched, runner = make(num_blocks=6)
    system = list(range(100, 108))
    a = req("a", [*system, 1], 10, arrival_time=0.0)  # computes 18 positions: 5 blocks
    sched.add_request(a)
    run_step(sched, runner)
    b = req("b", [*system, 2], 9, arrival_time=1.0)
    sched.add_request(b)
    run_step(sched, runner)
    kv = sched.kv
    a_table, b_table = kv.block_table("a"), kv.block_table("b")
    assert b.num_cached_tokens == 8 and b_table[:2] == a_table[:2]
    for _ in range(8):
        if (out := run_step(sched, runner, now=2.0)).preempted_ids:
            break
    assert out.preempted_ids == ["b"] and b.num_computed_tokens == 15
    assert [g for g, _ in out.blocks_to_swap_out][:2] == a_table[:2]
    assert len(out.blocks_to_swap_out) == 4
    assert [kv.pool.ref_counts[x] for x in a_table[:2]] == [1, 1]
    outs = drain(sched, runner, now=3.0)
    i = next(i for i, o in enumerate(outs) if o.blocks_to_swap_in)
    new_table = next(s for s in outs[i].scheduled if s.request_id == "b").block_table
    cpu = [c for _, c in out.blocks_to_swap_out]
    assert outs[i].blocks_to_swap_in == list(zip(cpu, new_table[:4], strict=True))
    for r in (a, b):
        assert r.output_token_ids == expected_output(runner, r)


def test_swapped_in_blocks_are_cached_again():
    kv = KVCacheManager(3, BS, num_cpu_blocks=3)
    tokens = list(range(9))
    assert kv.allocate_slots("a", 9)
    kv.cache_full_blocks("a", hashes(tokens), 0, 9, tokens)
    kv.swap_out("a", 9)
    kv.take_moves()
    assert kv.allocate_slots("x", 12)  # evicts a's cached GPU blocks
    assert kv.find_cached_prefix(hashes(tokens), len(tokens)).num_tokens == 0
    kv.free("x")
    assert kv.swap_in("a", 10, hashes(tokens))
    moves = kv.take_moves()
    new = kv.block_table("a")
    assert [g for _, g in moves.swap_in] == new
    hit = kv.find_cached_prefix(hashes(tokens), len(tokens))
    assert hit.blocks == tuple(new[:2]) and hit.num_tokens == 8
    kv.moves_done()
    kv.check_integrity()


def test_cpu_blocks_read_by_a_swap_in_are_not_reused_in_its_step():
    # The runner swaps out before it swaps in: a swap-out in the step that swaps a
    # request in must not overwrite the CPU blocks that swap-in is about to read.
    kv = KVCacheManager(8, BS, num_cpu_blocks=2)
    assert kv.allocate_slots("a", 8)
    kv.swap_out("a", 8)
    kv.take_moves()
    kv.moves_done()
    assert kv.allocate_slots("b", 8)
    assert kv.swap_in("a", 9)  # a step: a comes back...
    assert not kv.can_swap_out("b", 8)  # ...and b could not go out into a's CPU blocks
    moves = kv.take_moves()
    assert [c for c, _ in moves.swap_in] == [0, 1]
    kv.moves_done()
    assert kv.can_swap_out("b", 8)
    kv.check_integrity()


def test_copy_source_is_pinned_until_the_moves_are_done():
    # The runner swaps in before it copies: the source of a copy must not be evicted and
    # handed to a swap-in of the same step.
    kv = KVCacheManager(3, BS, num_cpu_blocks=4)
    tokens = list(range(8))
    assert kv.allocate_slots("a", 8)
    kv.cache_full_blocks("a", hashes(tokens), 0, 8, tokens)
    src = kv.block_table("a")[1]
    kv.free("a")  # both blocks free and cached; block 2 never used
    hit = kv.find_cached_prefix(hashes(tokens), len(tokens))
    assert hit.cow_src == src and hit.num_tokens == 7
    assert kv.allocate_slots("b", 8, hit)
    assert kv.pool.ref_counts[src] == 1 and kv.num_free_blocks == 0  # pinned, not free
    assert not kv.can_allocate("c", 1)
    assert kv.take_moves().copy == [(src, kv.block_table("b")[1])]
    kv.moves_done()
    assert kv.pool.ref_counts[src] == 0 and kv.num_free_blocks == 1
    kv.check_integrity()


def test_a_victim_is_never_swapped_out_in_the_step_that_wrote_its_blocks():
    kv = KVCacheManager(8, BS, num_cpu_blocks=8)
    assert kv.allocate_slots("a", 8)
    kv.swap_out("a", 8)
    kv.take_moves()
    kv.moves_done()
    assert kv.swap_in("a", 9)
    with pytest.raises(AssertionError, match="swapped out in the step"):
        kv.swap_out("a", 8)


def _mixed_requests(n: int = 64) -> list[Request]:
    rng = random.Random(5)
    systems = [[rng.randrange(1000) for _ in range(rng.randint(4, 24))] for _ in range(3)]
    rs = []
    for i in range(n):
        head = systems[i % 3] if rng.random() < 0.7 else []
        tail = [rng.randrange(1000) for _ in range(rng.randint(1, 12))]
        rs.append(
            Request(
                f"m{i}",
                head + tail,
                SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True),
                arrival_time=float(i // 4),
                priority=rng.randint(0, 2),
                cache_salt=rng.choice([None, None, "t"]),
            )
        )
    return rs


def _run_mixed(num_blocks: int, **cfg) -> tuple[list[Request], Scheduler, KVRunner]:
    sched, runner = make(num_blocks=num_blocks, budget=32, **cfg)
    rs = _mixed_requests()
    t = 0
    while t < 10_000 and (t <= rs[-1].arrival_time or sched.has_unfinished_requests()):
        for r in rs:
            if r.arrival_time == t:
                sched.add_request(r)
        if sched.has_unfinished_requests():
            run_step(sched, runner, now=float(t))
        t += 1
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == num_blocks
    assert sched.kv.num_free_cpu_blocks == sched.kv.num_cpu_blocks
    for r in rs:
        assert r.num_output_tokens == r.sampling_params.max_tokens
    return rs, sched, runner


@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize(("mode", "num_cpu_blocks"), [("swap", 64), ("auto", 6), ("recompute", 0)])
def test_outputs_identical_under_every_preemption_mode(prefix, mode, num_cpu_blocks):
    ref, *_ = _run_mixed(1024, mode="recompute", num_cpu_blocks=0, prefix=False)
    assert sum(r.num_preemptions for r in ref) == 0
    # The longest request fits alone, with a block to spare; few fit together.
    longest = max(r.num_prompt_tokens + r.sampling_params.max_tokens for r in _mixed_requests())
    tiny = -(-longest // BS) + 1
    got, sched, runner = _run_mixed(tiny, mode=mode, num_cpu_blocks=num_cpu_blocks, prefix=prefix)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in ref]
    assert sum(r.num_preemptions for r in got) > 10
    assert runner.num_swapped_out == runner.num_swapped_in
    assert (runner.num_swapped_out > 0) == (mode != "recompute")
    assert (sched.kv.stats.num_hit_tokens > 0) == prefix
