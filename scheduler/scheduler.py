"""Which requests run this step, and how many tokens each (vLLM v1 style).

One rule for everything: each request's `num_computed_tokens` catches up with its
`num_tokens` (prompt + output). A fresh prompt is far behind, a decode is one token behind,
a preempted request is all the way behind again. Running requests are served first, then
waiting ones, all under `max_num_batched_tokens` and `max_num_seqs`; a prompt longer than
the budget left is chunked, so prefill chunks and decodes share one batch.

    step:  running (in order)                 waiting (front first)
           [A: 1 decode][B: 1][C: 40 chunk] | [D: first chunk of its prompt] ... budget
"""

import time
from collections import deque

from kvcache.manager import KVCacheManager, cdiv
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import Request, RequestStatus

POLICIES = ("continuous", "static")


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "continuous",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        assert max_num_seqs >= 1 and max_num_batched_tokens >= 1 and max_model_len >= 2
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.requests: dict[str, Request] = {}  # unfinished ones, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []  # freed since the last schedule()

    # -- the queue -------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens fits in the whole cache on its own."""
        return cdiv(num_tokens, self.kv.block_size) <= self.kv.num_blocks

    def add_request(self, req: Request) -> None:
        rid = req.request_id
        if not req.prompt_token_ids:
            raise ValueError(f"{rid}: prompt is empty")
        if req.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"{rid}: prompt has {req.num_prompt_tokens} tokens, must be < "
                f"max_model_len {self.max_model_len}"
            )
        if rid in self.requests:
            raise ValueError(f"{rid}: request id already in use")
        # A request that cannot fit alone would preempt itself forever; refuse it up front.
        longest = min(req.num_prompt_tokens + req.sampling_params.max_tokens, self.max_model_len)
        if not self.can_ever_fit(longest):
            raise ValueError(
                f"{rid}: {longest} tokens can never fit in the KV cache "
                f"({self.kv.num_blocks} blocks of {self.kv.block_size})"
            )
        assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
        self.requests[rid] = req
        self.waiting.append(req)

    def abort_requests(self, request_ids: list[str], now: float | None = None) -> list[Request]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED, now)

    def finish_requests(
        self, request_ids: list[str], status: RequestStatus, now: float | None = None
    ) -> list[Request]:
        """End requests now (abort, stop string); frees their blocks. Unknown ids are ignored."""
        assert status.is_finished(), status
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            (self.running if req.status is RequestStatus.RUNNING else self.waiting).remove(req)
            req.status = status
            self._release(req, now)
            done.append(req)
        return done

    # -- one step --------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        now = time.monotonic() if now is None else now
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[str] = []

        # 1. Running requests, in order: a decode takes 1 token, an unfinished prefill a chunk.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            assert num_new > 0, f"{req.request_id}: nothing to compute (no update_from_output?)"
            victim = None
            while victim is not req and not self.kv.allocate_slots(
                req.request_id, req.num_computed_tokens + num_new
            ):
                victim = self._pick_victim(req)
                if self.running.index(victim) < i:
                    i -= 1
                budget += self._preempt(victim, scheduled)
                preempted.append(victim.request_id)
            if victim is req:
                continue  # it preempted itself; running[i] is now the next one
            scheduled[req.request_id] = self._scheduled(req, num_new, now)
            budget -= num_new
            i += 1

        # 2. Waiting requests, unless blocks just ran out (re-admitting a victim would thrash).
        if not preempted:
            budget = self._admit(budget, scheduled, now)

        out = SchedulerOutput(
            scheduled=list(scheduled.values()),
            num_batched_tokens=self.max_num_batched_tokens - budget,
            preempted_ids=preempted,
            finished_ids=self._finished_ids,
        )
        self._finished_ids = []
        assert sum(s.num_new_tokens for s in out.scheduled) == out.num_batched_tokens
        assert 0 <= out.num_batched_tokens <= self.max_num_batched_tokens
        assert len(self.running) <= self.max_num_seqs
        for s in out.scheduled:
            assert s.num_new_tokens >= 1 and s.request.status is RequestStatus.RUNNING
            assert len(s.block_table) * self.kv.block_size >= s.start + s.num_new_tokens
        return out

    def _admit(self, budget: int, scheduled: dict[str, ScheduledRequest], now: float) -> int:
        """Move waiting requests into running, front first; returns the budget left."""
        static = self.policy == "static"
        if static and self.running:
            return budget  # static: the next batch starts when the whole current one is done
        queue = self._waiting_order()
        while queue and len(self.running) < self.max_num_seqs:
            req = queue[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            # Static moves the whole batch in at once; members past the budget wait as running.
            if num_new == 0 and not static:
                break
            if num_new and not self.kv.allocate_slots(req.request_id, num_new):
                break  # FCFS: nobody skips ahead of a request that does not fit yet
            queue.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if num_new:
                scheduled[req.request_id] = self._scheduled(req, num_new, now)
                budget -= num_new
        return budget

    def _waiting_order(self) -> deque[Request]:
        """The waiting queue, front = next to admit. FCFS needs no work: arrivals append at
        the back, preempted requests re-enter at the front.
        TODO(priorities): order by (priority, arrival_time), lower value = more urgent."""
        return self.waiting

    def _pick_victim(self, req: Request) -> Request:
        """The running request to preempt so that `req` gets its blocks: the latest arrival
        (possibly `req` itself), so the oldest request always progresses and cannot starve.
        TODO(priorities): only a strictly lower-priority request may be displaced by `req`.
        TODO(prefix caching): prefer victims whose blocks are not shared."""
        return max(self.running, key=lambda r: r.arrival_time)

    def _preempt(self, req: Request, scheduled: dict[str, ScheduledRequest]) -> int:
        """Preempt by recompute: free the blocks, keep the output tokens, and requeue at the
        front with its arrival time. Returns the tokens it was given this step, handed back.
        TODO(swap): swap the blocks to CPU when swap space allows, recompute otherwise."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0  # prefill prompt + output again
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        given = scheduled.pop(req.request_id, None)
        return given.num_new_tokens if given else 0

    def _scheduled(self, req: Request, num_new: int, now: float) -> ScheduledRequest:
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        start = req.num_computed_tokens
        return ScheduledRequest(
            request=req,
            num_new_tokens=num_new,
            start=start,
            block_table=self.kv.block_table(req.request_id),
            will_sample=start + num_new == req.num_tokens,
        )

    # -- after the model ran ---------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, int], now: float | None = None
    ) -> list[Request]:
        """Advance each scheduled request; returns those that got a new token (finished or
        not), for the engine to publish. Finished ones leave running with their blocks freed."""
        now = time.monotonic() if now is None else now
        updated = []
        any_finished = False
        for s in output.scheduled:
            req = s.request
            if req.is_finished:
                continue  # aborted or stopped by the engine while the step ran
            assert req.status is RequestStatus.RUNNING and req.num_computed_tokens == s.start
            req.num_computed_tokens += s.num_new_tokens
            if not s.will_sample:
                continue
            req.append_output_token(sampled[req.request_id])
            if req.first_token_time is None:
                req.first_token_time = now
            updated.append(req)
            if req.check_stop(self.max_model_len):
                self._release(req, now)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return updated

    def _release(self, req: Request, now: float | None) -> None:
        assert req.is_finished, req.status
        req.finished_time = time.monotonic() if now is None else now
        self.kv.free(req.request_id)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
