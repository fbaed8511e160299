"""Summary figures of a run, defined as ``vllm bench serve`` defines them.

Over the successful requests of a run lasting `duration` seconds (first send to last answer):

- request throughput = completed / duration; input and output tokens/s = the prompt and
  output tokens of the completed requests (as the server's usage reports them) / duration;
- TTFT: send -> first chunk carrying a token; e2e latency (E2EL): send -> last such chunk;
- TPOT per request = (E2EL - TTFT) / (output tokens - 1), for requests with > 1 token;
- ITL: every gap between consecutive token-carrying chunks, pooled over all requests. A
  chunk carrying k tokens is one gap, as in vLLM (its ITL counts chunks, not tokens;
  TPOT is the per-token figure);
- goodput: requests per second that met every SLO given (``ttft``, ``tpot``, ``e2el``); a
  request with one output token has TPOT 0 here, as in vLLM.

Each distribution is reported as mean, median, p90 and p99 in milliseconds (numpy's linear
interpolation), or None when it is empty. Failed requests are counted, and their errors
tallied, in `failed` and `errors`.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import numpy as np

from clients.bench.record import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el")
_UNITS = {"ms": 1e-3, "s": 1.0, "": 1e-3}  # a bare number is milliseconds


def distribution_ms(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    a = np.asarray(values_s, dtype=float) * 1e3
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def parse_slo(spec: str | None) -> dict[str, float]:
    """``"ttft=500ms,tpot=50ms,e2el=2s"`` -> {metric: seconds}; ValueError when malformed."""
    if not spec:
        return {}
    out: dict[str, float] = {}
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\w+)\s*[=:]\s*([0-9.]+)\s*(ms|s|)\s*", part)
        if not m or m.group(1) not in SLO_METRICS:
            raise ValueError(
                f"bad SLO {part!r}: use METRIC=VALUE[ms|s] with METRIC one of "
                f"{', '.join(SLO_METRICS)}, e.g. ttft=500ms,tpot=50ms"
            )
        out[m.group(1)] = float(m.group(2)) * _UNITS[m.group(3)]
    return out


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a successful request met every SLO in `slo` (seconds)."""
    got = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2el": rec.latency}
    return all(got[k] is not None and got[k] <= v for k, v in slo.items())


def summarize(
    records: list[RequestRecord], duration_s: float, slo: dict[str, float] | None = None
) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    out: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "errors": dict(Counter(r.error or r.finish_reason or "unknown" for r in failed)),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "input_throughput": total_in / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "ttft_ms": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": distribution_ms([g for r in ok for g in r.itl]),
        "e2el_ms": distribution_ms([r.latency for r in ok if r.latency is not None]),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in ok)
        out["slo_ms"] = {k: v * 1e3 for k, v in slo.items()}
        out["num_good"] = good
        out["request_goodput"] = good / dur
    return out
