"""Our own `llmworker.v1.WorkerService`, through `AsyncWorkerClient`.

Token-id prompts go as ``token_ids``, chats as ``chat`` messages (the worker applies the
chat template), rendered text as ``text``. A chunk carries its tokens' ids, so the record
knows how many each chunk held; output and prompt tokens come from the final ``usage``.
Success is a ``complete`` with finish reason stop or length; an RPC error or an abort is
a failure, recorded with its status.
"""

from __future__ import annotations

import json
import time
from typing import Any

import grpc

from clients.bench.dataset import BenchRequest
from clients.bench.record import RequestRecord
from clients.client import AsyncWorkerClient, finish_reason_name


class GrpcBackend:
    name = "grpc"

    def __init__(
        self,
        target: str,
        *,
        ignore_eos: bool,
        temperature: float,
        top_p: float = 1.0,
        penalties: dict[str, float] | None = None,
        token: str | None = None,
        timeout: float | None = None,
    ) -> None:
        # Streams are many and small: one channel multiplexes them all (HTTP/2).
        self.client = AsyncWorkerClient(target, token=token, timeout=timeout)
        self.target = target
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        self.top_p = top_p
        self.penalties = dict(penalties or {})  # request fields: presence_penalty, ...

    async def describe(self) -> dict[str, Any]:
        """The model, and the worker's whole configuration (its flags) and versions as
        GetServerStatus gives them, so that a figure says what it was measured under. That
        RPC is an admin one: refused (a Generate-only token), the record says why instead."""
        wait = self.client.timeout or 30
        info = await self.client.model_info(timeout=wait)
        server: dict[str, Any] = {
            "backend": self.name,
            "target": self.target,
            "model": info.model_name,
            "vocab_size": info.vocab_size,
            "max_model_len": info.max_model_len,
            "device": info.device,
            "dtype": info.dtype,
            "weights_source": info.weights_source,
        }
        try:
            status = await self.client.status(timeout=wait)
        except grpc.RpcError as e:
            server["config"] = None
            server["config_error"] = f"GetServerStatus: {e.code().name}: {(e.details() or '')[:200]}"
        else:
            server["config"] = json.loads(status.config_json) if status.config_json else None
            server["versions"] = dict(status.versions)
        return server

    async def send(self, req: BenchRequest) -> RequestRecord:
        rec = RequestRecord(req.index, req.output_len)
        if req.token_ids is not None:
            inputs: dict[str, Any] = {"token_ids": req.token_ids}
        elif req.messages is not None:
            inputs = {"messages": req.messages}
        else:
            inputs = {"prompt": req.text}
        rec.sent_at = t0 = time.perf_counter()
        call = self.client.generate(
            **inputs,
            max_tokens=req.output_len,
            temperature=self.temperature,
            top_p=self.top_p if self.top_p < 1 else None,
            ignore_eos=self.ignore_eos,
            **self.penalties,
        )
        try:
            async for resp in call:
                kind = resp.WhichOneof("response")
                if kind == "chunk" and resp.chunk.token_ids:
                    rec.add_chunk(time.perf_counter() - t0, len(resp.chunk.token_ids))
                elif kind == "complete":
                    done = resp.complete
                    rec.finish_reason = finish_reason_name(done.finish_reason)
                    rec.prompt_tokens = done.usage.prompt_tokens
                    rec.output_tokens = done.usage.completion_tokens
                    rec.error = done.error_message
        except grpc.RpcError as e:
            rec.error = f"{e.code().name}: {e.details()}"
            return rec
        if not rec.finish_reason:
            rec.error = "the stream ended without its complete message"
        elif rec.finish_reason not in ("stop", "length"):
            rec.error = rec.error or f"finish reason {rec.finish_reason}"
        else:
            rec.success = bool(rec.chunk_times) or rec.output_tokens == 0
        return rec

    async def close(self) -> None:
        await self.client.close()
