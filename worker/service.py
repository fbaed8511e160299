"""`llmworker.v1.WorkerService` over the one engine, through the `EngineBridge`.

A thin adapter: validate every field at the door, translate to a `Request`, stream the
engine's outputs back. Status codes:

==========================  =========================================================
INVALID_ARGUMENT            bad input; the message names the field and the limit (no
                            input, empty text/chat/token ids, unknown chat role, more
                            chat messages than --max-chat-messages, more characters than
                            --max-prompt-chars, token id out of
                            vocabulary, more prompt tokens than --max-prompt-tokens,
                            prompt + max_tokens over max_model_len, any sampling value
                            out of range, too many or too long stop strings,
                            top_logprobs > 20, request_id too long, text or chat sent to
                            a model without a tokenizer; a structured-output constraint
                            that does not compile, or is over --max-structured-bytes;
                            more than 1024 logit_bias tokens or a bias outside
                            [-100, 100]; min_tokens > max_tokens; n over 16 or over
                            max_num_seqs; prompt_logprobs > 20; a
                            lora_name that is not loaded, or sent without
                            --enable-lora)
ALREADY_EXISTS              a request_id that is still in flight
RESOURCE_EXHAUSTED          the waiting queue is at --max-waiting; trailing metadata
                            ``grpc-retry-pushback-ms`` (gRPC's retry design, gRFC A6)
                            and ``retry-after-ms`` say when to try again. Also (from gRPC
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

``sampling.n`` > 1: each chunk and ``complete`` carries its sample's ``index``; every
sample ends with its own ``complete`` (its finish reason and completion tokens; the prompt
and cached tokens on index 0 only, so usage sums over completes), and the stream ends after
the n-th. ``prompt_logprobs`` ride on each sample's first chunk.

Any abort (Abort RPC, cancel, disconnect, deadline, generation-time limit) frees the
request's KV blocks in the engine's next step (every sample's). `Generate` sends at most one chunk per engine
step, and per stream at most one output is buffered (a slow reader gets coalesced chunks,
see `worker.bridge`); the step that finishes a request sends its last chunk and then
`complete`.

A thin adapter: it translates `GenerateRequest` into the door's `Submission` and the
engine's outputs into `GenerateResponse`s; every check, limit and status above is the
door's (`worker.door`), shared with the vLLM protocol's adapter (`worker.vllm_service`).

Text input is tokenized as is (BOS prepended only when the model's tokenizer adds one to
plain text); chat input is rendered with the model's chat template and a generation prompt.
Special-token strings typed in text or message content stay text unless
``parse_special_tokens`` is set. Admin RPCs read plain counters and never wait on the
engine thread.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import platform

import google.protobuf
import grpc
import torch
from llmworker.v1 import worker_pb2 as pb
from llmworker.v1 import worker_pb2_grpc

from worker import telemetry
from worker.door import Door, FieldNames, InvalidArgument, Submission, abort
from worker.lora.registry import LoraInfo
from worker.outputs import RequestOutput
from worker.structured import Constraint

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name
FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}
# The door's defaults are this proto's field names; SamplingParams' are spelled here.
NAMES = FieldNames(sampling={
    **{f: f"sampling_params.{f}" for f in ("temperature", "top_p", "top_k", "min_p",
                                           "repetition_penalty", "presence_penalty",
                                           "frequency_penalty", "seed")},
    "stop_token_ids": "stopping.stop_token_ids", "ignore_eos": "stopping.ignore_eos",
    "logprobs": "top_logprobs", "logit_bias": "sampling_params.logit_bias",
    "min_tokens": "stopping.min_tokens", "n": "sampling.n", "prompt_logprobs": "prompt_logprobs"})
_GRAMMAR_KINDS = {pb.GRAMMAR_SYNTAX_UNSPECIFIED: "grammar", pb.GRAMMAR_SYNTAX_LARK: "lark",
                  pb.GRAMMAR_SYNTAX_GBNF: "gbnf"}


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


def constraint(msg: pb.GenerateRequest) -> Constraint | None:
    """The request's structured-output constraint, as sent (the door checks it)."""
    kind = msg.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not msg.json_object):
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "choice":
        return Constraint("choice", choices=msg.choice.choices)
    if kind == "grammar":
        syntax = _GRAMMAR_KINDS.get(msg.grammar.syntax)
        if syntax is None:
            raise InvalidArgument(f"grammar.syntax {msg.grammar.syntax} is unknown")
        return Constraint(syntax, msg.grammar.text)
    return Constraint(kind, getattr(msg, kind))


