"""The front door: everything a request meets before the engine, for every wire format.

    adapter (worker.service: ours,       the door                               engine
    worker.vllm_service: vLLM's)
    wire message --translate--> Submission --admit()--> serving? (UNAVAILABLE)
                                                        cheap checks, before any tokenizing
                                                        prompt ids: tokenize / render the
                                                          chat template OFF the event loop
                                                        Request: SamplingParams, the model's
                                                          and the scheduler's checks
                                                        room in the queue? (RESOURCE_EXHAUSTED)
                                                        bridge.open -------------------> inbox
    wire chunks <--translate-- Generation.outputs(): deadline, --max-generation-time-s,
                               cancel -> abort, trace + log lines, engine errors -> status

An adapter only translates: its wire message into a `Submission` (refusing what its wire
format cannot express, reading its proto3 defaults), and `RequestOutput`s into its
response messages. Every limit, every status code and every message below is the same for
both wire formats, and each check is made once: here for the wire's concerns (sizes,
counts, characters, tokenizing), in `SamplingParams` for its own values, in
`Engine.make_request` for the model's (vocabulary, max_model_len), in
`Scheduler.check_request` for the scheduler's.

Hostile input this door turns away, and how:

- sizes: characters are counted before anything is tokenized (--max-prompt-chars), list
  fields by their length before they are read; tokenizing and template rendering run in a
  worker thread (`Tokenizer.encode` releases the GIL), so health checks keep answering;
- error messages quote at most `QUOTE_CHARS` characters of any input (`quote`), and every
  status message is cut to `MAX_STATUS_CHARS`, so no message can outgrow gRPC's metadata;
- special-token strings typed in text or chat content stay text unless the caller sets
  `parse_special_tokens` (a trusted caller: a gateway that rendered the prompt itself);
- extreme sampling values: `SamplingParams` bounds them, the sampler is immune to the rest;
- structured-output constraints: sized before anything else (--max-structured-bytes),
  compiled in the same worker thread (llguidance; a cache keyed by kind and text spares the
  repeats), refused here when they do not compile, quoting a bounded part of the reason.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc

from scheduler.request import (
    MAX_LOGIT_BIAS_TOKENS,
    RemoteKV,
    RemoteKVState,
    Request,
    SamplingParams,
    SamplingParamsError,
)
from worker import telemetry
from worker.bridge import DuplicateRequestError, EngineBridge, RequestStream
from worker.config import WorkerConfig
from worker.kv_transfer import handoff
from worker.kv_transfer.client import RemotePull
from worker.load import Load, snapshot
from worker.lora.adapter import LoraAdapterError
from worker.lora.registry import LoraInfo, LoraInUseError, LoraRegistry, UnknownLoraError
from worker.oneshot_thread import in_oneshot_thread
from worker.outputs import RequestOutput
from worker.structured import Constraint, ConstraintError, Grammar, GrammarCompiler
from worker.tokenizer import Tokenizer

CHAT_ROLES = ("system", "user", "assistant", "tool")
QUOTE_CHARS = 64  # the most of any input an error message quotes
MAX_STATUS_CHARS = 1024  # the longest status message sent
MAX_STOP_TOKEN_IDS = 1024  # a stop set the size of a small vocabulary; more is a mistake or an attack
# Shorter inputs are tokenized on the loop: a thread hop costs more than they do.
_INLINE_CHARS = 8192


class InvalidArgument(ValueError):
    """Bad input; the message names the field and the limit."""


def quote(text: str, limit: int = QUOTE_CHARS) -> str:
    """`text` for an error message: repr'd, at most `limit` characters of it."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str,
                trailing_metadata: Sequence[tuple[str, str]] = ()) -> NoReturn:
    """End the RPC with `code`; the message is cut to `MAX_STATUS_CHARS`."""
    if len(message) > MAX_STATUS_CHARS:
        message = message[: MAX_STATUS_CHARS - 3] + "..."
    await context.abort(code, message, trailing_metadata=tuple(trailing_metadata))
    raise AssertionError("unreachable: context.abort raises")


@dataclass(frozen=True)
class FieldNames:
    """How a wire format names the fields the door's messages mention."""

    request_id: str = "request_id"
    input: str = "input (text, chat or token_ids)"
    text: str = "text"
    messages: str = "chat.messages"
    token_ids: str = "token_ids.ids"
    stop: str = "stopping.stop"
    max_tokens: str = "stopping.max_tokens"
    truncate_prompt_tokens: str = "truncate_prompt_tokens"
    lora: str = "lora_name"
    cache_salt: str = "cache_salt"
    # SamplingParams' field -> the wire's name for it, where they differ.
    sampling: Mapping[str, str] = field(default_factory=dict)
    # Constraint kind (worker.structured.KINDS) -> the wire's field that carries it.
    constraint: Mapping[str, str] = field(default_factory=lambda: {
        "json_schema": "json_schema", "json_object": "json_object", "regex": "regex",
        "choice": "choice.choices", "grammar": "grammar.text", "lark": "grammar.text",
        "gbnf": "grammar.text", "structural_tag": "structural_tag"})


