"""The one engine: a background thread that loops
``schedule -> run model -> sample -> update -> publish`` while there is work.

`submit()` and `abort()` are safe from any thread: they post to an inbox the
loop drains at the top of each step. Each step's results leave once, as one
`StepOutput` (the requests' outputs, the prefix-cache events taken from the KV
cache, the step's figures), through the `on_step` callback (the gRPC side hops
it onto its event loop). `generate()` is the offline API: it drives the same
`step()` in the caller's thread, for tests, the CLI and benchmarks.

A request with n > 1 is submitted as one (its leader); the engine makes its followers
(`scheduler.sample_group`) and reports every sample's outputs under the leader's id with
the sample's `index`. Aborting the id aborts every sample; a leader that ends before its
first token (abort, a failed step, refused) ends its unforked followers with it.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch

import ops
from kvcache.budget import KVBudget, fit_budget, kv_bytes_per_token
from kvcache.events import KVEvent
from kvcache.manager import KVCacheManager
from scheduler.request import Request, RequestStatus, SamplingParams, SamplingParamsError
from scheduler.sample_group import SampleGroup, make_group
from scheduler.scheduler import PrefixCacheReset, Scheduler
from worker import memory
from worker.config import NgramSpeculation, WorkerConfig
from worker.lora.registry import LoraRegistry
from worker.lora.slots import LoraSlots
from worker.model_runner import ModelRunner
from worker.outputs import OutputState, RequestOutput
from worker.spec_decode import NgramProposer
from worker.structured import GrammarMatcher
from worker.weights import LinearPolicy, LoadedModel, load_model

log = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass
class StepOutput:
    """What one engine step publishes, in one piece: per-request outputs, the prefix-cache
    events the step caused (taken from the KV cache, `kvcache.events`), and figures."""

    outputs: list[RequestOutput] = field(default_factory=list)
    kv_events: list[KVEvent] = field(default_factory=list)
    num_batched_tokens: int = 0  # tokens the model computed (prefill chunks + decodes)
    num_preempted: int = 0  # requests preempted by this step's schedule (swap or recompute)
    num_draft_tokens: int = 0  # speculative drafts the step verified
    num_accepted_tokens: int = 0  # of those, accepted

    def __bool__(self) -> bool:
        return bool(self.outputs or self.kv_events or self.num_preempted)


# Takes a step's output; returns False where its reader need not be woken for it yet
# (the bridge at --stream-interval > 1: no stream has a message due; `Engine.start`).
StepSink = Callable[[StepOutput], bool | None]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)  # (ModelConfig checked the spelling)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA device here (this torch: "
                             f"{torch.__version__}, CUDA available: no)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@dataclass
class Completion:
    """A finished request, as the offline API returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: str | int | None
    logprobs: list | None
    cached_tokens: int
    index: int = 0  # the sample's, with n > 1
    prompt_logprobs: list | None = None

    @classmethod
    def of(cls, request: Request, out: RequestOutput | None) -> Completion:
        assert out is not None and out.finished
        return cls(request.request_id, request.prompt_token_ids, out.new_token_ids, out.new_text,
                   out.finish_reason or "", out.stop_reason, out.logprobs, out.cached_tokens,
                   out.index, out.prompt_logprobs)


# Graph rows for verification at most (vLLM's largest capture size by default): each
# captured size holds its logits ([rows, vocab] float32: 263 MB at 512 rows of a 128k
# vocabulary); larger verification steps run eagerly.
MAX_VERIFY_GRAPH_ROWS = 512


def _max_verify_rows(spec: NgramSpeculation | None, max_num_seqs: int) -> int:
    """Rows of the largest verification step: with speculation on (at most
    disable_by_batch_size running requests) each request is a row per drafted token and
    one for its own; the CUDA graphs are captured up to this many rows (at most
    MAX_VERIFY_GRAPH_ROWS)."""
    if spec is None:
        return 0
    rows = min(max_num_seqs, spec.disable_by_batch_size) * (spec.num_speculative_tokens + 1)
    return min(rows, MAX_VERIFY_GRAPH_ROWS)


def _wake_reader(fd: int | None) -> None:
    """One byte to the reader's wake-up pipe (Engine.start)."""
    assert fd is not None
    try:
        os.write(fd, b"\0")
    except (BlockingIOError, BrokenPipeError):  # full: the reader is awake; closed: gone
        pass


