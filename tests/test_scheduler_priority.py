"""Priorities in the scheduler: (priority, arrival) order, preemption only by strictly more
urgent requests, hand-back of a victim's tokens, aging against starvation, and outputs that
do not depend on any of it. Lower `priority` = more urgent."""

import math
import random
import zlib

from kvcache import KVCacheManager
from scheduler import Request, RequestStatus, SamplingParams, Scheduler, SchedulerOutput
from tests.fake_runner import FakeRunner
from tests.test_kvcache_runner import KVRunner


def make(
    num_blocks: int = 1024,
    block_size: int = 4,
    max_num_seqs: int = 8,
    budget: int = 256,
    max_model_len: int = 4096,
    aging_s: float | None = None,
) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(num_blocks, block_size)
    sched = Scheduler(kv, max_num_seqs, budget, max_model_len, aging_s=aging_s)
    return sched, KVRunner(block_size)


def req(rid: str, prompt_len: int, max_tokens: int, priority: int = 0, arrival: float = 0.0):
    # Prompts depend on the id: cache hits come (almost) only from its own preemption.
    prompt = [(zlib.crc32(rid.encode()) + i * 7) % 1000 for i in range(prompt_len)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, sp, eos_token_ids=(2,), arrival_time=arrival, priority=priority)


def expected_output(runner: FakeRunner, r: Request) -> list[int]:
    n = r.num_output_tokens
    return [runner.token_for(r.request_id, r.num_prompt_tokens + k) for k in range(n)]


def step(sched: Scheduler, runner: FakeRunner, now: float = 0.0) -> SchedulerOutput:
    out = sched.schedule(now=now)
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert sched.num_running <= sched.max_num_seqs
    assert not {s.request_id for s in out.scheduled} & set(out.preempted_ids)
    sched.update_from_output(out, runner.execute(out), now=now)
    sched.kv.check_integrity()
    bs = sched.kv.block_size
    assert sched.kv.blocks_in_use() <= sum(
        math.ceil(r.num_computed_tokens / bs) for r in sched.running
    )
    return out


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def test_waiting_queue_is_priority_then_arrival_ordered():
    sched, _ = make()
    rng = random.Random(5)
    rs = [
        req(f"r{i}", 4, 4, priority=rng.randint(-2, 3), arrival=rng.randint(0, 9))
        for i in range(40)
    ]
    for r in rs:
        sched.add_request(r)
    by_key = sorted(rs, key=lambda r: (r.priority, r.arrival_time, int(r.request_id[1:])))
    assert ids(sched.waiting) == ids(by_key)


def test_aging_orders_by_effective_priority():
    sched, _ = make(aging_s=10.0)
    old_low = req("old_low", 4, 4, priority=3, arrival=0.0)  # effective 3 - t/10
    new_hi = req("new_hi", 4, 4, priority=0, arrival=25.0)  # effective 0 - (t-25)/10
    mid = req("mid", 4, 4, priority=1, arrival=0.0)
    for r in (new_hi, old_low, mid):
        sched.add_request(r)
    # old_low ~ virtual arrival 30, new_hi 25, mid 10: the order at any `now`.
    assert ids(sched.waiting) == ["mid", "new_hi", "old_low"]
    late_hi = req("late_hi", 4, 4, priority=0, arrival=31.0)
    sched.add_request(late_hi)  # arrived more than (3 - 0) * 10 s after old_low: behind it
    assert ids(sched.waiting) == ["mid", "new_hi", "old_low", "late_hi"]


def _three_low_running(**cfg):
    # 6 blocks of 4: L1, L2 (priority 5) and M (priority 3) hold 2 blocks each, none free.
    sched, runner = make(num_blocks=6, block_size=4, **cfg)
    l1 = req("L1", 6, 3, priority=5, arrival=1.0)
    l2 = req("L2", 6, 3, priority=5, arrival=2.0)
    m = req("M", 6, 3, priority=3, arrival=3.0)
    for r in (l1, l2, m):
        sched.add_request(r)
    step(sched, runner)
    assert sched.kv.num_free_blocks == 0 and ids(sched.running) == ["M", "L1", "L2"]
    return sched, runner, (l1, l2, m)


def test_urgent_arrival_preempts_least_urgent_latest_and_gets_tokens_back():
    sched, runner, (l1, l2, m) = _three_low_running()
    u = req("U", 4, 2, priority=0, arrival=4.0)
    sched.add_request(u)
    out = step(sched, runner)
    # Running in rank order: M, L1, L2 each got a decode token, then U needed a block:
    # L2 (least urgent, latest) is preempted and its token handed back to the budget.
    assert out.preempted_ids == ["L2"]
    assert ids(s.request for s in out.scheduled) == ["M", "L1", "U"]
    assert out.num_batched_tokens == 1 + 1 + 4
    assert l2.status is RequestStatus.WAITING and l2.num_computed_tokens == 0
    assert l2.num_output_tokens == 1 and l2.num_preemptions == 1
    assert ids(sched.waiting) == ["L2"]
    while sched.has_unfinished_requests():
        step(sched, runner)
    for r in (l1, l2, m, u):
        assert r.num_output_tokens == r.sampling_params.max_tokens
        assert r.output_token_ids == expected_output(runner, r)
    assert sched.kv.num_free_blocks == 6