@dataclass
class Submission:
    """One generation request as the door takes it, whatever the wire format. Exactly one
    of `text`, `messages`, `token_ids` is set (None = not sent)."""

    request_id: str = ""
    text: str | None = None
    messages: Sequence[Any] | None = None  # items with .role and .content (str)
    token_ids: Sequence[int] | None = None
    parse_special_tokens: bool = False  # special strings typed in text/content are tokens
    max_tokens: int = 0  # 0 = --default-max-tokens, clipped to what fits
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1 = all that fit
    priority: int = 0
    cache_salt: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields
    constraint: Constraint | None = None  # structured output; None = unconstrained
    lora_name: str | None = None  # a loaded LoRA adapter; None = the base model
    # Prefill/decode disaggregation (worker.kv_transfer.handoff): the JSON as sent.
    kv_transfer_params_json: str | None = None
    names: FieldNames = field(default_factory=FieldNames)

    @property
    def kind(self) -> str | None:
        sent = [k for k in ("text", "messages", "token_ids") if getattr(self, k) is not None]
        return sent[0] if len(sent) == 1 else None

    @property
    def stop(self) -> Sequence[str]:
        return self.sampling.get("stop", ())


@dataclass(frozen=True)
class ModelInfo:
    """What the adapters report about the served model; read once at attach."""

    name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    max_prompt_tokens: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    dtype: str
    device: str
    block_size: int
    source: str  # gguf | safetensors | dummy
    num_parameters: int
    max_num_seqs: int
    has_tokenizer: bool


@dataclass(frozen=True)
class Status:
    """Counters for the status RPCs (plain reads, never waiting on the engine)."""

    uptime_s: float
    requests_by_finish_reason: dict[str, int]
    num_preemptions: int
    prefix_cache_hit_tokens: int
    num_steps: int
    num_in_flight: int
    draining: bool
    spec_draft_tokens: int = 0  # speculative decoding since ready (after the warm-up)
    spec_accepted_tokens: int = 0
    # Since ready: prompt tokens by the source of their keys and values (Engine's tally).
    prompt_tokens_by_source: dict[str, int] = field(default_factory=dict)


