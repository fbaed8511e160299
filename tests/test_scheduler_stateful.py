"""A hypothesis state machine over Scheduler + KVCacheManager + FakeRunner: random submits
(mixed priorities), aborts, steps and early finishes. After every rule: the last step kept
the token budget and `max_num_seqs`, no block is leaked or double-owned, the waiting queue
is in effective-priority order, and blocks in use never exceed what running requests need.
At the end everything drains: every submitted request ended and every block is free."""

import math

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvcache import KVCacheManager
from scheduler import Request, RequestStatus, SamplingParams, Scheduler
from tests.fake_runner import FakeRunner

MAX_PROMPT, MAX_OUT, EOS = 40, 30, 2


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 4, 16]),
        spare_blocks=st.integers(0, 8),
        max_num_seqs=st.integers(1, 8),
        budget=st.integers(1, 128),
        aging_s=st.sampled_from([None, 2.0, 8.0]),
    )
    def setup(self, block_size, spare_blocks, max_num_seqs, budget, aging_s):
        # The cache always holds the longest request alone, sometimes little more.
        num_blocks = math.ceil((MAX_PROMPT + MAX_OUT) / block_size) + spare_blocks
        self.kv = KVCacheManager(num_blocks, block_size)
        self.sched = Scheduler(self.kv, max_num_seqs, budget, 256, aging_s=aging_s)
        self.runner = FakeRunner(block_size, vocab_size=40)  # EOS now and then
        self.now = 0.0
        self.submitted: list[Request] = []
        self.last_out = None

    @rule(
        prompt_len=st.integers(1, MAX_PROMPT),
        max_tokens=st.integers(1, MAX_OUT),
        priority=st.integers(-2, 3),
        ignore_eos=st.booleans(),
    )
    def submit(self, prompt_len, max_tokens, priority, ignore_eos):
        rid = f"r{len(self.submitted)}"
        prompt = [(len(self.submitted) * 13 + i * 7) % 40 for i in range(prompt_len)]
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        r = Request(rid, prompt, sp, (EOS,), arrival_time=self.now, priority=priority)
        self.sched.add_request(r)
        self.submitted.append(r)

    @precondition(lambda self: self.sched.has_unfinished_requests())
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        (r,) = self.sched.abort_requests([rid], now=self.now)
        assert r.finish_reason == "abort" and self.kv.block_table(rid) == []

    @precondition(lambda self: self.sched.num_running > 0)
    @rule(data=st.data())
    def finish_running(self, data):  # as a stop string matched by the engine would
        rid = data.draw(st.sampled_from(sorted(r.request_id for r in self.sched.running)))
        (r,) = self.sched.finish_requests([rid], RequestStatus.FINISHED_STOPPED, now=self.now)
        assert r.finish_reason == "stop"

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0]), n=st.integers(1, 4))
    def step(self, dt, n):
        for _ in range(n):
            self.now += dt
            self._step()
            self.budget_and_seats()
            self.blocks()

    def _step(self):
        had_work = self.sched.has_unfinished_requests()
        out = self.sched.schedule(now=self.now)
        if had_work:
            assert not out.is_empty or out.finished_ids, "no progress with unfinished requests"
        self.sched.update_from_output(out, self.runner.execute(out), now=self.now)
        self.last_out = out

    # -- invariants, after every rule ------------------------------------------------------

    @invariant()
    def budget_and_seats(self):
        if not hasattr(self, "sched"):
            return
        out = self.last_out
        if out is not None:
            assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
            assert out.num_batched_tokens <= self.sched.max_num_batched_tokens
            assert len(out.scheduled) <= self.sched.max_num_seqs
        assert self.sched.num_running <= self.sched.max_num_seqs

    @invariant()
    def blocks(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_integrity()
        bs = self.kv.block_size
        need = sum(math.ceil(r.num_computed_tokens / bs) for r in self.sched.running)
        assert self.kv.blocks_in_use() <= need
        for r in self.sched.waiting:
            assert r.status is RequestStatus.WAITING and self.kv.block_table(r.request_id) == []

    @invariant()
    def waiting_in_effective_priority_order(self):
        if not hasattr(self, "sched"):
            return
        aging_s = self.sched.aging_s

        def effective(r: Request) -> float:
            if aging_s is None:
                return r.priority
            return r.priority - (self.now - r.arrival_time) / aging_s

        keys = [(effective(r), r.arrival_time) for r in self.sched.waiting]
        assert keys == sorted(keys), keys

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(20_000):
            if not self.sched.has_unfinished_requests():
                break
            self.now += 1.0
            self._step()
            self.budget_and_seats()
            self.blocks()
            self.waiting_in_effective_priority_order()
        assert not self.sched.has_unfinished_requests()
        assert self.sched.num_running == self.sched.num_waiting == 0
        assert self.kv.num_free_blocks == self.kv.num_blocks and self.kv.block_tables == {}
        self.kv.check_integrity()
        for r in self.submitted:
            assert r.is_finished, r.request_id
            n = r.num_output_tokens
            want = [self.runner.token_for(r.request_id, r.num_prompt_tokens + k) for k in range(n)]
            assert r.output_token_ids == want


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerStateful = SchedulerMachine.TestCase
