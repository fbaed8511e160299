"""Scheduler behaviour driven by the fake runner: chunked prefill, budgets, stops, aborts,
preemption by recompute, the static policy, and block accounting after every scenario."""

import math
import random
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import KVCacheManager
from scheduler import Request, RequestStatus, SamplingParams, Scheduler, SchedulerOutput
from tests.fake_runner import FakeRunner
from tests.test_kvcache_runner import KVRunner

# -- helpers ----------------------------------------------------------------------------------


def make(
    num_blocks: int = 1024,
    block_size: int = 16,
    max_num_seqs: int = 8,
    budget: int = 256,
    max_model_len: int = 4096,
    policy: str = "continuous",
) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(num_blocks, block_size)
    sched = Scheduler(kv, max_num_seqs, budget, max_model_len, policy)
    return sched, KVRunner(block_size)


def req(rid: str, prompt_len: int, max_tokens: int, arrival: float = 0.0, **params) -> Request:
    params.setdefault("ignore_eos", True)
    # Prompts depend on the id: cache hits come (almost) only from its own preemption.
    prompt = [(zlib.crc32(rid.encode()) + i * 7) % 1000 for i in range(prompt_len)]
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(rid, prompt, sp, eos_token_ids=(2,), arrival_time=arrival)


def expected_output(runner: FakeRunner, r: Request, n: int) -> list[int]:
    return [runner.token_for(r.request_id, r.num_prompt_tokens + k) for k in range(n)]


def check_schedule(sched: Scheduler, out: SchedulerOutput) -> None:
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert sched.num_running <= sched.max_num_seqs
    assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
    for s in out.scheduled:
        assert s.num_new_tokens >= 1 and s.start == s.request.num_computed_tokens
        assert s.request in sched.running
    if out.num_batched_tokens < sched.max_num_batched_tokens:  # budget left: nobody skipped
        assert {s.request_id for s in out.scheduled} == {r.request_id for r in sched.running}


def check_state(sched: Scheduler) -> None:
    kv, bs = sched.kv, sched.kv.block_size
    kv.check_integrity()
    # Blocks in use never exceed what running requests need, rounded up to a block.
    assert kv.blocks_in_use() <= sum(math.ceil(r.num_computed_tokens / bs) for r in sched.running)
    for r in sched.waiting:
        assert r.status is RequestStatus.WAITING and kv.block_table(r.request_id) == []
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING and r.num_computed_tokens < r.num_tokens
    assert len(sched.requests) == sched.num_running + sched.num_waiting


def step(sched: Scheduler, runner: FakeRunner, now: float = 0.0) -> SchedulerOutput:
    waiting_before = {r.request_id for r in sched.waiting}
    out = sched.schedule(now=now)
    check_schedule(sched, out)
    if out.preempted_ids:  # blocks ran out: nobody is admitted in the same step
        assert not waiting_before & {s.request_id for s in out.scheduled}
    sched.update_from_output(out, runner.execute(out), now=now)
    check_state(sched)
    return out


def drive(sched: Scheduler, runner: FakeRunner, max_steps: int = 100_000) -> int:
    """Step until every request ended; returns the number of steps."""
    steps = 0
    while sched.has_unfinished_requests():
        out = step(sched, runner, now=float(steps))
        assert not out.is_empty, "no progress with unfinished requests"
        steps += 1
        assert steps < max_steps
    return steps


def assert_clean(sched: Scheduler, free_at_start: int) -> None:
    assert not sched.has_unfinished_requests()
    assert sched.num_running == 0 and sched.num_waiting == 0
    assert sched.kv.num_free_blocks == free_at_start == sched.kv.num_blocks
    assert sched.kv.block_tables == {}
    sched.kv.check_integrity()


# -- basics -----------------------------------------------------------------------------------


