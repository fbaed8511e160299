"""Prometheus metrics under vLLM's names (worker/metrics.py), scraped over HTTP from a real
`llm-worker serve` process: the gauges move under load and come back to zero; after a known
set of requests every per-request histogram, token counter and finish-reason counter agrees
with what the clients were told, and the per-step histogram with the engine's steps; a
preemption is counted when it happens and its victim counts as waiting, as in vLLM v1."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator

import psutil
import pytest
from llmworker.v1 import worker_pb2 as pb
from prometheus_client.parser import text_string_to_metric_families

from tests.test_server import GREEDY, Worker, run, wait_until
from worker.config import CacheConfig

MODEL = "SmolLM2-135M-Instruct"
PER_REQUEST_HISTOGRAMS = (
    "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:request_params_max_tokens",
)
REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
           pb.FINISH_REASON_ABORT: "abort"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Scrape:
    """One /metrics answer, parsed: sample name -> value (every series must carry our
    model_name and engine labels)."""

    def __init__(self, port: int, model: str = MODEL) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        self.values: dict[str, float] = {}
        self.by_reason: dict[str, float] = {}
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        for fam in self.families.values():
            for s in fam.samples:
                if not s.name.startswith("vllm:"):
                    continue
                assert s.labels["model_name"] == model and s.labels["engine"] == "0", s
                if s.name == "vllm:request_success_total":
                    self.by_reason[s.labels["finished_reason"]] = s.value
                elif "le" not in s.labels:
                    self.values[s.name] = s.value

    def __getitem__(self, name: str) -> float:
        return self.values[name]


@contextlib.contextmanager
def worker_with_metrics(*flags: str) -> Iterator[tuple[Worker, int]]:
    """A ready `llm-worker serve --metrics-port PORT *flags`, and PORT."""
    port = free_port()
    w = Worker("--metrics-port", str(port), *flags)
    try:
        w.wait_ready()
        w.wait_for(rf"Prometheus metrics .* on http://127\.0\.0\.1:{port}/metrics", timeout=5)
        yield w, port
    finally:
        w.close()


@pytest.fixture(scope="module")
def metrics_worker() -> Iterator[tuple[Worker, int]]:
    with worker_with_metrics() as served:
        yield served


def test_fresh_worker_publishes_vllm_names_at_zero(metrics_worker: tuple[Worker, int]) -> None:
    w, port = metrics_worker
    m = Scrape(port)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_requests_swapped", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:num_preemptions_total", "vllm:inter_token_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count"):
        assert m[name] == 0, name  # the warm-up generation is not counted
    for name in PER_REQUEST_HISTOGRAMS:
        assert m.families[name].type == "histogram" and m[f"{name}_count"] == 0, name
    assert m.by_reason == {"stop": 0, "length": 0, "abort": 0, "error": 0}
    assert m["vllm:prefix_cache_hits_total"] <= m["vllm:prefix_cache_queries_total"]
    load = w.stub.GetLoad(pb.GetLoadRequest(), timeout=5)
    (info,) = m.families["vllm:cache_config_info"].samples
    assert int(info.labels["num_gpu_blocks"]) == load.num_total_blocks
    assert info.value == 1
    assert {k: info.labels[k] for k in ("block_size", "cache_dtype", "enable_prefix_caching",
                                        "swap_space", "gpu_memory_utilization")} == {
        "block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True",
        "swap_space": "4.0",
        "gpu_memory_utilization": str(CacheConfig().gpu_memory_utilization)}
    assert int(info.labels["num_cpu_blocks"]) > 0  # 4 GiB of swap space
    # The warm-up's steps are not counted; the buckets are vLLM's.
    assert m.families["vllm:iteration_tokens_total"].type == "histogram"
    assert m["vllm:iteration_tokens_total_count"] == m["vllm:iteration_tokens_total_sum"] == 0
    bounds = [s.labels["le"] for s in m.families["vllm:iteration_tokens_total"].samples
              if s.name.endswith("_bucket")]
    assert bounds == [*(f"{b}.0" for b in (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                           8192, 16384)), "+Inf"]
    # LoRA: the family exists (pickers read it), no adapters, its value the time.
    (lora,) = m.families["vllm:lora_requests_info"].samples
    assert (lora.labels["running_lora_adapters"], lora.labels["waiting_lora_adapters"],
            lora.labels["max_lora"]) == ("", "", "0")
    assert abs(lora.value - time.time()) < 60


def test_gauges_move_under_load_and_return_to_zero(metrics_worker: tuple[Worker, int]) -> None:
    w, port = metrics_worker
    calls = [w.stub.Generate(pb.GenerateRequest(
        request_id=f"long-{i}", text=f"Story number {i}: once upon a time", sampling=GREEDY,
        stopping=pb.StoppingCriteria(max_tokens=400, ignore_eos=True)), timeout=120)
        for i in range(4)]
    ends: list[pb.GenerateComplete] = []

    def drain(call) -> None:
        ends.extend(r.complete for r in call if r.HasField("complete"))

    readers = [threading.Thread(target=drain, args=(c,)) for c in calls]
    for t in readers:
        t.start()
    seen: dict[str, float] = {}
    end = time.monotonic() + 60
    # Running and KV usage move at admission; generated tokens once a prefill is done (on a
    # slow machine that can be several scrapes later), all while the streams still run.
    while not (seen.get("running", 0) >= 2 and seen.get("kv", 0) > 0 and seen.get("gen", 0) > 0):
        assert time.monotonic() < end, f"gauges never moved: {seen}"
        m = Scrape(port)
        seen["running"] = max(seen.get("running", 0), m["vllm:num_requests_running"])
        seen["kv"] = max(seen.get("kv", 0), m["vllm:kv_cache_usage_perc"])
        seen["gen"] = m["vllm:generation_tokens_total"]  # counted while streaming
        assert 0 <= m["vllm:kv_cache_usage_perc"] <= 1
        assert m["vllm:kv_cache_usage_perc"] == m["vllm:gpu_cache_usage_perc"]
        time.sleep(0.05)
    w.stub.Abort(pb.AbortRequest(request_ids=[f"long-{i}" for i in range(4)]), timeout=5)
    for t in readers:
        t.join(30)
    assert [e.finish_reason for e in ends] == [pb.FINISH_REASON_ABORT] * 4

    def idle() -> bool:
        m = Scrape(port)
        return (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"],
                m["vllm:kv_cache_usage_perc"]) == (0, 0, 0)

    wait_until(idle, timeout=10, what="the gauges back at zero")


def test_histograms_and_counters_match_client_usage(metrics_worker: tuple[Worker, int]) -> None:
    w, port = metrics_worker
    before = Scrape(port)
    steps_before = w.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=5).num_steps
    done: list[pb.GenerateComplete] = []
    # A prompt over two KV blocks, sent twice: the second one hits the prefix cache.
    shared = "The quick brown fox jumps over the lazy dog. " * 4
    for text, n in ((shared, 6), (shared, 9), ("1, 2, 3, 4,", 12)):
        _, c = run(w.stub, text=text, sampling=GREEDY,
                   stopping=pb.StoppingCriteria(max_tokens=n, ignore_eos=True))
        done.append(c)
    # Stop on the third greedy token of a known continuation: finish reason "stop".
    chunks, c = run(w.stub, text="Roses are red,", sampling=GREEDY,
                    stopping=pb.StoppingCriteria(max_tokens=5, ignore_eos=True))
    done.append(c)
    third = [t for ch in chunks for t in ch.token_ids][2]
    for _ in range(2):
        _, c = run(w.stub, text="Roses are red,", sampling=GREEDY,
                   stopping=pb.StoppingCriteria(max_tokens=50, stop_token_ids=[third]))
        done.append(c)
    # One aborted after its first chunk.
    call = w.stub.Generate(pb.GenerateRequest(
        request_id="abort-one", text="Count slowly:", sampling=GREEDY,
        stopping=pb.StoppingCriteria(max_tokens=500, ignore_eos=True)), timeout=120)
    assert next(call).HasField("chunk")
    w.stub.Abort(pb.AbortRequest(request_ids=["abort-one"]), timeout=5)
    done.append([r.complete for r in call if r.HasField("complete")][-1])

    n = len(done)
    usage = [c.usage for c in done]
    assert all(u.completion_tokens >= 1 for u in usage)
    after = Scrape(port)

    def delta(name: str) -> float:
        return after[name] - before[name]

    for name in PER_REQUEST_HISTOGRAMS:
        assert delta(f"{name}_count") == n, name
    prompt = sum(u.prompt_tokens for u in usage)
    generated = sum(u.completion_tokens for u in usage)
    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens_total") == generated
    assert delta("vllm:request_prompt_tokens_sum") == prompt
    assert delta("vllm:request_generation_tokens_sum") == generated
    # One inter-token gap per token after each request's first, under both names.
    assert delta("vllm:inter_token_latency_seconds_count") == generated - n
    assert delta("vllm:time_per_output_token_seconds_count") == generated - n
    # The same timings the clients got in GenerateComplete (milliseconds there).
    for name, field in (("vllm:e2e_request_latency_seconds", "total_time_ms"),
                        ("vllm:time_to_first_token_seconds", "ttft_ms"),
                        ("vllm:request_queue_time_seconds", "queue_time_ms")):
        got = sum(getattr(c, field) for c in done) / 1000
        assert delta(f"{name}_sum") == pytest.approx(got, rel=1e-6, abs=1e-6), name
    reasons = Counter(REASONS[c.finish_reason] for c in done)
    assert reasons == {"length": 4, "stop": 2, "abort": 1}
    for reason in ("stop", "length", "abort", "error"):
        assert after.by_reason[reason] - before.by_reason[reason] == reasons[reason], reason
    hits = delta("vllm:prefix_cache_hits_total")
    assert hits == sum(u.cached_tokens for u in usage) and hits >= 32
    assert delta("vllm:prefix_cache_queries_total") >= prompt
    # One observation per engine step, of the tokens it ran: each request's uncached prompt
    # and every output token but the last (sampled, never fed back).
    steps = w.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=5).num_steps
    assert delta("vllm:iteration_tokens_total_count") == steps - steps_before > 0
    computed = sum(u.prompt_tokens - u.cached_tokens + u.completion_tokens - 1 for u in usage)
    assert delta("vllm:iteration_tokens_total_sum") == computed
    assert after["vllm:num_preemptions_total"] == before["vllm:num_preemptions_total"]


def test_preemptions_count_when_made_and_preempted_requests_wait() -> None:
    """Two requests that cannot both fit in a 12-block cache (160 tokens each, 16 a block):
    one is swapped out while the other runs. vllm:num_preemptions_total counts it while both
    still run (not when they finish), and vllm:num_requests_waiting counts the swapped one,
    as vLLM v1 counts its preempted requests."""
    per_block = 16 * 2 * 30 * 3 * 64 * 4  # tokens x (K, V) x layers x KV heads x dim x fp32
    port = free_port()
    # The default model (its quantized kernels run the 300 tokens ~4x faster than dummy
    # float32 weights); its KV cache is float32 on the CPU, as per_block counts.
    w = Worker("--max-model-len", "192",
               "--kv-cache-memory", str(12.5 * per_block / (1 << 30)), "--swap-space", "0.05",
               "--metrics-port", str(port), "--no-reflection")
    try:
        w.wait_ready()
        assert int(Scrape(port).families["vllm:cache_config_info"].samples[0]
                   .labels["num_gpu_blocks"]) == 12
        calls = [w.stub.Generate(pb.GenerateRequest(
            request_id=f"pre-{i}", token_ids=pb.TokenIdsInput(ids=list(range(100 + i, 110 + i))),
            sampling=GREEDY, stopping=pb.StoppingCriteria(max_tokens=150, ignore_eos=True)),
            timeout=120) for i in range(2)]
        done: list[pb.GenerateComplete] = []

        def drain(call) -> None:
            done.extend(r.complete for r in call if r.HasField("complete"))

        readers = [threading.Thread(target=drain, args=(c,)) for c in calls]
        for t in readers:
            t.start()
        while_running: list[dict[str, float]] = []
        end = time.monotonic() + 120
        while len(done) < 2:
            assert time.monotonic() < end, "the requests never finished"
            m = Scrape(port)
            if not done:  # neither has finished yet
                while_running.append({k: m[k] for k in (
                    "vllm:num_preemptions_total", "vllm:num_requests_running",
                    "vllm:num_requests_waiting", "vllm:num_requests_swapped")})
            time.sleep(0.02)
        for t in readers:
            t.join(30)
        assert [c.usage.completion_tokens for c in done] == [150, 150]
        swapped = [m for m in while_running if m["vllm:num_requests_swapped"] == 1]
        assert swapped, f"never saw a swapped request: {while_running[-5:]}"
        for m in swapped:  # the swapped one is waiting; the other runs
            assert m["vllm:num_requests_waiting"] == 1 and m["vllm:num_requests_running"] == 1
            assert m["vllm:num_preemptions_total"] >= 1
        # Counted when made and when finished, the totals agree once both have finished.
        status = w.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=5)
        final = Scrape(port)["vllm:num_preemptions_total"]
        assert final == status.num_preemptions >= 1
    finally:
        w.close()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_engine_tallies_preemptions_when_made_and_tokens_per_step(default_model, mode) -> None:
    """The engine's tallies behind the two step figures, without a server: every preemption
    the scheduler makes (a request's own count, summed), and one entry per model step of
    the tokens it ran."""
    from scheduler.request import SamplingParams
    from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
    from worker.engine import Engine

    per_block = 16 * 2 * 30 * 3 * 64 * 4
    engine = Engine(WorkerConfig(
        model=ModelConfig(max_model_len=192),
        cache=CacheConfig(kv_cache_memory=12.5 * per_block / (1 << 30),
                          swap_space=(20 * per_block / (1 << 30)) if mode == "swap" else 0),
        scheduler=SchedulerConfig(preemption_mode=mode)), loaded=default_model)
    reqs = [engine.make_request(list(range(100 + i, 110 + i)),
                                SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
            for i in range(3)]
    seen: list[int] = []  # the tally after each step that published something
    engine.generate(reqs, on_output=lambda _: seen.append(engine.num_preemptions))
    made = sum(r.num_preemptions for r in reqs)
    assert made >= 1 and engine.num_preemptions == made
    assert 0 < seen.index(made) < len(seen) - 1  # counted before the last request finished
    assert sum(engine.step_tokens.values()) == engine.num_steps
    # Every token a request holds at the end was run once, plus what recompute ran again.
    ran = sum(n * c for n, c in engine.step_tokens.items())
    held = sum(r.num_prompt_tokens + r.num_output_tokens - 1 for r in reqs)
    assert ran == held if mode == "swap" else ran > held


def _listening_ports(pid: int) -> set[int]:
    return {c.laddr.port for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def test_metrics_are_off_by_default() -> None:
    w = Worker("--model", "dummy:smollm2-135m", "--max-num-seqs", "1", "--no-reflection")
    try:
        w.wait_ready()
        grpc_port = int(w.address.rsplit(":", 1)[1])
        assert _listening_ports(w.proc.pid) == {grpc_port}
        assert not any("Prometheus metrics" in line for line in w.lines)
    finally:
        w.close()


def test_the_metrics_http_server_bounds_its_connections_and_their_time(monkeypatch) -> None:
    """Requests that never finish their headers (slowloris) hold at most METRICS_CONNECTIONS
    threads, each for at most the handler's timeout; one more is closed at once, and once the
    held ones time out /metrics answers again (prometheus_client's server gave each a thread
    of its own, forever: 1,500 held 1,500 threads)."""
    from worker import metrics as m

    monkeypatch.setattr(m._QuietHandler, "timeout", 0.5)
    srv = m._metrics_server("127.0.0.1", 0, lambda env, start: (start("200 OK", []), [b"ok"])[1])
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    try:
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(m.METRICS_CONNECTIONS)]
        for s in held:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", port), timeout=2)
        extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert extra.recv(100) == b""  # closed unanswered: every slot is held
        time.sleep(1.0)  # the held ones time out
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            assert r.read() == b"ok"
        assert threading.active_count() < 10
    finally:
        srv.shutdown()
        srv.server_close()
