"""Prometheus metrics under vLLM's names, served over HTTP at --metrics-host:--metrics-port
/metrics (off when the port is 0), in the Prometheus text format (see `text_format_only`),
for the Gateway API Inference Extension endpoint pickers (llm-d and others), the Grafana
dashboards built for vLLM and deploy/'s (grafana-dashboard.json, prometheus-rules.yaml).

Every series carries the labels ``model_name`` (the served model's name, as GetModelInfo
reports it) and ``engine="0"`` (vLLM's engine index; we have one engine). Names and bucket
boundaries follow vLLM's V1 engine. Only tracked requests count: the warm-up does not.

Read at scrape time from the one `worker.load.Load` snapshot (the same figures as GetLoad)
and the engine's own tallies:

==========================================  =========  ===================================
vllm:num_requests_running                   gauge      requests in the scheduler's running
                                                       set
vllm:num_requests_waiting                   gauge      admitted and not running, preempted
                                                       ones included (swapped or waiting to
                                                       recompute), as vLLM v1 counts it
vllm:num_requests_swapped                   gauge      of those, preempted to the CPU swap
                                                       space (vLLM V0's name; V1 has none)
vllm:kv_cache_usage_perc                    gauge      fraction of KV blocks held by
                                                       requests, 0..1
vllm:gpu_cache_usage_perc                   gauge      the same figure under the name
                                                       vLLM used before 0.9 (deprecated
                                                       there; older pickers still read it)
vllm:prefix_cache_queries_total             counter    prompt tokens looked up in the
                                                       prefix cache (tokens, as vLLM counts)
vllm:prefix_cache_hits_total                counter    of those, tokens found cached
vllm:num_preemptions_total                  counter    preemptions (swap or recompute),
                                                       counted when the scheduler makes
                                                       them
vllm:iteration_tokens_total                 histogram  tokens the model ran per engine step
                                                       (prefill chunks + decodes), vLLM's
                                                       buckets; steps since the metrics
                                                       server started (not the warm-up's)
vllm:spec_decode_num_drafts_total           counter    with --speculative-config only:
                                                       drafts verified (one per request and
                                                       step that had draft tokens)
vllm:spec_decode_num_draft_tokens_total     counter    draft tokens verified
vllm:spec_decode_num_accepted_tokens_total  counter    of those, accepted (equal to the
                                                       model's own token there)
vllm:spec_decode_num_accepted_tokens_per_pos_total
                                            counter    accepted drafts by their position in
                                                       the draft (label position: 0, 1, ...)
llm_worker:structured_output_requests_total
                                            counter    requests admitted with a structured-
                                                       output constraint (label kind:
                                                       json_schema, regex, choice, grammar,
                                                       lark, gbnf, json_object,
                                                       structural_tag); ours, not vLLM's
vllm:cache_config_info                      gauge      always 1; the cache configuration in
                                                       labels, under vLLM's CacheConfig
                                                       names: block_size, cache_dtype,
                                                       gpu_memory_utilization, swap_space,
                                                       num_gpu_blocks (KV blocks on the
                                                       model's device), num_cpu_blocks,
                                                       enable_prefix_caching
vllm:lora_requests_info                     gauge      the scrape's time (vLLM sets it to
                                                       the time of its latest stats); labels
                                                       running_lora_adapters and
                                                       waiting_lora_adapters (comma lists of
                                                       the adapters of running and of
                                                       waiting requests; empty without
                                                       --enable-lora) and max_lora
                                                       (--max-loras, "0" without LoRA), what
                                                       endpoint pickers read for adapter
                                                       affinity
llm_worker:lora_requests_total              counter    with --enable-lora: requests served
                                                       with each loaded adapter since it was
                                                       loaded (label lora_name)
vllm:prompt_tokens_by_source_total         counter    prompt tokens by where their keys
                                                       and values came from (label source:
                                                       local_compute, local_cache_hit,
                                                       external_kv_transfer), counted as
                                                       each prompt is done
==========================================  =========  ===================================

With --kv-transfer-config (prefill/decode disaggregation, worker/kv_transfer), ours:

==========================================  =========  ===================================
llm_worker:kv_transfer_pulls_total          counter    handoffs pulled (decode side)
llm_worker:kv_transfer_blocks_total         counter    blocks they moved
llm_worker:kv_transfer_bytes_total          counter    bytes they moved (keys and values)
llm_worker:kv_transfer_seconds              histogram  one pull's time
llm_worker:kv_transfer_fallbacks_total      counter    handoffs not pulled, the prompt
                                                       computed here (label reason)
llm_worker:kv_transfer_skipped_total        counter    handoffs unneeded: the prefix cache
                                                       here held what they had
llm_worker:kv_transfer_handoffs_total       counter    tagged prompts handed off (prefill
                                                       side; label outcome: pinned, or
                                                       refused at the pin limit)
llm_worker:kv_transfer_pins_total           counter    pins ended (label outcome: pulled,
                                                       released, expired)
llm_worker:kv_transfer_pinned_blocks        gauge      blocks held for handoffs now
==========================================  =========  ===================================

The prefix-cache counters come from the KV cache's own statistics, which the warm-up's one
lookup also feeds.

Observed on the event loop as each engine step's outputs are dispatched (tokens) and once
per finished request (everything else); times are seconds of ``time.monotonic()``:

==========================================  =========  ===================================
vllm:prompt_tokens_total                    counter    prompt tokens, counted when a
                                                       request's first token arrives
                                                       (prefill done), cached ones included
vllm:generation_tokens_total                counter    generated tokens, as they arrive
vllm:time_to_first_token_seconds            histogram  arrival -> first token, observed
                                                       when it arrives
vllm:inter_token_latency_seconds            histogram  gap between a request's consecutive
                                                       tokens (one per token after the
                                                       first), between the engine steps
                                                       that produced them
vllm:time_per_output_token_seconds          histogram  the same observations under vLLM's
                                                       pre-0.11 name (deprecated there)
vllm:request_time_per_output_token_seconds  histogram  per request: decode time / (output
                                                       tokens - 1); 0 for one token or none
vllm:e2e_request_latency_seconds            histogram  arrival -> finished
vllm:request_queue_time_seconds             histogram  arrival -> first scheduled (the whole
                                                       life of one never scheduled)
vllm:request_prefill_time_seconds           histogram  first scheduled -> first token
vllm:request_decode_time_seconds            histogram  first token -> finished
vllm:request_inference_time_seconds         histogram  first scheduled -> finished
vllm:request_prompt_tokens                  histogram  prompt tokens per finished request
vllm:request_generation_tokens              histogram  output tokens per finished request
vllm:request_params_max_tokens              histogram  max_tokens per finished request
vllm:request_success_total                  counter    finished requests by finished_reason:
                                                       stop, length, abort, error
llm_worker:grpc_server_handled_total        counter    RPCs ended, by grpc_service,
                                                       grpc_method and grpc_code (the status
                                                       name: OK, INVALID_ARGUMENT,
                                                       RESOURCE_EXHAUSTED, UNAVAILABLE, ...),
                                                       as go-grpc-prometheus labels them;
                                                       both protocols' Generate and our
                                                       unary RPCs (not health, reflection);
                                                       rejections at the door included,
                                                       which no request counter sees
==========================================  =========  ===================================

So once every finished request produced at least one token, each per-request histogram
counts exactly the finished requests, and the token counters equal the sums of the usage
reported to clients. A request that ends before its first token (aborted while queued,
failed) adds no TTFT and no prompt tokens, as in vLLM.

Threads: prometheus_client answers scrapes on its own threads, while the engine runs on
another and the bridge lives on the event loop, where `EngineBridge.tokens_per_second` trims
a deque that `_dispatch` appends to. So a scrape never computes the snapshot itself: it asks
the loop for one (``call_soon_threadsafe``) and waits for it, up to `SNAPSHOT_TIMEOUT_S`;
when the loop does not answer in time (or has closed) it serves the last snapshot taken.
The snapshot is then computed on the loop by the same function as GetLoad's. Histograms and
counters are prometheus_client objects, which lock internally; only the loop writes them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import socket
import threading
import time
from collections.abc import Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from worker import telemetry
from worker.bridge import EngineBridge, RequestStream
from worker.kv_transfer.stats import PULL_SECONDS_BUCKETS
from worker.load import Load, snapshot
from worker.outputs import RequestOutput

log = logging.getLogger(__name__)

LABELS = ("model_name", "engine")
SNAPSHOT_TIMEOUT_S = 2.0

# vLLM's boundaries, so that dashboards' histogram_quantile reads the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# vLLM's buckets for vllm:iteration_tokens_total without CUDA graphs (with them vLLM uses its
# capture sizes); one fixed set keeps dashboards comparable across our devices.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


def lora_adapters(scheduler: Any) -> tuple[str, str]:
    """The adapters of running and of waiting (or swapped) requests, as vLLM's comma lists.
    Read from another thread: list() copies are single C calls, safe against the engine
    thread changing the queues meanwhile."""
    def names(reqs: list[Any]) -> str:
        return ",".join(sorted({r.lora_name for r in reqs if r.lora_name}))
    return names(list(scheduler.running)), names(list(scheduler.waiting) + list(scheduler.swapped))


class LoadCollector(Collector):
    """The gauges, the cache and preemption counters and the step histogram: from a `Load`
    taken on the loop at each scrape, and the engine's plain tallies."""

    def __init__(self, bridge: EngineBridge, loop: asyncio.AbstractEventLoop,
                 labels: tuple[str, str], cache_info: dict[str, str]) -> None:
        self.bridge = bridge
        self.loop = loop
        self.labels = list(labels)
        self.cache_info = cache_info
        self._last: Load | None = None
        # What the engine ran before metrics existed (the warm-up) is left out.
        self._base_step_tokens = dict(bridge.engine.step_tokens)
        self._base_sources = dict(bridge.engine.prompt_tokens_by_source)
        self._base_spec = self._spec_tallies()

    def _spec_tallies(self) -> tuple[int, int, int, list[int]]:
        e = self.bridge.engine
        return e.num_drafts, e.num_draft_tokens, e.num_accepted_tokens, list(e.accepted_per_position)

    def load(self) -> Load | None:
        if self._on_loop():
            self._last = snapshot(self.bridge)
            return self._last
        fut: concurrent.futures.Future[Load] = concurrent.futures.Future()

        def take() -> None:  # on the loop
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(snapshot(self.bridge))
                except Exception as e:
                    fut.set_exception(e)

        try:
            self.loop.call_soon_threadsafe(take)
            self._last = fut.result(SNAPSHOT_TIMEOUT_S)
        except (RuntimeError, concurrent.futures.TimeoutError):  # loop closed, or busy
            fut.cancel()
            log.warning("metrics: the event loop did not answer; serving the last snapshot")
        return self._last

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def collect(self) -> Iterator[Metric]:
        load = self.load()
        if load is None:
            return
        names = list(LABELS)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(self.labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(self.labels, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running set.", load.num_running)
        yield gauge("vllm:num_requests_waiting",
                    "Requests waiting to run, preempted ones (swapped or to recompute) included.",
                    load.num_waiting_reqs)
        yield gauge("vllm:num_requests_swapped",
                    "Requests preempted to the CPU swap space (also counted as waiting).",
                    load.num_swapped)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.",
                    load.kv_cache_usage)
        yield gauge("vllm:gpu_cache_usage_perc",
                    "KV-cache usage; 1 means 100 percent. Deprecated: vllm:kv_cache_usage_perc.",
                    load.kv_cache_usage)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in queried tokens.", load.prefix_cache_queried_tokens)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in cached tokens.", load.prefix_cache_hit_tokens)
        yield counter("vllm:num_preemptions", "Preemptions, counted when they are made.",
                      load.num_preemptions)
        yield self._iteration_tokens()
        if self.bridge.engine.speculation is not None:  # as vLLM: only when speculating
            *now, per_pos = self._spec_tallies()
            *base, base_per_pos = self._base_spec
            drafts, tokens, accepted = (n - b for n, b in zip(now, base, strict=True))
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", tokens)
            yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          accepted)
            pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.",
                                      labels=[*names, "position"])
            for j, (n, b) in enumerate(zip(per_pos, base_per_pos, strict=True)):
                pos.add_metric([*self.labels, str(j)], n - b)
            yield pos
        sources = CounterMetricFamily("vllm:prompt_tokens_by_source",
                                      "Prompt tokens by the source of their KV.",
                                      labels=[*names, "source"])
        for source, n in self.bridge.engine.prompt_tokens_by_source.copy().items():
            sources.add_metric([*self.labels, source], n - self._base_sources.get(source, 0))
        yield sources
        if self.bridge.engine.config.kv_transfer.kv_transfer_config is not None:
            yield from self._kv_transfer(names)
        structured = CounterMetricFamily(
            "llm_worker:structured_output_requests",
            "Requests admitted with a structured-output constraint, by its kind.",
            labels=[*names, "kind"])
        for kind, n in sorted(self.bridge.engine.structured_requests.copy().items()):
            structured.add_metric([*self.labels, kind], n)
        yield structured
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the cache config.",
                                 labels=[*self.cache_info, *names])
        info.add_metric([*self.cache_info.values(), *self.labels], 1)
        yield info
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["running_lora_adapters", "waiting_lora_adapters",
                                         "max_lora", *names])
        engine = self.bridge.engine
        running, waiting = lora_adapters(engine.scheduler)
        max_lora = str(engine.config.lora.max_loras) if engine.loras is not None else "0"
        lora.add_metric([running, waiting, max_lora, *self.labels], time.time())
        yield lora
        if engine.loras is not None:
            per = CounterMetricFamily("llm_worker:lora_requests",
                                      "Requests served with each LoRA adapter.",
                                      labels=[*names, "lora_name"])
            for info in engine.loras.infos():
                per.add_metric([*self.labels, info.name], info.num_requests)
            yield per

    def _kv_transfer(self, names: list[str]) -> Iterator[Metric]:
        engine = self.bridge.engine
        k = engine.kv_stats.snapshot()
        pins = engine.kv.handoff_pins

        def family(kind: type, name: str, doc: str, value: float | None = None,
                   label: str | None = None, values: dict[str, float] | None = None) -> Metric:
            m = kind(name, doc, labels=[*names, label] if label else names)
            if label:
                for key, v in sorted((values or {}).items()):
                    m.add_metric([*self.labels, key], v)
            else:
                m.add_metric(self.labels, value)
            return m

        yield family(CounterMetricFamily, "llm_worker:kv_transfer_pulls", "KV handoffs pulled.",
                     k.num_pulls)
        yield family(CounterMetricFamily, "llm_worker:kv_transfer_blocks",
                     "KV blocks pulled.", k.num_pulled_blocks)
        yield family(CounterMetricFamily, "llm_worker:kv_transfer_bytes",
                     "KV bytes pulled.", k.num_pulled_bytes)
        h = HistogramMetricFamily("llm_worker:kv_transfer_seconds", "Seconds of one KV pull.",
                                  labels=names)
        counts = list(itertools.accumulate(k.pull_seconds))
        buckets = [(floatToGoString(le), c) for le, c in zip(PULL_SECONDS_BUCKETS, counts,
                                                             strict=False)]
        h.add_metric(self.labels, [*buckets, ("+Inf", counts[-1])], sum_value=k.pull_seconds_sum)
        yield h
        yield family(CounterMetricFamily, "llm_worker:kv_transfer_fallbacks",
                     "KV handoffs not pulled (the prompt computed here), by reason.",
                     label="reason", values=k.fallbacks)
        yield family(CounterMetricFamily, "llm_worker:kv_transfer_skipped",
                     "KV handoffs unneeded: the prefix cache held them.", k.num_skipped)
        yield family(CounterMetricFamily, "llm_worker:kv_transfer_handoffs",
                     "Tagged prompts handed off, by outcome.", label="outcome",
                     values={"pinned": k.num_handoffs, "refused": k.num_handoffs_refused})
        yield family(CounterMetricFamily, "llm_worker:kv_transfer_pins", "Pins ended, by how.",
                     label="outcome", values={"pulled": pins.num_pulled,
                                              "released": pins.num_released,
                                              "expired": pins.num_expired})
        yield family(GaugeMetricFamily, "llm_worker:kv_transfer_pinned_blocks",
                     "KV blocks pinned for handoffs now.", pins.num_blocks())

    def _iteration_tokens(self) -> HistogramMetricFamily:
        # A dict copy is one C call: safe against the engine thread adding a key meanwhile.
        tally = self.bridge.engine.step_tokens.copy()
        steps = {n: c - self._base_step_tokens.get(n, 0) for n, c in tally.items()}
        buckets = [(floatToGoString(le), sum(c for n, c in steps.items() if n <= le))
                   for le in ITERATION_TOKEN_BUCKETS]
        buckets.append(("+Inf", sum(steps.values())))
        h = HistogramMetricFamily("vllm:iteration_tokens_total",
                                  "Histogram of number of tokens per engine_step.",
                                  labels=list(LABELS))
        h.add_metric(self.labels, buckets, sum_value=sum(n * c for n, c in steps.items()))
        return h


