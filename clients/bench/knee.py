"""The knee of a latency-throughput sweep: the most load the server takes before queueing.

Definition: with the runs in increasing request rate and B the p99 TTFT of the lowest
rate (the low-load value), the knee is the last rate before the first run whose p99 TTFT
exceeds ``factor * B`` (3 by default) or that has a failed request. Past it, requests wait
in a queue that grows with the rate, and throughput stops growing with it. When no run
crosses the line, the knee is the highest rate and ``reached`` is False: sweep higher.
"""

from __future__ import annotations

from typing import Any

from clients.bench.runner import rate_value

DEFAULT_FACTOR = 3.0


def find_knee(runs: list[dict[str, Any]], factor: float = DEFAULT_FACTOR) -> dict[str, Any]:
    ordered = sorted(runs, key=rate_value)
    base = ordered[0]["summary"]["ttft_ms"]["p99"] if ordered else None
    knee: dict[str, Any] | None = None
    crossed = None
    for run in ordered:
        s = run["summary"]
        p99 = s["ttft_ms"]["p99"]
        if s["failed"] or p99 is None or base is None or p99 > factor * base:
            crossed = run
            break
        knee = run
    return {
        "definition": f"last rate before p99 TTFT exceeds {factor:g}x its lowest-rate value "
                      "(or a request fails)",
        "factor": factor,
        "baseline_p99_ttft_ms": base,
        "request_rate": None if knee is None else knee["request_rate"],
        "output_throughput": None if knee is None else knee["summary"]["output_throughput"],
        "p99_ttft_ms": None if knee is None else knee["summary"]["ttft_ms"]["p99"],
        "first_rate_past": None if crossed is None else crossed["request_rate"],
        "reached": crossed is not None,
    }