class Door:
    """The one front door. Serves before the engine exists (generation is UNAVAILABLE,
    status answers); `attach` hands it the running bridge."""

    def __init__(self, config: WorkerConfig,
                 on_drain: Callable[[], Awaitable[None]] | None = None) -> None:
        self.config = config
        self.sc = config.server
        self.on_drain = on_drain  # e.g. health NOT_SERVING
        self.bridge: EngineBridge | None = None
        self._spec_base = (0, 0)  # the engine's speculation counters when it became ready
        self._sources_base: dict[str, int] = {}
        self.model: ModelInfo | None = None
        self.grammars: GrammarCompiler | None = None  # with a tokenizer, at attach
        self.draining = False
        self.started_at = time.monotonic()
        self.last_receive = 0.0  # wall time of the last generation request
        # Tokenizing and template rendering run here, never on the loop; one core is left
        # to the loop and gRPC so that health answers while big prompts are tokenized.
        self._prep = ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0)) - 1),
                                        thread_name_prefix="door-prep")

    def attach(self, bridge: EngineBridge) -> None:
        self.bridge = bridge
        engine = bridge.engine
        # What the warm-up drafted is left out, as the Prometheus counters leave it out.
        self._spec_base = (engine.num_draft_tokens, engine.num_accepted_tokens)
        self._sources_base = dict(engine.prompt_tokens_by_source)  # the warm-up's
        loaded, tok = engine.loaded, engine.tokenizer
        self.model = ModelInfo(
            name=engine.model_name, architecture=loaded.config.architecture,
            vocab_size=loaded.config.vocab_size, max_model_len=engine.max_model_len,
            max_prompt_tokens=self.max_prompt_tokens(engine.max_model_len),
            eos_token_ids=tuple(loaded.eos_token_ids),
            bos_token_id=tok.bos_token_id if tok else None,
            pad_token_id=tok.pad_token_id if tok else None,
            dtype=str(loaded.dtype).removeprefix("torch."), device=str(loaded.device),
            block_size=engine.kv.block_size, source=loaded.source,
            num_parameters=loaded.config.num_params,
            max_num_seqs=self.config.scheduler.max_num_seqs, has_tokenizer=tok is not None)
        if tok is not None:
            self.grammars = GrammarCompiler(tok, loaded.config.vocab_size, loaded.eos_token_ids)

    def max_prompt_tokens(self, max_model_len: int) -> int:
        return self.sc.max_prompt_tokens or max_model_len

    def max_prompt_chars(self, max_model_len: int) -> int:
        """--max-prompt-chars, or by default 32 characters per allowed prompt token (no
        real prompt averages that many; a longer one is refused before tokenizing)."""
        return self.sc.max_prompt_chars or 32 * self.max_prompt_tokens(max_model_len)

    # ----- state -----

    async def start_draining(self) -> int:
        """Stop taking new generations; returns the requests in flight."""
        if not self.draining:
            self.draining = True
            if self.on_drain is not None:
                await self.on_drain()
        return self.bridge.num_in_flight if self.bridge else 0

    def health(self) -> tuple[bool, str]:
        """(serving, why not): serving exactly when a running engine is attached and the
        worker is not draining."""
        bridge = self.bridge
        if bridge is None:
            return False, "the model is still loading"
        if bridge.dead or bridge.closed:
            return False, "the engine is not running"
        if self.draining:
            return False, "the worker is draining"
        return True, "serving"

    async def engine(self, context: grpc.aio.ServicerContext) -> EngineBridge:
        """The running bridge, for admin calls: UNAVAILABLE while loading or when dead."""
        bridge = self.bridge
        if bridge is None:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        if bridge.dead or bridge.closed:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "the engine is not running")
        return bridge

    async def serving(self, context: grpc.aio.ServicerContext) -> EngineBridge:
        """The bridge, for new work: UNAVAILABLE while loading, draining or dead."""
        bridge = await self.engine(context)
        if self.draining:
            await abort(context, grpc.StatusCode.UNAVAILABLE,
                        "the worker is draining; send the request to another replica")
        return bridge

    def load(self) -> Load:
        assert self.bridge is not None
        return snapshot(self.bridge)

    def status(self) -> Status:
        bridge = self.bridge
        return Status(
            uptime_s=time.monotonic() - self.started_at,
            requests_by_finish_reason=dict(bridge.finish_counts) if bridge else {},
            num_preemptions=bridge.num_preemptions if bridge else 0,
            prefix_cache_hit_tokens=bridge.engine.kv.stats.num_hit_tokens if bridge else 0,
            num_steps=bridge.engine.num_steps if bridge else 0,
            num_in_flight=bridge.num_in_flight if bridge else 0,
            draining=self.draining,
            spec_draft_tokens=bridge.engine.num_draft_tokens - self._spec_base[0] if bridge else 0,
            spec_accepted_tokens=bridge.engine.num_accepted_tokens - self._spec_base[1] if bridge else 0,
            prompt_tokens_by_source={
                k: v - self._sources_base.get(k, 0)
                for k, v in bridge.engine.prompt_tokens_by_source.copy().items()} if bridge else {})

    async def abort_requests(self, context: grpc.aio.ServicerContext,
                             request_ids: Sequence[str]) -> list[str]:
        """Abort those in flight (blocks freed next step; the ids free at once)."""
        bridge = await self.engine(context)
        return [rid for rid in request_ids if bridge.abort(rid)]

    async def reset_prefix_cache(self, context: grpc.aio.ServicerContext, requeue: bool):
        bridge = await self.engine(context)
        return await asyncio.wrap_future(bridge.engine.reset_prefix_cache(requeue))

    def tokenizer(self) -> Tokenizer | None:
        return self.bridge.engine.tokenizer if self.bridge else None

    # ----- admission -----

    async def admit(self, context: grpc.aio.ServicerContext, sub: Submission) -> Generation:
        """Check, tokenize and queue one request; the RPC ends here with the status that
        says why when it cannot be taken."""
        bridge = await self.serving(context)
        self.last_receive = time.time()
        try:
            req = await self._build(sub, bridge)
        except ValueError as e:  # ours, SamplingParams', make_request's, the tokenizer's
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        waiting = bridge.num_waiting
        if waiting >= self.sc.max_waiting:
            pushback = str(self.sc.retry_after_ms)
            await abort(
                context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the waiting queue is full ({waiting} requests, --max-waiting "
                f"{self.sc.max_waiting}); retry later or on another replica",
                # gRPC's own retry design (gRFC A6) reads the first; ours and SMG the second.
                (("grpc-retry-pushback-ms", pushback), ("retry-after-ms", pushback)))
        try:
            stream = bridge.open(req)
        except DuplicateRequestError as e:
            await abort(context, grpc.StatusCode.ALREADY_EXISTS, str(e))
        except RuntimeError as e:
            await abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        return Generation(self, context, bridge, req, stream, sub)

    async def _build(self, sub: Submission, bridge: EngineBridge) -> Request:
        """The Request for `sub`; raises ValueError naming the field and the limit."""
        engine = bridge.engine
        self._check(sub, engine.max_model_len)
        ids = await self._prompt_ids(sub, engine.tokenizer, engine.model_name)
        n = sub.names
        max_prompt = self.max_prompt_tokens(engine.max_model_len)
        if sub.truncate_prompt_tokens is not None:
            k = sub.truncate_prompt_tokens
            if k == -1:  # as many as leave room for max_tokens (for the default, one token)
                k = max(1, min(max_prompt, engine.max_model_len - max(sub.max_tokens, 1)))
            elif k < 1:
                raise InvalidArgument(f"{n.truncate_prompt_tokens} must be >= 1 or -1, got {k}")
            ids = ids[-k:]
        if len(ids) > max_prompt:
            raise InvalidArgument(f"the prompt is {len(ids)} tokens; at most {max_prompt} are "
                                  f"allowed ({self._prompt_limit_flag})")
        max_tokens = sub.max_tokens
        if max_tokens == 0:  # the default, clipped to what fits
            max_tokens = min(self.sc.default_max_tokens, engine.max_model_len - len(ids))
            if max_tokens < 1:
                raise InvalidArgument(f"the prompt ({len(ids)} tokens) leaves no room for "
                                      f"output in max_model_len ({engine.max_model_len})")
        elif max_tokens < 0:
            raise InvalidArgument(f"{n.max_tokens} must be >= 1, got {max_tokens}")
        try:
            params = SamplingParams(max_tokens=max_tokens, **sub.sampling)
        except SamplingParamsError as e:  # said in the wire's names
            raise InvalidArgument(f"{n.sampling.get(e.field, e.field)} {e.problem}") from None
        seats = self.config.scheduler.max_num_seqs
        if params.n > seats:  # the samples run side by side, each in a seat of its own
            raise InvalidArgument(f"{n.sampling.get('n', 'n')} is {params.n}; at most "
                                  f"{seats} are allowed (--max-num-seqs)")
        if sub.lora_name:
            await self._warm_lora(sub, engine.loras)
        try:
            req = engine.make_request(ids, params, request_id=sub.request_id or uuid.uuid4().hex,
                                      priority=sub.priority, cache_salt=sub.cache_salt or None,
                                      lora_name=sub.lora_name or None)
        except SamplingParamsError as e:  # a token id out of the vocabulary
            raise InvalidArgument(f"{n.sampling.get(e.field, e.field)} {e.problem}") from None
        if sub.kv_transfer_params_json is not None:
            self._kv_transfer(sub.kv_transfer_params_json, req, engine)
        if sub.constraint is not None:  # last: the cheap checks came first
            req.grammar = (await self._grammar(sub, sub.constraint, engine.model_name)).matcher()
        return req

    def _kv_transfer(self, text: str, req: Request, engine: Any) -> None:
        """Tag `req` as a handoff's prefill leg (its blocks pinned when it finishes) or give
        it the handoff to pull as its decode leg; a handoff this worker cannot use (not
        ours, a peer not trusted, another model or layout, n > 1, prompt logprobs) leaves
        the prompt to be computed here, counted and logged by reason."""
        kc = self.config.kv_transfer
        spec = kc.kv_transfer_config
        if spec is None:  # sent to a worker that cannot honour it: refused, never ignored
            raise InvalidArgument(f"{handoff.FIELD} is not supported: this worker does no KV "
                                  "transfer (start it with --kv-transfer-config)")
        bs = engine.kv.block_size
        params = handoff.parse(text, max_blocks=-(-engine.max_model_len // bs))
        p = req.sampling_params
        if params.remote_decode:
            if not spec.is_producer:
                raise InvalidArgument(f"{handoff.FIELD}: do_remote_decode on a worker that "
                                      "makes no KV handoffs (start it with --kv-transfer-config "
                                      "kv_role kv_producer or kv_both)")
            if p.n == 1:  # as SMG: with n > 1 nothing is handed over
                req.kv_pin_key = handoff.prompt_digest(req.prompt_token_ids, req.lora_name)
            return
        if params.handoff is None and not params.foreign:
            return  # neither leg: a plain request
        if not spec.is_consumer:
            raise InvalidArgument(f"{handoff.FIELD}: do_remote_prefill on a worker that pulls "
                                  "no KV (start it with --kv-transfer-config kv_role "
                                  "kv_consumer or kv_both)")
        h = params.handoff
        reason = params.foreign or ("n" if p.n > 1 else "") or (
            "prompt_logprobs" if p.prompt_logprobs is not None else "")
        if not reason and h is not None:
            reason = handoff.usable(h, engine.kv_layout, req.num_prompt_tokens,
                                    kc.kv_transfer_peers) or ""
        assert h is not None or reason
        pull = (None if h is None else
                RemotePull(h, handoff.prompt_digest(req.prompt_token_ids, req.lora_name)))
        req.remote_kv = RemoteKV(req.num_prompt_tokens, pull)
        if reason:  # kept on the request, failed, for its span
            req.remote_kv.state, req.remote_kv.reason = RemoteKVState.FAILED, reason
            engine.kv_fallback(req, reason, pull)

    async def _warm_lora(self, sub: Submission, loras: LoraRegistry | None) -> None:
        """Check the named adapter is loaded, and have its weights in host memory (read
        again from disk, off the loop, when the LRU dropped them)."""
        name = sub.lora_name or ""
        if loras is None:
            raise InvalidArgument(f"{sub.names.lora} {quote(name)}: this worker serves no LoRA "
                                  "adapters (start it with --enable-lora)")
        try:
            loras.key(name)  # an unknown one raises, naming it and the loaded ones
            await asyncio.get_running_loop().run_in_executor(self._prep, loras.warm, name)
        except UnknownLoraError as e:
            raise InvalidArgument(f"{sub.names.lora}: {e}") from None
        except LoraAdapterError as e:  # its folder changed since it was loaded
            raise InvalidArgument(f"{sub.names.lora}: {e}") from None

    # ----- LoRA adapters (admin) -----

    async def loras(self, context: grpc.aio.ServicerContext) -> LoraRegistry:
        bridge = await self.engine(context)
        loras = bridge.engine.loras
        if loras is None:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        "LoRA adapters are off; start the worker with --enable-lora")
        return loras

    async def load_lora(self, context: grpc.aio.ServicerContext, name: str, path: str) -> LoraInfo:
        """Read and check the adapter off the loop; INVALID_ARGUMENT when it cannot be
        served, ALREADY_EXISTS when the name is taken."""
        loras = await self.loras(context)
        if name in loras.names:
            await abort(context, grpc.StatusCode.ALREADY_EXISTS,
                        f"LoRA adapter {quote(name)} is already loaded; unload it first")
        try:
            # Torch work: in a thread that ends, as the engine's build (worker.oneshot_thread).
            return await in_oneshot_thread(loras.load, name, path, thread_name="lora-load")
        except ValueError as e:  # LoraAdapterError, a bad name, or loaded meanwhile
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def unload_lora(self, context: grpc.aio.ServicerContext, name: str) -> None:
        loras = await self.loras(context)
        try:
            loras.unload(name)
        except UnknownLoraError as e:
            await abort(context, grpc.StatusCode.NOT_FOUND, str(e))
        except LoraInUseError as e:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))

    async def _grammar(self, sub: Submission, constraint: Constraint, model: str) -> Grammar:
        """The compiled constraint: from the cache, or compiled in the door's worker thread
        (other requests and health checks go on meanwhile)."""
        what = sub.names.constraint[constraint.kind]
        grammars = self.grammars
        if grammars is None:
            raise InvalidArgument(f"{what} needs a tokenizer; model {model} has none")
        grammar = grammars.cached(constraint)
        if grammar is not None:
            return grammar
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._prep, grammars.compile, constraint)
        except ConstraintError as e:
            raise InvalidArgument(f"{what} {e.problem}") from None

    @property
    def _prompt_limit_flag(self) -> str:
        return "--max-prompt-tokens" if self.sc.max_prompt_tokens else "max_model_len"

    def _check(self, sub: Submission, max_model_len: int) -> None:
        """The cheap checks, made before anything is tokenized or copied."""
        sc, n = self.sc, sub.names
        if len(sub.request_id) > sc.max_request_id_len:
            raise InvalidArgument(f"{n.request_id} is {len(sub.request_id)} characters; at "
                                  f"most {sc.max_request_id_len} are allowed")
        # A parallel sample's id is its leader's, a NUL and its index (scheduler.sample_group):
        # "x\x001" sent beside "x" with n > 1 was one id for two requests, and killed the
        # engine thread. Control characters have no place in an id that logs carry anyway.
        bad = next((i for i, c in enumerate(sub.request_id) if c < " " or c == "\x7f"), None)
        if bad is not None:
            raise InvalidArgument(f"{n.request_id} holds a control character "
                                  f"(U+{ord(sub.request_id[bad]):04X}) at index {bad}")
        # Unbounded, a salt was kept in every block event of the KV-event history (1024
        # steps' batches, subscribers or none) and sent in each: megabytes a request.
        if sub.cache_salt and len(sub.cache_salt) > sc.max_cache_salt_len:
            raise InvalidArgument(f"{n.cache_salt} is {len(sub.cache_salt)} characters; at "
                                  f"most {sc.max_cache_salt_len} are allowed (--max-cache-salt-len)")
        stops = sub.stop
        if len(stops) > sc.max_stop_strings:
            raise InvalidArgument(f"{n.stop} has {len(stops)} strings; at most "
                                  f"{sc.max_stop_strings} are allowed (--max-stop-strings)")
        for i, s in enumerate(stops):
            if not s:
                raise InvalidArgument(f"{n.stop}[{i}] is empty")
            if len(s) > sc.max_stop_len:
                raise InvalidArgument(f"{n.stop}[{i}] is {len(s)} characters; at most "
                                      f"{sc.max_stop_len} are allowed (--max-stop-len)")
        stop_ids = sub.sampling.get("stop_token_ids", ())
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(f"stop_token_ids has {len(stop_ids)} ids; at most "
                                  f"{MAX_STOP_TOKEN_IDS} are allowed")
        bias = sub.sampling.get("logit_bias", ())
        if len(bias) > MAX_LOGIT_BIAS_TOKENS:  # counted before SamplingParams sorts it
            raise InvalidArgument(f"{n.sampling.get('logit_bias', 'logit_bias')} has "
                                  f"{len(bias)} tokens; at most {MAX_LOGIT_BIAS_TOKENS} are "
                                  "allowed")
        c = sub.constraint
        if c is not None and c.num_bytes > sc.max_structured_bytes:
            raise InvalidArgument(f"{n.constraint[c.kind]} is {c.num_bytes} bytes; at most "
                                  f"{sc.max_structured_bytes} are allowed "
                                  "(--max-structured-bytes)")
        kind = sub.kind
        if kind is None:
            raise InvalidArgument(f"{n.input} is missing: set exactly one")
        max_chars = self.max_prompt_chars(max_model_len)
        if kind == "token_ids":
            assert sub.token_ids is not None
            if not sub.token_ids:
                raise InvalidArgument(f"{n.token_ids} is empty")
            max_prompt = self.max_prompt_tokens(max_model_len)
            # Counted before it is copied (truncation, if asked, may shorten a longer one).
            if len(sub.token_ids) > max_prompt and sub.truncate_prompt_tokens is None:
                raise InvalidArgument(f"{n.token_ids} has {len(sub.token_ids)} tokens; at most "
                                      f"{max_prompt} are allowed ({self._prompt_limit_flag})")
        elif kind == "text":
            assert sub.text is not None
            if not sub.text:
                raise InvalidArgument(f"{n.text} is empty")
            if len(sub.text) > max_chars:
                raise InvalidArgument(f"{n.text} is {len(sub.text)} characters; at most "
                                      f"{max_chars} are allowed (--max-prompt-chars)")
        else:
            messages = sub.messages
            assert messages is not None
            if not messages:
                raise InvalidArgument(f"{n.messages} is empty")
            if len(messages) > sc.max_chat_messages:
                raise InvalidArgument(f"{n.messages} has {len(messages)} messages; at most "
                                      f"{sc.max_chat_messages} are allowed (--max-chat-messages)")
            chars = 0
            for i, m in enumerate(messages):
                if m.role not in CHAT_ROLES:
                    raise InvalidArgument(f"{n.messages}[{i}].role {quote(m.role)} is unknown; "
                                          f"allowed: {', '.join(CHAT_ROLES)}")
                chars += len(m.content)
            if chars > max_chars:
                raise InvalidArgument(f"{n.messages} hold {chars} characters of content; at "
                                      f"most {max_chars} are allowed (--max-prompt-chars)")

    async def _prompt_ids(self, sub: Submission, tok: Tokenizer | None, model: str) -> list[int]:
        kind = sub.kind
        if kind == "token_ids":
            return list(sub.token_ids or ())  # make_request checks the vocabulary
        if tok is None:
            what = sub.names.text if kind == "text" else sub.names.messages
            raise InvalidArgument(f"{what} needs a tokenizer; model {model} has none "
                                  f"(send {sub.names.token_ids})")
        special = sub.parse_special_tokens
        if kind == "text":
            text = sub.text or ""
            # Raw text gets a BOS only where the model's tokenizer adds one.
            work = lambda: tok.encode(text, add_special_tokens=True,  # noqa: E731
                                      parse_special_tokens=special)
            size = len(text)
        else:
            messages = [{"role": m.role, "content": m.content} for m in sub.messages or ()]
            work = lambda: tok.encode_chat(messages, parse_special_tokens=special)  # noqa: E731
            size = sum(len(m["content"]) for m in messages)
        if size <= _INLINE_CHARS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._prep, work)