def test_budget_handed_back_makes_room_for_the_urgent_prompt():
    # Budget 4: M, L1, L2 take 3 decode tokens; U gets the 1 left, then displaces L2 and
    # the handed-back token is free again (not counted twice, not lost).
    sched, runner, _ = _three_low_running()
    sched.max_num_batched_tokens = 4
    sched.add_request(req("U", 4, 2, priority=0, arrival=4.0))
    out = step(sched, runner)
    assert out.preempted_ids == ["L2"]
    got = {s.request_id: s.num_new_tokens for s in out.scheduled}
    assert got == {"M": 1, "L1": 1, "U": 1} and out.num_batched_tokens == 3
    out = step(sched, runner)  # the freed budget is really there next step
    assert out.num_batched_tokens <= 4


def test_equal_priority_arrival_does_not_preempt():
    sched, runner, _ = _three_low_running()
    sched.add_request(req("E", 4, 2, priority=3, arrival=4.0))  # equal to M, beats L1/L2
    out = step(sched, runner)
    assert out.preempted_ids == ["L2"] and "E" in ids(s.request for s in out.scheduled)
    sched.add_request(req("E2", 4, 2, priority=3, arrival=5.0))
    sched.add_request(req("E3", 4, 2, priority=5, arrival=6.0))
    out = step(sched, runner)
    # E2 may only displace strictly less urgent (priority 5) requests: L1 is one; E3 is
    # never admitted over equals.
    assert "E3" not in ids(s.request for s in out.scheduled)
    for rid in out.preempted_ids:
        assert sched.get_request(rid).priority == 5


def test_equal_priorities_never_ping_pong():
    # One priority class, a cache that fits about two requests, many steps: admission never
    # displaces anyone, and the oldest unfinished request is never the victim.
    for aging_s in (None, 1.0):
        sched, runner = make(
            num_blocks=12, block_size=4, max_num_seqs=6, budget=32, aging_s=aging_s
        )
        rng = random.Random(3)
        rs = [
            req(f"r{i}", rng.randint(1, 20), rng.randint(1, 20), priority=2, arrival=float(i))
            for i in range(30)
        ]
        for r in rs:
            sched.add_request(r)
        t = 0
        while sched.has_unfinished_requests():
            oldest = min(sched.requests.values(), key=lambda r: r.arrival_time)
            waiting_before = set(ids(sched.waiting))
            out = step(sched, runner, now=float(t))
            t += 1
            assert oldest.request_id not in out.preempted_ids
            if out.preempted_ids:
                assert not waiting_before & {s.request_id for s in out.scheduled}
            assert t < 5000
        assert sum(r.num_preemptions for r in rs) > 0
        for r in rs:
            assert r.output_token_ids == expected_output(runner, r)


def test_top_ranked_request_is_never_preempted_with_mixed_priorities():
    sched, runner = make(num_blocks=10, block_size=4, max_num_seqs=6, budget=24, aging_s=3.0)
    rng = random.Random(11)
    rs = []
    for t in range(3000):
        if rng.random() < 0.4 and len(rs) < 300:
            r = req(
                f"q{len(rs)}",
                rng.randint(1, 16),
                rng.randint(1, 16),
                priority=rng.randint(0, 3),
                arrival=float(t),
            )
            sched.add_request(r)
            rs.append(r)
        if not sched.has_unfinished_requests():
            continue
        top = min(sched.requests.values(), key=sched._rank)
        out = step(sched, runner, now=float(t))
        assert top.request_id not in out.preempted_ids
    while sched.has_unfinished_requests():
        step(sched, runner, now=3000.0)
    assert sum(r.num_preemptions for r in rs) > 0
    for r in rs:
        assert r.is_finished and r.output_token_ids == expected_output(runner, r)


def _flood(aging_s: float | None, num_blocks: int, steps: int = 300):
    """One urgent (priority 0) request arrives every step, more than 2 seats can serve;
    one priority-4 request arrives at t0 = 0.5. Returns (low, urgent requests)."""
    sched, runner = make(
        num_blocks=num_blocks, block_size=4, max_num_seqs=2, budget=64, aging_s=aging_s
    )
    low = req("low", 10, 6, priority=4, arrival=0.5)
    urgent = []
    for t in range(steps):
        u = req(f"u{t}", 4, 3, priority=0, arrival=float(t))
        sched.add_request(u)
        urgent.append(u)
        if t == 1:
            sched.add_request(low)
        step(sched, runner, now=float(t))
    return sched, runner, low, urgent


