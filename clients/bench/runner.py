"""One measured run, and a sweep of runs over request rates, against one backend.

A run sends every request of the dataset by its arrival process, waits for all, and is
timed from its first send to its last answer. Warm-up requests (the first few of the
dataset, at most 16 output tokens each, all at once) go before the first run and are not
counted. A sweep repeats the same requests at each rate, lowest first.
"""

from __future__ import annotations

import math
import time
from typing import Any

from clients.bench.arrival import arrival_offsets, dispatch
from clients.bench.dataset import BenchRequest
from clients.bench.metrics import summarize
from clients.bench.progress import Progress
from clients.bench.record import Backend, RequestRecord

WARMUP_MAX_TOKENS = 16


async def warm_up(backend: Backend, requests: list[BenchRequest], n: int) -> list[RequestRecord]:
    """Send `n` requests (the dataset's first, cycled) at once; results not counted."""
    if n <= 0 or not requests:
        return []
    reqs = []
    for i in range(n):
        r = requests[i % len(requests)]
        reqs.append(BenchRequest(
            -1 - i, min(r.output_len, WARMUP_MAX_TOKENS), r.kind, r.token_ids, r.messages, r.text
        ))
    records, _ = await dispatch(reqs, backend.send, [0.0] * n)
    return records


async def run_once(
    backend: Backend,
    requests: list[BenchRequest],
    *,
    request_rate: float,
    max_concurrency: int | None,
    seed: int,
    slo: dict[str, float],
    progress: bool = True,
    label: str = "",
) -> dict[str, Any]:
    """One run: its settings, summary and per-request records (JSON-ready), and under
    "_raw" (to pop before writing) the records themselves and their client queue times."""
    offsets = arrival_offsets(len(requests), request_rate, seed)
    bar = Progress(len(requests), label, enabled=progress)
    start = time.perf_counter()
    records, peak = await dispatch(
        requests, backend.send, offsets, max_concurrency, on_done=lambda r: bar.update(r.success)
    )
    duration = time.perf_counter() - start
    bar.close()
    summary = summarize(records, duration, slo)
    summary["max_in_flight"] = peak
    kinds = sorted({q.kind for q in requests})
    if len(kinds) > 1:  # e.g. mixed: do the short chats stall behind the long prompts?
        summary["by_kind"] = {
            k: _latencies(summarize([r for r, q in zip(records, requests, strict=True)
                                     if q.kind == k], duration, slo))
            for k in kinds
        }
    # From its arrival to its send: the time a request waited for a --max-concurrency slot.
    queue_s = [max(0.0, r.sent_at - start - at) for r, at in zip(records, offsets, strict=True)]
    return {
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "max_concurrency": max_concurrency,
        "summary": summary,
        "records": [{"kind": q.kind, **r.to_json(start)}
                    for r, q in zip(records, requests, strict=True)],
        # Not written: for vLLM's result file (vllm_result.py), which wants them unrounded.
        "_raw": (records, queue_s),
    }


def _latencies(s: dict[str, Any]) -> dict[str, Any]:
    keep = ("completed", "failed", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "num_good")
    return {k: s[k] for k in keep if k in s}


def rate_value(run: dict[str, Any]) -> float:
    r = run["request_rate"]
    return math.inf if r == "inf" else float(r)
