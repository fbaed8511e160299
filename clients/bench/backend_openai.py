"""An OpenAI-compatible HTTP server (vLLM, SGLang, the SMG gateway), streaming SSE.

Chat requests go to ``/v1/chat/completions`` as messages; token-id prompts and rendered
text go to ``/v1/completions`` (``prompt`` a list of ids or a string). Every request asks
for ``stream: true`` and ``stream_options: {include_usage: true}``, so the last event
carries the prompt and completion token counts; ``max_tokens`` and, with --ignore-eos,
``ignore_eos`` are sent as vLLM's extra fields. A chunk counts as carrying a token when
its delta content (chat) or text (completions) is not empty; how many tokens it held is
unknown (recorded as 0), and TPOT uses the usage count. Without usage the output count
falls back to the number of such chunks.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from clients.bench.dataset import BenchRequest
from clients.bench.http import get_json, request
from clients.bench.record import RequestRecord
from clients.bench.sse import SSEParser

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class OpenAIBackend:
    name = "openai"

    def __init__(
        self,
        base_url: str,
        *,
        ignore_eos: bool,
        temperature: float,
        top_p: float = 1.0,
        penalties: dict[str, float] | None = None,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float | None = None,
    ) -> None:
        self.timeout = timeout
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        self.top_p = top_p
        self.penalties = dict(penalties or {})  # body fields: presence_penalty, ...
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def describe(self) -> dict[str, Any]:
        if self.model is None:  # the server's first model, as the OpenAI clients do
            listing = await get_json(self.base_url + "/v1/models", self.headers)
            self.model = listing["data"][0]["id"]
        # The OpenAI API does not say how the server was started: a harness that starts it
        # records its flags (clients.bench_gateway records its workers').
        return {"backend": self.name, "base_url": self.base_url, "model": self.model,
                "config": None, "config_error": "not reported over the OpenAI API"}

    def payload(self, req: BenchRequest) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.model or "",
            "max_tokens": req.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.top_p < 1:
            body["top_p"] = self.top_p
        body.update(self.penalties)
        if self.ignore_eos:
            body["ignore_eos"] = True
        if req.messages is not None:
            return CHAT_PATH, {**body, "messages": req.messages}
        prompt = req.token_ids if req.token_ids is not None else req.text
        return COMPLETIONS_PATH, {**body, "prompt": prompt}

    async def send(self, req: BenchRequest) -> RequestRecord:
        rec = RequestRecord(req.index, req.output_len)
        try:
            async with asyncio.timeout(self.timeout):
                await self._stream(req, rec)
        except TimeoutError:
            rec.success = False
            rec.error = f"timed out after {self.timeout} s"
        return rec

    async def _stream(self, req: BenchRequest, rec: RequestRecord) -> None:
        path, body = self.payload(req)
        rec.sent_at = t0 = time.perf_counter()
        done = False
        usage: dict[str, Any] | None = None
        try:
            resp = await request("POST", self.base_url + path, body, self.headers)
            try:
                if resp.status != 200:
                    text = (await resp.read_all()).decode(errors="replace")
                    rec.error = f"HTTP {resp.status} {resp.reason}: {text[:200]}"
                    return
                parser = SSEParser()
                async for piece in resp.body_chunks():
                    for data in parser.feed(piece):
                        if data.strip() == "[DONE]":
                            done = True
                            continue
                        event = json.loads(data)
                        if "error" in event:
                            rec.error = f"error event: {json.dumps(event['error'])[:200]}"
                            return
                        for choice in event.get("choices") or []:
                            delta = choice.get("delta") or {}
                            if delta.get("content") or choice.get("text"):
                                rec.add_chunk(time.perf_counter() - t0, 0)
                            if choice.get("finish_reason"):
                                rec.finish_reason = choice["finish_reason"]
                        if event.get("usage"):
                            usage = event["usage"]
            finally:
                await resp.close()
        # Connection, JSON, HTTP framing (a short read is an EOFError).
        except (OSError, ValueError, RuntimeError, EOFError, asyncio.LimitOverrunError) as e:
            rec.error = f"{type(e).__name__}: {e}"
            return
        if usage:
            rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            rec.output_tokens = int(usage.get("completion_tokens") or 0)
        else:
            rec.prompt_tokens = req.prompt_len or 0
            rec.output_tokens = len(rec.chunk_times)
        if not (done or rec.finish_reason):
            rec.error = "the stream ended without [DONE] or a finish reason"
        elif not rec.chunk_times:
            rec.error = "no chunk carried a token"
        else:
            rec.success = True

    async def close(self) -> None:
        pass