class RequestMetrics:
    """The counters and histograms fed by the bridge (an `EngineBridge` observer): every
    call comes on the loop, for tracked requests only."""

    def __init__(self, registry: CollectorRegistry, labels: tuple[str, str],
                 max_model_len: int) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=registry).labels(*labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[int]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=registry, buckets=buckets).labels(*labels)

        tokens = one_two_five(max_model_len)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               (*LABELS, "finished_reason"), registry=registry)
        self._labels = labels
        for reason in ("stop", "length", "abort", "error"):  # present from the start, at 0
            self.success.labels(*labels, reason)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Inter-token latency in seconds.", TOKEN_GAP_BUCKETS)
        self.tpot_old = histogram(
            "vllm:time_per_output_token_seconds",
            "Inter-token latency in seconds. Deprecated: vllm:inter_token_latency_seconds.",
            TOKEN_GAP_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Mean time per output token of each request, seconds.",
                                      TOKEN_GAP_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "End-to-end request latency in seconds.", REQUEST_TIME_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Seconds from arrival to first scheduled.", REQUEST_TIME_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Seconds from first scheduled to first token.",
                                 REQUEST_TIME_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Seconds from first token to finished.", REQUEST_TIME_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Seconds from first scheduled to finished.",
                                   REQUEST_TIME_BUCKETS)
        self.request_prompt = histogram("vllm:request_prompt_tokens",
                                        "Prompt tokens of each finished request.", tokens)
        self.request_generation = histogram("vllm:request_generation_tokens",
                                            "Output tokens of each finished request.", tokens)
        self.max_tokens = histogram("vllm:request_params_max_tokens",
                                    "max_tokens of each finished request.", tokens)
        self._last_token_t: dict[str, float] = {}  # request id -> when its last token came

    def output(self, stream: RequestStream, out: RequestOutput, t: float) -> None:
        """An output dispatched at `t` (the engine step's end); may be the finished one."""
        n = len(out.new_token_ids)
        if not n:
            return
        rid, req = stream.request_id, stream.request
        last = self._last_token_t.get(rid)
        if last is None:
            first = req.first_token_time if req.first_token_time is not None else t
            self.ttft.observe(max(0.0, first - req.arrival_time))
            self.prompt_tokens.inc(out.prompt_tokens)
        else:
            self.itl.observe(t - last)
            self.tpot_old.observe(t - last)
        self.generation_tokens.inc(n)
        self._last_token_t[rid] = t

    def finished(self, stream: RequestStream, out: RequestOutput) -> None:
        """Once per finished request, after its last `output`."""
        self._last_token_t.pop(stream.request_id, None)
        req = stream.request
        self.success.labels(*self._labels, out.finish_reason or "error").inc()
        e2e = out.total_time_s if out.total_time_s is not None else 0.0
        # Times since arrival; a phase never reached ends where the request did.
        scheduled = (e2e if req.first_scheduled_time is None
                     else req.first_scheduled_time - req.arrival_time)
        first = e2e if req.first_token_time is None else req.first_token_time - req.arrival_time
        self.e2e.observe(e2e)
        self.queue.observe(scheduled)
        self.prefill.observe(max(0.0, first - scheduled))
        self.decode.observe(max(0.0, e2e - first))
        self.inference.observe(max(0.0, e2e - scheduled))
        n = out.completion_tokens
        self.request_tpot.observe(max(0.0, e2e - first) / (n - 1) if n > 1 else 0.0)
        self.request_prompt.observe(out.prompt_tokens)
        self.request_generation.observe(n)
        self.max_tokens.observe(req.sampling_params.max_tokens)