def test_prefill_then_decode():
    sched, runner = make()
    r = req("a", prompt_len=10, max_tokens=5)
    sched.add_request(r)
    out = step(sched, runner, now=1.0)
    (s,) = out.scheduled
    assert (s.start, s.num_new_tokens, s.will_sample) == (0, 10, True)
    assert s.token_ids == r.prompt_token_ids
    assert r.first_scheduled_time == 1.0 and r.first_token_time == 1.0
    for i in range(4):
        out = step(sched, runner, now=2.0 + i)
        assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(10 + i, 1)]
    assert r.is_finished and r.finish_reason == "length" and r.finished_time == 5.0
    assert r.output_token_ids == expected_output(runner, r, 5)
    assert r.all_token_ids == r.prompt_token_ids + r.output_token_ids
    out = sched.schedule()
    assert out.is_empty and out.finished_ids == ["a"]
    assert_clean(sched, 1024)


def test_chunked_prefill_alone():
    sched, runner = make(budget=64)
    r = req("long", prompt_len=1000, max_tokens=2)
    sched.add_request(r)
    chunks = []
    while not r.output_token_ids:
        out = step(sched, runner)
        (s,) = out.scheduled
        chunks.append(s.num_new_tokens)
        assert s.will_sample == (s.start + s.num_new_tokens == 1000)
    assert len(chunks) == math.ceil(1000 / 64) == 16
    assert chunks == [64] * 15 + [40]
    drive(sched, runner)
    assert_clean(sched, 1024)


def test_chunked_prefill_shares_batch_with_decodes():
    sched, runner = make(budget=64)
    decoders = [req(f"d{i}", prompt_len=5, max_tokens=100) for i in range(2)]
    for d in decoders:
        sched.add_request(d)
    step(sched, runner)  # both prefill in one step
    long = req("long", prompt_len=1000, max_tokens=1)
    sched.add_request(long)
    steps = 0
    while not long.is_finished:
        out = step(sched, runner)
        steps += 1
        by_id = {s.request_id: s.num_new_tokens for s in out.scheduled}
        assert by_id["d0"] == by_id["d1"] == 1  # decodes run in the same step as the chunk
        assert by_id["long"] == min(62, 1000 - long.num_computed_tokens + by_id["long"])
        if not long.is_finished:
            assert out.num_batched_tokens == 64
    assert steps == math.ceil(1000 / 62) == 17
    drive(sched, runner)
    assert_clean(sched, 1024)


def test_max_num_seqs_limits_admission():
    sched, runner = make(max_num_seqs=2)
    for i in range(5):
        sched.add_request(req(f"r{i}", prompt_len=4, max_tokens=3))
    out = step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"] and sched.num_waiting == 3
    drive(sched, runner)
    assert_clean(sched, 1024)


# -- stopping ---------------------------------------------------------------------------------


def test_ignore_eos_gives_exactly_max_tokens():
    sched, runner = make(budget=48, max_num_seqs=4)
    rs = [req(f"r{i}", prompt_len=3 + 11 * i, max_tokens=1 + 7 * i) for i in range(10)]
    runner.vocab_size = 3  # token 2 is EOS: hit often, and ignored
    for r in rs:
        sched.add_request(r)
    drive(sched, runner)
    for r in rs:
        assert r.num_output_tokens == r.sampling_params.max_tokens
        assert r.output_token_ids == expected_output(runner, r, r.num_output_tokens)
        assert r.finish_reason == "length" and r.stop_reason is None
    assert any(2 in r.output_token_ids for r in rs)
    assert_clean(sched, 1024)


def _first_index(tokens: list[int], value: int) -> int:
    return tokens.index(value) if value in tokens else -1


@pytest.mark.parametrize("how", ["eos", "stop_token_ids"])
def test_stop_tokens_finish_early(how):
    sched, runner = make()
    probe = req("r", prompt_len=7, max_tokens=50)
    planned = expected_output(runner, probe, 50)
    stop_tok = planned[5]
    k = _first_index(planned, stop_tok)
    if how == "eos":
        r = Request(
            "r", probe.prompt_token_ids, SamplingParams(max_tokens=50), eos_token_ids=(stop_tok,)
        )
    else:
        r = Request(
            "r", probe.prompt_token_ids, SamplingParams(max_tokens=50, stop_token_ids=(stop_tok,))
        )
    sched.add_request(r)
    drive(sched, runner)
    assert r.status is RequestStatus.FINISHED_STOPPED and r.finish_reason == "stop"
    assert r.stop_reason == stop_tok
    assert r.output_token_ids == planned[: k + 1]  # the stop token itself is kept
    assert_clean(sched, 1024)