def submission(msg: pb.GenerateRequest) -> Submission:
    """Our wire message as the door takes it (the door checks every value)."""
    kind = msg.WhichOneof("input")
    s, stopping = msg.sampling, msg.stopping
    return Submission(
        request_id=msg.request_id,
        text=msg.text if kind == "text" else None,
        messages=msg.chat.messages if kind == "chat" else None,
        token_ids=msg.token_ids.ids if kind == "token_ids" else None,
        parse_special_tokens=msg.parse_special_tokens,
        max_tokens=stopping.max_tokens,
        priority=msg.priority,
        cache_salt=msg.cache_salt or None,
        lora_name=msg.lora_name or None,
        names=NAMES,
        constraint=constraint(msg),
        sampling=dict(
            temperature=s.temperature if s.HasField("temperature") else 1.0,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            top_k=s.top_k if s.HasField("top_k") else 0,
            min_p=s.min_p if s.HasField("min_p") else 0.0,
            repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
            presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else 0.0,
            frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else 0.0,
            seed=s.seed if s.HasField("seed") else None,  # any uint64 is valid
            stop=tuple(stopping.stop),
            stop_token_ids=tuple(stopping.stop_token_ids),
            ignore_eos=stopping.ignore_eos,
            logprobs=msg.top_logprobs if msg.logprobs or msg.top_logprobs else None,
            skip_special_tokens=not msg.include_special_tokens,
            min_tokens=stopping.min_tokens,
            logit_bias=dict(s.logit_bias),
            n=s.n if s.HasField("n") and s.n else 1,
            prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        ),
    )


def _token_logprob(token_id: int, logprob: float | None,
                   top: list[tuple[int, float]] | None) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=token_id, logprob=logprob if logprob is not None else 0.0,
                           top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp)
                                         for t, lp in top or ()])


def chunk_response(rid: str, out: RequestOutput, logprobs: bool) -> pb.GenerateResponse:
    chunk = pb.GenerateChunk(text=out.new_text, token_ids=out.new_token_ids, index=out.index)
    if out.prompt_logprobs:
        chunk.prompt_logprobs.extend(_token_logprob(p.token_id, p.logprob, p.top_logprobs)
                                     for p in out.prompt_logprobs)
    if logprobs and out.logprobs:
        chunk.logprobs.extend(_token_logprob(r.token_id, r.logprob, r.top_logprobs)
                              for r in out.logprobs)
    return pb.GenerateResponse(request_id=rid, chunk=chunk)


def complete_response(rid: str, out: RequestOutput) -> pb.GenerateResponse:
    prompt = out.index == 0  # n > 1: the prompt is counted once, on sample 0
    req = out.request  # speculative decoding's counts are the sample's (its own Request)
    return pb.GenerateResponse(request_id=rid, complete=pb.GenerateComplete(
        finish_reason=FINISH_REASONS.get(out.finish_reason or "error", pb.FINISH_REASON_ERROR),
        usage=pb.Usage(prompt_tokens=out.prompt_tokens if prompt else 0,
                       completion_tokens=out.completion_tokens,
                       cached_tokens=out.cached_tokens if prompt else 0),
        index=out.index,
        queue_time_ms=_ms(out.queue_time_s),
        ttft_ms=_ms(out.ttft_s),
        total_time_ms=_ms(out.total_time_s),
        stop_reason="" if out.stop_reason is None else str(out.stop_reason),
        error_message=out.error or "",
        spec_draft_tokens=req.num_draft_tokens if req is not None else 0,
        spec_accepted_tokens=req.num_accepted_tokens if req is not None else 0,
    ))


