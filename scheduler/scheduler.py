"""Which requests run this step, and how many tokens each (vLLM v1 style).

One rule for everything: each request's `num_computed_tokens` catches up with its
`num_tokens` (prompt + output). A fresh prompt is far behind, a decode is one token behind,
a preempted request is all the way behind again. Running requests are served first, then
waiting ones, all under `max_num_batched_tokens` and `max_num_seqs`; a prompt longer than
the budget left is chunked, so prefill chunks and decodes share one batch. Without chunked
prefill (`chunked_prefill=False`, vLLM's ``--no-enable-chunked-prefill``) a prompt is
prefilled in one step: it waits for a step with room for all of it, and the budget is at
least `max_model_len` so that every prompt fits one.

    step:  running (in order)                 waiting (front first)
           [A: 1 decode][B: 1][C: 40 chunk] | [D: first chunk of its prompt] ... budget

Long prompts share the step (`prefill_limits`, scheduler/partial_prefill.py: vLLM's
``--long-prefill-token-threshold``, ``--max-num-partial-prefills``,
``--max-long-partial-prefills``): each prefill chunk is cut to its share of the step, so
that a short prompt arriving behind a long one is admitted in the next step; a long prompt
beyond the long-prefill limit is passed over by shorter ones behind it, for that step only.

Priorities. A LOWER `Request.priority` is MORE urgent (0 by default, negative allowed). All
requests are ranked in one order, most urgent first: by (priority, arrival_time) and, with
aging, by the effective priority

    priority - (now - arrival_time) / aging_s        (ties: earlier arrival first)

i.e. a request improves by one priority class for every `aging_s` seconds since it arrived,
without bound. Every request ages at the same rate, so this order never changes over time:
it is the order of the "virtual arrival" `arrival_time + priority * aging_s` (`_rank`). The
waiting queue is kept in that order (a preempted request keeps its arrival time and
re-enters in place) and the running requests are served in it. Blocks short:

- a running request preempts the lowest-ranked running request, possibly itself (among
  equal priorities that is the latest arrival: FCFS, the oldest always progresses);
- a waiting request may preempt running requests ranked behind it AND of a strictly less
  urgent `priority` (lowest-ranked first); otherwise admission stops there, nobody skips
  ahead. Equal priorities never displace each other on admission.

Seats and tokens short (all `max_num_seqs` seats taken, or running requests took this
step's whole token budget): a waiting request takes the seat of the lowest-ranked running
request of a strictly less urgent priority, and the tokens that request was given this
step (for tokens, only a request given some is a candidate). So an urgent arrival starts
within one step instead of waiting for a low-priority request to finish or its long
prompt to prefill.

Because the order is fixed, a displaced request is always ranked behind its displacer and
can never displace it back: no ping-pong. Starvation bound: a request R of priority p that
arrives at t0 is ranked ahead of every priority-q request arriving after
t0 + (p - q) * aging_s. Under a flood of priority-q requests, R therefore waits at most for
what is ranked ahead of it (earlier arrivals ranked ahead, plus the flood of the next
(p - q) * aging_s seconds) and then for running requests to free a seat or its blocks
(nothing behind it is admitted meanwhile); once running, only requests ranked ahead of it
can preempt it. With `aging_s=None` the order is strict (priority, arrival): no bound.

Preemption by swap or recompute (`preemption_mode`). A victim is swapped out when its
computed blocks fit in the free CPU blocks (modes "auto" and "swap"), and recomputed
otherwise (mode "recompute" always): its blocks are freed, `num_computed_tokens` goes back
to 0 and it prefills its prompt plus its output again. "swap" differs from "auto" only in
demanding a swap space; falling back to recompute when that is full keeps the scheduler
live rather than stuck. A swapped request keeps `num_computed_tokens` and waits in
`swapped`, ranked like the waiting queue; admission takes the most urgent of both
queues' fronts, so a swapped request resumes before anything ranked behind it is
admitted, into fresh GPU blocks (the runner copies its CPU blocks back).

Prefix caching. A request's full blocks are hashed once, as they fill
(`Request.block_hashes`, started at `add_request`). A request admitted with no blocks first
takes the longest cached prefix of its tokens (prompt, plus output when it was recomputed),
so `num_computed_tokens` starts there; `num_cached_tokens` records the first admission's
hit. After each step, blocks that filled up with computed tokens are registered under those
hashes for later requests (`KVCacheManager.cache_full_blocks`).

Speculative decoding (worker/spec_decode). A running request whose chunk reaches its last
token may carry draft tokens (`Request.spec_token_ids`, proposed before the step): it is
given 1 + k tokens and KV slots for them, k cut to the budget left after its own tokens and
to the room its max_tokens and max_model_len leave after the step's token. Drafts never
preempt anyone: when their blocks are short, the request runs without them. After the step,
its accepted drafts and the model's next token are appended, and `num_computed_tokens` is
the tokens minus the last, as for any decode: the rejected drafts' keys and values lie past
it, in blocks that are the request's own and never cached, and later steps overwrite them.

Parallel sampling (n > 1, scheduler/sample_group.py). Only the group's leader is queued;
from its admission until its first token it also takes a seat for each follower
(`_num_seats`). The step that samples its first token samples the followers too
(`ScheduledRequest.forks`); after it they are forked into running, sharing the leader's
blocks. A request that asked for prompt logprobs skips the prefix cache (cached tokens have
no logits to take them from), as vLLM does.

Prefill/decode disaggregation (worker/kv_transfer). On a prefill worker a request tagged for
remote decode (`Request.kv_pin_key`) pins its prompt's blocks as it finishes, before they
are freed (`KVCacheManager.pin`, under a lease of `handoff_lease_s`). On a decode worker a
request with a handoff (`Request.remote_kv`) is admitted like any other, in rank order and
with the same right to displace, but into WAITING_FOR_REMOTE_KV (`pulling`): its prefix is
taken from the prefix cache here, blocks are allocated for the whole prompt, and the step's
`remote_kv` names it so that the engine starts the pull of the blocks not cached here. It
takes a seat, no token budget, and is never preempted (the pull writes its blocks). When
the pull ends (`remote_kv_done`) it joins running with the pulled tokens computed (the full
blocks entered in the prefix cache as if computed here), or, when the pull failed, with
only its own prefix: it computes the rest like any prompt. Either way at least the last
prompt token is computed here. A prompt whose prefix cache here already covers what the
handoff holds is admitted as usual, its handoff unneeded (`RemoteKVState.SKIPPED`).
"""

