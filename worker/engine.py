"""The one engine: a background thread that loops `step()` while there is work. A step
drains the inbox, then runs its phases (`Engine._run`, each a method):

    schedule -> execute (KV moves, model, sample) -> tally drafts -> advance
             -> check stops (detokenize, stop strings, grammar) -> finish -> publish

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
from scheduler.output import SchedulerOutput
from scheduler.partial_prefill import PrefillLimits
from scheduler.request import (
    RemoteKVState,
    Request,
    RequestStatus,
    SamplingParams,
    SamplingParamsError,
)
from scheduler.sample_group import SampleGroup, make_group
from scheduler.scheduler import PrefixCacheReset, Scheduler
from worker import memory
from worker.config import NgramSpeculation, WorkerConfig
from worker.kv_transfer.client import KVPuller, RemotePull
from worker.kv_transfer.handoff import Layout, model_fingerprint
from worker.kv_transfer.stats import KVTransferStats
from worker.lora.registry import LoraRegistry
from worker.lora.slots import LoraSlots
from worker.model_runner import ModelRunner, SampleResult
from worker.outputs import OutputState, RequestOutput
from worker.parallel import RankLost
from worker.parallel.shard import ShardPlan
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


@dataclass
class _Ends:
    """How requests end in this step besides the scheduler's own stops (`Engine._check_stops`)."""

    stopped: list[str] = field(default_factory=list)  # a stop string, or a complete grammar
    failed: dict[str, str] = field(default_factory=dict)  # the grammar refused: id -> error
    client_faults: set[str] = field(default_factory=set)  # of `failed`: the constraint's limit


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
        tp = config.parallel.tensor_parallel_size
        # Under tensor parallelism a GGUF loads rank 0's slices only, on the file's blocks
        # as at TP = 1 (worker/parallel/gguf_split.py); other sources are sliced after.
        quantized = mc.cpu_quantized_linear
        split = (tp, 0) if tp > 1 else None
        if loaded is None:
            loaded = load_model(mc.model, device, resolve_dtype(mc.dtype, device), quantized,
                                mc.cpu_activations, split)
        else:  # a load made for other linears is made again, unless an engine runs on it
            if tp > 1:  # a split that does not divide is refused before any reload
                ShardPlan.of(loaded.config, tp)
            loaded.hold_linears(LinearPolicy.of(loaded.device, loaded.dtype, quantized,
                                                mc.cpu_activations), split)
        log.info(loaded.describe_weights())
        loaded.taken = True
        self.loaded = loaded
        self.lost: str | None = None  # why the tensor-parallel group broke (RankLost), if it did
        self.tensor_parallel = None
        if tp > 1:  # rank 0: its model is sliced here; the followers start with the runner
            from worker.parallel.leader import TensorParallel

            self.tensor_parallel = TensorParallel(config, loaded)
        self.model_name = config.model.served_model_name or loaded.name  # the id clients see
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.config
        self.max_model_len = config.model.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(
                f"--max-model-len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {mcfg.max_position_embeddings}"
            )
        serve_context = getattr(loaded.model, "serve_context", None)
        if serve_context is not None:  # a rotary table made for the served context
            serve_context(self.max_model_len)
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
        kc = config.kv_transfer
        kv_spec = kc.kv_transfer_config
        self.scheduler = Scheduler(
            self.kv, sc.max_num_seqs, sc.max_num_batched_tokens, self.max_model_len, sc.policy,
            aging_s=sc.priority_aging_s or None, preemption_mode=sc.preemption_mode,
            chunked_prefill=sc.enable_chunked_prefill,
            max_loras=config.lora.max_loras if config.lora.enable_lora else None,
            handoff_lease_s=kc.kv_transfer_lease_s if kv_spec and kv_spec.is_producer else None,
            max_pinned_blocks=kc.kv_transfer_max_pinned_blocks,
            prefill_limits=PrefillLimits.from_flags(
                sc.long_prefill_token_threshold, sc.max_num_partial_prefills,
                sc.max_long_partial_prefills, self.max_model_len),
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
            # Under tensor parallelism the slots hold this rank's share (worker/parallel/lora.py).
            tp_plan = self.tensor_parallel.plan if self.tensor_parallel is not None else None
            lora_slots = LoraSlots(mcfg if tp_plan is None else loaded.model.config, lc.max_loras,
                                   lc.max_lora_rank, loaded.device, loaded.dtype,
                                   None if tp_plan is None else tp_plan.lora_slicer(0))
            log.info("LoRA: %d adapter(s) loaded (%s); %d slots of rank %d (%.1f MiB)",
                     len(lc.lora_modules), ", ".join(self.loras.names) or "none", lc.max_loras,
                     lc.max_lora_rank, lora_slots.nbytes / (1 << 20))
        ops.set_backend(config.model.kernels)
        if self.tensor_parallel is not None:
            self.tensor_parallel.start(self.budget.num_blocks, num_cpu_blocks, cc.block_size, self.kv_dtype)
        self.runner = ModelRunner(
            loaded.model, self.budget.num_blocks, cc.block_size, loaded.device, loaded.dtype,
            kv_dtype=self.kv_dtype, max_num_seqs=sc.max_num_seqs, max_model_len=self.max_model_len,
            # The torch references sync with the host inside; only the kernels can be captured.
            cuda_graphs=(config.model.cuda_graphs and ops.uses_triton(loaded.device)
                         and self.tensor_parallel is None),
            max_decode_rows=_max_verify_rows(config.speculative.speculative_config, sc.max_num_seqs),
            num_cpu_blocks=num_cpu_blocks,
            cpu_packed_linear=config.model.cpu_packed_linear,
            cpu_huge_pages=config.model.cpu_huge_pages,
            lora=lora_slots,
        )
        self.runner.step_hook = self.tensor_parallel
        if self.tensor_parallel is not None and lora_slots is not None:
            lora_slots.on_write = self.tensor_parallel.write_lora
        log.info(self.runner.describe_kernels())
        # Prefill/decode disaggregation (worker/kv_transfer): what our blocks mean, the
        # figures, and on a decode worker the pulls (off this thread).
        self.kv_layout = Layout(
            mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, cc.block_size,
            str(self.kv_dtype).removeprefix("torch."),
            model_fingerprint(self.model_name, mcfg.architecture,
                              str(loaded.dtype).removeprefix("torch."), loaded.source,
                              (mcfg.vocab_size, mcfg.num_layers, mcfg.hidden_size,
                               mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim,
                               mcfg.num_params)))
        self.kv_stats = KVTransferStats()
        self.puller = (KVPuller(config, self.kv_layout, self.runner.kv_caches, self.kv_stats,
                                self._pulled) if kv_spec and kv_spec.is_consumer else None)
        # Prompt tokens by where their keys and values came from (vLLM's sources), counted
        # when a request's prompt is done: computed here, this prefix cache, a KV handoff.
        self.prompt_tokens_by_source = dict.fromkeys(
            ("local_compute", "local_cache_hit", "external_kv_transfer"), 0)
        self._stalled = False  # the last step ran nothing while pulls were under way
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
        # The model's own config: under tensor parallelism a rank's (its KV heads only).
        m, dev, cc = self.loaded.model.config, self.loaded.device, self.config.cache
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

    # ----- KV handoffs (worker/kv_transfer); safe from any thread -----

    def release_pin(self, handle: str, pulled: bool = False) -> bool:
        """End a handoff's pin (pulled, or not needed); its blocks are freed in the engine's
        next step. False when it had ended already."""
        done = self.kv.handoff_pins.release(handle, pulled)
        if done:
            self._inbox.put(("free_pins", None))
            self._wake.set()
        return done

    def kv_fallback(self, req: Request, reason: str, pull: RemotePull | None) -> None:
        """A request's handoff it cannot use: the prompt is computed here, counted and
        logged; the prefill's pin is released when the peer is one this worker trusts."""
        self.kv_stats.fallback(reason)
        log.warning("KV handoff not used (%s) for request %r; computing the prompt here",
                    reason, req.request_id[:64])
        if pull is not None and reason != "untrusted_peer" and self.puller is not None:
            self.puller.release(pull)

    def _pulled(self, req: Request, ok: bool, reason: str) -> None:
        """A pull thread's report (`KVPuller.on_done`): the engine takes it next step."""
        self._inbox.put(("pulled", (req, ok, reason)))
        self._wake.set()

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
                    self._release_handoff(item)
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
                remote = item.remote_kv
                if (remote is not None and remote.state is RemoteKVState.PENDING
                        and self.puller is not None):
                    self.puller.watch(remote.handoff)  # its lease renewed meanwhile
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
            elif kind == "pulled":
                req, ok, reason = item  # type: ignore[misc]
                pull = req.remote_kv.handoff
                if pull.abort_pending:  # aborted during its pull: no thread writes it now
                    for r in self.scheduler.abort_requests([req.request_id]):
                        outputs.append(self._output(r, [], finished=True))
                elif req.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                    self.scheduler.remote_kv_done(req, ok, reason)
            elif kind == "free_pins":
                pass  # freed below, with the expired ones
            else:
                assert isinstance(item, list)
                groups = [g for rid in item if (g := self._groups.get(rid)) is not None]
                ids = list(item) + [f.request_id for g in groups for f in g.followers]
                ids = self._defer_pulling_aborts(ids)
                for req in self.scheduler.abort_requests(ids):
                    self._release_handoff(req)
                    outputs.append(self._output(req, [], finished=True))
                for g in groups:  # followers not forked yet are in no queue
                    for f in g.followers:
                        if not f.is_finished:
                            f.status = RequestStatus.FINISHED_ABORTED
                            outputs.append(self._output(f, [], finished=True))

    def _defer_pulling_aborts(self, ids: list[str]) -> list[str]:
        """Of `ids`, those to abort now: a request whose pull is under way is cancelled and
        ends when its pull thread reports (its blocks are being written)."""
        now = []
        for rid in ids:
            req = self.scheduler.get_request(rid)
            if req is not None and req.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                assert req.remote_kv is not None
                req.remote_kv.handoff.abort_pending = True
                req.remote_kv.handoff.cancel()
            else:
                now.append(rid)
        return now

    def _release_handoff(self, req: Request) -> None:
        """A request that ended before its handoff was pulled lets the prefill free it."""
        remote = req.remote_kv
        if (remote is not None and remote.state in (RemoteKVState.PENDING, RemoteKVState.SKIPPED)
                and self.puller is not None):
            self.puller.release(remote.handoff)

    def has_work(self) -> bool:
        # The inbox counts: a reset or an abort must be answered even when nothing runs.
        return self.scheduler.has_unfinished_requests() or not self._inbox.empty()

    def step(self) -> StepOutput:
        """One iteration: the inbox (adds, aborts, prefix-cache resets), then the step's
        phases (`_run`) when anything is unfinished, then the parallel samples' groups and
        the KV events the step caused. Returns what it produced (possibly nothing), for
        the caller to publish (`_loop`'s `on_step`, or `generate`)."""
        step = StepOutput(self._drain_inbox())
        self._stalled = False
        if self.kv.handoff_pins.num_live or self.kv.handoff_pins.num_ended:
            self.kv.free_pins(time.monotonic())  # pulled, released or past their lease
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
        """The step's phases, in order (each a method below that states its contract):

            schedule -> remote KV (pulls started) -> execute (KV moves, model, sample)
                     -> tally drafts -> advance -> check stops (detokenize, stop strings,
                     grammar) -> finish -> publish

        Every phase after `_execute` runs only when the model step succeeded; a failed one
        has ended its requests (published with the error) and the step stops there."""
        sched = self._schedule(step)
        if sched.remote_kv:
            self._remote_kv(sched.remote_kv)
        if sched.is_empty:
            # Only pulls under way (their reports wake the loop): nothing to spin for.
            self._stalled = bool(self.scheduler.num_pulling)
            return
        sampled = self._execute(sched, step)
        if sampled is None:
            return
        self._tally_drafts(sched, sampled, step)
        updated, new_ids = self._advance(sched, sampled)
        ends = self._check_stops(updated, new_ids, sampled)
        self._finish(ends)
        self._publish(step, updated, new_ids, ends)

    def _schedule(self, step: StepOutput) -> SchedulerOutput:
        """Phase 1: drafts for the requests that decode next (with speculation on), then the
        scheduler's choice of requests and tokens for this step. Preemptions are counted
        here, when made, even if the step then runs nothing."""
        if self.proposer is not None:
            self._propose()
        sched = self.scheduler.schedule()
        step.num_preempted = len(sched.preempted_ids)
        self.num_preemptions += step.num_preempted  # for the metrics, when made
        return sched

    def _execute(self, sched: SchedulerOutput, step: StepOutput) -> dict[str, list[SampleResult]] | None:
        """Phase 2: the runner's one call: the step's KV moves (swap out, swap in, copy),
        the forward pass, and sampling (the C decoder finds greedy rows' tokens in the same
        native call as the layers, so these stay one call). Returns each sampling request's
        results: one, or with drafts the accepted drafts and then the model's own token.

        A call that raises fails the step's requests (and those it swapped out: their CPU
        blocks may be unwritten) with the error in their outputs, and returns None; the
        engine goes on (`max_consecutive_failed_steps`)."""
        try:
            sampled = self.runner.execute(sched)
        except RankLost as e:  # the group cannot run another step: the engine ends (loudly)
            self.lost = str(e)
            raise
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
            step.outputs += [self._output(r, [], finished=True, error=f"model step failed: {e}")
                             for r in reqs]
            return None
        self.num_steps += 1
        self.num_failed_steps = 0
        step.num_batched_tokens = sched.num_batched_tokens
        self.step_tokens[step.num_batched_tokens] = self.step_tokens.get(step.num_batched_tokens, 0) + 1
        return sampled

    def _tally_drafts(self, sched: SchedulerOutput, sampled: dict[str, list[SampleResult]],
                      step: StepOutput) -> None:
        """Phase 3: speculative decoding's figures: drafts verified and accepted, in all and
        per draft position, and this step's in `step`. Nothing without drafts."""
        drafted = sum(len(s.spec_token_ids) for s in sched.scheduled)
        if not drafted:
            return
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

    def _advance(self, sched: SchedulerOutput, sampled: dict[str, list[SampleResult]]
                 ) -> tuple[list[Request], dict[str, list[int]]]:
        """Phase 4: the scheduler takes the sampled tokens (`Scheduler.update_from_output`:
        appended up to a stop token or max_tokens, which finish and free the request;
        followers forked). Returns the requests that got tokens, and by id the tokens each
        got this step (a list the next phase may cut at a stop string)."""
        before = {s.request_id: s.request.num_output_tokens for s in sched.scheduled if s.will_sample}
        updated = self.scheduler.update_from_output(
            sched, {k: [r.token_id for r in v] for k, v in sampled.items()})
        # A follower forked this step had none before.
        return updated, {r.request_id: r.output_token_ids[before.get(r.request_id, 0):] for r in updated}

    def _check_stops(self, updated: list[Request], new_ids: dict[str, list[int]],
                     sampled: dict[str, list[SampleResult]]) -> _Ends:
        """Phase 5: each request's new tokens through its detokenizer (logprobs taken
        along), in order, up to a stop string; else through its grammar. A stop string
        ends the request at the token that completed it: later tokens (accepted drafts)
        are cut from `new_ids` and from the request, as if never sampled. Returns who ends
        how; the scheduler has not been told yet (`_finish`)."""
        ends = _Ends()
        for req in updated:
            ids = new_ids[req.request_id]
            stopped = self._stop_string(req, ids, sampled[req.request_id], ends)
            if not stopped and req.grammar is not None:
                self._accept_grammar(req, ids, ends)
        return ends

    @staticmethod
    def _stop_string(req: Request, ids: list[int], results: list[SampleResult], ends: _Ends) -> bool:
        """Detokenize `ids` (the request's new tokens, the last `len(ids)` of its output);
        True where a stop string ended the request (`ids` and its output then cut)."""
        state = req.output_state
        first = req.num_output_tokens - len(ids)
        for j, token in enumerate(ids):
            if req.sampling_params.logprobs is not None:
                state.pending_logprobs.append(results[j])
            stop = state.add_token(token)
            if stop is None:
                continue
            if req.is_finished and j == len(ids) - 1:
                return True  # its stop token or length ended it at this very token: that stands
            del ids[j + 1 :]
            req.truncate_output(first + j + 1)
            req.stop_reason = stop
            if req.is_finished:  # ended later in the dropped tokens; already released
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                ends.stopped.append(req.request_id)
            return True
        return False

    @staticmethod
    def _accept_grammar(req: Request, ids: list[int], ends: _Ends) -> None:
        """A grammar's request (never drafted: one token here) advances its matcher over
        the token: refused, the request fails (the client's fault when the constraint hit a
        limit); complete, the grammar ends it."""
        assert req.grammar is not None
        if req.is_finished:
            return
        assert len(ids) == 1, "a constrained request got drafts"
        if not req.grammar.accept(ids[0]):
            ends.failed[req.request_id] = f"the grammar refused token {ids[0]}: {req.grammar.error}"
            if req.grammar.over_limit:  # the constraint's doing, not ours
                ends.client_faults.add(req.request_id)
        elif req.grammar.done:
            ends.stopped.append(req.request_id)

    def _finish(self, ends: _Ends) -> None:
        """Phase 6: the scheduler ends what a stop string or grammar stopped, and what a
        grammar failed, freeing their blocks."""
        if ends.stopped:
            self.scheduler.finish_requests(ends.stopped, RequestStatus.FINISHED_STOPPED)
        if ends.failed:
            self.scheduler.finish_requests(list(ends.failed), RequestStatus.FINISHED_ERROR)

    def _publish(self, step: StepOutput, updated: list[Request], new_ids: dict[str, list[int]],
                 ends: _Ends) -> None:
        """Phase 7: one output per request that got tokens (its new tokens and text,
        finished or not, the error if it failed), in the step's order, into `step`."""
        for req in updated:
            rid = req.request_id
            step.outputs.append(self._output(req, new_ids[rid], finished=req.is_finished,
                                             error=ends.failed.get(rid),
                                             refused=rid in ends.client_faults))

    def _remote_kv(self, reqs: list[Request]) -> None:
        """Start the pulls of requests admitted into WAITING_FOR_REMOTE_KV; let the prefill
        free the handoffs the prefix cache here made unneeded."""
        assert self.puller is not None
        for req in reqs:
            remote = req.remote_kv
            assert remote is not None
            if remote.state is RemoteKVState.PULLING:
                self.puller.start(req)
            else:
                assert remote.state is RemoteKVState.SKIPPED
                self.kv_stats.count("num_skipped")
                self.puller.release(remote.handoff)

    def _count_prompt_sources(self, req: Request) -> None:
        """Where the prompt's keys and values came from, once its first token is out."""
        remote = req.remote_kv
        pulled = remote.num_pulled_tokens if remote is not None else 0
        tally = self.prompt_tokens_by_source
        tally["external_kv_transfer"] += pulled
        tally["local_cache_hit"] += req.num_cached_tokens - pulled
        tally["local_compute"] += req.num_prompt_tokens - req.num_cached_tokens

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
        if first and req.sample_index == 0:
            self._count_prompt_sources(req)
        if finished and req.kv_pin_key is not None and error is None and req.finish_reason in (
                "stop", "length"):
            if req.kv_handoff is not None:
                self.kv_stats.count("num_handoffs")
            else:  # its decode worker recomputes the prompt
                self.kv_stats.count("num_handoffs_refused")
                log.warning("no KV handoff for request %r: %d blocks pinned already "
                            "(--kv-transfer-max-pinned-blocks %d)", req.request_id[:64],
                            self.kv.handoff_pins.num_blocks(), self.scheduler.max_pinned_blocks)
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
        if self.puller is not None:
            self.puller.close()
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    def _loop(self, on_step: StepSink, wake_fd: int | None) -> None:
        defer = wake_fd is not None and self.runner.cpu_decoder is not None
        queued = False  # a step handed to on_step whose reader is to be woken at the next call
        unwoken = False  # a step handed to on_step that asked for no wake (yet)
        try:
            while not self._stop:
                if not self.has_work() or self._stalled:
                    # Idle, or only pulls under way: sleep until an inbox item (a request, an
                    # abort, a pull's report) or the next handoff pin's lease end.
                    if queued or unwoken:
                        _wake_reader(wake_fd)
                        queued = unwoken = False
                    self._wake.wait(self._idle_timeout())
                    self._wake.clear()
                    self._stalled = False
                    if self.kv.handoff_pins.num_live:
                        self.kv.free_pins(time.monotonic())
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

    def _idle_timeout(self) -> float | None:
        """How long the idle loop may sleep: until the next handoff pin expires (None:
        until woken); stalled on pulls, a short while (their reports wake it anyway)."""
        expiry = self.kv.handoff_pins.next_expiry()
        timeout = None if expiry is None else max(0.0, expiry - time.monotonic()) + 0.01
        if self._stalled:
            timeout = 0.25 if timeout is None else min(timeout, 0.25)
        return timeout

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