class RpcMetrics:
    """RPCs by status, fed by `telemetry.rpc_observers` (on the loop) while registered."""

    def __init__(self, registry: CollectorRegistry, labels: tuple[str, str]) -> None:
        self._labels = labels
        self.handled = Counter("llm_worker:grpc_server_handled", "RPCs ended, by status code.",
                               (*LABELS, "grpc_service", "grpc_method", "grpc_code"),
                               registry=registry)

    def __call__(self, method: str, code: str) -> None:
        service, _, name = method.rpartition("/")
        self.handled.labels(*self._labels, service, name, code).inc()


class MetricsServer:
    """The registry, the bridge observer and the HTTP server of one worker."""

    def __init__(self, bridge: EngineBridge, host: str, port: int) -> None:
        engine = bridge.engine
        labels = (engine.model_name, "0")
        # No `*_created` series: vLLM publishes none, and they double the counters' lines.
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()  # private: not the process-wide default
        self.requests = RequestMetrics(self.registry, labels, engine.max_model_len)
        cc = engine.config.cache
        # vLLM's CacheConfig field names and str() forms, for the fields we have.
        cache_info = {
            "block_size": str(engine.kv.block_size),
            "cache_dtype": "auto",  # the KV cache is in the model's dtype, as vLLM's "auto"
            "gpu_memory_utilization": str(cc.gpu_memory_utilization),
            "swap_space": str(cc.swap_space),
            "num_gpu_blocks": str(engine.kv.num_blocks),
            "num_cpu_blocks": str(engine.kv.num_cpu_blocks),
            "enable_prefix_caching": str(cc.enable_prefix_caching),
        }
        self.registry.register(LoadCollector(bridge, asyncio.get_running_loop(), labels,
                                             cache_info))
        self._httpd: WSGIServer
        self._thread: threading.Thread
        try:
            self._httpd = _metrics_server(host, port, text_format_only(
                prometheus_client.make_wsgi_app(self.registry)))
        except OSError as e:
            raise ValueError(f"--metrics-port: cannot listen on {host}:{port}: {e}") from e
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http",
                                        daemon=True)
        self._thread.start()
        self.port: int = self._httpd.server_address[1]
        bridge.observers.append(self.requests)
        self.rpcs = RpcMetrics(self.registry, labels)
        telemetry.rpc_observers.append(self.rpcs)

    def stop(self) -> None:
        """Blocks until the server thread ends (up to its 0.5 s poll): call off the loop."""
        if self.rpcs in telemetry.rpc_observers:
            telemetry.rpc_observers.remove(self.rpcs)
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)