import bisect
import heapq
import itertools
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from kvcache.manager import KVCacheManager, cdiv
from kvcache.prefix_cache import PrefixHit
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.partial_prefill import PrefillLimits, StepPrefills, num_to_prefill
from scheduler.request import RemoteKVState, Request, RequestStatus
from scheduler.sample_group import SampleGroup

POLICIES = ("continuous", "static")
PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclass(frozen=True)
class PrefixCacheReset:
    """What `Scheduler.reset_prefix_cache` did; falsy when it was refused."""

    ok: bool
    num_requeued: int = 0  # running or swapped requests preempted to allow it
    num_blocks_dropped: int = 0  # cached blocks forgotten

    def __bool__(self) -> bool:
        return self.ok


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "continuous",
        aging_s: float | None = 30.0,
        preemption_mode: str = "auto",
        chunked_prefill: bool = True,
        max_loras: int | None = None,
        handoff_lease_s: float | None = None,
        max_pinned_blocks: int = 0,
        prefill_limits: PrefillLimits | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if aging_s is not None and not 0 < aging_s < float("inf"):
            raise ValueError(f"aging_s must be > 0 and finite, or None; got {aging_s!r}")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}"
            )
        if preemption_mode == "swap" and kv.num_cpu_blocks == 0:
            raise ValueError("preemption_mode 'swap' needs swap space (num_cpu_blocks > 0)")
        assert max_num_seqs >= 1 and max_num_batched_tokens >= 1 and max_model_len >= 2
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        # Unchunked, a prompt of max_model_len - 1 tokens must fit one step (vLLM's rule).
        self.chunked_prefill = chunked_prefill
        self.max_num_batched_tokens = (max_num_batched_tokens if chunked_prefill
                                       else max(max_num_batched_tokens, max_model_len))
        self.max_model_len = max_model_len
        self.policy = policy
        self.aging_s = aging_s
        self.preemption_mode = preemption_mode
        # LoRA: at most this many distinct adapters (Request.lora_key) among the running
        # requests, so in any step; None = no adapters served.
        self.max_loras = max_loras
        # KV handoffs (prefill side): a tagged request's pin lasts this long unless pulled,
        # released or renewed; None = this worker pins nothing. At most `max_pinned_blocks`
        # blocks are pinned at once (0: half the cache).
        self.handoff_lease_s = handoff_lease_s
        self.max_pinned_blocks = max_pinned_blocks or kv.num_blocks // 2
        # Long prompts share the step (scheduler/partial_prefill.py); whole prompts move
        # unchunked or in a static batch, so there is nothing to share.
        self.prefill_limits = ((prefill_limits or PrefillLimits.off())
                               if chunked_prefill and policy == "continuous"
                               else PrefillLimits.off())
        self.requests: dict[str, Request] = {}  # unfinished ones, by id
        self.waiting: list[Request] = []  # in _rank order, front = next to admit
        self.swapped: list[Request] = []  # in _rank order too
        self.running: list[Request] = []
        self.pulling: list[Request] = []  # WAITING_FOR_REMOTE_KV, in admission order
        self._remote: list[Request] = []  # this step's pulls to start, handoffs skipped
        self._finished_ids: list[str] = []  # freed since the last schedule()
        self._requeued_ids: list[str] = []  # preempted between steps (prefix-cache reset)
        self._seq = itertools.count()
        self._num_groups = 0  # leaders of parallel samples not finished (seats to count)

    # -- the queue -------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def num_pulling(self) -> int:
        return len(self.pulling)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens fits in the whole cache on its own."""
        return cdiv(num_tokens, self.kv.block_size) <= self.kv.num_blocks

    def check_request(self, req: Request) -> None:
        """What the scheduler needs of a new request; raises ValueError saying what is
        wrong. `add_request` calls it; callers that want the error before queueing (the
        door) may call it first: it reads only fixed settings, from any thread."""
        if not req.prompt_token_ids:
            raise ValueError("prompt is empty")
        if req.sampling_params.n > self.max_num_seqs:
            raise ValueError(f"n = {req.sampling_params.n} parallel samples need as many seats; "
                             f"max_num_seqs is {self.max_num_seqs}")
        if req.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {req.num_prompt_tokens} tokens, must be < "
                f"max_model_len {self.max_model_len}"
            )
        # A request that cannot fit alone would preempt itself forever; refuse it up front.
        longest = min(req.num_prompt_tokens + req.sampling_params.max_tokens, self.max_model_len)
        if not self.can_ever_fit(longest):
            raise ValueError(
                f"{longest} tokens can never fit in the KV cache "
                f"({self.kv.num_blocks} blocks of {self.kv.block_size})"
            )

    def add_request(self, req: Request) -> None:
        rid = req.request_id
        self.check_request(req)
        if rid in self.requests:
            raise ValueError(f"request id {rid[:64]!r} is already in use")
        assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
        if self.kv.enable_prefix_caching and not req.hash_block_size:
            req.start_block_hashes(self.kv.block_size)
        req.seq = next(self._seq)
        self.requests[rid] = req
        if req.group is not None:
            assert req.sample_index == 0 and not req.group.forked, f"{rid}: only a leader is added"
            self._num_groups += 1
        self._enqueue(req)

    def abort_requests(self, request_ids: list[str], now: float | None = None) -> list[Request]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED, now)

    def finish_requests(
        self, request_ids: list[str], status: RequestStatus, now: float | None = None
    ) -> list[Request]:
        """End requests now (abort, stop string); frees their blocks, GPU or CPU. Unknown
        ids are ignored."""
        assert status.is_finished(), status
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._queue_of(req).remove(req)
            req.status = status
            self._release(req, now)
            done.append(req)
        return done

    def reset_prefix_cache(self, requeue: bool = False) -> PrefixCacheReset:
        """Forget every cached block (`KVCacheManager.reset_prefix_cache`). Call between
        steps. Refused (falsy result, nothing changed) while any request holds blocks,
        running or swapped out. With `requeue`, every running and swapped request is first
        preempted by recompute (back to waiting in rank order, their blocks freed, reported
        in the next step's `preempted_ids`); then the reset succeeds."""
        requeued = 0
        if requeue:
            for req in sorted([*self.running, *self.swapped], key=self._rank):
                self._queue_of(req).remove(req)
                self._recompute(req)
                self._requeued_ids.append(req.request_id)
                requeued += 1
        dropped = self.kv.num_cached_blocks
        if not self.kv.reset_prefix_cache():
            return PrefixCacheReset(False, requeued)
        return PrefixCacheReset(True, requeued, dropped)

    # -- one step --------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """The next step. The runner must make its KV moves (see `SchedulerOutput`) before
        the next `schedule()` or `update_from_output()`."""
        now = time.monotonic() if now is None else now
        self.kv.moves_done()  # the previous step's, if update_from_output did not say so
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[str] = []

        # 1. Running requests, most urgent first: a decode takes 1 token, a prefill a chunk
        # (its share of the step when long prompts share it).
        self.running.sort(key=self._rank)
        prefills = StepPrefills(self.prefill_limits, budget, self.running,
                                heapq.merge(self.swapped, self.waiting, key=self._rank),
                                self._num_left_to_prefill)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(prefills.share(req.num_tokens - req.num_computed_tokens), budget)
            assert num_new > 0, f"{req.request_id}: nothing to compute (no update_from_output?)"
            if not self.chunked_prefill and num_new < req.num_tokens - req.num_computed_tokens:
                i += 1  # unchunked (a static batch's member not yet started): a later step
                continue
            drafts = self._drafts(req, num_new, budget)
            num_total = req.num_computed_tokens + num_new
            if drafts and not self.kv.allocate_slots(req.request_id, num_total + len(drafts)):
                drafts = []  # drafts preempt nobody: short of blocks, it runs without them
            victim = None
            while victim is not req and not self.kv.allocate_slots(
                req.request_id, num_total + len(drafts)
            ):
                victim = self._pick_victim(req)
                if self.running.index(victim) < i:
                    i -= 1
                budget += self._preempt(victim, scheduled, preempted)
            if victim is req:
                continue  # it preempted itself; running[i] is now the next one
            scheduled[req.request_id] = self._scheduled(req, num_new, now, drafts)
            budget -= num_new + len(drafts)
            i += 1

        # 2. Swapped and waiting requests, unless blocks just ran out (re-admitting a victim
        # would thrash).
        if not preempted:
            budget = self._admit(budget, scheduled, preempted, now, prefills)

        moves = self.kv.take_moves()
        out = SchedulerOutput(
            scheduled=list(scheduled.values()),
            num_batched_tokens=self.max_num_batched_tokens - budget,
            preempted_ids=self._requeued_ids + preempted,
            finished_ids=self._finished_ids,
            blocks_to_swap_out=moves.swap_out,
            blocks_to_swap_in=moves.swap_in,
            blocks_to_copy=moves.copy,
            remote_kv=self._remote,
        )
        self._finished_ids = []
        self._requeued_ids = []
        self._remote = []
        self._check_step(out)
        return out

    def _check_step(self, out: SchedulerOutput) -> None:
        assert sum(s.num_new_tokens for s in out.scheduled) == out.num_batched_tokens
        assert 0 <= out.num_batched_tokens <= self.max_num_batched_tokens
        assert self._num_seats() <= self.max_num_seqs
        if self.max_loras is not None:
            loras = {r.lora_key for r in self.running if r.lora_key is not None}
            assert len(loras) <= self.max_loras, f"{len(loras)} adapters running, max {self.max_loras}"
        assert out.scheduled or not (
            out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy
        ), "KV moves in a step that runs nothing"
        for req in self.pulling:
            assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV and req.remote_kv is not None
            assert len(self.kv.block_table(req.request_id)) * self.kv.block_size >= req.num_tokens
        for queue in (self.waiting, self.swapped):
            ranks = [self._rank(r) for r in queue]
            assert all(a <= b for a, b in itertools.pairwise(ranks)), "queue out of order"
        for s in out.scheduled:
            assert s.num_new_tokens >= 1 and s.request.status is RequestStatus.RUNNING
            assert not s.spec_token_ids or (s.will_sample and len(s.spec_token_ids) < s.num_new_tokens)
            assert s.start + s.num_new_tokens - len(s.spec_token_ids) <= s.request.num_tokens
            assert len(s.block_table) * self.kv.block_size >= s.start + s.num_new_tokens
            self.kv.check_writable(s.request_id, s.start, s.start + s.num_new_tokens)

    def _admit(
        self,
        budget: int,
        scheduled: dict[str, ScheduledRequest],
        preempted: list[str],
        now: float,
        prefills: StepPrefills,
    ) -> int:
        """Move swapped and waiting requests into running, most urgent first; returns the
        budget left. A request short of blocks may preempt lower-ranked running requests of
        a strictly less urgent priority; if that cannot make room, admission stops (nobody
        skips ahead). Only a long prompt beyond `max_long_partial_prefills` is passed over,
        for this step (`prefills`)."""
        static = self.policy == "static"
        if static and self.running:
            return budget  # static: the next batch starts when the whole current one is done
        passed: set[str] = set()
        while True:
            req = self._next_to_admit(passed)
            if req is None:
                break
            if req.request_id in preempted:
                break  # preempted by someone this step; re-admitting it now would thrash
            if not self._lora_fits(req):
                # Its adapter cannot join the running ones': it waits, and nobody skips ahead
                # of it (FCFS), so running adapters drain and it gets its turn: no starvation.
                break
            if self._passed_over(req, prefills):
                passed.add(req.request_id)  # before it displaces anyone for a seat
                continue
            need_seat = self._num_seats() + self._seats_of(req) > self.max_num_seqs
            if need_seat or (budget <= 0 and not static):
                # A strictly more urgent request takes the seat (and the tokens this step
                # gave) of the lowest-ranked running one; otherwise it waits its turn.
                victim = None if static else self._room_victim(req, budget <= 0, scheduled)
                if victim is None:
                    break
                budget += self._preempt(victim, scheduled, preempted)
                continue
            swapped = req.status is RequestStatus.SWAPPED
            remote = req.remote_kv
            if remote is not None and remote.state is RemoteKVState.PENDING and not swapped:
                admitted, budget = self._admit_remote(req, budget, scheduled, preempted, now)
                if admitted is None:
                    break  # no blocks for it yet: it waits, and nobody skips ahead
                if admitted:
                    continue
                # Nothing to pull: its prefix is cached here. Admitted as any other below.
            hit = None
            if not swapped and budget > 0 and req.sampling_params.prompt_logprobs is None:
                hit = self.kv.find_cached_prefix(req.block_hashes, req.num_tokens)
            start = req.num_computed_tokens if hit is None else hit.num_tokens
            num_left = req.num_tokens - start
            num_new = min(prefills.share(num_left), budget)
            if not self.chunked_prefill and 0 < num_new < req.num_tokens - start:
                break  # unchunked: it waits for a step with room for its whole prompt
            # Static moves the whole batch in at once; members past the budget wait as
            # running, without blocks (a swapped one cannot: it waits for the next batch).
            if num_new == 0 and (swapped or not static):
                break
            if num_new and not self._allocate(req, start + num_new, hit):
                victims = self._displaceable(req, start + num_new, hit)
                if victims is None:
                    break  # nobody skips ahead of a request that does not fit yet
                for victim in victims:  # lowest-ranked first
                    budget += self._preempt(victim, scheduled, preempted)
                    if self._allocate(req, start + num_new, hit):
                        break
                else:
                    raise AssertionError(f"{req.request_id}: displacing freed too few blocks")
            self._dequeue(req)
            if num_left > 1:
                prefills.admitted(num_left)
            if hit is not None and num_new:
                req.num_computed_tokens = hit.num_tokens
                if req.first_scheduled_time is None:
                    req.num_cached_tokens = hit.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if num_new:
                scheduled[req.request_id] = self._scheduled(req, num_new, now)
                budget -= num_new
        return budget

    def _num_left_to_prefill(self, req: Request) -> int:
        """What waiting or swapped `req` has left to prefill once admitted: after its cached
        prefix, looked up only for a long one (`partial_prefill.num_to_prefill`)."""
        left = num_to_prefill(req)
        if (self.prefill_limits.is_long(left) and req.status is RequestStatus.WAITING
                and req.num_computed_tokens == 0 and req.sampling_params.prompt_logprobs is None):
            hit = self.kv.find_cached_prefix(req.block_hashes, req.num_tokens)
            left = req.num_tokens - hit.num_tokens
        return left if left > 1 else 0

    def _passed_over(self, req: Request, prefills: StepPrefills) -> bool:
        """Whether waiting or swapped `req` is a long prefill, after its cached prefix, that
        lets shorter ones pass this step (`StepPrefills.passes_over`)."""
        left = num_to_prefill(req)
        return bool(left) and prefills.passes_over(left) and prefills.passes_over(
            self._num_left_to_prefill(req))

    def _admit_remote(self, req: Request, budget: int, scheduled: dict[str, ScheduledRequest],
                      preempted: list[str], now: float) -> tuple[bool | None, int]:
        """Admit the queue's front `req`, which holds a handoff, into `pulling` (see the
        module docstring): True when admitted; False when its prefix cache here covers what
        the handoff would bring (the handoff is skipped: admit it as usual); None when its
        blocks do not fit even by displacing requests it may displace. With the budget,
        grown by what displaced requests were given this step."""
        remote = req.remote_kv
        assert remote is not None and req.num_computed_tokens == 0
        hit = (self.kv.find_cached_prefix(req.block_hashes, req.num_tokens)
               if req.sampling_params.prompt_logprobs is None else None)
        local = hit.num_tokens if hit is not None else 0
        wanted = min(remote.num_tokens, req.num_prompt_tokens - 1)
        if local >= wanted:
            remote.state = RemoteKVState.SKIPPED
            remote.reason = "cached" if local else "nothing to pull"
            self._remote.append(req)
            return False, budget
        total = req.num_tokens
        if not self._allocate(req, total, hit):
            victims = self._displaceable(req, total, hit)
            if victims is None:
                return None, budget
            for victim in victims:  # lowest-ranked first
                budget += self._preempt(victim, scheduled, preempted)
                if self._allocate(req, total, hit):
                    break
            else:
                raise AssertionError(f"{req.request_id}: displacing freed too few blocks")
        self._dequeue(req)
        bs = self.kv.block_size
        assert local % bs == 0, f"{req.request_id}: a partial prefix hit ({local} tokens)"
        req.num_computed_tokens = local
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        remote.num_local_tokens = local
        remote.num_tokens_wanted = wanted
        remote.first_block = local // bs
        remote.block_ids = self.kv.block_table(req.request_id)[local // bs: cdiv(wanted, bs)]
        remote.state = RemoteKVState.PULLING
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.pulling.append(req)
        self._remote.append(req)
        return True, budget

    def remote_kv_done(self, req: Request, ok: bool, reason: str = "") -> None:
        """The pull of `req` (pulling) ended: its blocks hold the wanted tokens' keys and
        values (`ok`), or not (it failed: `reason`). Either way it joins running; call
        between steps, from the engine thread."""
        remote = req.remote_kv
        assert remote is not None and remote.state is RemoteKVState.PULLING, req.request_id
        assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV, req.status
        self.pulling.remove(req)
        if ok:
            remote.state = RemoteKVState.DONE
            remote.num_pulled_tokens = remote.num_tokens_wanted - remote.num_local_tokens
            req.num_computed_tokens = remote.num_tokens_wanted
            # Full pulled blocks are this worker's now, as if computed here.
            self.kv.cache_full_blocks(req.request_id, req.block_hashes, remote.num_local_tokens,
                                      req.num_computed_tokens, req.all_token_ids, req.cache_salt)
        else:
            remote.state = RemoteKVState.FAILED
            remote.reason = reason
        if req.first_token_time is None:
            req.num_cached_tokens = req.num_computed_tokens  # as vLLM: local and external
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _lora_fits(self, req: Request) -> bool:
        """Whether `req` may run beside the running requests under max_loras."""
        if req.lora_key is None or self.max_loras is None:
            return True
        keys = {r.lora_key for r in self.running if r.lora_key is not None}
        return req.lora_key in keys or len(keys) < self.max_loras

    def _drafts(self, req: Request, num_new: int, budget: int) -> list[int]:
        """The drafts of `req` this step takes (see the module docstring): none unless its
        chunk of `num_new` tokens reaches its last token; at most the budget left after
        them; and at most what leaves room, once all are accepted and the model's token
        appended, within max_tokens and max_model_len."""
        spec = req.spec_token_ids
        if not spec or req.num_computed_tokens + num_new != req.num_tokens:
            return []
        room = min(req.sampling_params.max_tokens - req.num_output_tokens,
                   self.max_model_len - req.num_tokens) - 1
        return spec[: max(0, min(room, budget - num_new))]

    def _num_seats(self) -> int:
        """Seats taken: the running and pulling requests, and the followers their leaders
        will fork."""
        if not self._num_groups:
            return len(self.running) + len(self.pulling)
        return len(self.running) + len(self.pulling) + sum(
            r.group.num_unforked for r in self.running if r.group is not None)

    @staticmethod
    def _seats_of(req: Request) -> int:
        return 1 if req.group is None else 1 + req.group.num_unforked

    def _allocate(self, req: Request, num_total_tokens: int, hit: PrefixHit | None) -> bool:
        if req.status is RequestStatus.SWAPPED:
            computed = req.block_hashes[: req.num_computed_tokens // self.kv.block_size]
            return self.kv.swap_in(req.request_id, num_total_tokens, computed)
        return self.kv.allocate_slots(req.request_id, num_total_tokens, hit)

    def _rank(self, req: Request) -> tuple[float, float, int]:
        """Sort key, most urgent first (see the module docstring). Sorting by effective
        priority `priority - (now - arrival) / aging_s` at any `now` gives the same order
        as the virtual arrival `arrival + priority * aging_s`, so the key needs no clock."""
        if self.aging_s is None:
            return (req.priority, req.arrival_time, req.seq)
        return (req.arrival_time + req.priority * self.aging_s, req.arrival_time, req.seq)

    def _enqueue(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=self._rank)

    def _waiting_order(self) -> list[Request]:
        """The waiting queue, front = next to admit: kept in `_rank` order by `_enqueue`, so
        new arrivals and preempted requests (which keep their arrival time) go in place."""
        return self.waiting

    def _next_to_admit(self, passed: Collection[str] = ()) -> Request | None:
        """The more urgent of the swapped and waiting queues' fronts, past the requests
        `passed` over this step."""
        fronts = [r for q in (self.swapped, self._waiting_order())
                  if (r := next((r for r in q if r.request_id not in passed), None))]
        return min(fronts, key=self._rank, default=None)

    def _dequeue(self, req: Request) -> None:
        """Take an admitted `req` off its queue: the front but for requests passed over."""
        queue = self._queue_of(req)
        if queue[0] is req:
            queue.pop(0)
        else:
            queue.remove(req)

    def _queue_of(self, req: Request) -> list[Request]:
        return {
            RequestStatus.WAITING: self.waiting,
            RequestStatus.RUNNING: self.running,
            RequestStatus.SWAPPED: self.swapped,
            RequestStatus.WAITING_FOR_REMOTE_KV: self.pulling,
        }[req.status]

    def _pick_victim(self, req: Request) -> Request:
        """The running request to preempt so that running `req` gets its blocks: the
        lowest-ranked one, possibly `req` itself (never one ranked ahead of `req`). Among
        equal priorities that is the latest arrival, so the oldest always progresses. Rank
        alone decides, even if the victim's blocks are shared and free nothing: preferring
        unshared victims would break the priority guarantees."""
        victim = max(self.running, key=self._rank)
        assert self._rank(victim) >= self._rank(req)
        return victim

    def _room_victim(
        self, req: Request, need_tokens: bool, scheduled: dict[str, ScheduledRequest]
    ) -> Request | None:
        """The running request `req` may preempt for a seat (and, with `need_tokens`, for
        this step's token budget): the lowest-ranked one of a strictly less urgent priority
        (and, for tokens, one given some this step). None if there is none."""
        key = self._rank(req)
        victims = [
            r for r in self.running
            if r.priority > req.priority and self._rank(r) > key
            and (not need_tokens or r.request_id in scheduled)
        ]
        return max(victims, key=self._rank) if victims else None

    def _displaceable(
        self, req: Request, num_total_tokens: int, hit: PrefixHit | None
    ) -> list[Request] | None:
        """Running requests that `req` (waiting or swapped) may preempt to get blocks for
        `num_total_tokens` positions, lowest-ranked first: those ranked behind it with a
        strictly less urgent priority. None when even all of them would not free enough
        blocks (shared blocks free only with their last holder)."""
        key = self._rank(req)
        victims = sorted(
            (r for r in self.running if r.priority > req.priority and self._rank(r) > key),
            key=self._rank,
            reverse=True,
        )
        freeing = [r.request_id for r in victims]
        if victims and self.kv.can_allocate(req.request_id, num_total_tokens, hit, freeing):
            return victims
        return None

    def _preempt(
        self, req: Request, scheduled: dict[str, ScheduledRequest], preempted: list[str]
    ) -> int:
        """Preempt a running request by swap when the mode and the CPU blocks allow, else by
        recompute; either way it keeps its arrival time and re-queues in place. Returns the
        tokens it was given this step, handed back."""
        self.running.remove(req)
        preempted.append(req.request_id)
        req.spec_token_ids = []
        rid = req.request_id
        if self.preemption_mode != "recompute" and self.kv.can_swap_out(
            rid, req.num_computed_tokens
        ):
            self.kv.swap_out(rid, req.num_computed_tokens)
            req.status = RequestStatus.SWAPPED
            req.num_preemptions += 1
            bisect.insort(self.swapped, req, key=self._rank)
        else:
            self._recompute(req)
        given = scheduled.pop(rid, None)
        return given.num_new_tokens if given else 0

    def _recompute(self, req: Request) -> None:
        """Free the blocks, keep the output tokens, and requeue as waiting: it prefills its
        prompt plus output again (from whatever of it is still cached)."""
        self.kv.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self._enqueue(req)

    def _scheduled(self, req: Request, num_new: int, now: float,
                   drafts: Sequence[int] = ()) -> ScheduledRequest:
        """`num_new` of the request's own tokens, then `drafts` (taken off the request)."""
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        start = req.num_computed_tokens
        req.spec_token_ids = []
        will_sample = start + num_new == req.num_tokens
        group = req.group
        return ScheduledRequest(
            request=req,
            num_new_tokens=num_new + len(drafts),
            start=start,
            block_table=self.kv.block_table(req.request_id),
            will_sample=will_sample,
            spec_token_ids=list(drafts),
            forks=(group.followers if will_sample and group is not None and group.num_unforked
                   else []),
        )

    # -- after the model ran ---------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]],
        now: float | None = None,
    ) -> list[Request]:
        """Advance each scheduled request; returns those that got new tokens (finished or
        not), for the engine to publish. `sampled` gives each sampling request's token, or
        with drafts its tokens: the accepted drafts, then the model's own. They are appended
        in order up to the first that ends the request (stop token, max_tokens); the rest
        are dropped. Finished ones leave running with their blocks freed. Blocks that filled
        up this step are hashed into the prefix cache."""
        now = time.monotonic() if now is None else now
        self.kv.moves_done()  # the runner made the step's moves before its forward pass
        updated = []
        any_finished = False
        for s in output.scheduled:
            req = s.request
            if req.is_finished:
                continue  # aborted or stopped by the engine while the step ran
            assert req.status is RequestStatus.RUNNING and req.num_computed_tokens == s.start
            if s.will_sample:
                got = sampled[req.request_id]
                tokens = [got] if isinstance(got, int) else list(got)
                drafts = s.spec_token_ids
                assert 1 <= len(tokens) <= len(drafts) + 1 and tokens[:-1] == drafts[: len(tokens) - 1], (
                    f"{req.request_id}: tokens {tokens[:8]} do not follow the drafts {drafts[:8]}")
                if drafts:
                    req.num_draft_tokens += len(drafts)
                    req.num_accepted_tokens += len(tokens) - 1
                for token in tokens:
                    req.append_output_token(token)
                    if req.check_stop(self.max_model_len):
                        break
                # Every token but the last now has its keys and values (rejected drafts'
                # lie past it); without drafts that is the whole chunk.
                req.num_computed_tokens = req.num_tokens - 1
                assert (s.start + s.num_new_tokens - len(drafts) <= req.num_computed_tokens
                        <= s.start + s.num_new_tokens)
            else:
                req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(req.request_id, req.block_hashes, s.start,
                                      req.num_computed_tokens, req.all_token_ids,
                                      req.cache_salt)
            if not s.will_sample:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            updated.append(req)
            if s.forks:  # before the leader may release the blocks they share
                updated += self._fork(req.group, sampled, now)
            if req.is_finished:
                self._release(req, now)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return updated

    def _fork(self, group: SampleGroup, sampled: Mapping[str, int | Sequence[int]],
              now: float) -> list[Request]:
        """Start the followers of `group` after the step that sampled the leader's first
        token and theirs: each shares the leader's blocks (`KVCacheManager.fork`), has the
        prompt computed and its own first token. Returns them (finished ones released)."""
        leader = group.leader
        group.forked = True
        computed = leader.num_computed_tokens
        assert computed == leader.num_prompt_tokens, f"{leader.request_id}: fork after the prompt"
        bs = leader.hash_block_size
        forked = []
        for f in group.followers:
            rid = f.request_id
            assert f.status is RequestStatus.WAITING and rid not in self.requests, rid
            self.kv.fork(leader.request_id, rid, computed)
            if bs:  # the prompt's full blocks hash alike (same tokens and salt)
                f.hash_block_size = bs
                f.block_hashes = leader.block_hashes[: computed // bs]
            f.seq = next(self._seq)
            f.status = RequestStatus.RUNNING
            f.num_computed_tokens = computed
            f.num_cached_tokens = leader.num_cached_tokens
            f.first_scheduled_time = leader.first_scheduled_time
            f.first_token_time = now
            self.requests[rid] = f
            got = sampled[rid]
            f.append_output_token(got if isinstance(got, int) else got[0])
            if f.check_stop(self.max_model_len):
                self._release(f, now)
            else:
                self.running.append(f)
            forked.append(f)
        return forked

    def _pin(self, req: Request, now: float) -> None:
        """A tagged prompt that computed and sampled normally pins its prompt's blocks for
        the decode worker to pull (an abort or a failure pins nothing; nor does a sample of
        a group: remote decode is for one sample)."""
        assert req.kv_pin_key is not None
        if (self.handoff_lease_s is None or req.kv_handoff is not None or req.group is not None
                or req.status not in (RequestStatus.FINISHED_STOPPED,
                                      RequestStatus.FINISHED_LENGTH)
                or req.num_computed_tokens < req.num_prompt_tokens):
            return
        req.kv_handoff = self.kv.pin(req.request_id, req.num_prompt_tokens, req.kv_pin_key,
                                     now + self.handoff_lease_s, self.max_pinned_blocks)

    def _release(self, req: Request, now: float | None) -> None:
        assert req.is_finished, req.status
        if req.group is not None and req.sample_index == 0:
            self._num_groups -= 1
        req.finished_time = time.monotonic() if now is None else now
        if req.kv_pin_key is not None:
            self._pin(req, req.finished_time)
        self.kv.free(req.request_id)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
