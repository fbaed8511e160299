"""`vllm.grpc.engine.VllmEngine` (the protocol SMG speaks to its workers) over the one engine.

A second thin adapter beside `worker.service.WorkerServicer`, on the same server and port
(--vllm-protocol), over the same door (`worker.door`): the same checks and limits, the same
admission and the same output stream (deadline, --max-generation-time-s, abort on cancel,
traces). It translates this wire format's messages and nothing more. Stubs come from
`smg-grpc-proto`.

Generate
--------
Input: ``tokenized.input_ids`` as given (``original_text`` is not read): how the gateway
tokenized, special tokens included, is its business. Or ``text``, tokenized by us (BOS only
if the model's tokenizer adds one to plain text; special-token strings in it stay text, as
on our protocol).
``stream`` true: a chunk per engine step that produced tokens (``token_ids`` new ones;
``prompt_tokens``, ``cached_tokens`` and the running ``completion_tokens`` so far), then
``complete``. ``stream`` false: only ``complete``. ``complete.output_ids`` always holds
every output token (so in streaming it repeats what the chunks sent); ``finish_reason``
stop | length | abort; ``matched_token_id`` (EOS or a stop token id) or
``matched_stop_str``; the usage counts. Logprobs, when asked for, ride on each chunk
(its tokens) and, without streaming, on ``complete`` (all tokens).

``n`` > 1 (at most 16 and max_num_seqs): the prompt is computed once and its blocks shared
(scheduler/sample_group.py); sample i draws from seed + i. Chunks carry their sample's
``index``; the n completes (each with its index, output, finish reason and counts) come
together once every sample has finished, as vLLM sends them.
``prompt_logprobs`` k (0..20): ``input_logprobs`` (one entry per prompt token, the first
without a value; each with its top k) on each sample's first chunk, or without streaming
on its complete. Such a request skips the prefix cache. -1 (all) is refused.

Sampling fields, read as vLLM's own servicer reads the proto3 zeros: temperature unset
= 1.0; top_p 0 = 1.0; top_k 0 = off; repetition_penalty 0 = 1.0; min_p, presence and
frequency penalties as given; max_tokens unset = --default-max-tokens clipped to what fits
(an explicit 0 is refused); stop, stop_token_ids, ignore_eos, skip_special_tokens as
given; seed: the int32's bits read as a uint32 (so -1 and 4294967295 are one seed);
logprobs 0..20; truncate_prompt_tokens k keeps the prompt's last k tokens (-1: as many as
leave room for max_tokens); min_tokens and logit_bias (bounded by the door: 1024 tokens,
[-100, 100]); the structured-output constraints json_schema, regex, grammar (Lark or
EBNF/GBNF), choice, json_object and structural_tag (xgrammar's `format` tree or the older
structures/triggers, worker.structural_tag) (worker.structured; compiled at the door,
INVALID_ARGUMENT when they do not).
Accepted with no effect, since we return token ids and no text:
``include_stop_str_in_output`` (the ids always include the tokens that completed a stop
string; the stop string is matched in our detokenized text) and
``spaces_between_special_tokens``; ``grammar_from_first_token`` (we run no reasoning
parser: a grammar always starts at the first generated token, as GetServerInfo's
``constrained_decoding_start`` "first_token" says); ``data_parallel_rank`` 0.

Refused with INVALID_ARGUMENT naming the field: n > 16 or > max_num_seqs,
prompt_logprobs -1 or > 20, logprobs -1 or > 20, mm_inputs, extra_mm_inputs, media_refs,
kv_transfer_params (Mooncake's typed field), a data_parallel_rank other than 0; and every
bad value our own service refuses, with the same limits and messages.

Prefill/decode disaggregation (--kv-transfer-config, worker.kv_transfer): on a producer,
``kv_transfer_params_json`` ``{"do_remote_decode": true}`` tags the request: it pins its
prompt's blocks as it finishes, and its ``complete.kv_transfer_params_json`` is the handoff
(vLLM NIXL's keys and ours). On a consumer, a ``do_remote_prefill`` handoff is pulled from
the prefill worker it names (when that is on --kv-transfer-peers) before the rest of the
prompt is computed here; one it cannot use is computed here, counted by reason. Malformed
JSON (over 64 KiB, wrong types, too many block ids) is INVALID_ARGUMENT, as is either leg
on a worker without that role. GetServerInfo reports ``kv_connector`` NixlConnector (the
connector SMG tags prefill legs for), ``kv_role``, ``kv_engine_id``, the resolved
``kv_cache_dtype``, ``attention_backend`` LLM_WORKER_PAGED, and ``pairing_protocol`` from
SMG_PAIRING_PROTOCOL as vLLM's servicer reads it.

==========================  =========================================================
INVALID_ARGUMENT            a bad or unsupported field (above); bytes that do not parse
RESOURCE_EXHAUSTED          the waiting queue is full (``retry-after-ms`` trailing
                            metadata); a KV-event subscriber that fell behind
ALREADY_EXISTS              a request_id still in flight
UNAVAILABLE                 loading, draining, the engine not running, or the worker
                            shutting down under a request
DEADLINE_EXCEEDED           the client's deadline passed (the request is aborted)
CANCELLED                   the client cancelled: the request is aborted, blocks freed
INTERNAL                    the engine failed the request (after any chunks sent)
FAILED_PRECONDITION         GetTokenizer for a model without a tokenizer (dummy weights)
UNIMPLEMENTED               Embed, StartProfile, StopProfile; SubscribeKvEvents when
                            --kv-events is off or prefix caching is off (no events)
==========================  =========================================================

Other RPCs
----------
HealthCheck: healthy exactly when the worker is SERVING (engine attached and running, not
draining); never an error status, so that SMG's backend detection always gets an answer.
GetModelInfo / GetServerInfo: real figures (``model_path`` is the GGUF file or folder we
loaded; SMG tries it as a tokenizer source before it calls GetTokenizer). GetLoads: one
rank, from the same `worker.load` snapshot as our GetLoad. FlushCache: our prefix-cache
reset, refused (success false, a message) while requests hold blocks; ``timeout_s`` > 0
retries until then. GetTokenizer: `worker.tokenizer_bundle`'s zip in 64 KiB chunks, the
SHA-256 (hex) on the last one. Abort: aborts those in flight (blocks freed next step).

SubscribeKvEvents: `worker.kv_events` (block hashes mapped to int64, bounds, resume).
Every event batch carries the load record; while no batch flows, a ``load_only`` record
(numbered as the last batch sent, or 0 before the first when the subscriber asked for
``load_records_before_first_batch``) goes out when the figures change (checked every
0.25 s) and at least every second. Sequence numbers run on across subscriptions (one
counter per worker). A draining worker (or a dead engine) ends the stream with
UNAVAILABLE, so that the router stops routing here at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib.metadata
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from worker import telemetry, tokenizer_bundle, vllm_convert
from worker.door import Door, abort
from worker.kv_events import KvEventHub, Overflowed
from worker.kv_transfer import handoff
from worker.tokenizer import Tokenizer
from worker.weights import default_model_path

SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
TOKENIZER_CHUNK = 64 << 10
_LOAD_CHECK_S = 0.25  # how often a quiet KV-event stream looks for a changed load
_HEARTBEAT_S = 1.0  # the longest a KV-event stream stays silent
_MAX_FLUSH_WAIT_S = 600.0


def _version() -> str:
    try:
        return importlib.metadata.version("llm-worker")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """The vLLM engine protocol over the door; `hub` publishes the KV events (None when
    --kv-events or prefix caching is off)."""

    def __init__(self, door: Door, hub: KvEventHub | None = None) -> None:
        self.door = door
        self.config = door.config
        self.hub = hub
        self.version = _version()
        self._tokenizer_zip: tuple[bytes, str] | None = None
        self._tokenizer_lock = asyncio.Lock()
        # Where a decode worker pulls this worker's handoffs from (the server sets it once
        # the port is bound); None: no handoffs.
        self.kv_address: tuple[str, int] | None = None
        spec = self.config.kv_transfer.kv_transfer_config
        self.kv_engine_id = (spec.engine_id or uuid.uuid4().hex) if spec is not None else ""

    # ----- Generate -----

    async def Generate(self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext):
        method = f"/{SERVICE_NAME}/Generate"
        with telemetry.rpc_span(method, context.invocation_metadata(), context=context):
            try:
                sub = vllm_convert.submission(request)
            except ValueError as e:  # what this wire format cannot express
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            gen = await self.door.admit(context, sub)
            want_logprobs = gen.wants_logprobs
            n = gen.request.sampling_params.n
            # Per sample (index): its tokens, logprobs, prompt logprobs, finished output.
            output_ids: list[list[int]] = [[] for _ in range(n)]
            logprobs: list[list] = [[] for _ in range(n)]
            prompt_logprobs: list = [None] * n
            finished: dict[int, Any] = {}
            async with contextlib.aclosing(gen.outputs()) as outs:
                async for out in outs:
                    i = out.index
                    output_ids[i] += out.new_token_ids
                    if want_logprobs and not request.stream:
                        logprobs[i] += out.logprobs or ()
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[i] = out.prompt_logprobs
                    if request.stream and out.new_token_ids:
                        yield vllm_convert.chunk_response(out, len(output_ids[i]), want_logprobs)
                    if out.finished:
                        finished[i] = out
                    if len(finished) == n:  # as vLLM: every sample's complete at the end
                        for j in range(n):
                            yield vllm_convert.complete_response(
                                finished[j], output_ids[j], logprobs[j] or None,
                                None if request.stream else prompt_logprobs[j],
                                self._handoff(finished[j]))

    def _handoff(self, out: Any) -> str | None:
        """A finished prefill's handoff JSON, when it pinned its prompt's blocks."""
        req = out.request
        pin = req.kv_handoff if req is not None else None
        if pin is None or self.kv_address is None:
            return None
        engine = self.door.bridge.engine
        host, port = self.kv_address
        return handoff.build(handle=pin.handle, request_id=req.request_id, blocks=pin.blocks,
                             num_tokens=pin.num_tokens, layout=engine.kv_layout, host=host,
                             port=port, engine_id=self.kv_engine_id,
                             lease_s=self.config.kv_transfer.kv_transfer_lease_s)

    # ----- management -----

    async def Abort(self, request: vpb.AbortRequest, context: grpc.aio.ServicerContext):
        await self.door.abort_requests(context, list(request.request_ids))
        return vpb.AbortResponse()

    async def HealthCheck(self, request: vpb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext):
        healthy, message = self.door.health()
        return vpb.HealthCheckResponse(healthy=healthy, message=message)

    def _model_path(self) -> str:
        spec = self.config.model.model
        if spec == "default":
            return str(default_model_path())
        return spec if spec.startswith("dummy:") else str(Path(spec).expanduser().resolve())

    async def GetModelInfo(self, request: vpb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext):
        await self.door.engine(context)
        m = self.door.model
        assert m is not None
        return vpb.GetModelInfoResponse(
            model_path=self._model_path(),
            is_generation=True,
            max_context_length=m.max_model_len,
            vocab_size=m.vocab_size,
            supports_vision=False,
            served_model_name=m.name,
            tokenizer_path=self._model_path() if m.source == "safetensors" else "",
            model_type="llama",
            architectures=[m.architecture],
            eos_token_ids=list(m.eos_token_ids),
            pad_token_id=m.pad_token_id or 0,
            bos_token_id=m.bos_token_id or 0,
            max_req_input_len=m.max_prompt_tokens,
            default_sampling_params_json="",
        )

    async def GetServerInfo(self, request: vpb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext):
        door, cfg = self.door, self.config
        st, m = door.status(), door.model
        info = vpb.GetServerInfoResponse(
            active_requests=st.num_in_flight,
            is_paused=st.draining,
            last_receive_timestamp=door.last_receive,
            uptime_seconds=st.uptime_s,
            server_type="vllm-grpc",
            data_parallel_size=1,
            kv_cache_dtype=cfg.cache.kv_cache_dtype,  # as vLLM reports it: "auto" = the model's dtype
            block_size=cfg.cache.block_size,
            model_dtype=f"torch.{m.dtype}" if m else "",
            max_num_seqs=cfg.scheduler.max_num_seqs,
            constrained_decoding_start="first_token",  # no reasoning parser holds it back
            # As vLLM's servicer: the operator's pairing protocol, compared whole by SMG when
            # both workers of a pair carry one.
            pairing_protocol=os.environ.get("SMG_PAIRING_PROTOCOL", "").strip(),
        )
        spec = cfg.kv_transfer.kv_transfer_config
        if spec is not None:
            # SMG tags prefill legs and relays handoffs only for NIXL's name; the layout
            # facts (the resolved cache dtype and our attention's name, which no vLLM backend
            # has) keep SMG from pairing us with a vLLM worker that reports its own.
            info.kv_connector = handoff.SMG_CONNECTOR
            info.kv_role = spec.kv_role
            info.kv_engine_id = self.kv_engine_id
            info.attention_backend = handoff.ATTENTION_BACKEND
            if door.bridge is not None:
                info.kv_cache_dtype = door.bridge.engine.kv_layout.dtype
        return info

    async def GetLoads(self, request: vpb.GetLoadsRequest, context: grpc.aio.ServicerContext):
        await self.door.engine(context)
        load = self.door.load()
        loads = []
        if not request.HasField("dp_rank") or request.dp_rank == 0:
            loads.append(vpb.SchedulerLoad(
                dp_rank=0,
                num_running_reqs=load.num_running,
                num_waiting_reqs=load.num_waiting,
                num_total_reqs=load.num_running + load.num_waiting + load.num_swapped,
                num_used_tokens=load.num_used_tokens,
                max_total_num_tokens=load.num_total_tokens,
                token_usage=load.kv_cache_usage,
                gen_throughput=load.tokens_per_second,
                cache_hit_rate=load.prefix_cache_hit_rate,
                max_running_requests=self.config.scheduler.max_num_seqs,
            ))
        return vpb.GetLoadsResponse(
            timestamp=datetime.datetime.now(datetime.UTC).isoformat(),
            version=self.version, dp_rank_count=1, loads=loads)

    async def FlushCache(self, request: common_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext):
        door = self.door
        await door.engine(context)
        wait = request.timeout_s
        if not 0 <= wait <= _MAX_FLUSH_WAIT_S:  # NaN fails too
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"timeout_s must be in [0, {_MAX_FLUSH_WAIT_S:g}], got {wait}")
        loop = asyncio.get_running_loop()
        until = loop.time() + wait
        while True:
            result = await door.reset_prefix_cache(context, False)
            if result:
                return common_pb2.FlushCacheResponse(
                    success=True,
                    message=f"prefix cache flushed: {result.num_blocks_dropped} blocks dropped")
            if loop.time() >= until:
                return common_pb2.FlushCacheResponse(
                    success=False,
                    message=f"requests in flight hold KV blocks ({door.status().num_in_flight} "
                            f"requests); retry when idle or with timeout_s > 0"
                            + (f" (waited {wait:g} s)" if wait else ""))
            await asyncio.sleep(min(0.05, max(0.0, until - loop.time())))

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator:
        await self.door.engine(context)
        tok, m = self.door.tokenizer(), self.door.model
        assert m is not None
        if tok is None:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        f"model {m.name} has no tokenizer (dummy weights)")
        async with self._tokenizer_lock:  # built once, off the loop
            if self._tokenizer_zip is None:
                self._tokenizer_zip = await asyncio.to_thread(self._build_tokenizer_zip, tok,
                                                              m.source, m.max_model_len)
        data, sha = self._tokenizer_zip
        for start in range(0, len(data), TOKENIZER_CHUNK):
            end = start + TOKENIZER_CHUNK
            yield common_pb2.GetTokenizerChunk(data=data[start:end],
                                               sha256=sha if end >= len(data) else "")

    def _build_tokenizer_zip(self, tok: Tokenizer, source: str,
                             max_model_len: int) -> tuple[bytes, str]:
        if source == "safetensors":
            files = tokenizer_bundle.folder_files(Path(self._model_path()))
        else:
            files = tokenizer_bundle.gguf_files(tok, max_model_len)
        return tokenizer_bundle.build_zip(files)

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator:
        door = self.door
        await door.serving(context)  # UNAVAILABLE while loading or draining
        hub = self.hub
        if hub is None:
            await abort(
                context, grpc.StatusCode.UNIMPLEMENTED,
                "KV cache events are off on this worker (--kv-events false or prefix caching "
                "off); poll GetLoads for its load")
        await context.send_initial_metadata(())  # the subscriber's call resolves at once
        sub = hub.subscribe(request.start_sequence_number)
        sent_seq = 0  # the last batch sequence sent on this stream
        first = True
        last_figures: tuple | None = None
        loop = asyncio.get_running_loop()
        last_sent = loop.time()
        try:
            while True:
                if not door.health()[0]:
                    # Ends the stream, so that the router stops sending here at once (and the
                    # server's shutdown does not wait on an endless stream).
                    await abort(context, grpc.StatusCode.UNAVAILABLE,
                                "the worker is draining or its engine stopped")
                try:
                    batch = await sub.next(_LOAD_CHECK_S)
                except Overflowed as e:
                    await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
                now = loop.time()
                if batch is not None:
                    if first:  # a stream's first record carries the extras
                        batch = _with_extras(batch, hub)
                    sent_seq, first, last_sent = batch.sequence_number, False, now
                    last_figures = _figures(batch.load)
                    yield batch
                    continue
                if sent_seq == 0 and not request.load_records_before_first_batch:
                    continue  # an old subscriber takes its first record with a batch
                record = hub.load_record(load_only=True, extras=True)
                figures = _figures(record)
                if figures != last_figures or now - last_sent >= _HEARTBEAT_S:
                    last_figures, last_sent, first = figures, now, False
                    yield common_pb2.KvEventBatch(sequence_number=sent_seq,
                                                  timestamp=time.time(), dp_rank=0, load=record)
        finally:
            hub.unsubscribe(sub)

    # ----- not offered -----

    async def Embed(self, request: vpb.EmbedRequest, context: grpc.aio.ServicerContext):
        await abort(context, grpc.StatusCode.UNIMPLEMENTED,
                            "Embed is not supported: this worker serves a generative model")

    async def StartProfile(self, request: common_pb2.StartProfileRequest,
                           context: grpc.aio.ServicerContext):
        await abort(context, grpc.StatusCode.UNIMPLEMENTED,
                            "profiling is not supported by this worker (use its traces)")

    async def StopProfile(self, request: common_pb2.StopProfileRequest,
                          context: grpc.aio.ServicerContext):
        await abort(context, grpc.StatusCode.UNIMPLEMENTED,
                            "profiling is not supported by this worker (use its traces)")


def _figures(rec: common_pb2.EngineLoad) -> tuple:
    """What a subscriber routes on; a change sends a load-only record."""
    return (rec.running_requests, rec.waiting_requests, round(rec.token_usage, 4))


def _with_extras(batch: common_pb2.KvEventBatch, hub: KvEventHub) -> common_pb2.KvEventBatch:
    mine = common_pb2.KvEventBatch()
    mine.CopyFrom(batch)  # the batch is shared with other subscribers
    extras = hub.load_record(load_only=False, extras=True)
    for name in ("cache_hit_rate", "num_used_tokens", "max_total_num_tokens"):
        setattr(mine.load, name, getattr(extras, name))
    return mine

