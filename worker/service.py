"""`llmworker.v1.WorkerService` over the one engine, through the `EngineBridge`.

A thin adapter: validate every field at the door, translate to a `Request`, stream the
engine's outputs back. Status codes:

==========================  =========================================================
INVALID_ARGUMENT            bad input; the message names the field and the limit (no
                            input, empty text/chat/token ids, unknown chat role, more
                            chat messages than --max-chat-messages, token id out of
                            vocabulary, more prompt tokens than --max-prompt-tokens,
                            prompt + max_tokens over max_model_len, any sampling value
                            out of range, too many or too long stop strings,
                            top_logprobs > 20, request_id too long, text or chat sent to
                            a model without a tokenizer)
ALREADY_EXISTS              a request_id that is still in flight
RESOURCE_EXHAUSTED          the waiting queue is at --max-waiting; trailing metadata
                            ``retry-after-ms`` says when to try again. Also (from gRPC
                            itself, before any of our code runs) a message larger than
                            --max-message-bytes
UNAVAILABLE                 the model is still loading, the worker is draining, the
                            engine thread died, or the worker shut down under a request
DEADLINE_EXCEEDED           the client's deadline passed; the request is aborted
CANCELLED                   (the client's own) a cancel or disconnect aborts the request
INTERNAL                    the request failed inside the engine (an exception in a model
                            step; the engine thread dying under it): the stream ends
                            with this status and a message, after whatever chunks it
                            already sent. No ``complete`` is sent: a stream either ends
                            OK after ``complete`` or with a non-OK status
==========================  =========================================================

(``FINISH_REASON_ERROR`` is still in the proto, and `complete_response` still maps it, but
Generate no longer sends a ``complete`` with it: engine errors are the INTERNAL status.)

--max-generation-time-s: a request still in flight that long after it arrived (queue time
counts) is ended through the abort path (`EngineBridge.expire`): its KV blocks are freed in
the engine's next step and the stream ends OK with its last chunk and ``complete`` with
finish_reason LENGTH (usage counts what it generated). It is checked whenever the stream
waits for or sends output, so a slow reader cannot dodge it.

Any abort (Abort RPC, cancel, disconnect, deadline, generation-time limit) frees the
request's KV blocks in the engine's next step. `Generate` sends at most one chunk per engine
step, and per stream at most one output is buffered (a slow reader gets coalesced chunks,
see `worker.bridge`); the step that finishes a request sends its last chunk and then
`complete`.

The door (`check_door`, `build_request`), admission (`serving`, `open_stream`) and the
output stream (`follow`) are shared with the vLLM protocol's adapter (`worker.vllm_service`),
so both wire formats check the same limits and end requests the same way.

Text input is tokenized as is (BOS prepended only when the model's tokenizer adds one to
plain text); chat input is rendered with the model's chat template and a generation prompt.
Admin RPCs read plain counters and never wait on the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import logging
import platform
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import google.protobuf
import grpc
import torch
from llmworker.v1 import worker_pb2 as pb
from llmworker.v1 import worker_pb2_grpc

from scheduler.request import MAX_LOGPROBS, Request, SamplingParams
from worker import telemetry
from worker.bridge import DuplicateRequestError, EngineBridge, RequestStream
from worker.config import ServerConfig, WorkerConfig
from worker.engine import Engine
from worker.load import snapshot
from worker.outputs import RequestOutput
from worker.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name
CHAT_ROLES = ("system", "user", "assistant", "tool")
FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}
_LONG_TEXT = 8192  # characters; longer inputs are tokenized off the event loop


class InvalidArgument(ValueError):
    pass


def traced(handler):
    """A server span per unary RPC, joining the caller's W3C trace context."""
    method = f"/{SERVICE_NAME}/{handler.__name__}"

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        with telemetry.rpc_span(method, context.invocation_metadata(), context=context):
            return await handler(self, request, context)

    return wrapper


def _versions() -> dict[str, str]:
    try:
        ours = importlib.metadata.version("llm-worker")
    except importlib.metadata.PackageNotFoundError:
        ours = "unknown"
    return {
        "llm-worker": ours,
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "protobuf": google.protobuf.__version__,
        "python": platform.python_version(),
    }