# The Prometheus text format (0.0.4), whatever the scraper asks for. Prometheus 2.x asks for
# OpenMetrics first, and prometheus_client's OpenMetrics writer (0.26), unless the scraper
# asks for UTF-8 names, writes each sample of vllm:num_requests_waiting as
# vllm_num_requests_waiting, under HELP and TYPE lines that keep the colon
# (prometheus/client_python#1177): a real Prometheus then stored none of our vLLM names
# (tests/test_prometheus.py). The text format keeps them; we publish nothing that needs
# OpenMetrics (no exemplars, no _created series).
TEXT_FORMAT = "text/plain; version=0.0.4"


def text_format_only(app: Any) -> Any:
    def app_text_format(environ: dict[str, Any], start_response: Any) -> Any:
        return app({**environ, "HTTP_ACCEPT": TEXT_FORMAT}, start_response)
    return app_text_format


# prometheus_client's start_http_server gives each connection a thread with no timeout and no
# limit: 1,500 half-sent requests held 1,500 threads, then /metrics timed out (a probe, session
# 27). A scraper sends its request at once and reads a few kilobytes.
METRICS_TIMEOUT_S = 10.0
METRICS_CONNECTIONS = 16


class _QuietHandler(WSGIRequestHandler):
    timeout = METRICS_TIMEOUT_S  # a connection that sends nothing for this long is closed

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _MetricsServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most METRICS_CONNECTIONS at once (more are closed at
    once: a scraper retries at its next interval)."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(METRICS_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _metrics_server(host: str, port: int, app: Any) -> WSGIServer:
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (_MetricsServer,), {"address_family": family})
    server = server_class((host, port), _QuietHandler)
    server.set_app(app)
    return server
