"""One run as ``vllm bench serve --save-result`` writes it (vLLM's vllm/benchmarks/serve.py,
read 2026-12), so that tools reading vLLM's result files read ours.

The keys, in vLLM's order: the setup (``date``, ``endpoint_type``, ``backend``, ``label``,
``model_id``, ``tokenizer_id``, ``num_prompts``, any ``--metadata`` KEY=VALUE, then
``request_rate``, ``burstiness``, ``max_concurrency``), the totals (``duration``,
``completed``, ``failed``, ``total_input_tokens``, ``total_output_tokens``,
``request_throughput``, ``request_goodput``, ``output_throughput``,
``total_token_throughput``), per request ``latencies`` and ``queue_times`` (and with
--save-detailed ``input_lens``, ``output_lens``, ``start_times``, ``ttfts``, ``itls``,
``errors``), ``max_output_tokens_per_s``, ``max_concurrent_requests``, ``rtfx``, then for
each metric of --percentile-metrics (default ttft,tpot,itl) ``mean_X_ms``, ``median_X_ms``,
``std_X_ms`` and ``pP_X_ms`` for each P of --metric-percentiles (default 99: ``p99_ttft_ms``).

Definitions are vLLM's, over the successful requests of the run (metrics.py has ours, the
same): TTFT; TPOT = (E2EL - TTFT) / (output tokens - 1), for requests of more than one token;
ITL, every gap between token-carrying chunks, pooled; E2EL; client queue time, from the
request's arrival (its offset in the arrival process) to its send (a --max-concurrency slot).
Mean, median, population standard deviation and numpy's linear percentiles, in
milliseconds; an empty list gives 0, as vLLM's ``np.mean(x or 0)`` does. Throughputs divide
by ``duration``, the run's first send to its last answer. ``request_goodput`` is None without
an SLO (--slo, vLLM's --goodput). ``max_output_tokens_per_s`` is the most output tokens
arriving in one second of the run (seconds counted from the first send), and
``max_concurrent_requests`` the most requests in flight at once, both over successful
requests; vLLM counts a streamed chunk as one token there, we count its tokens (our gRPC
chunks may carry several). ``rtfx`` (speech recognition) is 0. Not written: vLLM's
``generated_texts`` (the bench keeps no text) and its ``spec_decode_*`` keys (read from a
vLLM server's /metrics; the worker's are in its Prometheus metrics).
"""

from __future__ import annotations

import datetime
import math
from typing import Any

import numpy as np

from clients.bench.record import RequestRecord

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time",
                      "e2el_including_client_queue")
DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl")
DEFAULT_PERCENTILES = (99.0,)


def percentile_word(p: float) -> str:
    """vLLM's key spelling: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def stats_ms(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    a = np.asarray(values_s or [0.0], dtype=float) * 1e3
    out = {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
           f"std_{name}_ms": float(a.std())}
    for p in percentiles:
        out[f"p{percentile_word(p)}_{name}_ms"] = float(np.percentile(a, p))
    return out


def peaks(ok: list[RequestRecord]) -> tuple[float, int]:
    """(most output tokens in one second of the run, most requests in flight at once)."""
    if not ok:
        return 0.0, 0
    start = min(r.sent_at for r in ok)
    end = max(r.sent_at + (r.latency or 0.0) for r in ok)
    per_second = np.zeros(math.ceil(end - start) + 1)
    events = []
    for r in ok:
        for t, n in zip(r.chunk_times, r.chunk_tokens, strict=True):
            per_second[int(r.sent_at + t - start)] += n or 1  # 0: a count the chunk did not say
        events += [(r.sent_at, 1), (r.sent_at + (r.latency or 0.0), -1)]
    in_flight = peak = 0
    for _, step in sorted(events):  # an end before a start at the same time: [start, end)
        in_flight += step
        peak = max(peak, in_flight)
    return float(per_second.max()), peak


def vllm_result(
    records: list[RequestRecord],
    queue_times_s: list[float],
    *,
    duration_s: float,
    setup: dict[str, Any],
    request_rate: float,
    max_concurrency: int | None,
    num_good: int | None,
    percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
    detailed: bool = False,
) -> dict[str, Any]:
    """vLLM's result dict for one run: `records` in dataset order, `queue_times_s` theirs;
    `setup` the keys from ``date`` to ``num_prompts`` (and metadata), in order."""
    assert len(queue_times_s) == len(records)
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    out: dict[str, Any] = {
        **setup,
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "burstiness": 1.0,  # Poisson arrivals (vLLM's gamma with shape 1)
        "max_concurrency": max_concurrency,
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": None if num_good is None else num_good / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
    }
    if detailed:
        out.update({
            "input_lens": [r.prompt_tokens for r in records],
            "output_lens": [r.output_tokens if r.success else 0 for r in records],
            "start_times": [r.sent_at - min(x.sent_at for x in records) for r in records],
            "ttfts": [r.ttft or 0.0 for r in records],
            "itls": [r.itl for r in records],
            "errors": [r.error for r in records],
        })
    most_tokens, most_in_flight = peaks(ok)
    out.update({
        "latencies": [r.latency or 0.0 for r in records],
        "queue_times": list(queue_times_s),
        "max_output_tokens_per_s": most_tokens,
        "max_concurrent_requests": most_in_flight,
        "rtfx": 0.0,
    })
    queue_ok = [q for r, q in zip(records, queue_times_s, strict=True) if r.success]
    values = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.latency for r in ok if r.latency is not None],
        # As vLLM: only with a concurrency cap (and, the second, a finite rate).
        "client_queue_time": queue_ok if max_concurrency is not None else None,
        "e2el_including_client_queue": (
            [(r.latency or 0.0) + q for r, q in zip(ok, queue_ok, strict=True)]
            if max_concurrency is not None and not math.isinf(request_rate) else None),
    }
    for name in percentile_metrics:
        if values[name] is not None:
            out.update(stats_ms(name, values[name], percentiles))
    return out


def setup_keys(*, backend: str, label: str | None, model_id: str, tokenizer_id: str,
               num_prompts: int, metadata: dict[str, str]) -> dict[str, Any]:
    """vLLM's first keys, its `date` local time as it writes it."""
    return {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend,
            "backend": backend, "label": label, "model_id": model_id,
            "tokenizer_id": tokenizer_id, "num_prompts": num_prompts, **metadata}


def default_filename(*, label: str | None, backend: str, request_rate: float,
                     max_concurrency: int | None, model_id: str, date: str) -> str:
    """vLLM's name: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json."""
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    return f"{label or backend}-{float(request_rate)}qps{conc}-{model_id.split('/')[-1]}-{date}.json"
