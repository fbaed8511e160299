"""Long prompts share the step (scheduler/partial_prefill.py), with the fake runner: a short
request arriving during a long prefill gets its first token in the next step; the v1
threshold caps chunks; a long prompt beyond max_long_partial_prefills is passed over by
short ones only; a pending KV handoff or a prefix-cached prompt is not a long prefill; the
tokens every request gets never change."""

from __future__ import annotations

import pytest

from kvcache import KVCacheManager
from scheduler import Request, Scheduler, SchedulerOutput
from scheduler.partial_prefill import PrefillLimits
from scheduler.request import RemoteKV, RemoteKVState
from tests.test_kvcache_runner import KVRunner
from tests.test_scheduler import _workload, check_schedule, check_state
from tests.test_scheduler import req as plain_req

BUDGET, MAX_LEN = 256, 4096


def make(threshold: int = 0, partial: int = 1, long: int = 1, *, num_blocks: int = 1024,
         prefix: bool = False, max_num_seqs: int = 8, budget: int = BUDGET) -> tuple[Scheduler, KVRunner]:
    kv = KVCacheManager(num_blocks, 16, enable_prefix_caching=prefix)
    limits = PrefillLimits.from_flags(threshold, partial, long, MAX_LEN)
    return Scheduler(kv, max_num_seqs, budget, MAX_LEN, prefill_limits=limits), KVRunner(16)


def req(rid: str, prompt_len: int, max_tokens: int, arrival: float = 0.0,
        priority: int = 0) -> Request:
    r = plain_req(rid, prompt_len, max_tokens, arrival)
    r.priority = priority
    return r


def step(sched: Scheduler, runner: KVRunner, pulls: bool = False) -> dict[str, int]:
    out: SchedulerOutput = sched.schedule(now=0.0)
    check_schedule(sched, out)
    sched.update_from_output(out, runner.execute(out), now=0.0)
    if pulls:  # (check_state counts only running requests' blocks)
        sched.kv.check_integrity()
    else:
        check_state(sched)
    return {s.request_id: s.num_new_tokens for s in out.scheduled}


def first_token_step(sched: Scheduler, runner: KVRunner, r: Request, limit: int = 100) -> int:
    for n in range(1, limit + 1):
        step(sched, runner)
        if r.num_output_tokens:
            return n
    raise AssertionError(f"{r.request_id} got no token in {limit} steps")


@pytest.mark.parametrize(("flags", "short_steps"), [
    ((0, 1, 1), 7),  # off: the 2,000-token prompt takes every step until its last chunk
    ((0, 2, 1), 1),  # v0: the two prefills split the next step
    ((128, 1, 1), 1),  # v1: chunks of at most 128 leave room beside it
])
def test_a_short_request_during_a_long_prefill(flags, short_steps) -> None:
    sched, runner = make(*flags)
    long = req("long", 2000, 4)
    sched.add_request(long)
    step(sched, runner)
    short = req("short", 8, 4)
    sched.add_request(short)
    assert first_token_step(sched, runner, short) == short_steps
    for _ in range(3):  # and then a token each step, the long prompt still prefilling
        step(sched, runner)
    assert short.num_output_tokens == 4 and (short_steps > 1 or not long.num_output_tokens)


def test_partial_prefills_split_the_budget_only_while_several_prefill() -> None:
    sched, runner = make(0, 2, 1)
    long = req("long", 2000, 4)
    sched.add_request(long)
    assert step(sched, runner) == {"long": BUDGET}  # alone: the whole budget
    sched.add_request(req("short", 8, 4))
    sched.add_request(req("mid", 150, 4))  # short too: 150 <= 163, 4% of 4096
    # Three prefills, two counted: shares of 128; what the long one's share and the 8 leave
    # goes to the third.
    assert step(sched, runner) == {"long": 128, "short": 8, "mid": 120}
    # Two prefills and a decode: (256 - 1) // 2 each.
    assert step(sched, runner) == {"long": 127, "short": 1, "mid": 30}
    # One prefill again: all the budget but the decodes' tokens.
    assert step(sched, runner) == {"long": 254, "short": 1, "mid": 1}


def test_the_v1_threshold_caps_every_chunk_even_alone() -> None:
    sched, runner = make(100, 1, 1)
    long = req("long", 450, 2)
    sched.add_request(long)
    assert [step(sched, runner)["long"] for _ in range(5)] == [100, 100, 100, 100, 50]
    assert long.num_output_tokens == 1