def _ms(seconds: float | None) -> float:
    return 0.0 if seconds is None else seconds * 1000.0


def chunk_response(rid: str, out: RequestOutput, logprobs: bool) -> pb.GenerateResponse:
    chunk = pb.GenerateChunk(text=out.new_text, token_ids=out.new_token_ids)
    if logprobs and out.logprobs:
        chunk.logprobs.extend(
            pb.TokenLogprob(
                token_id=r.token_id,
                logprob=r.logprob if r.logprob is not None else 0.0,
                top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in r.top_logprobs or ()],
            )
            for r in out.logprobs
        )
    return pb.GenerateResponse(request_id=rid, chunk=chunk)


def complete_response(rid: str, out: RequestOutput) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=rid, complete=pb.GenerateComplete(
        finish_reason=FINISH_REASONS.get(out.finish_reason or "error", pb.FINISH_REASON_ERROR),
        usage=pb.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                       cached_tokens=out.cached_tokens),
        queue_time_ms=_ms(out.queue_time_s),
        ttft_ms=_ms(out.ttft_s),
        total_time_ms=_ms(out.total_time_s),
        stop_reason="" if out.stop_reason is None else str(out.stop_reason),
        error_message=out.error or "",
    ))


# ----- the door: one set of checks for every wire format (ours and worker.vllm_service) -----


def check_door(sc: ServerConfig, request_id: str, stops: Sequence[str], stop_field: str) -> None:
    """The cheap checks made before tokenizing; raises InvalidArgument naming the field."""
    if len(request_id) > sc.max_request_id_len:
        raise InvalidArgument(f"request_id is {len(request_id)} characters; at most "
                              f"{sc.max_request_id_len} are allowed")
    if len(stops) > sc.max_stop_strings:
        raise InvalidArgument(f"{stop_field} has {len(stops)} strings; at most "
                              f"{sc.max_stop_strings} are allowed (--max-stop-strings)")
    for i, s in enumerate(stops):
        if not s:
            raise InvalidArgument(f"{stop_field}[{i}] is empty")
        if len(s) > sc.max_stop_len:
            raise InvalidArgument(f"{stop_field}[{i}] is {len(s)} characters; at most "
                                  f"{sc.max_stop_len} are allowed (--max-stop-len)")