def test_aging_lets_low_priority_finish_under_urgent_flood():
    aging_s, p, q, t0 = 5.0, 4, 0, 0.5
    horizon = t0 + (p - q) * aging_s  # urgent requests arriving later rank behind `low`
    for num_blocks in (64, 5):  # roomy cache, and one where `low` must displace
        sched, runner, low, urgent = _flood(aging_s, num_blocks)
        assert low.is_finished and low.output_token_ids == expected_output(runner, low)
        low_start = low.first_scheduled_time
        behind = [u for u in urgent if u.arrival_time > horizon]
        ahead = [u for u in urgent if u.arrival_time <= horizon]
        # Nobody ranked behind `low` is admitted before it...
        for u in behind:
            assert u.first_scheduled_time is None or u.first_scheduled_time >= low_start
        # ... so it waits at most for the flood ranked ahead of it: each urgent request takes
        # 3 steps on one of 2 seats; then its own 6 tokens (10-token prompt in one step).
        bound = t0 + math.ceil(len(ahead) / 2) * 3 + 6 + 3
        assert low.finished_time <= bound, (low.finished_time, bound)
        assert sched.has_unfinished_requests()  # the flood was still going on
        if num_blocks == 5:  # `low`, ranked ahead, took blocks from a later urgent request
            assert low.num_preemptions == 0 and sum(u.num_preemptions for u in urgent) > 0


def test_without_aging_low_priority_starves_under_flood():
    _, _, low, _ = _flood(None, 64)
    assert low.first_scheduled_time is None and not low.is_finished


def _mixed_run(num_blocks: int, aging_s: float | None) -> tuple[dict, int]:
    sched, runner = make(
        num_blocks=num_blocks, block_size=4, max_num_seqs=8, budget=48, aging_s=aging_s
    )
    rng = random.Random(42)
    rs = [
        req(
            f"m{i}",
            rng.randint(1, 30),
            rng.randint(1, 30),
            priority=rng.randint(-1, 2),
            arrival=float(i // 3),
        )
        for i in range(64)
    ]
    t = 0
    while t < 10_000 and (rs[-1].arrival_time >= t or sched.has_unfinished_requests()):
        for r in rs:
            if r.arrival_time == t:
                sched.add_request(r)
        if sched.has_unfinished_requests():
            step(sched, runner, now=float(t))
        t += 1
    assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == num_blocks
    for r in rs:
        assert r.num_output_tokens == r.sampling_params.max_tokens
    return {r.request_id: r.output_token_ids for r in rs}, sum(r.num_preemptions for r in rs)


def test_outputs_identical_with_and_without_preemption():
    big, big_preempted = _mixed_run(1024, aging_s=None)
    for aging_s in (None, 2.0):
        tiny, tiny_preempted = _mixed_run(16, aging_s)  # 64 tokens: the longest fits alone
        # The big cache preempts only for seats (urgent arrivals), the tiny one for blocks too.
        assert tiny_preempted > max(10, big_preempted)
        assert tiny == big


def test_aging_s_validation():
    for bad in (0.0, -1.0, math.inf, math.nan):
        try:
            make(aging_s=bad)
        except ValueError:
            continue
        raise AssertionError(f"aging_s={bad} accepted")


def test_urgent_arrival_takes_the_budget_of_a_less_urgent_prefill():
    # Budget 10. L (priority 5) is admitted first and its 40-token prompt would take the
    # whole budget for 4 steps. U (priority 0) arrives: the next step preempts L (handing
    # back the 10 tokens it was given) and runs U's first chunk; L resumes once U is done.
    sched, runner = make(budget=10)
    low = req("L", 40, 5, priority=5, arrival=0.0)
    sched.add_request(low)
    step(sched, runner)
    urgent = req("U", 30, 2, priority=0, arrival=1.0)
    sched.add_request(urgent)
    out = step(sched, runner)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("U", 10)]
    assert out.preempted_ids == ["L"] and low.num_preemptions == 1
    for _ in range(2):
        out = step(sched, runner)
        assert ids(s.request for s in out.scheduled) == ["U"]
    # An equal or less urgent arrival never displaces anyone.
    sched.add_request(req("L2", 5, 1, priority=5, arrival=2.0))
    out = step(sched, runner)
    assert "L2" not in out.preempted_ids and "U" in ids(s.request for s in out.scheduled)
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert low.output_token_ids == expected_output(runner, low)
    assert urgent.output_token_ids == expected_output(runner, urgent)


def test_no_preemption_when_displacing_cannot_make_room():
    # U (priority 4) needs 5 blocks; only L1 and L2 (priority 5, 4 blocks) may be displaced.
    sched, runner, (l1, l2, _) = _three_low_running()
    u = req("U", 20, 2, priority=4, arrival=4.0)
    sched.add_request(u)
    out = step(sched, runner)
    assert out.preempted_ids == [] and ids(sched.waiting) == ["U"]
    assert l1.num_preemptions == l2.num_preemptions == 0
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert u.output_token_ids == expected_output(runner, u)
