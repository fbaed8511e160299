"""Integration with the real SMG gateway (`smg launch`, PyPI `smg`): two `llm-worker serve`
processes speak the vLLM engine protocol; SMG does the OpenAI API, the chat template and the
tokenizer (fetched from the workers with GetTokenizer: no --model-path, no hub) and routes
with `--policy cache_aware`. HTTP goes through the standard library only.

Which replica served a request is read from each worker's own finish counters
(GetServerStatus.requests_by_finish_reason), never from SMG.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from llmworker.v1 import worker_pb2 as pb

from tests.test_server import Worker, blocks_all_free, run, text_of, wait_until

pytestmark = pytest.mark.slow

HTTP_TIMEOUT_S = 120
READY_TIMEOUT_S = 90
# SMG sends one cache hit in 8 (and a share of misses) to a replica whose prefix index is
# "thin", to warm it; off here so that cache affinity alone decides where a request goes.
WARMUP_OFF = ("--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0")
# ~500 tokens shared by the cache_aware requests (a prefix no other test sends).
SYSTEM_PROMPT = "You are a terse assistant for a small bakery. " + " ".join(
    f"Rule {i}: loaf {i} costs {i + 2} coins and is baked at {6 + i % 5} o'clock." for i in range(21)
)


def smg_bin() -> str:
    found = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
    # A declared test dependency: its absence is a failure, never a skip (as grpcurl's).
    assert found, "smg is not installed (pip install smg, in the test extras)"
    return found


def _smg_runs() -> str | None:
    """Why the smg binary cannot run here, or None when it can."""
    try:
        done = subprocess.run([smg_bin(), "launch", "--help"], capture_output=True, timeout=60)
    except OSError as e:  # e.g. a wheel built for another platform
        return f"smg cannot run on this platform: {e}"
    return None if done.returncode == 0 else f"smg launch --help exited {done.returncode}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """One `smg launch` process on loopback in front of `workers`; its log is kept in memory."""

    def __init__(self, workers: list[Worker], *flags: str, pd: bool = False) -> None:
        """`pd`: PD mode, the first worker the prefill and the second the decode."""
        self.port = free_port()
        self.workers = workers
        self.urls = [f"grpc://{w.address}" for w in workers]
        route = (["--pd-disaggregation", "--prefill", self.urls[0], "none", "--decode",
                  self.urls[1], "--policy", "round_robin"] if pd
                 else ["--worker-urls", *self.urls, "--policy", "cache_aware"])
        cmd = [smg_bin(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               *route, "--shutdown-grace-period-secs", "1", "--log-level", "debug", *flags]
        env = {**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace")
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(re.sub(r"\x1b\[[0-9;]*m", "", line.rstrip("\n")))

    def log_has(self, pattern: str) -> bool:
        rx = re.compile(pattern)
        return any(rx.search(line) for line in list(self.lines))

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.lines[-n:])

    def wait_ready(self) -> Gateway:
        """Both workers registered and ready, and the tokenizer loaded (it loads in the background)."""
        end = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, f"smg exited {self.proc.returncode}:\n{self.tail()}"
            with contextlib.suppress(OSError, ValueError):
                ready = {w["url"] for w in self.get("/workers")["workers"]
                         if w["status"] == "ready" and w["is_healthy"]}
                if ready == set(self.urls) and self.log_has(r"Successfully loaded tokenizer"):
                    return self
            assert time.monotonic() < end, f"smg not ready in {READY_TIMEOUT_S}s:\n{self.tail()}"
            time.sleep(0.25)

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=HTTP_TIMEOUT_S)

    def get(self, path: str) -> dict:
        conn = self._conn()
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
            assert resp.status == 200, f"GET {path}: {resp.status} {body[:500]!r}"
            return json.loads(body)
        finally:
            conn.close()

    def post(self, path: str, **body) -> dict:
        """POST a JSON body (the served model's name added) to `path`; its JSON answer."""
        conn = self._conn()
        try:
            conn.request("POST", path, json.dumps({"model": self.model, **body}),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            assert resp.status == 200, f"{path}: {resp.status} {data[:500]!r}\n{self.tail(10)}"
            return json.loads(data)
        finally:
            conn.close()

    def chat(self, **body) -> dict:
        return self.post("/v1/chat/completions", **body)

    def chat_stream(self, **body) -> tuple[str, list[dict]]:
        """The text of a streamed chat completion and every SSE event (usage included)."""
        conn = self._conn()
        try:
            conn.request("POST", "/v1/chat/completions",
                         json.dumps({"model": self.model, "stream": True, **body}),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200, f"stream: {resp.status} {resp.read()[:500]!r}"
            assert resp.getheader("Content-Type", "").startswith("text/event-stream")
            events, done = [], False
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                events.append(json.loads(data))
            assert done, "the stream ended without [DONE]"
            text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
            return text, events
        finally:
            conn.close()

    @property
    def model(self) -> str:
        return self.get("/v1/models")["data"][0]["id"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


# ----- helpers -----------------------------------------------------------------------------


def finished(w: Worker) -> int:
    """Requests this worker has finished, whatever the reason."""
    status = w.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)
    return sum(status.requests_by_finish_reason.values())


def finish_counts(w: Worker) -> dict[str, int]:
    return dict(w.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)
                .requests_by_finish_reason)


def prefix_hits(w: Worker) -> int:
    """Prompt tokens this worker has served from its own prefix cache."""
    return w.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10).prefix_cache_hit_tokens


def served_by(workers: list[Worker], before: list[int]) -> int:
    """Index of the one worker whose finish count grew since `before`."""
    wait_until(lambda: sum(finished(w) for w in workers) > sum(before), 10, "a finish count")
    grew = [i for i, w in enumerate(workers) if finished(w) > before[i]]
    assert len(grew) == 1, f"finish counts moved on {grew}"
    return grew[0]


def worker_chat(w: Worker, messages: list[dict], max_tokens: int, **sampling) -> tuple[str, str]:
    """Our own Generate with chat messages: (text, finish reason name)."""
    chunks, done = run(w.stub, chat=pb.ChatInput(messages=[pb.ChatMessage(**m) for m in messages]),
                       sampling=pb.SamplingParams(**sampling),
                       stopping=pb.StoppingCriteria(max_tokens=max_tokens))
    return text_of(chunks), pb.FinishReason.Name(done.finish_reason)


def greedy_chat_matches_our_generate(gw: Gateway, question: str, max_tokens: int) -> list[dict]:
    """SMG's greedy chat, unstreamed and streamed, against our own Generate on a replica:
    the same text and finish reason, the same usage; the streamed one's SSE events."""
    messages = [{"role": "user", "content": question}]
    want, reason = worker_chat(gw.workers[0], messages, max_tokens, temperature=0.0)
    out = gw.chat(messages=messages, max_tokens=max_tokens, temperature=0)
    choice = out["choices"][0]
    assert choice["message"]["content"] == want
    assert choice["finish_reason"] == {"FINISH_REASON_STOP": "stop",
                                       "FINISH_REASON_LENGTH": "length"}[reason]
    text, events = gw.chat_stream(messages=messages, max_tokens=max_tokens, temperature=0,
                                  stream_options={"include_usage": True})
    assert text == want
    usage = events[-1]["usage"]
    assert usage["prompt_tokens"] == out["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == out["usage"]["completion_tokens"]
    return events


def cache_aware_run(gw: Gateway, n: int = 16) -> tuple[list[int], list[int]]:
    """`n` requests sharing SYSTEM_PROMPT, one at a time: (replica index, cached tokens) each.

    The replica is the one whose own finish counter grew; afterwards each worker's own
    prefix-cache counter must agree with the cached tokens SMG reported for its requests.
    """
    replicas, cached = [], []
    hits_before = [prefix_hits(w) for w in gw.workers]
    for i in range(n):
        before = [finished(w) for w in gw.workers]
        out = gw.chat(messages=[{"role": "system", "content": SYSTEM_PROMPT},
                                {"role": "user", "content": f"Question {i}: which loaf is cheapest?"}],
                      max_tokens=4, temperature=0)
        replicas.append(served_by(gw.workers, before))
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
    hits = [prefix_hits(w) - b for w, b in zip(gw.workers, hits_before, strict=True)]
    want = [sum(c for r, c in zip(replicas, cached, strict=True) if r == i)
            for i in range(len(gw.workers))]
    assert hits == want, f"workers' prefix-cache hits {hits}, SMG's usage {want}"
    return replicas, cached


def report(line: str) -> None:
    """Figures worth reading in the test output (`pytest -s`)."""
    print(f"\n[smg] {line}", flush=True)


@pytest.fixture(scope="module", autouse=True)
def _needs_smg() -> None:
    if why := _smg_runs():
        pytest.fail(why)


@contextlib.contextmanager
def replicas_behind_smg(*worker_flags: str) -> Iterator[Gateway]:
    """Two workers started with `worker_flags` and one SMG in front of them."""
    workers: list[Worker] = []
    gw = None
    try:
        for _ in range(2):
            workers.append(Worker(*worker_flags))
        for w in workers:
            w.wait_ready()
        gw = Gateway(workers, *WARMUP_OFF)
        yield gw.wait_ready()
    finally:
        if gw is not None:
            gw.close()
        for w in workers:
            w.close()


# ----- two replicas with KV events (the default) -------------------------------------------


@pytest.fixture(scope="class")
def gw() -> Iterator[Gateway]:
    with replicas_behind_smg() as gw:
        yield gw


class TestGateway:
    def test_registers_both_workers_with_the_workers_tokenizer(self, gw: Gateway) -> None:
        workers = {w["url"]: w for w in gw.get("/workers")["workers"]}
        assert set(workers) == set(gw.urls)
        for w in workers.values():
            assert w["runtime_type"] == "vllm" and w["connection_mode"] == "grpc"
            assert w["labels"]["page_size"] == "16"  # GetServerInfo.block_size
        models = [m["id"] for m in gw.get("/v1/models")["data"]]
        assert models == [next(iter(workers.values()))["model_id"]]
        # No --model-path was given and the hub is off: the tokenizer came over GetTokenizer.
        assert gw.log_has(r"Fetching tokenizer from worker: grpc://127\.0\.0\.1")
        assert gw.log_has(r"Tokenizer extracted from temporary path")

    @pytest.mark.parametrize("question", ["What is the capital of France?",
                                          "Write a haiku about autumn leaves."])
    def test_greedy_chat_matches_our_generate(self, gw: Gateway, question: str) -> None:
        greedy_chat_matches_our_generate(gw, question, 24)

    def test_max_tokens_stop_and_seed(self, gw: Gateway) -> None:
        messages = [{"role": "user", "content": "Tell me a long story about a brave knight."}]
        out = gw.chat(messages=messages, max_tokens=5, temperature=0)
        assert out["usage"]["completion_tokens"] == 5
        assert out["choices"][0]["finish_reason"] == "length"

        full = gw.chat(messages=messages, max_tokens=32, temperature=0)["choices"][0]
        words = full["message"]["content"].split()
        assert len(words) >= 4, full
        stop = " " + words[3]
        cut = gw.chat(messages=messages, max_tokens=32, temperature=0, stop=[stop])["choices"][0]
        assert cut["finish_reason"] == "stop"
        assert cut["message"]["content"] == full["message"]["content"].split(stop)[0]

        seeded = [gw.chat(messages=messages, max_tokens=16, temperature=1.0, seed=1234)
                  ["choices"][0]["message"]["content"] for _ in range(2)]
        assert seeded[0] == seeded[1]
        # The seed reaches the engine as our own Generate's seed does.
        mine, _ = worker_chat(gw.workers[1], messages, 16, temperature=1.0, seed=1234)
        assert seeded[0] == mine

    def test_client_disconnect_aborts_on_the_worker(self, gw: Gateway) -> None:
        aborted = [finish_counts(w).get("abort", 0) for w in gw.workers]
        conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=HTTP_TIMEOUT_S)
        conn.request("POST", "/v1/chat/completions", json.dumps({
            "model": gw.model, "stream": True, "max_tokens": 1500, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Count from one to a thousand."}]}),
            {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        deltas = 0
        while deltas < 3:  # a few tokens in: the request runs on a worker
            line = resp.readline().decode()
            assert line, "the stream ended early"
            deltas += '"content"' in line
        assert any(load.num_running for load in
                   (w.stub.GetLoad(pb.GetLoadRequest(), timeout=5) for w in gw.workers))
        conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
        conn.close()
        wait_until(lambda: all(blocks_all_free(w) for w in gw.workers), 20,
                   "every block free and nothing running")
        now = [finish_counts(w).get("abort", 0) for w in gw.workers]
        assert sum(now) == sum(aborted) + 1, (aborted, now)

    def test_cache_aware_keeps_a_shared_prefix_on_one_replica(self, gw: Gateway) -> None:
        replicas, cached = cache_aware_run(gw)
        report(f"cache_aware with KV events: replicas={replicas} cached_tokens={cached} "
               f"sum(2..16)={sum(cached[1:])}")
        routing = "\n".join(ln for ln in gw.lines if "routing" in ln or "selection" in ln)
        assert replicas[1:] == [replicas[0]] * 15, routing[-6000:]
        # The ~500-token system prompt is reused from the second request on.
        assert all(c >= 400 for c in cached[1:]), cached

    def test_a_stopped_worker_gets_no_more_requests(self, gw: Gateway) -> None:
        # Warm one replica with a prefix, then stop exactly that one: affinity must not win.
        before = [finished(w) for w in gw.workers]
        gw.chat(messages=[{"role": "system", "content": SYSTEM_PROMPT},
                          {"role": "user", "content": "Warm-up."}], max_tokens=2, temperature=0)
        gone = served_by(gw.workers, before)
        left = gw.workers[1 - gone]
        gw.workers[gone].proc.send_signal(signal.SIGTERM)
        gw.workers[gone].proc.wait(60)
        start = finished(left)
        for i in range(6):
            out = gw.chat(messages=[{"role": "system", "content": SYSTEM_PROMPT},
                                    {"role": "user", "content": f"After stop {i}."}],
                          max_tokens=4, temperature=0)
            assert out["choices"][0]["finish_reason"] in ("stop", "length")
        assert finished(left) == start + 6


# ----- the same two replicas without KV events: SMG's own prefix tree ----------------------


def test_cache_aware_without_kv_events() -> None:
    """Without the workers' KV events SMG routes on its own approximate prefix tree, built
    from the requests it has sent: the shared prefix must still stay on one replica, which
    then serves it from its prefix cache (the workers' own counters say which and how much)."""
    with replicas_behind_smg("--no-kv-events") as gw:
        assert gw.log_has(r"does not implement SubscribeKvEvents")
        replicas, cached = cache_aware_run(gw)
    report(f"cache_aware without KV events: replicas={replicas} cached_tokens={cached} "
           f"sum(2..16)={sum(cached[1:])}")
    assert replicas[1:] == [replicas[0]] * 15, replicas
    # The ~500-token system prompt is reused from the second request on.
    assert all(c >= 400 for c in cached[1:]), cached


# ----- replicas at --stream-interval 4: SMG takes chunks of several tokens -------------------


def test_stream_interval_behind_smg_keeps_the_text_in_fewer_events() -> None:
    """Workers that send four tokens a message (--stream-interval 4): SMG's streamed chat has
    the same greedy text and usage as its unstreamed one and as our own Generate, in fewer
    content events than tokens (the first token still alone at the front)."""
    with replicas_behind_smg("--stream-interval", "4") as gw:
        events = greedy_chat_matches_our_generate(gw, "Write a haiku about autumn leaves.", 32)
        n = events[-1]["usage"]["completion_tokens"]
        content = [e for e in events for c in e["choices"] if c["delta"].get("content")]
        report(f"stream-interval 4 behind SMG: {n} tokens in {len(content)} content events")
        assert n >= 8 and len(content) <= 1 + -(-(n - 1) // 4) < n, (n, len(content))