async def encode_text(tok: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of `text`; a long text is tokenized off the event loop."""
    if len(text) > _LONG_TEXT:
        return await asyncio.to_thread(tok.encode, text, add_special_tokens)
    return tok.encode(text, add_special_tokens)


def build_request(sc: ServerConfig, engine: Engine, ids: list[int], *, request_id: str,
                  max_tokens: int, priority: int = 0, cache_salt: str | None = None,
                  **sampling: Any) -> Request:
    """The checks made on the prompt's token ids, then the `Request`: the prompt within
    --max-prompt-tokens (or max_model_len), max_tokens 0 = the default clipped to what fits,
    every sampling value within `SamplingParams`' limits, the ids within the vocabulary.
    Raises ValueError naming the field and the limit; `sampling` are SamplingParams fields."""
    max_prompt = sc.max_prompt_tokens or engine.max_model_len
    if len(ids) > max_prompt:
        flag = "--max-prompt-tokens" if sc.max_prompt_tokens else "max_model_len"
        raise InvalidArgument(f"the prompt is {len(ids)} tokens; at most {max_prompt} are "
                              f"allowed ({flag})")
    if max_tokens == 0:  # the default, clipped to what fits
        max_tokens = min(sc.default_max_tokens, engine.max_model_len - len(ids))
        if max_tokens < 1:
            raise InvalidArgument(f"the prompt ({len(ids)} tokens) leaves no room for output "
                                  f"in max_model_len ({engine.max_model_len})")
    params = SamplingParams(max_tokens=max_tokens, **sampling)
    return engine.make_request(ids, params, request_id=request_id or uuid.uuid4().hex,
                               priority=priority, cache_salt=cache_salt)


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Serves before the engine exists (admin RPCs say UNAVAILABLE, GetServerStatus
    answers); `attach` hands it the running bridge."""

    def __init__(self, config: WorkerConfig,
                 on_drain: Callable[[], Awaitable[None]] | None = None) -> None:
        self.config = config
        self.sc = config.server
        self.on_drain = on_drain  # e.g. health NOT_SERVING
        self.bridge: EngineBridge | None = None
        self.draining = False
        self.started_at = time.monotonic()
        self.versions = _versions()
        self.config_json = config.to_json()

    def attach(self, bridge: EngineBridge) -> None:
        self.bridge = bridge

    async def start_draining(self) -> int:
        """Stop taking new Generate calls; returns the requests in flight."""
        if not self.draining:
            self.draining = True
            if self.on_drain is not None:
                await self.on_drain()
        return self.bridge.num_in_flight if self.bridge else 0

    async def _engine(self, context: grpc.aio.ServicerContext) -> EngineBridge:
        bridge = self.bridge
        if bridge is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        if bridge.dead or bridge.closed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is not running")
        return bridge

    # ----- Generate -----

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        method = f"/{SERVICE_NAME}/Generate"
        with telemetry.rpc_span(method, context.invocation_metadata(), context=context):
            async for response in self._generate(request, context):
                yield response

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        bridge = await self.serving(context)
        try:
            req = await self._to_request(request, bridge)
        except ValueError as e:  # ours, SamplingParams', make_request's, the tokenizer's
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        stream = await self.open_stream(context, bridge, req)
        rid = req.request_id
        logprobs = req.sampling_params.logprobs is not None
        prompt = request.text if request.HasField("text") else None
        async with contextlib.aclosing(self.follow(context, bridge, req, stream, prompt)) as outs:
            async for out in outs:
                if out.new_token_ids or out.new_text:
                    yield chunk_response(rid, out, logprobs)
                if out.finished:
                    if out.finish_reason == "error":
                        await self.fail(context, bridge, rid, out)
                    yield complete_response(rid, out)

    # ----- the door and the stream, shared with the vLLM adapter (worker.vllm_service) -----

    async def serving(self, context: grpc.aio.ServicerContext) -> EngineBridge:
        """The bridge, for a new generation: UNAVAILABLE while loading or draining."""
        bridge = await self._engine(context)
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the worker is draining; send the request to another replica")
        return bridge

    async def open_stream(self, context: grpc.aio.ServicerContext, bridge: EngineBridge,
                          req: Request) -> RequestStream:
        """Hand a validated request to the engine: RESOURCE_EXHAUSTED when the waiting queue
        is full, ALREADY_EXISTS for a request_id in flight."""
        if bridge.num_waiting >= self.sc.max_waiting:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the waiting queue is full ({bridge.num_waiting} requests, --max-waiting "
                f"{self.sc.max_waiting}); retry later or on another replica",
                trailing_metadata=(("retry-after-ms", str(self.sc.retry_after_ms)),),
            )
        try:
            return bridge.open(req)
        except DuplicateRequestError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        raise AssertionError("unreachable: context.abort raises")

    async def follow(self, context: grpc.aio.ServicerContext, bridge: EngineBridge, req: Request,
                     stream: RequestStream, prompt_text: str | None = None,
                     ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine publishes them (coalesced when the reader is
        slow), ending with the finished one; traced and logged. Enforces the client's
        deadline (DEADLINE_EXCEEDED) and --max-generation-time-s; closing it early
        (cancel, disconnect, a failed write) aborts the request. Use it under
        `contextlib.aclosing` so that the abort happens at once."""
        rid = req.request_id
        p = req.sampling_params
        record = self.sc.trace_content
        gen = telemetry.GenerationTrace(
            bridge.engine.model_name, rid, max_tokens=p.max_tokens, temperature=p.temperature,
            top_p=p.top_p, top_k=p.top_k, seed=p.seed, priority=req.priority,
            prompt=prompt_text if record else None, record_content=record)
        arrival_wall = telemetry.monotonic_to_wall(req.arrival_time)
        gen.event("queued", timestamp_s=arrival_wall, prompt_tokens=req.num_prompt_tokens)
        logger = telemetry.bind_request(rid, gen.span)
        text: list[str] = []
        loop = asyncio.get_running_loop()
        remaining = context.time_remaining()
        deadline = None if remaining is None else loop.time() + remaining
        limit_s = self.sc.max_generation_time_s
        # Counted from arrival (req.arrival_time is time.monotonic(); loop.time() need not be).
        expires = (None if limit_s <= 0
                   else loop.time() + limit_s - (time.monotonic() - req.arrival_time))
        done = False
        first = True
        preemptions = 0  # the engine thread bumps req.num_preemptions; reading an int is safe
        try:
            while True:
                if expires is not None and loop.time() >= expires:
                    # Past --max-generation-time-s: ended through the abort path (blocks
                    # freed in the next step); the stream still ends with complete(LENGTH).
                    bridge.expire(rid)
                    expires = None
                    logger.info("request ended", reason="max-generation-time-s", limit_s=limit_s)
                wake = min((t for t in (deadline, expires) if t is not None), default=None)
                if wake is None:
                    out = await stream.next()
                else:
                    try:
                        async with asyncio.timeout_at(wake):
                            out = await stream.next()
                    except TimeoutError:
                        if deadline is not None and loop.time() >= deadline:
                            bridge.abort(rid)
                            await context.abort(
                                grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"request {rid}: the deadline passed after "
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
                    gen.event("first_token")
                if record:
                    text.append(out.new_text)
                if out.finished:
                    done = True
                    self._finished(gen, logger, rid, out, "".join(text) if record else None)
                yield out
                if out.finished:
                    return
        finally:
            # Cancelled, disconnected (GeneratorExit), past its deadline or failed: free the
            # blocks in the engine's next step.
            if not done:
                bridge.abort(rid)
                gen.finish("abort", req.num_prompt_tokens, req.num_output_tokens)
                logger.info("request aborted", reason="cancelled, disconnected or deadline")

    @staticmethod
    async def fail(context: grpc.aio.ServicerContext, bridge: EngineBridge, rid: str,
                   out: RequestOutput) -> None:
        """End the RPC for a request the engine failed: INTERNAL (a fault: a model step
        raised, the engine thread died), or UNAVAILABLE when the worker shut down under it
        (another replica can serve it)."""
        shut_down = bridge.closed and not bridge.dead
        code = grpc.StatusCode.UNAVAILABLE if shut_down else grpc.StatusCode.INTERNAL
        await context.abort(code, f"request {rid} failed after {out.completion_tokens} "
                                  f"tokens: {out.error or 'engine error'}")

    @staticmethod
    def _finished(gen: telemetry.GenerationTrace, logger: Any, rid: str,
                  out: RequestOutput, text: str | None) -> None:
        reason = out.finish_reason or "error"
        gen.finish(reason, out.prompt_tokens, out.completion_tokens, output_text=text,
                   error=out.error, cached_tokens=out.cached_tokens,
                   queue_time_ms=_ms(out.queue_time_s), ttft_ms=_ms(out.ttft_s))
        telemetry.log_request_summary(
            logger, request_id=rid, finish_reason=reason, prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
            queue_time_ms=_ms(out.queue_time_s), ttft_ms=_ms(out.ttft_s),
            total_time_ms=_ms(out.total_time_s))

    async def _to_request(self, msg: pb.GenerateRequest, bridge: EngineBridge) -> Request:
        """Validate and translate; raises ValueError naming the field and the limit."""
        sc = self.sc
        stops = list(msg.stopping.stop)
        check_door(sc, msg.request_id, stops, "stopping.stop")
        if msg.WhichOneof("input") == "chat" and len(msg.chat.messages) > sc.max_chat_messages:
            raise InvalidArgument(f"chat.messages has {len(msg.chat.messages)} messages; at most "
                                  f"{sc.max_chat_messages} are allowed (--max-chat-messages)")
        if msg.top_logprobs > MAX_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must be <= {MAX_LOGPROBS}, got {msg.top_logprobs}")
        ids = await self._prompt_ids(msg, bridge)
        s = msg.sampling
        return build_request(
            sc, bridge.engine, ids, request_id=msg.request_id,
            max_tokens=msg.stopping.max_tokens, priority=msg.priority,
            cache_salt=msg.cache_salt or None,
            temperature=s.temperature if s.HasField("temperature") else 1.0,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            top_k=s.top_k if s.HasField("top_k") else 0,
            min_p=s.min_p if s.HasField("min_p") else 0.0,
            repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
            presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else 0.0,
            frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else 0.0,
            seed=s.seed if s.HasField("seed") else None,  # any uint64 is valid
            stop=tuple(stops),
            stop_token_ids=tuple(msg.stopping.stop_token_ids),
            ignore_eos=msg.stopping.ignore_eos,
            logprobs=msg.top_logprobs if msg.logprobs or msg.top_logprobs else None,
            skip_special_tokens=not msg.include_special_tokens,
        )

    async def _prompt_ids(self, msg: pb.GenerateRequest, bridge: EngineBridge) -> list[int]:
        kind = msg.WhichOneof("input")
        if kind is None:
            raise InvalidArgument("input is missing: set one of text, chat, token_ids")
        if kind == "token_ids":
            if not msg.token_ids.ids:
                raise InvalidArgument("token_ids.ids is empty")
            return list(msg.token_ids.ids)  # make_request checks the vocabulary
        tok = bridge.engine.tokenizer
        if tok is None:
            raise InvalidArgument(f"{kind} input needs a tokenizer; model "
                                  f"{bridge.engine.loaded.name} has none (send token_ids)")
        if kind == "text":
            if not msg.text:
                raise InvalidArgument("text is empty")
            text = msg.text
        else:
            messages = msg.chat.messages
            if not messages:
                raise InvalidArgument("chat.messages is empty")
            for i, m in enumerate(messages):
                if m.role not in CHAT_ROLES:
                    raise InvalidArgument(f"chat.messages[{i}].role {m.role!r} is unknown; "
                                          f"allowed: {', '.join(CHAT_ROLES)}")
            text = tok.apply_chat_template([{"role": m.role, "content": m.content}
                                            for m in messages], add_generation_prompt=True)
        # A rendered template writes its own BOS; raw text gets one only if the model adds it.
        return await encode_text(tok, text, add_special_tokens=kind == "text")

    # ----- admin -----

    @traced
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext):
        bridge = await self._engine(context)
        return pb.AbortResponse(aborted_ids=[r for r in request.request_ids if bridge.abort(r)])

    @traced
    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext):
        engine = (await self._engine(context)).engine
        loaded = engine.loaded
        return pb.GetModelInfoResponse(
            model_name=engine.model_name,
            architecture=loaded.config.architecture,
            vocab_size=loaded.config.vocab_size,
            max_model_len=engine.max_model_len,
            eos_token_ids=loaded.eos_token_ids,
            dtype=str(loaded.dtype).removeprefix("torch."),
            device=str(loaded.device),
            kv_block_size=engine.kv.block_size,
            weights_source=loaded.source,
            num_parameters=loaded.config.num_params,
        )

    @traced
    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext):
        load = snapshot(await self._engine(context))
        return pb.GetLoadResponse(
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            num_swapped=load.num_swapped,
            kv_cache_usage=load.kv_cache_usage,
            num_free_blocks=load.num_free_blocks,
            num_total_blocks=load.num_total_blocks,
            tokens_per_second=load.tokens_per_second,
            draining=self.draining,
        )

    @traced
    async def GetServerStatus(self, request: pb.GetServerStatusRequest,
                              context: grpc.aio.ServicerContext):
        bridge = self.bridge
        return pb.GetServerStatusResponse(
            uptime_s=time.monotonic() - self.started_at,
            config_json=self.config_json,
            versions=self.versions,
            requests_by_finish_reason=dict(bridge.finish_counts) if bridge else {},
            num_preemptions=bridge.num_preemptions if bridge else 0,
            prefix_cache_hit_tokens=bridge.engine.kv.stats.num_hit_tokens if bridge else 0,
            num_steps=bridge.engine.num_steps if bridge else 0,
            draining=self.draining,
        )

    @traced
    async def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest,
                               context: grpc.aio.ServicerContext):
        bridge = await self._engine(context)
        result = await asyncio.wrap_future(bridge.engine.reset_prefix_cache(request.requeue))
        if not result:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "requests hold KV blocks computed before the reset; retry when idle, or send "
                "requeue=true to preempt them (they recompute)",
            )
        return pb.ResetPrefixCacheResponse(num_requeued=result.num_requeued,
                                           num_blocks_dropped=result.num_blocks_dropped)

    @traced
    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext):
        return pb.DrainResponse(in_flight=await self.start_draining())