@pytest.mark.parametrize("max_long", [1, 2])
def test_long_prompts_beyond_max_long_partial_prefills_let_short_ones_pass(max_long) -> None:
    sched, runner = make(0, 2, max_long)
    a, b, s = req("a", 1000, 2, arrival=0.0), req("b", 1000, 2, arrival=1.0), req("s", 8, 2, arrival=2.0)
    for r in (a, b, s):
        sched.add_request(r)
    got = step(sched, runner)
    if max_long == 1:  # b is passed over; s, behind it, is not
        assert got == {"a": BUDGET // 2, "s": 8} and [r.request_id for r in sched.waiting] == ["b"]
    else:  # both long ones prefill, s waits its turn
        assert got == {"a": BUDGET // 2, "b": BUDGET // 2} and sched.waiting == [s]
    while b.num_output_tokens == 0:
        step(sched, runner)
    assert a.num_output_tokens and s.num_output_tokens  # a, admitted first, never waited on b


def test_a_passed_over_prompt_displaces_nobody() -> None:
    """Seats short: the long prompt passed over does not preempt a less urgent request for a
    seat it would not use this step."""
    sched, runner = make(0, 2, 1, max_num_seqs=2)
    a = req("a", 1000, 2)
    low = req("low", 8, 50, priority=5)
    sched.add_request(a)
    sched.add_request(low)
    step(sched, runner)
    urgent_long = req("urgent", 1000, 2, priority=-5)
    sched.add_request(urgent_long)
    step(sched, runner)
    assert low in sched.running and urgent_long in sched.waiting and not low.num_preemptions


def test_a_pending_handoff_is_no_long_prefill_and_is_admitted_to_pull() -> None:
    sched, runner = make(0, 2, 1)
    a = req("a", 1000, 2)
    sched.add_request(a)
    step(sched, runner)
    remote = Request("r", [(i * 7) % 997 + 3 for i in range(1000)], a.sampling_params,
                     eos_token_ids=(2,), remote_kv=RemoteKV(1000))
    sched.add_request(remote)
    # Not counted as a prefill: a keeps the whole budget (a pull waits for a step with
    # budget left, as before); and never passed over as long: it is admitted to pull.
    given = []
    while remote.remote_kv.state is RemoteKVState.PENDING:
        given.append(step(sched, runner, pulls=True)["a"])
    assert given == [BUDGET, BUDGET, 1000 - 3 * BUDGET]
    assert remote.remote_kv.state is RemoteKVState.PULLING
    sched.remote_kv_done(remote, ok=False, reason="peer gone")  # now it computes its prompt
    assert step(sched, runner, pulls=True) == {"a": 1, "r": BUDGET - 1}


def test_a_prompt_mostly_in_the_prefix_cache_is_short() -> None:
    sched, runner = make(0, 2, 1, prefix=True)
    first = req("x", 1000, 1)
    sched.add_request(first)
    while first.num_output_tokens == 0:
        step(sched, runner)
    a = req("a", 1000, 2)
    sched.add_request(a)
    step(sched, runner)
    again = Request("x2", list(first.prompt_token_ids), first.sampling_params, eos_token_ids=(2,))
    sched.add_request(again)
    # 992 of its 1,000 tokens cached: 8 left, not long; two prefills share the step.
    assert step(sched, runner) == {"a": BUDGET // 2, "x2": 8}
    assert again.num_cached_tokens == 992


@pytest.mark.parametrize("flags", [(0, 2, 1), (0, 3, 2), (48, 1, 1), (32, 4, 1)])
def test_tokens_are_those_without_limits_under_preemption_and_priorities(flags) -> None:
    work = _workload(seed=3, n=24, max_prompt=300, max_out=30)

    def run(limits: tuple[int, int, int], num_blocks: int) -> dict[str, list[int]]:
        sched, runner = make(*limits, num_blocks=num_blocks, budget=64)
        rs = [req(rid, p, m, arrival=t, priority=i % 3) for i, (rid, p, m, t) in enumerate(work)]
        for r in rs:
            sched.add_request(r)
        for _ in range(20_000):
            if not sched.has_unfinished_requests():
                break
            step(sched, runner)
        assert sched.kv.blocks_in_use() == 0
        return {r.request_id: r.output_token_ids for r in rs}

    reference = run((0, 1, 1), 1024)
    assert run(flags, 1024) == reference
    assert run(flags, 24) == reference  # 384 tokens of cache: constant preemption


@pytest.mark.parametrize(("flags", "match"), [
    ((-1, 1, 1), "threshold must be >= 0"),
    ((0, 0, 1), "must be >= 1"),
    ((0, 2, 3), r"max_long_partial_prefills \(3\) must be <="),
    ((MAX_LEN, 1, 1), "must be < max_model_len"),
])
def test_flag_validation(flags, match) -> None:
    with pytest.raises(ValueError, match=match):
        PrefillLimits.from_flags(*flags, MAX_LEN)


def test_vllms_auto_threshold_and_no_limits_where_whole_prompts_move() -> None:
    assert PrefillLimits.from_flags(0, 2, 1, 8192).threshold == 327  # 4% of max_model_len
    assert PrefillLimits.from_flags(0, 1, 1, 8192).threshold == 0
    kv = KVCacheManager(64, 16)
    limits = PrefillLimits.from_flags(64, 2, 1, MAX_LEN)
    assert Scheduler(kv, 4, 256, MAX_LEN, "static", prefill_limits=limits).prefill_limits == PrefillLimits.off()
    assert Scheduler(kv, 4, 256, MAX_LEN, chunked_prefill=False,
                     prefill_limits=limits).prefill_limits == PrefillLimits.off()
