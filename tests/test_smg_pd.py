"""Prefill/decode disaggregation through the real SMG (`smg launch --pd-disaggregation`):
a prefill worker and a decode worker on loopback, each pinned to one CPU, SMG in front
driving vLLM's sequential protocol (the prefill leg tagged do_remote_decode because our
GetServerInfo says NixlConnector; the handoff relayed verbatim to the decode leg).

Chat and text completions, streamed and not, greedy: the text is our own Generate's on one
worker alone; the decode worker's own counters say it computed exactly one prompt token of
each request (the rest pulled, or in its prefix cache), the prefill's pins are back to zero
after every scenario, and both workers' block accounting holds when they stop. A client
that goes away mid-stream leaves both sides free. A worker describing itself as a real vLLM
NIXL worker is never paired with ours (SMG answers 503 no_compatible_pd_pair).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
from collections.abc import Iterator

import pytest
from llmworker.v1 import worker_pb2 as pb

from tests.pd_helpers import CONSUMER, PRODUCER, delta, figures, settled, stop_and_check
from tests.test_server import Worker, run, text_of, wait_until
from tests.test_smg import (
    HTTP_TIMEOUT_S,
    WARMUP_OFF,
    Gateway,
    finish_counts,
    worker_chat,
)

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn leaves."]
PROMPTS = ["The three primary colors are", "Once upon a time, in a small village,"]


def two_cpus() -> tuple[str, str]:
    cpus = sorted(os.sched_getaffinity(0))
    return (str(cpus[0]), str(cpus[1 % len(cpus)]))


class PD:
    """P, D and SMG in PD mode in front of them."""

    def __init__(self, p: Worker, d: Worker, gw: Gateway) -> None:
        self.p, self.d, self.gw = p, d, gw

    def computed_once_each(self, before: dict[str, int], requests: int) -> None:
        """Every decode request computed exactly one prompt token; nothing fell back; and
        the prefill's pins are back to zero."""
        settled(self.p, self.d)
        got = delta(figures(self.d), before)
        assert got.get("source:local_compute") == requests, got
        assert got.get("pulls", 0) + got.get("skipped", 0) == requests, got
        assert not any(k.startswith("fallback") for k in got), got


@pytest.fixture(scope="module")
def pd() -> Iterator[PD]:
    cpu_p, cpu_d = two_cpus()
    p = Worker(*PRODUCER, cpus=cpu_p)
    started, gw = [p], None
    try:
        m = p.wait_for(r"listening on (\S+):(\d+)")
        d = Worker(*CONSUMER, "--kv-transfer-peers", f"{m.group(1)}:{m.group(2)}", cpus=cpu_d)
        started.append(d)
        for w in started:
            w.wait_ready()
        gw = Gateway([p, d], *WARMUP_OFF, pd=True).wait_ready()
        yield PD(p, d, gw)
        gw.close()
        gw = None
        stop_and_check(*started)
    finally:
        if gw is not None:
            gw.close()
        for w in started:
            w.close()


def test_smg_sees_a_prefill_and_a_decode(pd: PD) -> None:
    workers = {w["url"]: w for w in pd.gw.get("/workers")["workers"]}
    assert workers[pd.gw.urls[0]]["worker_type"] == "prefill"
    assert workers[pd.gw.urls[1]]["worker_type"] == "decode"
    prefill = workers[pd.gw.urls[0]]
    assert (prefill["kv_connector"], prefill["kv_role"]) == ("NixlConnector", "kv_producer")
    assert prefill["labels"]["attention_backend"] == "LLM_WORKER_PAGED"


@pytest.mark.parametrize("question", QUESTIONS)
def test_chat_streamed_and_not_is_one_worker_alone(pd: PD, question: str) -> None:
    messages = [{"role": "user", "content": question}]
    want, _ = worker_chat(pd.p, messages, 24, temperature=0.0)
    before_d, before_p = figures(pd.d), figures(pd.p)
    out = pd.gw.chat(messages=messages, max_tokens=24, temperature=0)
    assert out["choices"][0]["message"]["content"] == want
    text, events = pd.gw.chat_stream(messages=messages, max_tokens=24, temperature=0,
                                     stream_options={"include_usage": True})
    assert text == want
    assert events[-1]["usage"]["completion_tokens"] == out["usage"]["completion_tokens"]
    pd.computed_once_each(before_d, 2)
    assert delta(figures(pd.p), before_p)["handoffs"] == 2  # the prefill leg was tagged


@pytest.mark.parametrize("prompt", PROMPTS)
def test_text_completions_streamed_and_not_are_one_worker_alone(pd: PD, prompt: str) -> None:
    chunks, _ = run(pd.p.stub, text=prompt, sampling=pb.SamplingParams(temperature=0.0),
                    stopping=pb.StoppingCriteria(max_tokens=20))
    want = text_of(chunks)
    before = figures(pd.d)
    out = pd.gw.post("/v1/completions", prompt=prompt, max_tokens=20, temperature=0)
    assert out["choices"][0]["text"] == want
    assert completion_stream(pd.gw, prompt=prompt, max_tokens=20, temperature=0) == want
    pd.computed_once_each(before, 2)


def completion_stream(gw: Gateway, **body) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions",
                     json.dumps({"model": gw.model, "stream": True, **body}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()[:300]
        text = []
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                text += [c.get("text") or "" for c in json.loads(line[5:])["choices"]]
        return "".join(text)
    finally:
        conn.close()


def test_a_client_gone_mid_stream_frees_both_sides(pd: PD) -> None:
    aborted = finish_counts(pd.d).get("abort", 0)
    conn = http.client.HTTPConnection("127.0.0.1", pd.gw.port, timeout=HTTP_TIMEOUT_S)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": pd.gw.model, "stream": True, "max_tokens": 1500, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Count from one to a thousand."}]}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    deltas = 0
    while deltas < 3:  # a few tokens in: the decode leg runs
        line = resp.readline().decode()
        assert line, "the stream ended early"
        deltas += '"content"' in line
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    settled(pd.p, pd.d)
    wait_until(lambda: finish_counts(pd.d).get("abort", 0) == aborted + 1, 20, "the abort")


def test_n_2_hands_nothing_over_and_still_answers(pd: PD) -> None:
    before = figures(pd.p)
    out = pd.gw.chat(messages=[{"role": "user", "content": "Name a fruit."}], n=2,
                     temperature=0, max_tokens=8)
    assert len(out["choices"]) == 2
    assert out["choices"][0]["message"]["content"] == out["choices"][1]["message"]["content"]
    assert "handoffs" not in delta(figures(pd.p), before)
    settled(pd.p, pd.d)


def test_a_vllm_nixl_worker_is_never_paired_with_ours(pd: PD) -> None:
    fake = Worker(module="tests.pd_fake_vllm")
    gw = None
    try:
        fake.wait_ready()
        gw = Gateway([pd.p, fake], *WARMUP_OFF, pd=True).wait_ready()
        conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=HTTP_TIMEOUT_S)
        conn.request("POST", "/v1/chat/completions", json.dumps({
            "model": gw.model, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hello"}]}),
            {"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 503 and b"no_compatible_pd_pair" in body, body[:300]
        # Apart on the KV layout: our resolved cache dtype against vLLM's "auto".
        assert b"dtype=float32" in body and b"dtype=auto" in body, body[:400]
    finally:
        with contextlib.suppress(Exception):
            if gw is not None:
                gw.close()
        fake.close()
    settled(pd.p)