class Engine:
    # A model step that raises fails the requests of that step and the engine goes on; this
    # many failed steps in a row mean it cannot (a broken device): the engine thread ends,
    # and the bridge's watchdog fails what is left and marks the worker NOT_SERVING.
    max_consecutive_failed_steps = 3

    def __init__(self, config: WorkerConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        device = resolve_device(config.model.device)
        mc = config.model
        if loaded is None:
            loaded = load_model(mc.model, device, resolve_dtype(mc.dtype, device), mc.cpu_quantized_linear,
                                mc.cpu_activations)
        else:  # a load made for other linears is made again, unless an engine runs on it
            loaded.hold_linears(LinearPolicy.of(loaded.device, loaded.dtype, mc.cpu_quantized_linear,
                                                mc.cpu_activations))
        log.info(loaded.describe_weights())
        loaded.taken = True
        self.loaded = loaded
        self.model_name = config.model.served_model_name or loaded.name  # the id clients see
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.config
        self.max_model_len = config.model.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(
                f"--max-model-len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {mcfg.max_position_embeddings}"
            )
        self.kv_dtype = memory.kv_cache_dtype(config.cache.kv_cache_dtype, loaded.device, loaded.dtype)
        self.budget = self._kv_budget()
        log.info(self.budget.describe())
        cc, sc = config.cache, config.scheduler
        block_bytes = self.budget.bytes_per_token * cc.block_size
        num_cpu_blocks = 0 if sc.preemption_mode == "recompute" else int(cc.swap_space * GiB) // block_bytes
        if num_cpu_blocks:
            log.info("swap space: %d CPU blocks (%.2f GiB%s)", num_cpu_blocks,
                     num_cpu_blocks * block_bytes / GiB,
                     ", pinned" if loaded.device.type == "cuda" else "")
        self.kv = KVCacheManager(self.budget.num_blocks, cc.block_size,
                                 enable_prefix_caching=cc.enable_prefix_caching,
                                 num_cpu_blocks=num_cpu_blocks)
        srv = config.server
        if srv.kv_events and srv.vllm_protocol and cc.enable_prefix_caching:
            self.kv.pool.record_events()  # taken every step, published by worker.kv_events
        self.scheduler = Scheduler(
            self.kv, sc.max_num_seqs, sc.max_num_batched_tokens, self.max_model_len, sc.policy,
            aging_s=sc.priority_aging_s or None, preemption_mode=sc.preemption_mode,
            chunked_prefill=sc.enable_chunked_prefill,
            max_loras=config.lora.max_loras if config.lora.enable_lora else None,
        )
        # LoRA adapters (worker/lora): named in host memory, the step's in device slots.
        lc = config.lora
        self.loras: LoraRegistry | None = None
        lora_slots = None
        if lc.enable_lora:
            self.loras = LoraRegistry(mcfg, lc.max_lora_rank, lc.cpu_loras)
            for entry in lc.lora_modules:
                name, _, path = entry.partition("=")
                self.loras.load(name, path)
            lora_slots = LoraSlots(mcfg, lc.max_loras, lc.max_lora_rank, loaded.device, loaded.dtype)
            log.info("LoRA: %d adapter(s) loaded (%s); %d slots of rank %d (%.1f MiB)",
                     len(lc.lora_modules), ", ".join(self.loras.names) or "none", lc.max_loras,
                     lc.max_lora_rank, lora_slots.nbytes / (1 << 20))
        ops.set_backend(config.model.kernels)
        self.runner = ModelRunner(
            loaded.model, self.budget.num_blocks, cc.block_size, loaded.device, loaded.dtype,
            kv_dtype=self.kv_dtype, max_num_seqs=sc.max_num_seqs, max_model_len=self.max_model_len,
            # The torch references sync with the host inside; only the kernels can be captured.
            cuda_graphs=config.model.cuda_graphs and ops.uses_triton(loaded.device),
            max_decode_rows=_max_verify_rows(config.speculative.speculative_config, sc.max_num_seqs),
            num_cpu_blocks=num_cpu_blocks,
            cpu_packed_linear=config.model.cpu_packed_linear,
            cpu_huge_pages=config.model.cpu_huge_pages,
            lora=lora_slots,
        )
        log.info(self.runner.describe_kernels())
        spec = config.speculative.speculative_config
        self.speculation = spec
        self.proposer = (NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                       spec.prompt_lookup_max) if spec is not None else None)
        if spec is not None:
            log.info("speculative decoding: n-gram drafts of up to %d tokens (suffixes of %d..%d "
                     "tokens), off in steps with more than %d running requests",
                     spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
                     spec.disable_by_batch_size)
        torch.manual_seed(config.model.seed)
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._ids = itertools.count()
        # Parallel samples' groups with a sample not finished, by the leader's id: an abort
        # of that id reaches every sample (followers have ids of their own).
        self._groups: dict[str, SampleGroup] = {}
        self.num_steps = 0
        self.num_failed_steps = 0  # in a row; reset by a step that succeeds
        # For the metrics (read from the loop without a lock, like num_steps): preemptions
        # counted when the scheduler makes them, and how many steps ran each token count.
        self.num_preemptions = 0
        self.step_tokens: dict[int, int] = {}  # tokens the model ran in a step -> steps
        # Speculative decoding: drafts verified (one per request and step that had some),
        # draft tokens verified, and of those accepted.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # accepted_per_position[j]: drafts accepted at position j of their draft (vLLM's
        # per-position counter); as long as the longest draft.
        self.accepted_per_position = [0] * (spec.num_speculative_tokens if spec else 0)
        # Structured-output requests admitted, by constraint kind (worker.structured.KINDS).
        self.structured_requests: dict[str, int] = {}

    # ----- sizing -----

    def _kv_budget(self) -> KVBudget:
        m, dev, cc = self.loaded.config, self.loaded.device, self.config.cache
        per_token = kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, self.kv_dtype.itemsize)
        activations = memory.activation_reserve(m, self.config.scheduler, self.max_model_len,
                                                self.loaded.dtype.itemsize)
        budget = memory.kv_cache_bytes(cc, memory.device_memory(dev), activations)
        if dev.type == "cpu":
            memory.check_host_room(budget)
        return fit_budget(budget, cc.block_size, per_token, self.max_model_len)

    # ----- requests in -----

    def make_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> Request:
        """A request for this model; raises ValueError saying what is wrong. The model's
        concerns are checked here (the vocabulary, prompt + max_tokens within
        max_model_len, stop strings needing a tokenizer), the scheduler's by
        `Scheduler.check_request` (called here, so that the error comes before queueing),
        the sampling values' by `SamplingParams`."""
        if request_id is not None and "\x00" in request_id:  # the samples' ids hold one
            raise ValueError(f"request_id {request_id[:64]!r} holds a NUL (U+0000)")
        ids = list(prompt_token_ids)
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is out of the vocabulary [0, {vocab})")
        # Ids the logits are indexed by: one past the vocabulary would fail the whole step,
        # every request in it (a stop id is indexed while min_tokens bans it).
        for name, listed in (("logit_bias", [t for t, _ in params.logit_bias]),
                             ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in listed if not 0 <= t < vocab), None)
            if bad is not None:
                raise SamplingParamsError(name, f"has token id {bad}, out of the vocabulary [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (send stop_token_ids)")
        lora_key = None
        if lora_name:
            if self.loras is None:
                raise ValueError(f"LoRA adapter {lora_name[:64]!r} asked for, but this worker "
                                 "serves none (start it with --enable-lora)")
            lora_key = self.loras.key(lora_name)  # UnknownLoraError (a ValueError) names it
        req = Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_token_ids=ids,
            sampling_params=params,
            eos_token_ids=self.loaded.eos_token_ids,
            priority=priority,
            cache_salt=cache_salt or None,
            lora_name=lora_name or None,
            lora_key=lora_key,
        )
        self.scheduler.check_request(req)
        return req

    def submit(self, request: Request) -> None:
        self._inbox.put(("add", request))
        self._wake.set()

    def abort(self, request_ids: Sequence[str]) -> None:
        self._inbox.put(("abort", list(request_ids)))
        self._wake.set()

    def reset_prefix_cache(self, requeue: bool = False) -> Future[PrefixCacheReset]:
        """Forget the cached prefix blocks, between two steps on the engine thread (see
        `Scheduler.reset_prefix_cache`). Safe from any thread; the future says what happened."""
        fut: Future[PrefixCacheReset] = Future()
        self._inbox.put(("reset_prefix_cache", (requeue, fut)))
        self._wake.set()
        return fut

    # ----- the step -----

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if kind == "add":
                assert isinstance(item, Request)
                group = make_group(item) if item.sampling_params.n > 1 else None
                samples = group.samples if group is not None else [item]
                try:
                    if item.lora_key is not None:
                        assert self.loras is not None
                        # Held by each sample until it ends (_output): an adapter in use
                        # cannot be unloaded.
                        for r in samples:
                            r.lora = self.loras.acquire(item.lora_key)
                    self.scheduler.add_request(item)
                except ValueError as e:  # refused: that request fails, the engine goes on
                    for r in samples:
                        self._release_lora(r)
                    for r in samples:
                        r.status = RequestStatus.FINISHED_ERROR
                        outputs.append(RequestOutput(
                            item.request_id, [], "", finished=True, finish_reason="error",
                            prompt_tokens=item.num_prompt_tokens, error=str(e), refused=True,
                            request=r, index=r.sample_index))
                    continue
                if item.grammar is not None:
                    ck = item.grammar.kind
                    self.structured_requests[ck] = self.structured_requests.get(ck, 0) + 1
                item.output_state = OutputState.create(item, self.tokenizer)
                if group is not None:
                    self._groups[item.request_id] = group
                    for f in group.followers:
                        f.output_state = OutputState.create(f, self.tokenizer)
                        if item.grammar is not None:  # each sample its own matcher
                            f.grammar = GrammarMatcher(item.grammar.matcher.deep_copy())
            elif kind == "reset_prefix_cache":
                requeue, fut = item  # type: ignore[misc]
                try:
                    fut.set_result(self.scheduler.reset_prefix_cache(requeue))
                except Exception as e:  # the caller hears of it; the engine goes on
                    fut.set_exception(e)
            else:
                assert isinstance(item, list)
                groups = [g for rid in item if (g := self._groups.get(rid)) is not None]
                ids = list(item) + [f.request_id for g in groups for f in g.followers]
                for req in self.scheduler.abort_requests(ids):
                    outputs.append(self._output(req, [], finished=True))
                for g in groups:  # followers not forked yet are in no queue
                    for f in g.followers:
                        if not f.is_finished:
                            f.status = RequestStatus.FINISHED_ABORTED
                            outputs.append(self._output(f, [], finished=True))

    def has_work(self) -> bool:
        # The inbox counts: a reset or an abort must be answered even when nothing runs.
        return self.scheduler.has_unfinished_requests() or not self._inbox.empty()

    def step(self) -> StepOutput:
        """One iteration; returns what it produced (possibly nothing)."""
        step = StepOutput(self._drain_inbox())
        if self.scheduler.has_unfinished_requests():
            self._run(step)
        if self._groups:
            self._end_groups(step.outputs)
        # After the run: the events of this step's admissions, evictions and filled blocks.
        step.kv_events = self.kv.take_events()
        return step

    def _end_groups(self, outputs: list[RequestOutput]) -> None:
        """A leader that ended before its first token ends its unforked followers with it
        (same status and error); a group whose samples all ended is forgotten."""
        for out in list(outputs):
            req = out.request
            group = req.group if out.finished and req is not None else None
            if group is None:
                continue
            if req.sample_index == 0 and not group.forked:
                group.forked = True  # never will be: they end here
                for f in group.followers:
                    if not f.is_finished:
                        f.status = req.status
                        outputs.append(self._output(f, [], finished=True, error=out.error))
            if group.all_finished() and self._groups.get(group.leader.request_id) is group:
                del self._groups[group.leader.request_id]

    def _propose(self) -> None:
        """Draft tokens for every running request that decodes next, unless the batch is
        larger than speculation pays for (then none: the step runs as without it)."""
        assert self.proposer is not None and self.speculation is not None
        running = self.scheduler.running
        on = len(running) <= self.speculation.disable_by_batch_size
        for req in running:
            decoding = req.num_computed_tokens == req.num_tokens - 1
            # Not under a grammar (a draft would need the matcher advanced over it to mask the
            # next position) nor before min_tokens (its EOS mask depends on the position).
            plain = req.grammar is None and req.num_output_tokens >= req.sampling_params.min_tokens
            req.spec_token_ids = (self.proposer.propose(req.all_token_ids)
                                  if on and decoding and plain else [])

    def _run(self, step: StepOutput) -> None:
        outputs = step.outputs
        if self.proposer is not None:
            self._propose()
        sched = self.scheduler.schedule()
        step.num_preempted = len(sched.preempted_ids)
        self.num_preemptions += step.num_preempted  # for the metrics, when made
        if sched.is_empty:
            return
        try:
            sampled = self.runner.execute(sched)
        except Exception as e:  # a failed step fails its requests, never hangs them
            log.exception("model step failed")
            self.num_failed_steps += 1
            reqs = [s.request for s in sched.scheduled]
            # Requests swapped out this step hold CPU blocks the failed copy may not have
            # written: they fail too, rather than resume on garbage keys and values.
            reqs += [r for rid in sched.preempted_ids
                     if (r := self.scheduler.get_request(rid)) is not None
                     and r.status is RequestStatus.SWAPPED]
            self.scheduler.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ERROR)
            outputs += [self._output(r, [], finished=True, error=f"model step failed: {e}") for r in reqs]
            return
        self.num_steps += 1
        self.num_failed_steps = 0
        step.num_batched_tokens = sched.num_batched_tokens
        self.step_tokens[step.num_batched_tokens] = self.step_tokens.get(step.num_batched_tokens, 0) + 1
        before = {s.request_id: s.request.num_output_tokens for s in sched.scheduled if s.will_sample}
        drafted = sum(len(s.spec_token_ids) for s in sched.scheduled)
        if drafted:
            accepted = 0
            for s in sched.scheduled:
                if s.spec_token_ids:
                    n = len(sampled[s.request_id]) - 1
                    accepted += n
                    self.num_drafts += 1
                    for j in range(n):
                        self.accepted_per_position[j] += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
            step.num_draft_tokens, step.num_accepted_tokens = drafted, accepted
        updated = self.scheduler.update_from_output(
            sched, {k: [r.token_id for r in v] for k, v in sampled.items()})
        stopped: list[str] = []
        failed: dict[str, str] = {}
        client_faults: set[str] = set()  # of `failed`: what the request asked for failed
        new_ids: dict[str, list[int]] = {}
        for req in updated:
            state = req.output_state
            first = before.get(req.request_id, 0)  # a follower forked this step: 0
            ids = new_ids[req.request_id] = req.output_token_ids[first:]
            for j, token in enumerate(ids):
                if req.sampling_params.logprobs is not None:
                    state.pending_logprobs.append(sampled[req.request_id][j])
                stop = state.add_token(token)
                if stop is None:
                    continue
                last = j == len(ids) - 1
                if req.is_finished and last:
                    break  # its stop token or length ended it at this very token: that stands
                # A stop string ends the request at this token; tokens after it (accepted
                # drafts) are dropped, as if they had never been sampled.
                del ids[j + 1 :]
                req.truncate_output(first + j + 1)
                req.stop_reason = stop
                if req.is_finished:  # ended later in the dropped tokens; already released
                    req.status = RequestStatus.FINISHED_STOPPED
                else:
                    stopped.append(req.request_id)
                break
            else:
                # No stop string ended it. A grammar's request (never drafted: one token here)
                # advances its matcher over the token; complete, the grammar ends the request.
                if req.grammar is not None and not req.is_finished:
                    assert len(ids) == 1, "a constrained request got drafts"
                    if not req.grammar.accept(ids[0]):
                        failed[req.request_id] = (f"the grammar refused token {ids[0]}: "
                                                  f"{req.grammar.error}")
                        if req.grammar.over_limit:  # the constraint's doing, not ours
                            client_faults.add(req.request_id)
                    elif req.grammar.done:
                        stopped.append(req.request_id)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if failed:
            self.scheduler.finish_requests(list(failed), RequestStatus.FINISHED_ERROR)
        for req in updated:
            outputs.append(self._output(req, new_ids[req.request_id], finished=req.is_finished,
                                        error=failed.get(req.request_id),
                                        refused=req.request_id in client_faults))

    def _release_lora(self, req: Request) -> None:
        if req.lora is not None and self.loras is not None:
            self.loras.release(req.lora)
            req.lora = None

    def _output(self, req: Request, new_ids: list[int], finished: bool, error: str | None = None,
                refused: bool = False) -> RequestOutput:
        if finished:
            self._release_lora(req)
        state: OutputState = req.output_state
        lps = state.pending_logprobs or None
        state.pending_logprobs = []
        leader = req.group.leader if req.group is not None else req
        first = bool(new_ids) and req.num_output_tokens == len(new_ids)
        out = RequestOutput(
            request_id=leader.request_id,
            index=req.sample_index,
            prompt_logprobs=(leader.prompt_logprobs if first and
                             req.sampling_params.prompt_logprobs is not None else None),
            new_token_ids=new_ids,
            new_text=state.take_text(finished),
            finished=finished,
            logprobs=lps,
            prompt_tokens=req.num_prompt_tokens,
            completion_tokens=req.num_output_tokens,
            cached_tokens=req.num_cached_tokens,
            request=req,
        )
        if finished:
            now = time.monotonic()
            out.finish_reason = "error" if error else req.finish_reason
            out.stop_reason = req.stop_reason
            out.error = error
            out.refused = refused
            out.total_time_s = now - req.arrival_time
            if req.first_scheduled_time is not None:
                out.queue_time_s = req.first_scheduled_time - req.arrival_time
            if req.first_token_time is not None:
                out.ttft_s = req.first_token_time - req.arrival_time
        return out

    # ----- background loop -----

    def start(self, on_step: StepSink, wake_fd: int | None = None) -> None:
        """Run steps in a thread, calling `on_step` with each step that produced something.

        With `wake_fd`, `on_step` only queues the step for its reader (a served worker's
        event loop, `worker.bridge`), and the engine wakes the reader by writing one byte to
        `wake_fd` once per step it queued: as the *next* step's native call begins, where
        that call has released the GIL for its whole length, so that the loop's Python for
        the token runs beside the model, not in the gap between two steps, where the engine
        thread's own Python needs the GIL and would wait for the loop's (0.3 ms a token on a
        2-core machine, BENCHMARKS.md, session 18). Where no such call comes (the next step
        runs without the CPU decoder, or there is no next step yet) the byte is written
        after the step, or at once when the engine goes idle. A step for which `on_step`
        returns False stays queued unwoken: the reader takes it with the next step it is
        woken for, or when the engine goes idle.
        """
        assert self._thread is None, "engine already started"
        self._stop = False
        self._thread = threading.Thread(target=self._loop, args=(on_step, wake_fd), name="engine",
                                        daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self, on_step: StepSink, wake_fd: int | None) -> None:
        defer = wake_fd is not None and self.runner.cpu_decoder is not None
        queued = False  # a step handed to on_step whose reader is to be woken at the next call
        unwoken = False  # a step handed to on_step that asked for no wake (yet)
        try:
            while not self._stop:
                if not self.has_work():
                    if queued or unwoken:
                        _wake_reader(wake_fd)
                        queued = unwoken = False
                    self._wake.wait()
                    self._wake.clear()
                    continue
                if queued:
                    self.runner.wake_fd = wake_fd  # taken (reset to -1) by the step's native call
                step = self.step()
                if queued and self.runner.wake_fd >= 0:  # the step made no native call
                    self.runner.wake_fd = -1
                    _wake_reader(wake_fd)
                queued = False
                if step:
                    if on_step(step) is False:
                        unwoken = wake_fd is not None
                    elif defer:
                        queued, unwoken = True, False
                    elif wake_fd is not None:
                        _wake_reader(wake_fd)
                        unwoken = False
                if self.num_failed_steps >= self.max_consecutive_failed_steps:
                    log.error("%d model steps failed in a row; the engine stops",
                              self.num_failed_steps)
                    return
        finally:
            if queued or unwoken:
                _wake_reader(wake_fd)

    # ----- offline API -----

    def generate(self, requests: Sequence[Request],
                 on_output: Callable[[list[RequestOutput]], None] | None = None) -> list[Completion]:
        """Run requests to completion in this thread; results in the order given (a request
        with n > 1: its n samples, by index)."""
        assert self._thread is None, "generate() drives the engine itself; the loop is running"
        acc: dict[tuple[str, int], RequestOutput | None] = {}
        for r in requests:
            for i in range(r.sampling_params.n):
                acc[r.request_id, i] = None
            self.submit(r)
        pending = set(acc)
        while pending:
            outputs = self.step().outputs
            if on_output is not None and outputs:
                on_output(outputs)
            for o in outputs:
                key = (o.request_id, o.index)
                so_far = acc[key]
                if so_far is None:
                    acc[key] = replace(o)  # a copy: the sink saw `o`
                else:
                    so_far.merge(o)
                if o.finished:
                    pending.discard(key)
        return [Completion.of(r, acc[r.request_id, i]) for r in requests
                for i in range(r.sampling_params.n)]