class Generation:
    """One admitted request's way out: its outputs as the engine publishes them, ending
    with the finished one. Iterate `outputs()` under `contextlib.aclosing` so that an early
    close (cancel, disconnect, a failed write) aborts the request at once."""

    def __init__(self, door: Door, context: grpc.aio.ServicerContext, bridge: EngineBridge,
                 request: Request, stream: RequestStream, sub: Submission) -> None:
        self.door = door
        self.context = context
        self.bridge = bridge
        self.request = request
        self.stream = stream
        self.sub = sub

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def wants_logprobs(self) -> bool:
        return self.request.sampling_params.logprobs is not None

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The request's outputs (coalesced when the reader is slow), traced and logged;
        with n > 1, each sample's (`RequestOutput.index`), ending after the last sample's
        finished one.
        Enforces the client's deadline (DEADLINE_EXCEEDED) and --max-generation-time-s (the
        request ends through the abort path, reported as finish reason length). A request
        the engine failed ends the RPC with INTERNAL (UNAVAILABLE when the worker shut down
        under it) after the chunks already sent; no finished output with reason "error" is
        ever yielded."""
        context, bridge, req, stream = self.context, self.bridge, self.request, self.stream
        rid = req.request_id
        p = req.sampling_params
        sc = self.door.sc
        record = sc.trace_content
        sub = self.sub
        chat = sub.kind == "messages"
        gen = telemetry.GenerationTrace(
            bridge.engine.model_name, rid, max_tokens=p.max_tokens, temperature=p.temperature,
            top_p=p.top_p, top_k=p.top_k, seed=p.seed, priority=req.priority,
            frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
            stop_sequences=p.stop or None, stream=True, record_content=record,
            operation=(telemetry.GenerationTrace.CHAT if chat
                       else telemetry.GenerationTrace.TEXT_COMPLETION),
            input_messages=sub.messages if record and chat else None,
            prompt=sub.text if record else None, lora_name=req.lora_name)
        gen.event("queued", timestamp_s=telemetry.monotonic_to_wall(req.arrival_time),
                  prompt_tokens=req.num_prompt_tokens)
        logger = telemetry.bind_request(
            rid, gen.span, **({"lora_name": req.lora_name} if req.lora_name else {}))
        text: list[str] = []
        loop = asyncio.get_running_loop()
        remaining = context.time_remaining()
        deadline = None if remaining is None else loop.time() + remaining
        limit_s = sc.max_generation_time_s
        # Counted from arrival (req.arrival_time is time.monotonic(); loop.time() need not be).
        expires = (None if limit_s <= 0
                   else loop.time() + limit_s - (time.monotonic() - req.arrival_time))
        done = False
        unfinished = stream.num_samples  # samples whose finished output is still to come
        first = True
        preemptions = 0  # the engine thread bumps req.num_preemptions; reading an int is safe
        # One timer for the nearest of the two limits, rescheduled only when that changes
        # (an asyncio.timeout around every output cost a timer a token: ~14% of the event
        # loop's Python time a token, served); it wakes the stream, whose `next` gives None.
        timer: asyncio.TimerHandle | None = None
        timer_at: float | None = None
        try:
            while True:
                if expires is not None and loop.time() >= expires:
                    # Past --max-generation-time-s: ended through the abort path (blocks
                    # freed in the next step); the stream still ends with complete(LENGTH).
                    bridge.expire(rid)
                    expires = None
                    logger.info("request ended", reason="max-generation-time-s", limit_s=limit_s)
                wake = min((t for t in (deadline, expires) if t is not None), default=None)
                if wake != timer_at:
                    if timer is not None:
                        timer.cancel()
                    timer = None if wake is None else loop.call_at(wake, stream.wake)
                    timer_at = wake
                out = await stream.next()
                if out is None:  # the timer: a limit passed, or nearly (the loop's clock)
                    timer_at = None  # spent: set again at the top if still needed
                    if deadline is not None and loop.time() >= deadline:
                        bridge.abort(rid)
                        await abort(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"request {quote(rid)}: the deadline passed after "
                                    f"{req.num_output_tokens} tokens; it was aborted")
                    continue  # the generation-time limit: expired at the top
                if req.num_preemptions > preemptions:
                    # Seen late (at the next output), so back-dating is not possible; the
                    # event still says it happened and how often.
                    preemptions = req.num_preemptions
                    gen.event("preempted", count=preemptions)
                    if out.new_token_ids:
                        gen.event("resumed")
                if first and out.new_token_ids:
                    first = False
                    if req.first_scheduled_time is not None:
                        gen.event("scheduled",
                                  timestamp_s=telemetry.monotonic_to_wall(req.first_scheduled_time))
                    if req.remote_kv is not None:
                        _pull_events(gen, req.remote_kv)
                    gen.event("first_token")
                if record:
                    text.append(out.new_text)
                if out.finished:
                    unfinished -= 1
                    failed = out.finish_reason == "error"
                    if failed and unfinished:  # the RPC fails: the other samples end too
                        bridge.abort(rid)
                    done = failed or not unfinished
                    if done:
                        _finished(gen, logger, rid, out, "".join(text) if record else None)
                    if failed:
                        await self._fail(out)
                yield out
                if done:
                    return
        finally:
            if timer is not None:
                timer.cancel()
            # Cancelled, disconnected (GeneratorExit), past its deadline or failed: free the
            # blocks in the engine's next step.
            if not done:
                bridge.abort(rid)
                gen.finish("abort", req.num_prompt_tokens, req.num_output_tokens)
                logger.info("request aborted", reason="cancelled, disconnected or deadline")

    async def _fail(self, out: RequestOutput) -> NoReturn:
        """INTERNAL for a fault (a model step raised, the engine thread died), UNAVAILABLE
        when the worker shut down under the request or lost a tensor-parallel rank (another
        replica can serve it),
        INVALID_ARGUMENT when what it asked for failed it (`RequestOutput.refused`)."""
        if out.refused:
            what = (f"failed after {out.completion_tokens} tokens" if out.completion_tokens
                    else "refused")
            await abort(self.context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"request {quote(self.request_id)} {what}: {out.error}")
        bridge = self.bridge
        shut_down = (bridge.closed and not bridge.dead) or getattr(bridge, "unavailable", False)
        code = grpc.StatusCode.UNAVAILABLE if shut_down else grpc.StatusCode.INTERNAL
        await abort(self.context, code,
                    f"request {quote(self.request_id)} failed after {out.completion_tokens} "
                    f"tokens: {out.error or 'engine error'}")


def _ms(seconds: float | None) -> float:
    return 0.0 if seconds is None else seconds * 1000.0


def _pull_events(gen: telemetry.GenerationTrace, remote: RemoteKV) -> None:
    """The KV handoff's pull on the request's span: when it ran, what it moved, or why the
    prompt was computed here instead (events back-dated to when they happened)."""
    pull: RemotePull | None = remote.handoff
    if pull is not None and pull.started_at is not None:
        gen.event("kv_pull_started", timestamp_s=telemetry.monotonic_to_wall(pull.started_at),
                  peer=pull.handoff.address, blocks=len(remote.block_ids),
                  local_prefix_tokens=remote.num_local_tokens)
    attrs: dict[str, Any] = {"outcome": remote.state.name.lower(),
                             "tokens": remote.num_pulled_tokens}
    if remote.reason:
        attrs["reason"] = remote.reason
    ended = pull.ended_at if pull is not None else None
    if pull is not None:
        attrs["bytes"] = pull.num_bytes
    gen.event("kv_pull_ended", timestamp_s=(telemetry.monotonic_to_wall(ended)
                                            if ended is not None else None), **attrs)


def _finished(gen: telemetry.GenerationTrace, logger: Any, rid: str, out: RequestOutput,
              text: str | None) -> None:
    reason = out.finish_reason or "error"
    gen.finish(reason, out.prompt_tokens, out.completion_tokens, output_text=text,
               error=out.error, cached_tokens=out.cached_tokens,
               queue_time_ms=_ms(out.queue_time_s), ttft_ms=_ms(out.ttft_s))
    telemetry.log_request_summary(
        logger, request_id=rid, finish_reason=reason, prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
        queue_time_ms=_ms(out.queue_time_s), ttft_ms=_ms(out.ttft_s),
        total_time_ms=_ms(out.total_time_s))


