"""`llmworker.v1.KVTransfer` on a prefill worker: a handoff's pinned blocks to the decode
worker that presents its handle and its prompt's digest (protos/llmworker/v1/kv_transfer.proto).

Served on the main port, so behind the same TLS / mTLS and the Generate token
(`worker.auth`), and still while the worker drains: a draining prefill keeps serving its
pins until they are pulled or expire. A refusal carries its reason in the trailing metadata
``llm-worker-kv-reason`` (what the decode counts its fallback under):

===================  ===========================  =========================================
NOT_FOUND            unknown                      no such handle here (never, or forgotten)
FAILED_PRECONDITION  expired, used                the lease passed; pulled or released
PERMISSION_DENIED    key                          the handle belongs to another prompt
FAILED_PRECONDITION  model, block_size, dtype,    the caches differ: nothing is claimed
                     layout
FAILED_PRECONDITION  role                         this worker does not produce handoffs
INVALID_ARGUMENT     request                      a malformed request (sizes, ranges)
UNAVAILABLE                                       loading, or the engine is not running
===================  ===========================  =========================================

Blocks are read in a thread of their own (a chunk's gather and copy), never on the event
loop, which streams other requests' tokens meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NoReturn

import grpc
from llmworker.v1 import kv_transfer_pb2 as kpb
from llmworker.v1 import kv_transfer_pb2_grpc

from kvcache.pins import PinRefused
from worker.door import Door, abort
from worker.kv_transfer import blocks
from worker.kv_transfer.handoff import Layout
from worker.kv_transfer.messages import REASON_KEY, layout_message, layout_of

SERVICE_NAME = kpb.DESCRIPTOR.services_by_name["KVTransfer"].full_name
MAX_CHUNK_BYTES = 4 << 20
_CODES = {"unknown": grpc.StatusCode.NOT_FOUND, "key": grpc.StatusCode.PERMISSION_DENIED}


async def _refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: str,
                  message: str) -> NoReturn:
    await abort(context, code, message, [(REASON_KEY, reason)])


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, door: Door, max_message_bytes: int) -> None:
        self.door = door
        self.lease_s = door.config.kv_transfer.kv_transfer_lease_s
        # A chunk leaves room for the message's own fields within the send limit.
        self.max_chunk_bytes = min(MAX_CHUNK_BYTES, max_message_bytes - (16 << 10))
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-read")

    async def _engine(self, context: grpc.aio.ServicerContext):
        engine = (await self.door.engine(context)).engine  # not door.serving: drain serves
        spec = engine.config.kv_transfer.kv_transfer_config
        if spec is None or not spec.is_producer:
            await _refuse(context, grpc.StatusCode.FAILED_PRECONDITION, "role",
                          "this worker makes no KV handoffs (--kv-transfer-config kv_role "
                          "kv_producer or kv_both)")
        return engine

    async def PullBlocks(self, request: kpb.PullBlocksRequest,
                         context: grpc.aio.ServicerContext):
        engine = await self._engine(context)
        if len(request.handle) > 128 or len(request.prompt_digest) != 32:
            await _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "request",
                          "handle must be at most 128 characters and prompt_digest 32 bytes")
        ours: Layout = engine.kv_layout
        why = ours.mismatch(layout_of(request.layout))
        if why is not None:  # nothing claimed: the decode falls back and releases it
            await _refuse(context, grpc.StatusCode.FAILED_PRECONDITION, why,
                          f"the caches differ in {why}: this worker's is {ours}")
        try:
            pin = engine.kv.handoff_pins.claim(request.handle, request.prompt_digest,
                                               time.monotonic())
        except PinRefused as e:
            await _refuse(context, _CODES.get(e.reason, grpc.StatusCode.FAILED_PRECONDITION),
                          e.reason, str(e))
        pulled = False
        try:
            first, n = request.first_block, request.num_blocks
            if n < 1 or first + n > len(pin.blocks):
                await _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "request",
                              f"blocks [{first}, {first + n}) asked for; the handoff has "
                              f"{len(pin.blocks)}")
            caches = engine.runner.kv_caches
            per_block = 2 * blocks.block_nbytes(caches)
            limit = min(self.max_chunk_bytes, request.max_chunk_bytes or MAX_CHUNK_BYTES)
            per_chunk = max(1, limit // per_block)
            if per_block > self.max_chunk_bytes:
                await _refuse(context, grpc.StatusCode.FAILED_PRECONDITION, "request",
                              f"one block of one layer is {per_block} bytes, over this "
                              "worker's --max-message-bytes")
            wanted = pin.blocks[first:first + n]
            yield kpb.PullBlocksResponse(header=kpb.PullHeader(
                layout=layout_message(ours), num_tokens=pin.num_tokens, first_block=first,
                num_blocks=n, total_bytes=per_block * n * ours.num_layers))
            loop = asyncio.get_running_loop()
            sent = 0
            for layer in range(ours.num_layers):
                for start, count in blocks.runs(n, per_chunk):
                    keys, values = await loop.run_in_executor(
                        self._reader, blocks.read, caches, layer, wanted[start:start + count])
                    sent += len(keys) + len(values)
                    yield kpb.PullBlocksResponse(chunk=kpb.KVBlocksChunk(
                        layer=layer, first_block=first + start, num_blocks=count, keys=keys,
                        values=values))
            pulled = True
            engine.kv_stats.count("num_served_pulls")
            engine.kv_stats.count("num_served_bytes", sent)
        finally:  # however the stream ended (done, cancelled, failed): the pin is spent
            engine.release_pin(pin.handle, pulled=pulled)

    async def RenewLease(self, request: kpb.RenewLeaseRequest,
                         context: grpc.aio.ServicerContext):
        engine = await self._engine(context)
        lease = request.lease_s if 0 < request.lease_s <= self.lease_s else self.lease_s
        now = time.monotonic()
        pin = engine.kv.handoff_pins.renew(request.handle, now + lease)
        if pin is None:
            await _refuse(context, grpc.StatusCode.NOT_FOUND, "unknown",
                          "no such handoff here (pulled, released, expired or never made)")
        return kpb.RenewLeaseResponse(expires_in_s=pin.expires_at - now)

    async def ReleaseBlocks(self, request: kpb.ReleaseBlocksRequest,
                            context: grpc.aio.ServicerContext):
        engine = await self._engine(context)
        return kpb.ReleaseBlocksResponse(released=engine.release_pin(request.handle))
