"""A hypothesis state machine over Scheduler + KVCacheManager + KVRunner: random submits
(mixed priorities, shared prefixes, cache salts), aborts (swapped requests too), steps,
early finishes and prefix-cache resets, with prefix caching on or off and preemption by
swap, recompute or auto over a small CPU swap space.

After every rule: the last step kept the token budget and `max_num_seqs`; no GPU or CPU
block is leaked or double-owned and the swap space never over-commits (`check_integrity`);
the waiting and swapped queues are in effective-priority order; blocks in use never exceed
what running requests need; each swapped request holds exactly its computed blocks on CPU.
Every step the runner checks the fake KV contents through the block tables (after swaps,
copies and prefix hits). At the end everything drains: every request ended with the tokens
a lone run would give, and every block is free."""

import math

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from kvcache import KVCacheManager
from scheduler import Request, RequestStatus, SamplingParams, Scheduler
from tests.test_kvcache_runner import KVRunner

MAX_PROMPT, MAX_OUT, EOS, VOCAB = 40, 30, 2, 40
# System prompts that several requests start with (then their own tokens).
SHARED = [[(p * 17 + i * 5 + 3) % VOCAB for i in range(MAX_PROMPT)] for p in range(3)]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 4, 16]),
        spare_blocks=st.integers(0, 8),
        max_num_seqs=st.integers(1, 8),
        budget=st.integers(1, 128),
        aging_s=st.sampled_from([None, 2.0, 8.0]),
        prefix_caching=st.sampled_from([True, True, False]),
        mode=st.sampled_from(["auto", "swap", "swap", "recompute"]),
        cpu_fraction=st.sampled_from([0.0, 0.3, 1.0, 1.0, 3.0]),
    )
    def setup(
        self,
        block_size,
        spare_blocks,
        max_num_seqs,
        budget,
        aging_s,
        prefix_caching,
        mode,
        cpu_fraction,
    ):
        # The cache always holds the longest request alone, sometimes little more.
        num_blocks = math.ceil((MAX_PROMPT + MAX_OUT) / block_size) + spare_blocks
        num_cpu_blocks = round(num_blocks * cpu_fraction)
        if mode == "swap":
            num_cpu_blocks = max(num_cpu_blocks, 1)
        self.kv = KVCacheManager(num_blocks, block_size, prefix_caching, num_cpu_blocks)
        self.sched = Scheduler(
            self.kv, max_num_seqs, budget, 256, aging_s=aging_s, preemption_mode=mode
        )
        self.runner = KVRunner(block_size, vocab_size=VOCAB)  # EOS now and then
        self.now = 0.0
        self.submitted: list[Request] = []
        self.last_out = None

    @rule(
        prompt_len=st.integers(1, MAX_PROMPT),
        max_tokens=st.integers(1, MAX_OUT),
        priority=st.integers(-2, 3),
        ignore_eos=st.booleans(),
        shared=st.sampled_from([None, 0, 1, 2]),
        shared_len=st.integers(1, MAX_PROMPT),
        tail=st.integers(0, 3),
        salt=st.sampled_from([None, None, "tenant-a", "tenant-b"]),
        copies=st.integers(1, 3),
    )
    def submit(
        self, prompt_len, max_tokens, priority, ignore_eos, shared, shared_len, tail, salt, copies
    ):
        """`copies` requests with one prompt: a shared system prompt (or none), then a tail
        drawn from a few, so equal prompts and partial overlaps are common."""
        head = [] if shared is None else SHARED[shared][: min(shared_len, prompt_len)]
        prompt = head + [(tail * 13 + i * 7) % VOCAB for i in range(prompt_len - len(head))]
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        for _ in range(copies):
            r = Request(
                f"r{len(self.submitted)}",
                prompt,
                sp,
                (EOS,),
                arrival_time=self.now,
                priority=priority,
                cache_salt=salt,
            )
            self.sched.add_request(r)
            self.submitted.append(r)

    @rule(how=st.sampled_from(["abort", "abort swapped", "stop running"]), data=st.data())
    def end_one(self, how, data):
        """Abort any request, abort a swapped one, or stop a running one as a stop string
        matched by the engine would. A no-op when there is none (no preconditions: rules
        that hypothesis cannot pick make it give up on examples)."""
        sched, kv = self.sched, self.kv
        pool = {
            "abort": list(sched.requests.values()),
            "abort swapped": sched.swapped,
            "stop running": sched.running,
        }[how]
        if not pool:
            return
        rid = data.draw(st.sampled_from(sorted(r.request_id for r in pool)))
        free_cpu, held_cpu = kv.num_free_cpu_blocks, len(kv.cpu_block_table(rid))
        status = RequestStatus.FINISHED_STOPPED if how == "stop running" else None
        if status is None:
            (r,) = sched.abort_requests([rid], now=self.now)
            assert r.finish_reason == "abort"
        else:
            (r,) = sched.finish_requests([rid], status, now=self.now)
            assert r.finish_reason == "stop"
        assert kv.block_table(rid) == [] and not kv.is_swapped(rid)
        assert kv.num_free_cpu_blocks == free_cpu + held_cpu  # a swapped one's CPU blocks
        if how == "abort swapped":
            assert held_cpu > 0

    @rule(
        dt=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
        n=st.integers(1, 4),
        reset=st.sampled_from([None] * 6 + ["refuse", "requeue"]),
    )
    def step(self, dt, n, reset):
        for _ in range(n):
            self.now += dt
            self._step()
            self.budget_and_seats()
            self.blocks()
        if reset is not None:  # now and then only: a reset empties the cache
            self._reset_prefix_cache(requeue=reset == "requeue")

    def _reset_prefix_cache(self, requeue):
        held = self.kv.blocks_in_use() > 0 or self.sched.num_swapped > 0
        busy = self.sched.num_running + self.sched.num_swapped
        result = self.sched.reset_prefix_cache(requeue=requeue)
        if requeue:
            assert result and result.num_requeued == busy
            assert self.sched.num_running == self.sched.num_swapped == 0
        else:
            assert bool(result) == (not held) and result.num_requeued == 0
        if result:
            assert self.kv.num_cached_blocks == 0

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
        kv, sched = self.kv, self.sched
        kv.check_integrity()  # GPU and CPU pools; the CPU pool never over-commits
        bs = kv.block_size
        need = sum(math.ceil(r.num_computed_tokens / bs) for r in sched.running)
        assert kv.blocks_in_use() <= need
        for r in sched.waiting:
            assert r.status is RequestStatus.WAITING and kv.block_table(r.request_id) == []
            assert r.num_computed_tokens == 0
        held_cpu = 0
        for r in sched.swapped:
            assert r.status is RequestStatus.SWAPPED and kv.block_table(r.request_id) == []
            cpu = kv.cpu_block_table(r.request_id)
            assert len(cpu) == math.ceil(r.num_computed_tokens / bs) > 0
            held_cpu += len(cpu)
        assert held_cpu + kv.num_free_cpu_blocks == kv.num_cpu_blocks
        if sched.preemption_mode == "recompute":
            assert sched.num_swapped == 0
        if not kv.enable_prefix_caching:
            assert kv.num_cached_blocks == 0
        for r in self.submitted:
            assert 0 <= r.num_cached_tokens < r.num_prompt_tokens
        assert len(sched.requests) == sched.num_running + sched.num_waiting + sched.num_swapped

    @invariant()
    def queues_in_effective_priority_order(self):
        if not hasattr(self, "sched"):
            return
        aging_s = self.sched.aging_s

        def effective(r: Request) -> float:
            if aging_s is None:
                return r.priority
            return r.priority - (self.now - r.arrival_time) / aging_s

        for queue in (self.sched.waiting, self.sched.swapped):
            keys = [(effective(r), r.arrival_time) for r in queue]
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
            self.queues_in_effective_priority_order()
        assert not self.sched.has_unfinished_requests()
        assert self.sched.num_running == self.sched.num_waiting == self.sched.num_swapped == 0
        assert self.kv.num_free_blocks == self.kv.num_blocks and self.kv.block_tables == {}
        assert self.kv.num_free_cpu_blocks == self.kv.num_cpu_blocks
        self.kv.check_integrity()
        # What the run covered (pytest --hypothesis-show-statistics).
        event(f"swapped out: {self.runner.num_swapped_out > 0}")
        event(f"copy-on-write: {self.runner.num_copied > 0}")
        event(f"prefix hits: {self.kv.stats.num_hit_tokens > 0}")
        event(f"recomputed: {any(r.num_preemptions for r in self.submitted)}")
        for r in self.submitted:
            assert r.is_finished, r.request_id
            n = r.num_output_tokens
            want = [self.runner.token_for(r.request_id, r.num_prompt_tokens + k) for k in range(n)]
            assert r.output_token_ids == want


SchedulerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerStateful = SchedulerMachine.TestCase