def test_ignore_eos_does_not_ignore_stop_token_ids():
    r = Request(
        "r",
        [1],
        SamplingParams(max_tokens=9, ignore_eos=True, stop_token_ids=(7,)),
        eos_token_ids=(5,),
    )
    r.append_output_token(5)
    assert not r.check_stop(max_model_len=100)
    r.append_output_token(7)
    assert r.check_stop(max_model_len=100) and r.finish_reason == "stop" and r.stop_reason == 7


def test_stop_token_wins_over_length():
    r = Request("r", [1], SamplingParams(max_tokens=1), eos_token_ids=(5,))
    r.append_output_token(5)
    assert r.check_stop(max_model_len=100) and r.finish_reason == "stop"
    with pytest.raises(AssertionError):
        r.append_output_token(6)


def test_max_model_len_ends_with_length():
    sched, runner = make(max_model_len=20)
    r = req("r", prompt_len=10, max_tokens=100)
    sched.add_request(r)
    drive(sched, runner)
    assert r.finish_reason == "length" and r.num_tokens == 20 and r.num_output_tokens == 10
    assert_clean(sched, 1024)


def test_finish_requests_for_stop_strings():
    sched, runner = make()
    r = req("r", prompt_len=4, max_tokens=100)
    sched.add_request(r)
    step(sched, runner)
    step(sched, runner)
    (done,) = sched.finish_requests(["r", "unknown"], RequestStatus.FINISHED_STOPPED)
    assert done is r and r.finish_reason == "stop" and r.num_output_tokens == 2
    assert sched.kv.num_free_blocks == 1024
    assert sched.schedule().finished_ids == ["r"]
    assert_clean(sched, 1024)


# -- abort ------------------------------------------------------------------------------------