def lora_adapter(info: LoraInfo) -> pb.LoraAdapter:
    return pb.LoraAdapter(name=info.name, path=info.path, rank=info.rank, resident=info.resident,
                          num_running=info.num_running, num_requests=info.num_requests)


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Our protocol over the door."""

    def __init__(self, door: Door) -> None:
        self.door = door
        self.versions = _versions()
        self.config_json = door.config.to_json()

    # ----- Generate -----

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        method = f"/{SERVICE_NAME}/Generate"
        with telemetry.rpc_span(method, context.invocation_metadata(), context=context):
            try:
                sub = submission(request)
            except ValueError as e:  # what this adapter cannot read (an unknown enum value)
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            gen = await self.door.admit(context, sub)
            rid, logprobs = gen.request_id, gen.wants_logprobs
            async with contextlib.aclosing(gen.outputs()) as outs:
                async for out in outs:
                    if out.new_token_ids or out.new_text:
                        yield chunk_response(rid, out, logprobs)
                    if out.finished:
                        yield complete_response(rid, out)

    # ----- admin -----

    @traced
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext):
        aborted = await self.door.abort_requests(context, list(request.request_ids))
        return pb.AbortResponse(aborted_ids=aborted)

    @traced
    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext):
        await self.door.engine(context)
        m = self.door.model
        assert m is not None
        return pb.GetModelInfoResponse(
            model_name=m.name,
            architecture=m.architecture,
            vocab_size=m.vocab_size,
            max_model_len=m.max_model_len,
            eos_token_ids=m.eos_token_ids,
            dtype=m.dtype,
            device=m.device,
            kv_block_size=m.block_size,
            weights_source=m.source,
            num_parameters=m.num_parameters,
        )

    @traced
    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext):
        await self.door.engine(context)
        load = self.door.load()
        return pb.GetLoadResponse(
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            num_swapped=load.num_swapped,
            kv_cache_usage=load.kv_cache_usage,
            num_free_blocks=load.num_free_blocks,
            num_total_blocks=load.num_total_blocks,
            tokens_per_second=load.tokens_per_second,
            draining=self.door.draining,
        )

    @traced
    async def GetServerStatus(self, request: pb.GetServerStatusRequest,
                              context: grpc.aio.ServicerContext):
        st = self.door.status()
        return pb.GetServerStatusResponse(
            uptime_s=st.uptime_s,
            config_json=self.config_json,
            versions=self.versions,
            requests_by_finish_reason=st.requests_by_finish_reason,
            num_preemptions=st.num_preemptions,
            prefix_cache_hit_tokens=st.prefix_cache_hit_tokens,
            num_steps=st.num_steps,
            draining=st.draining,
            spec_draft_tokens=st.spec_draft_tokens,
            spec_accepted_tokens=st.spec_accepted_tokens,
            lora_adapters=self._lora_adapters(),
            kv_transfer=self._kv_transfer(),
            prompt_tokens_by_source=st.prompt_tokens_by_source,
        )

    def _kv_transfer(self) -> pb.KVTransferStatus | None:
        bridge = self.door.bridge
        spec = self.door.config.kv_transfer.kv_transfer_config
        if bridge is None or spec is None:
            return None
        engine = bridge.engine
        k = engine.kv_stats.snapshot()
        pins = engine.kv.handoff_pins
        return pb.KVTransferStatus(
            role=spec.kv_role, pulls=k.num_pulls, pulled_blocks=k.num_pulled_blocks,
            pulled_bytes=k.num_pulled_bytes, pull_seconds=k.pull_seconds_sum,
            fallbacks=k.fallbacks, skipped=k.num_skipped, pulls_aborted=k.num_pulls_aborted,
            handoffs=k.num_handoffs, handoffs_refused=k.num_handoffs_refused,
            pins_pulled=pins.num_pulled, pins_released=pins.num_released,
            pins_expired=pins.num_expired, pinned_blocks=pins.num_blocks(),
            served_bytes=k.num_served_bytes)

    def _lora_adapters(self) -> list[pb.LoraAdapter]:
        bridge = self.door.bridge
        loras = bridge.engine.loras if bridge is not None else None
        return [] if loras is None else [lora_adapter(i) for i in loras.infos()]

    @traced
    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext):
        info = await self.door.load_lora(context, request.lora_name, request.lora_path)
        return pb.LoadLoraAdapterResponse(adapter=lora_adapter(info))

    @traced
    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext):
        await self.door.unload_lora(context, request.lora_name)
        return pb.UnloadLoraAdapterResponse()

    @traced
    async def ListLoraAdapters(self, request: pb.ListLoraAdaptersRequest,
                               context: grpc.aio.ServicerContext):
        loras = await self.door.loras(context)
        lc = self.door.config.lora
        return pb.ListLoraAdaptersResponse(
            adapters=[lora_adapter(i) for i in loras.infos()], max_loras=lc.max_loras,
            max_lora_rank=lc.max_lora_rank, max_cpu_loras=lc.cpu_loras)

    @traced
    async def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest,
                               context: grpc.aio.ServicerContext):
        result = await self.door.reset_prefix_cache(context, request.requeue)
        if not result:
            await abort(
                context, grpc.StatusCode.FAILED_PRECONDITION,
                "requests hold KV blocks computed before the reset; retry when idle, or send "
                "requeue=true to preempt them (they recompute)",
            )
        return pb.ResetPrefixCacheResponse(num_requeued=result.num_requeued,
                                           num_blocks_dropped=result.num_blocks_dropped)

    @traced
    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext):
        return pb.DrainResponse(in_flight=await self.door.start_draining())
