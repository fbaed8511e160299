"""llm-worker-bench --save-result: one run as `vllm bench serve --save-result` writes it
(clients/bench/vllm_result.py), on constructed traces: vLLM's keys in vLLM's order, and
values that agree with the bench's own summary and with vLLM's definitions computed here
by hand. tests/test_bench.py writes such files from runs against a real worker."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clients.bench import vllm_result as vr
from clients.bench.args import parse_args
from clients.bench.metrics import parse_slo, summarize
from tests.test_bench import rec, traces

# vLLM's vllm/benchmarks/serve.py (main, read 2026-12): the keys of a generation benchmark's
# result file without --save-detailed, --metadata or a server's spec-decode metrics, in the
# order it writes them (setup, then benchmark()'s result, then process_one_metric's keys for
# the default --percentile-metrics ttft,tpot,itl and --metric-percentiles 99).
VLLM_KEYS = [
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency",
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "latencies", "queue_times", "max_output_tokens_per_s", "max_concurrent_requests", "rtfx",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
]
SETUP = vr.setup_keys(backend="grpc", label=None, model_id="org/m", tokenizer_id="org/m",
                      num_prompts=4, metadata={})


def result(records=None, **kw):
    records = traces() if records is None else records
    args = {"queue_times_s": [0.0] * len(records), "duration_s": 2.0, "setup": SETUP,
            "request_rate": math.inf, "max_concurrency": None, "num_good": None, **kw}
    return vr.vllm_result(records, args.pop("queue_times_s"), **args)


def test_the_keys_are_vllms_in_vllms_order() -> None:
    out = result()
    assert list(out) == VLLM_KEYS
    assert (out["request_rate"], out["burstiness"], out["max_concurrency"]) == ("inf", 1.0, None)
    assert out["request_goodput"] is None and out["rtfx"] == 0.0
    assert out["date"] == SETUP["date"] and len(out["date"]) == len("20261201-120000")


def test_values_agree_with_the_summary_and_vllms_definitions() -> None:
    records = traces()
    s = summarize(records, duration_s=2.0)
    out = result(records)
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput"):
        assert out[key] == pytest.approx(s[key]), key
    assert out["duration"] == s["duration_s"] == 2.0
    for name in ("ttft", "tpot", "itl"):
        assert out[f"mean_{name}_ms"] == pytest.approx(s[f"{name}_ms"]["mean"]), name
        assert out[f"median_{name}_ms"] == pytest.approx(s[f"{name}_ms"]["median"]), name
        assert out[f"p99_{name}_ms"] == pytest.approx(s[f"{name}_ms"]["p99"]), name
    # By hand, as vLLM defines them: TTFT 100, 200, 50 ms (the failed request left out);
    # TPOT only where more than one token: 400/3 and 100/3 ms; ITL pooled: 100, 200, 100, 100.
    assert out["std_ttft_ms"] == pytest.approx(np.std([100, 200, 50]))
    assert out["mean_tpot_ms"] == pytest.approx((400 / 3 + 100 / 3) / 2)
    assert out["std_tpot_ms"] == pytest.approx(np.std([400 / 3, 100 / 3]))
    assert out["std_itl_ms"] == pytest.approx(np.std([100, 200, 100, 100]))
    # All sent at 0; every token arrives within the first second: 4 + 4 + 1 tokens; three
    # requests in flight at once (the failed one is not counted).
    assert (out["max_output_tokens_per_s"], out["max_concurrent_requests"]) == (9.0, 3)
    assert out["latencies"] == pytest.approx([0.5, 0.3, 0.05, 0.3])
    # Goodput, as vLLM's --goodput, from the same requests the summary judged.
    slo = summarize(records, 2.0, parse_slo("ttft=150ms,tpot=120ms"))
    assert result(records, num_good=slo["num_good"])["request_goodput"] == pytest.approx(0.5)


def test_peaks_count_tokens_per_second_and_overlap() -> None:
    a = rec(0, [0.2, 0.9, 1.5], [1, 2, 3])  # sent at 0: 3 tokens in second 0, 3 in second 1
    b = rec(1, [0.1, 0.2], [1, 1])
    b.sent_at = 1.2  # 1.3 and 1.4: second 1 gets 2 more; overlaps a's [0, 1.5)
    c = rec(2, [0.1], [1])
    c.sent_at = 1.5  # starts as a ends: [start, end) intervals do not overlap
    assert vr.peaks([a, b, c]) == (6.0, 2)
    assert vr.peaks([]) == (0.0, 0)


def test_percentiles_metrics_queue_times_and_details() -> None:
    records = traces()
    queue = [0.01, 0.02, 0.0, 0.5]
    out = result(records, queue_times_s=queue, request_rate=4.0, max_concurrency=2,
                 percentile_metrics=("ttft", "e2el", "client_queue_time",
                                     "e2el_including_client_queue"),
                 percentiles=(50.0, 90.0, 99.9), detailed=True)
    assert out["request_rate"] == 4.0 and out["max_concurrency"] == 2
    assert "p99.9_ttft_ms" in out and "p50_e2el_ms" in out and "mean_tpot_ms" not in out
    assert out["p90_ttft_ms"] == pytest.approx(180)  # linear: 100 + 0.8 * (200 - 100)
    assert out["mean_client_queue_time_ms"] == pytest.approx(10)  # successful ones: 10, 20, 0
    assert out["median_e2el_including_client_queue_ms"] == pytest.approx(320)  # 510, 320, 50
    assert out["queue_times"] == queue
    assert out["input_lens"] == [10, 10, 10, 10] and out["output_lens"] == [4, 4, 1, 0]
    assert out["ttfts"] == [0.1, 0.2, 0.05, 0.3] and out["itls"][0] == pytest.approx([0.1, 0.2, 0.1])
    assert out["errors"] == ["", "", "", "UNAVAILABLE: gone"]
    assert out["start_times"] == [0.0] * 4
    # Without a cap there is no client queue: vLLM writes no such figures.
    free = result(records, percentile_metrics=("client_queue_time",))
    assert not [k for k in free if "client_queue" in k]


def test_all_failed_gives_zeros_as_vllm() -> None:
    out = result([rec(0, [0.3], [1], ok=False)])
    assert (out["completed"], out["failed"], out["mean_ttft_ms"], out["p99_itl_ms"]) == (0, 1, 0.0, 0.0)
    assert (out["max_output_tokens_per_s"], out["max_concurrent_requests"]) == (0.0, 0)


def test_file_names_and_flags_as_vllm() -> None:
    assert vr.default_filename(label=None, backend="grpc", request_rate=math.inf,
                               max_concurrency=None, model_id="org/m", date="d") == "grpc-infqps-m-d.json"
    assert vr.default_filename(label="x", backend="grpc", request_rate=2, max_concurrency=8,
                               model_id="m", date="d") == "x-2.0qps-concurrency8-m-d.json"
    args = parse_args(["--save-result", "--metadata", "commit=abc", "tp=1", "--label", "mine",
                       "--metric-percentiles", "50,99.9", "--percentile-metrics", "ttft,e2el"])
    assert args.metadata == {"commit": "abc", "tp": "1"} and args.name == "mine"
    assert args.metric_percentiles == (50.0, 99.9) and args.percentile_metrics == ("ttft", "e2el")
    assert parse_args(["--append-result"]).save_result  # append implies save
    for bad in (["--result-dir", "x"],  # without --save-result
                ["--save-result", "--result-filename", "f.json", "--request-rate", "1,2"],
                ["--save-result", "--metadata", "novalue"],
                ["--percentile-metrics", "ttft,latency"], ["--metric-percentiles", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