def test_abort_frees_blocks_at_once():
    sched, runner = make(max_num_seqs=1)
    a, b = req("a", prompt_len=40, max_tokens=100), req("b", prompt_len=4, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    assert sched.kv.blocks_in_use() == 3 and b.status is RequestStatus.WAITING
    aborted = sched.abort_requests(["a", "b", "nope"])
    assert aborted == [a, b]
    assert sched.kv.blocks_in_use() == 0 and not sched.has_unfinished_requests()
    assert a.finish_reason == b.finish_reason == "abort"
    assert sched.abort_requests(["a"]) == []  # already gone
    out = sched.schedule()
    assert out.is_empty and out.finished_ids == ["a", "b"]
    assert sched.schedule().finished_ids == []
    assert_clean(sched, 1024)


def test_abort_while_step_runs_is_skipped_by_update():
    sched, runner = make()
    a, b = req("a", prompt_len=8, max_tokens=10), req("b", prompt_len=8, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sampled = runner.execute(out)
    sched.abort_requests(["a"])
    updated = sched.update_from_output(out, sampled)
    assert updated == [b] and a.num_output_tokens == 0 and a.num_computed_tokens == 0
    check_state(sched)
    drive(sched, runner)
    assert b.num_output_tokens == 3
    assert_clean(sched, 1024)


# -- preemption -------------------------------------------------------------------------------


def test_preemption_mechanics():
    # 4 blocks of 4 tokens; 2 seats. After 5 steps a and b have computed 8 tokens each and
    # hold 2 blocks each; c waits for a seat.
    sched, runner = make(num_blocks=4, block_size=4, max_num_seqs=2, max_model_len=16)
    a = req("a", prompt_len=4, max_tokens=12, arrival=1.0)
    b = req("b", prompt_len=4, max_tokens=12, arrival=2.0)
    c = req("c", prompt_len=4, max_tokens=1, arrival=3.0)
    for r in (a, b, c):
        sched.add_request(r)
    for _ in range(5):
        step(sched, runner)
    assert sched.kv.num_free_blocks == 0 and a.num_computed_tokens == b.num_computed_tokens == 8
    assert [r.request_id for r in sched.waiting] == ["c"]
    # a needs a third block: b, the latest arrival, is preempted; a keeps going.
    out = step(sched, runner)
    assert out.preempted_ids == ["b"] and [s.request_id for s in out.scheduled] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # front, ahead of c
    assert b.num_computed_tokens == 0 and b.num_output_tokens == 5 and b.num_preemptions == 1
    drive(sched, runner)
    for r in (a, b, c):
        assert r.output_token_ids == expected_output(runner, r, r.num_output_tokens)
    assert a.num_output_tokens == b.num_output_tokens == 12  # max_model_len 16
    assert_clean(sched, 4)


def test_preempted_victim_hands_back_its_tokens():
    # Running order [b, a] with b the later arrival: b is scheduled first, then a needs a
    # block, so b is preempted after it was given a token this step; the token goes back.
    sched, runner = make(num_blocks=3, block_size=4, budget=100, max_model_len=12)
    a = req("a", prompt_len=7, max_tokens=5, arrival=1.0)
    b = req("b", prompt_len=1, max_tokens=8, arrival=2.0)
    sched.add_request(b)
    sched.add_request(a)
    step(sched, runner)  # b: 1 block, a: 2 blocks, none free
    step(sched, runner)  # b decodes position 1, a position 7: no new blocks
    assert sched.kv.num_free_blocks == 0
    out = step(sched, runner)  # b decodes position 2; a needs a block for position 8
    assert out.preempted_ids == ["b"] and [s.request_id for s in out.scheduled] == ["a"]
    assert out.num_batched_tokens == 1 and sched.running == [a]
    assert b.num_output_tokens == 2 and b.num_computed_tokens == 0
    drive(sched, runner)
    assert a.output_token_ids == expected_output(runner, a, 5)
    assert b.output_token_ids == expected_output(runner, b, 8)
    assert_clean(sched, 3)


def _workload(seed: int, n: int, max_prompt: int, max_out: int) -> list[tuple]:
    rng = random.Random(seed)
    return [
        (f"w{seed}-{i}", rng.randint(1, max_prompt), rng.randint(1, max_out), float(i))
        for i in range(n)
    ]


def _run_workload(work, **cfg) -> tuple[dict[str, list[int]], int]:
    sched, runner = make(**cfg)
    rs = [req(rid, p, m, arrival=t) for rid, p, m, t in work]
    for r in rs:
        sched.add_request(r)
    drive(sched, runner)
    assert_clean(sched, cfg["num_blocks"])
    for r in rs:
        assert r.num_output_tokens == r.sampling_params.max_tokens
    return {r.request_id: r.output_token_ids for r in rs}, sum(r.num_preemptions for r in rs)


def test_preemption_under_tiny_cache_gives_same_tokens():
    work = _workload(seed=7, n=30, max_prompt=60, max_out=80)
    big, big_preemptions = _run_workload(work, num_blocks=1024, block_size=16, budget=128)
    # 9 blocks x 16 = 144 tokens: every request fits alone (<= 140), few fit together.
    tiny, tiny_preemptions = _run_workload(work, num_blocks=9, block_size=16, budget=128)
    assert big_preemptions == 0 and tiny_preemptions > 10
    assert tiny == big


# -- static policy ----------------------------------------------------------------------------


def _admission_steps(policy: str) -> tuple[list[list[str]], list[int]]:
    """Returns each step's newly admitted ids and the running count before it."""
    sched, runner = make(max_num_seqs=3, budget=32, policy=policy)
    for i in range(7):
        sched.add_request(req(f"r{i}", prompt_len=20, max_tokens=2 + 3 * i))
    admitted, running_before = [], []
    while sched.has_unfinished_requests():
        before = {r.request_id for r in sched.running}
        running_before.append(len(before))
        step(sched, runner)
        admitted.append(sorted({r.request_id for r in sched.running} - before))
    assert_clean(sched, 1024)
    return admitted, running_before


def test_static_policy_admits_next_batch_only_after_whole_batch():
    admitted, running_before = _admission_steps("static")
    batches = [(i, ids) for i, ids in enumerate(admitted) if ids]
    # Budget 32 covers one 20-token prompt, yet the whole batch moves in at once.
    assert [ids for _, ids in batches] == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6"]]
    for i, _ in batches:
        assert running_before[i] == 0


def test_continuous_policy_admits_as_soon_as_a_seat_frees():
    admitted, running_before = _admission_steps("continuous")
    assert any(ids and running_before[i] > 0 for i, ids in enumerate(admitted))


# -- long random runs -------------------------------------------------------------------------


def test_long_random_run_with_arrivals_aborts_and_preemption():
    rng = random.Random(1234)
    sched, runner = make(num_blocks=96, block_size=8, max_num_seqs=12, budget=96, max_model_len=256)
    runner.vocab_size = 50  # EOS (2) is hit now and then
    expected: dict[str, Request] = {}
    aborted: set[str] = set()
    for steps in range(1, 4001):
        # Bursts now and then: the cache overflows and preempts, then the queue drains.
        for _ in range(8 if rng.random() < 0.01 else int(rng.random() < 0.1)):
            rid = f"q{len(expected)}"
            r = req(
                rid,
                rng.randint(1, 150),
                rng.randint(1, 100),
                arrival=float(steps),
                ignore_eos=rng.random() < 0.5,
            )
            sched.add_request(r)
            expected[rid] = r
        if sched.requests and rng.random() < 0.02:
            victim = rng.choice(sorted(sched.requests))
            sched.abort_requests([victim])
            aborted.add(victim)
        if sched.has_unfinished_requests():
            assert not step(sched, runner, now=float(steps)).is_empty
    drive(sched, runner)
    assert_clean(sched, 96)
    assert runner.num_steps > 3000 and sum(r.num_preemptions for r in expected.values()) > 0
    for rid, r in expected.items():
        assert r.is_finished
        assert r.output_token_ids == expected_output(runner, r, r.num_output_tokens)
        if rid in aborted:
            assert r.finish_reason == "abort"
        elif r.finish_reason == "stop":
            assert r.output_token_ids[-1] == 2 and not r.sampling_params.ignore_eos
        else:
            assert r.finish_reason == "length"
            assert r.num_output_tokens == r.sampling_params.max_tokens or r.num_tokens == 256


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    block_size=st.sampled_from([1, 4, 16]),
    spare_blocks=st.integers(0, 40),
    max_num_seqs=st.integers(1, 16),
    budget=st.integers(1, 200),
    policy=st.sampled_from(["continuous", "static"]),
)
def test_random_workloads_hold_invariants(
    seed, block_size, spare_blocks, max_num_seqs, budget, policy
):
    work = _workload(seed, n=25, max_prompt=80, max_out=40)
    # The cache always holds the longest request alone, and sometimes little more.
    longest = max(p + m for _, p, m, _ in work)
    num_blocks = math.ceil(longest / block_size) + spare_blocks
    outputs, _ = _run_workload(
        work,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        budget=budget,
        policy=policy,
    )
    runner = FakeRunner(block_size)
    for rid, p, m, _ in work:
        assert outputs[rid] == [runner.token_for(rid, p + k) for k in range(m)]


# -- validation -------------------------------------------------------------------------------


def test_add_request_validation():
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(Request("e", [], SamplingParams()))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(req("long", prompt_len=64, max_tokens=1))
    with pytest.raises(ValueError, match="never fit"):
        sched.add_request(req("big", prompt_len=10, max_tokens=7))  # 17 > 16 slots
    assert sched.can_ever_fit(16) and not sched.can_ever_fit(17)
    sched.add_request(req("ok", prompt_len=10, max_tokens=6))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("ok", prompt_len=1, max_tokens=1))
    with pytest.raises(ValueError, match="policy"):
        Scheduler(KVCacheManager(4), 1, 1, 8, policy="lifo")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 10**30}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_greedy():
    sp = SamplingParams(stop=["x"], stop_token_ids=[3], logprobs=20)  # lists become tuples
    assert sp.stop == ("x",) and sp.stop_token_ids == (3,) and hash(sp)
    assert not sp.greedy
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert SamplingParams(logprobs=0).logprobs == 0
