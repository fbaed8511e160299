"""llm-worker-bench: metric math on constructed traces, arrivals, datasets, SSE and the OpenAI
backend against an in-test HTTP server, and one end-to-end sweep against a real Worker."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clients.bench import dataset as ds
from clients.bench.args import parse_args
from clients.bench.arrival import arrival_offsets, dispatch
from clients.bench.backend_openai import OpenAIBackend
from clients.bench.cli import main, penalties
from clients.bench.knee import find_knee
from clients.bench.lengths import output_lengths, parse_lengths
from clients.bench.metrics import parse_slo, summarize
from clients.bench.record import RequestRecord
from clients.bench.runner import run_once
from clients.bench.sse import SSEParser
from tests.test_server import Worker


def rec(index: int, times: list[float], tokens: list[int], *, ok: bool = True,
        prompt: int = 10) -> RequestRecord:
    r = RequestRecord(index, sum(tokens), success=ok, prompt_tokens=prompt,
                      output_tokens=sum(tokens) if ok else 0)
    for t, k in zip(times, tokens, strict=True):
        r.add_chunk(t, k)
    if not ok:
        r.error = "UNAVAILABLE: gone"
    return r


# ----- metrics ---------------------------------------------------------------------------


def traces() -> list[RequestRecord]:
    return [
        rec(0, [0.1, 0.2, 0.4, 0.5], [1, 1, 1, 1]),  # TTFT 100 ms, TPOT 400/3 ms, ITL 100,200,100
        rec(1, [0.2, 0.3], [1, 3]),                  # a chunk with 3 tokens: one ITL gap of 100
        rec(2, [0.05], [1]),                         # one token: no TPOT
        rec(3, [0.3], [1], ok=False),                # failed: counted, not in the figures
    ]


def test_per_request_ttft_tpot_itl_from_chunk_times() -> None:
    a, b, c, _ = traces()
    assert a.ttft == 0.1 and a.latency == 0.5
    assert a.tpot == pytest.approx(0.4 / 3)
    assert a.itl == pytest.approx([0.1, 0.2, 0.1])
    # vLLM counts one gap per chunk, whatever it carries; TPOT divides by tokens.
    assert b.itl == pytest.approx([0.1])
    assert b.tpot == pytest.approx(0.1 / 3)
    assert c.tpot is None and c.itl == []
    j = a.to_json(start=a.sent_at)
    assert j["itl_ms"] == pytest.approx([100, 200, 100]) and j["e2el_ms"] == pytest.approx(500)


def test_summary_matches_vllm_definitions() -> None:
    s = summarize(traces(), duration_s=2.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["errors"] == {"UNAVAILABLE: gone": 1}
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["total_output_tokens"] == 4 + 4 + 1
    assert s["output_throughput"] == pytest.approx(9 / 2)
    assert s["input_throughput"] == pytest.approx(30 / 2)
    ttft = s["ttft_ms"]  # 100, 200, 50
    assert ttft["mean"] == pytest.approx(350 / 3)
    assert ttft["median"] == pytest.approx(100)
    assert ttft["p90"] == pytest.approx(180)  # linear: 100 + 0.8 * (200 - 100)
    assert ttft["p99"] == pytest.approx(198)
    tpot = s["tpot_ms"]  # only requests with > 1 token: 133.3, 33.3
    assert tpot["mean"] == pytest.approx((400 / 3 + 100 / 3) / 2)
    itl = s["itl_ms"]  # pooled: 100, 200, 100, 100
    assert itl["mean"] == pytest.approx(125) and itl["median"] == pytest.approx(100)
    assert s["e2el_ms"]["median"] == pytest.approx(300)  # 500, 300, 50
    assert "request_goodput" not in s


def test_goodput_counts_requests_meeting_every_slo() -> None:
    slo = parse_slo("ttft=150ms,tpot=120ms")
    assert slo == {"ttft": pytest.approx(0.15), "tpot": pytest.approx(0.12)}
    s = summarize(traces(), duration_s=2.0, slo=slo)
    # 0: TTFT ok, TPOT 133 > 120; 1: TTFT 200 > 150; 2: TTFT 50, TPOT 0 (one token) -> good;
    # 3 failed, never good.
    assert s["num_good"] == 1 and s["request_goodput"] == pytest.approx(0.5)
    loose = summarize(traces(), 2.0, parse_slo("ttft=1s,tpot=0.2s,e2el=600"))
    assert loose["num_good"] == 3 and loose["slo_ms"]["e2el"] == pytest.approx(600)
    assert summarize([], 1.0)["ttft_ms"]["p99"] is None
    for bad in ("ttft", "latency=5ms", "tpot=fast"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_knee_is_last_rate_before_p99_ttft_triples() -> None:
    def run(rate: float | str, p99: float, failed: int = 0) -> dict[str, Any]:
        return {"request_rate": rate, "summary": {
            "ttft_ms": {"p99": p99}, "failed": failed, "output_throughput": 10.0 * p99}}

    runs = [run(4, 250), run(1, 100), run(2, 290), run(8, 400)]
    k = find_knee(runs)
    assert (k["request_rate"], k["first_rate_past"], k["reached"]) == (4, 8, True)
    assert k["baseline_p99_ttft_ms"] == 100
    assert find_knee([run(1, 100), run(2, 120)])["reached"] is False
    assert find_knee([run(1, 100), run(2, 120, failed=1)])["request_rate"] == 1


# ----- datasets ----------------------------------------------------------------------------


def test_length_specs() -> None:
    rng = np.random.default_rng(0)
    assert parse_lengths("128").sample(3, rng) == [128] * 3
    u = parse_lengths("uniform:5:9").sample(500, rng)
    assert min(u) == 5 and max(u) == 9
    ln = parse_lengths("lognormal:24:0.8:100").sample(2000, rng)
    assert 20 <= np.median(ln) <= 28 and max(ln) <= 100
    lt = parse_lengths("longtail").sample(64, np.random.default_rng(3))
    assert lt == output_lengths(64, 3) and sum(x > 200 for x in lt) == 4
    for spec in ("uniform:9:5", "0", "lognormal:24", "gauss:1", "uniform:a:b"):
        with pytest.raises(ValueError):
            parse_lengths(spec)


def test_random_dataset_lengths_and_determinism() -> None:
    inp, out = parse_lengths("uniform:8:40"), parse_lengths("16")
    a = ds.random_dataset(50, inp, out, vocab_size=49152, seed=7)
    assert all(8 <= len(r.token_ids or []) <= 40 and r.output_len == 16 for r in a)
    assert all(1000 <= t < 49152 for r in a for t in r.token_ids or [])
    b = ds.random_dataset(50, inp, out, vocab_size=49152, seed=7)
    c = ds.random_dataset(50, inp, out, vocab_size=49152, seed=8)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


def test_chat_and_mixed_datasets() -> None:
    lt = parse_lengths("longtail")
    chats = ds.chat_dataset(64, lt, seed=0)
    assert [r.output_len for r in chats] == output_lengths(64, 0)  # benchmarks.offline's workload
    assert all(r.messages and r.messages[0]["role"] == "user" for r in chats)
    assert len({r.messages[0]["content"] for r in chats if r.messages}) > 32
    mixed = ds.mixed_dataset(40, lt, 0, long_fraction=0.25, long_input_len=2000,
                             long_output_len=16, vocab_size=49152)
    longs = [r for r in mixed if r.kind == "long"]
    assert len(longs) == 10 and all(len(r.token_ids or []) == 2000 for r in longs)
    assert all(r.output_len == 16 for r in longs)
    again = ds.mixed_dataset(40, lt, 0, long_fraction=0.25, long_input_len=2000,
                             long_output_len=16, vocab_size=49152)
    assert [r.index for r in longs] == [r.index for r in again if r.kind == "long"]
    assert ds.describe(mixed)["kinds"] == {"chat": 30, "long": 10}


# ----- arrivals ----------------------------------------------------------------------------


def test_poisson_offsets_seeded_with_the_right_mean_gap() -> None:
    offs = arrival_offsets(2001, rate=10.0, seed=1)
    assert len(offs) == 2001 and offs[0] == 0 and all(np.diff(offs) >= 0)
    gaps = np.diff(offs)
    assert gaps.mean() == pytest.approx(0.1, rel=0.08)
    assert gaps.std() == pytest.approx(0.1, rel=0.12)  # exponential: std == mean
    assert offs == arrival_offsets(2001, 10.0, 1) and offs != arrival_offsets(2001, 10.0, 2)
    assert arrival_offsets(5, math.inf, 0) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, 0)


class FakeBackend:
    """Sleeps a little per request and checks the concurrency cap on every entry."""

    name = "fake"

    def __init__(self, cap: int | None) -> None:
        self.cap, self.in_flight, self.peak, self.sent = cap, 0, 0, []

    async def send(self, i: int) -> RequestRecord:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        assert self.cap is None or self.in_flight <= self.cap
        self.sent.append(time.perf_counter())
        await asyncio.sleep(0.02)
        self.in_flight -= 1
        return RequestRecord(i, 1, success=True)


def test_dispatch_concurrency_cap_and_burst() -> None:
    capped = FakeBackend(cap=3)
    results, peak = asyncio.run(dispatch(list(range(12)), capped.send, [0.0] * 12, 3))
    assert [r.index for r in results] == list(range(12))
    assert peak == capped.peak == 3
    burst = FakeBackend(cap=None)
    _, peak = asyncio.run(dispatch(list(range(12)), burst.send, [0.0] * 12))
    assert peak == 12  # all at once
    assert max(burst.sent) - min(burst.sent) < 0.05  # one after another would take 0.22 s


def test_dispatch_follows_poisson_offsets() -> None:
    fake = FakeBackend(cap=None)
    offs = arrival_offsets(10, rate=40.0, seed=0)

    async def go() -> float:
        t0 = time.perf_counter()
        await dispatch(list(range(10)), fake.send, offs)
        return t0

    t0 = asyncio.run(go())
    late = [s - t0 - o for s, o in zip(fake.sent, offs, strict=True)]
    assert all(-0.001 <= x < 0.1 for x in late), late


class KindBackend:
    """Answers long prompts with a 10x later first token than chats."""

    name = "kinds"

    async def send(self, req: ds.BenchRequest) -> RequestRecord:
        r = RequestRecord(req.index, req.output_len, success=True, output_tokens=req.output_len,
                          prompt_tokens=req.prompt_len or 20)
        r.sent_at = time.perf_counter()
        first = 0.05 if req.kind == "long" else 0.005
        for i in range(req.output_len):
            r.add_chunk(first + 0.001 * i, 1)
        return r


def test_run_once_splits_a_mixed_run_by_kind() -> None:
    reqs = ds.mixed_dataset(10, parse_lengths("4"), 0, long_fraction=0.3, long_input_len=50,
                            long_output_len=2, vocab_size=5000)
    run = asyncio.run(run_once(KindBackend(), reqs, request_rate=math.inf, max_concurrency=None,
                               seed=0, slo=parse_slo("ttft=20ms"), progress=False))
    by = run["summary"]["by_kind"]
    assert (by["chat"]["completed"], by["long"]["completed"]) == (7, 3)
    assert by["long"]["ttft_ms"]["median"] == pytest.approx(50)
    assert by["chat"]["ttft_ms"]["median"] == pytest.approx(5)
    assert (by["chat"]["num_good"], by["long"]["num_good"]) == (7, 0)
    assert [r["kind"] for r in run["records"]] == [q.kind for q in reqs]
    assert run["summary"]["total_input_tokens"] == 7 * 20 + 3 * 50


# ----- SSE and the OpenAI backend ----------------------------------------------------------


def test_sse_parser_any_split() -> None:
    stream = (b": ping\r\n\r\ndata: {\"a\": \"\xc3\xa9\"}\r\n\r\nevent: x\ndata: line1\ndata: line2\n\n"
              b"data:[DONE]\r\r\n")
    want = ['{"a": "\u00e9"}', "line1\nline2", "[DONE]"]
    whole = SSEParser().feed(stream)
    assert whole == want
    for step in (1, 2, 3, 7):
        p, got = SSEParser(), []
        for i in range(0, len(stream), step):
            got += p.feed(stream[i : i + step])
        assert got == want, step


class FakeOpenAI:
    """An asyncio HTTP/1.1 server on 127.0.0.1 that streams chunked SSE like vLLM."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = (await reader.readline()).decode()
        method, path, _ = line.split(" ", 2)
        headers = {}
        while (h := (await reader.readline()).decode().strip()):
            k, _, v = h.partition(":")
            headers[k.lower()] = v.strip()
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        self.paths.append(f"{method} {path}")
        if path == "/v1/models":
            payload = json.dumps({"data": [{"id": "fake-model"}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        elif json.loads(body).get("max_tokens") == 999:
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\noops")
        else:
            req = json.loads(body)
            self.bodies.append(req)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            chat = path.endswith("/chat/completions")

            def choice(text: str, finish: str | None = None) -> dict[str, Any]:
                c: dict[str, Any] = {"index": 0, "finish_reason": finish}
                if chat:
                    c["delta"] = {"content": text}
                else:
                    c["text"] = text
                return c

            events = [{"choices": [choice("")]}]  # the role chunk: no token, no TTFT
            events += [{"choices": [choice(w)]} for w in ("Hel", "lo", " there")]
            events += [{"choices": [choice("", "length")]},
                       {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}]
            for ev in events:
                await asyncio.sleep(0.02)
                data = f"data: {json.dumps(ev)}\n\n".encode()
                # Split one event across two HTTP chunks, as proxies do.
                for part in (data[:5], data[5:]):
                    writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
            writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()


def test_openai_backend_streams_sse_chat_and_completions() -> None:
    fake = FakeOpenAI()

    async def go() -> tuple[dict[str, Any], list[RequestRecord]]:
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        be = OpenAIBackend(f"http://127.0.0.1:{port}/v1", ignore_eos=True, temperature=0.7,
                           top_p=0.9, penalties={"presence_penalty": 0.5})
        try:
            info = await asyncio.wait_for(be.describe(), 10)
            recs = [
                await asyncio.wait_for(be.send(r), 10) for r in (
                    ds.BenchRequest(0, 3, "chat", messages=[{"role": "user", "content": "hi"}]),
                    ds.BenchRequest(1, 3, "random", token_ids=[5, 6, 7]),
                    ds.BenchRequest(2, 999, "random", token_ids=[5]),
                )
            ]
        finally:
            server.close()
            await server.wait_closed()
        return info, recs

    info, (chat, comp, bad) = asyncio.run(go())
    assert info["model"] == "fake-model"
    assert fake.paths == ["GET /v1/models", "POST /v1/chat/completions", "POST /v1/completions",
                          "POST /v1/completions"]
    sent = fake.bodies[0]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["ignore_eos"] is True and sent["max_tokens"] == 3 and sent["model"] == "fake-model"
    assert sent["temperature"] == 0.7 and sent["top_p"] == 0.9 and sent["presence_penalty"] == 0.5
    assert "frequency_penalty" not in sent and "repetition_penalty" not in sent
    assert fake.bodies[1]["prompt"] == [5, 6, 7]
    for r in (chat, comp):
        assert r.success, r.error
        assert (r.prompt_tokens, r.output_tokens, r.finish_reason) == (7, 3, "length")
        assert len(r.chunk_times) == 3  # the empty role chunk carries no token
        assert r.ttft is not None and r.ttft >= 0.035  # the role chunk came at 20 ms
        assert all(g >= 0.015 for g in r.itl)
    assert not bad.success and bad.error.startswith("HTTP 500")


# ----- end to end against a real Worker ----------------------------------------------------


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker("--max-num-seqs", "8")
    try:
        yield w.wait_ready()
    finally:
        w.close()


def test_sweep_against_a_real_worker(worker: Worker, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    argv = ["run", "--target", worker.address, "--dataset", "random", "--input-len", "uniform:8:24",
            "--output-len", "uniform:3:6", "--num-requests", "6", "--ignore-eos", "--warmup", "1",
            "--request-rate", "20,inf", "--slo", "ttft=60s,tpot=10s", "--output-json", str(out),
            "--no-progress", "--seed", "3"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert {"name", "config", "server", "dataset", "runs", "environment", "knee", "plot"} <= set(
        result)
    env = result["environment"]
    for key in ("date", "machine", "cpu", "torch", "git_commit", "command"):
        assert env[key], key
    assert result["server"]["model"] and result["server"]["vocab_size"] > 1000
    # The worker's flags beside the figures, as its GetServerStatus gives them.
    assert result["server"]["config"]["scheduler"]["max_num_seqs"] == 8  # --max-num-seqs 8
    assert result["server"]["versions"]["torch"]
    # Commands and paths relative to the repo root (a tmp path is named by its file alone).
    assert env["command"].startswith("llm-worker-bench run --target ")
    assert env["command"].endswith("--output-json sweep.json --no-progress --seed 3")
    assert result["config"]["output_json"] == "sweep.json" and result["plot"] == "sweep.png"
    assert [r["request_rate"] for r in result["runs"]] == [20.0, "inf"]
    want = [r.output_len for r in ds.random_dataset(
        6, parse_lengths("uniform:8:24"), parse_lengths("uniform:3:6"),
        result["server"]["vocab_size"], 3)]
    for run in result["runs"]:
        s = run["summary"]
        assert (s["completed"], s["failed"], s["num_good"]) == (6, 0, 6)
        assert [r["output_tokens"] for r in run["records"]] == want  # ignore_eos: exactly asked
        assert [r["expected_output_tokens"] for r in run["records"]] == want
        assert all(8 <= r["prompt_tokens"] <= 24 for r in run["records"])
        assert s["total_output_tokens"] == sum(want)
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(s[key]) == {"mean", "median", "p90", "p99"}
            assert 0 < s[key]["median"] <= s[key]["p99"]
        assert s["output_throughput"] > 0 and s["max_in_flight"] >= 1
        for r in run["records"]:
            assert r["ttft_ms"] <= r["e2el_ms"] and len(r["itl_ms"]) == len(r["chunk_tokens"]) - 1
            assert sum(r["chunk_tokens"]) == r["output_tokens"]
    assert result["runs"][1]["summary"]["max_in_flight"] == 6  # burst: all at once
    assert result["knee"]["request_rate"] in (20.0, "inf")
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[0] > 100

    md = tmp_path / "table.md"
    assert main(["report", str(out), "--output", str(md)]) == 0
    text = md.read_text()
    assert env["git_commit"][:12] in text and env["command"] in text
    tput = result["runs"][0]["summary"]["output_throughput"]
    assert f"{tput:,.1f}" in text and "Knee" in text


def test_save_result_writes_vllms_keys_agreeing_with_the_report(
    worker: Worker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--save-result: each rate's run as vllm bench serve writes it, whose figures are the
    bench's own (its JSON summary, its printed report) and follow from the run's records."""
    from tests.test_bench_vllm import VLLM_KEYS

    out, folder = tmp_path / "ours.json", tmp_path / "vllm"
    argv = ["run", "--target", worker.address, "--dataset", "random", "--input-len", "12",
            "--output-len", "uniform:3:6", "--num-requests", "5", "--ignore-eos", "--warmup", "0",
            "--request-rate", "30,inf", "--max-concurrency", "2", "--slo", "ttft=60s",
            "--output-json", str(out), "--no-progress", "--save-result", "--result-dir",
            str(folder), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
            "50,90,99", "--metadata", "run=ci", "--label", "mine"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    ours = json.loads(out.read_text())
    model = ours["server"]["model"]
    files = sorted(folder.iterdir())
    assert [f.name.split(f"-{model}-")[0] for f in files] == [
        "mine-30.0qps-concurrency2", "mine-infqps-concurrency2"]
    for f, run in zip(files, ours["runs"], strict=True):
        got = json.loads(f.read_text())
        # vLLM's keys, with --metadata after num_prompts and e2el's after the default three.
        base = [k for k in VLLM_KEYS if not k.startswith(("p99_", "mean_", "median_", "std_"))]
        assert [k for k in got if not re.match(r"(p\d+|mean|median|std)_", k)] == (
            [*base[:7], "run", *base[7:]])
        assert (got["label"], got["model_id"], got["num_prompts"], got["run"]) == (
            "mine", model, 5, "ci")
        s = run["summary"]
        assert got["request_rate"] == run["request_rate"] and got["max_concurrency"] == 2
        for key in ("completed", "failed", "total_input_tokens", "total_output_tokens",
                    "request_throughput", "output_throughput", "total_token_throughput",
                    "request_goodput"):
            assert got[key] == pytest.approx(s[key]), key
        assert got["duration"] == s["duration_s"] and got["completed"] == 5
        for name in ("ttft", "tpot", "itl", "e2el"):
            for stat, key in (("mean", "mean"), ("median", "median"), ("p90", "p90"),
                              ("p99", "p99"), ("p50", "median")):
                assert got[f"{stat}_{name}_ms"] == pytest.approx(s[f"{name}_ms"][key]), (name, stat)
            # The bench's own printed report shows the same figures.
            line = {"ttft": "TTFT ms", "tpot": "TPOT ms", "itl": "ITL  ms", "e2el": "E2EL ms"}[name]
            shown = " / ".join(f"{got[f'{k}_{name}_ms']:.1f}" for k in ("mean", "median", "p90", "p99"))
            assert f"{line}" in printed and shown in printed, (name, shown)
        # From the run's per-request records (milliseconds, as written): vLLM's definitions.
        recs = run["records"]
        ttft = [r["ttft_ms"] for r in recs]
        itl = [g for r in recs for g in r["itl_ms"]]
        tpot = [(r["e2el_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1) for r in recs
                if r["output_tokens"] > 1]
        for name, values in (("ttft", ttft), ("itl", itl), ("tpot", tpot)):
            assert got[f"std_{name}_ms"] == pytest.approx(np.std(values), abs=1e-2), name
            assert got[f"mean_{name}_ms"] == pytest.approx(np.mean(values), abs=1e-2), name
        assert got["latencies"] == pytest.approx([r["e2el_ms"] / 1e3 for r in recs], abs=1e-6)
        assert got["max_concurrent_requests"] <= s["max_in_flight"] == 2
        assert got["max_output_tokens_per_s"] >= 1 and len(got["queue_times"]) == 5
    assert f"{ours['runs'][0]['summary']['request_throughput']:.2f} req/s" in printed


def test_client_side_text_with_the_workers_tokenizer_over_the_wire(
    worker: Worker, tmp_path: Path
) -> None:
    """The tokenizer comes over the vLLM protocol's GetTokenizer (or from a path), never from
    worker/; what it renders and encodes equals the worker's own tokenizer (the reference)."""
    from clients.bench.tokenizer import (
        as_text,
        fetch_tokenizer_zip,
        ids_as_text,
        load_tokenizer,
        pad_id,
        prompt_ids,
    )
    from worker.tokenizer import Tokenizer
    from worker.weights import default_model_path

    ref = Tokenizer.from_gguf(default_model_path())
    tok = load_tokenizer(None, target=worker.address)
    [rnd] = ds.random_dataset(1, parse_lengths("300"), parse_lengths("4"), 49152, seed=0)
    t = ids_as_text(rnd, tok)
    assert t.token_ids is None and t.text and 250 <= len(ref.encode(t.text)) <= 300
    chats = ds.chat_dataset(8, parse_lengths("4"), seed=0)
    for chat in chats:
        assert chat.messages
        rendered = as_text(chat, tok)
        assert rendered.text == ref.apply_chat_template(chat.messages, add_generation_prompt=True)
        # The peer's ids for a chat are what the worker computes: template, then encode.
        assert prompt_ids(chat, tok) == ref.encode(rendered.text)
    text = ds.BenchRequest(0, 4, "chat", text="Plain text, 12 + 30 = 42.")
    assert prompt_ids(text, tok) == ref.encode(text.text, True)
    assert pad_id(tok) == (ref.pad_token_id if ref.pad_token_id is not None
                           else ref.eos_token_ids[0])

    # The same files from a path: the zip as fetched, and a bare tokenizer.json (no template).
    zipped = tmp_path / "tokenizer.zip"
    zipped.write_bytes(fetch_tokenizer_zip(worker.address))
    from_zip = load_tokenizer(str(zipped), target="unused:1")
    assert prompt_ids(chats[0], from_zip) == prompt_ids(chats[0], tok)
    import zipfile

    with zipfile.ZipFile(zipped) as zf:
        zf.extract("tokenizer.json", tmp_path)
    bare = load_tokenizer(str(tmp_path / "tokenizer.json"), target="unused:1")
    assert bare.encode(text.text, add_special_tokens=False) == ref.encode(text.text)
    with pytest.raises(ValueError, match="chat template"):
        as_text(chats[0], bare)
    with pytest.raises(ValueError, match="--tokenizer"):
        load_tokenizer(str(tmp_path / "nothing.bin"), target="unused:1")


def test_grpc_backend_sends_top_p_only_below_one() -> None:
    from clients.bench.backend_grpc import GrpcBackend

    sent: list[dict[str, Any]] = []

    class Call:
        def __aiter__(self):
            return self

        async def __anext__(self):
            raise StopAsyncIteration

    async def go() -> None:
        for top_p in (0.9, 1.0):
            be = GrpcBackend("127.0.0.1:1", ignore_eos=True, temperature=0.7, top_p=top_p,
                             penalties=penalties(parse_args(
                                 ["--frequency-penalty", "0.2", "--repetition-penalty", "1.1"] if top_p < 1 else [])))
            be.client.generate = lambda **kw: sent.append(kw) or Call()  # type: ignore[method-assign]
            await be.send(ds.BenchRequest(0, 3, "random", token_ids=[5, 6]))
            await be.client.close()

    asyncio.run(go())
    assert [(kw["temperature"], kw["top_p"]) for kw in sent] == [(0.7, 0.9), (0.7, None)]
    # Penalties asked for are sent by their field names; those left at off are not sent.
    assert (sent[0]["frequency_penalty"], sent[0]["repetition_penalty"]) == (0.2, 1.1)
    assert "presence_penalty" not in sent[0] and not {k for k in sent[1] if k.endswith("_penalty")}


def test_chat_run_with_fixed_concurrency(worker: Worker, tmp_path: Path) -> None:
    out = tmp_path / "chat.json"
    argv = ["--target", worker.address, "--num-requests", "4", "--output-len", "longtail:5",
            "--ignore-eos", "--max-concurrency", "2", "--warmup", "0", "--no-progress",
            "--output-json", str(out)]
    assert main(argv) == 0  # "run" is implied
    run = json.loads(out.read_text())["runs"][0]
    assert run["summary"]["completed"] == 4 and run["summary"]["max_in_flight"] == 2
    assert all(r["output_tokens"] == r["expected_output_tokens"] <= 5 for r in run["records"])
    assert all(r["prompt_tokens"] > 10 for r in run["records"])  # the chat template's tokens


class FakeHF:
    """transformers' generate, shape for shape: appends 100, 101, ... to every row."""

    def __init__(self) -> None:
        import torch

        self.calls: list[tuple[int, int, int]] = []  # (rows, width, new tokens)
        self.device, self.dtype = torch.device("cpu"), torch.float32

    def generate(self, ids, attention_mask, max_new_tokens: int, **kw: Any):
        import torch

        assert kw["eos_token_id"] == [] and kw["do_sample"] is False  # ignore EOS, greedy
        assert attention_mask[:, -1].all()  # left padding: every prompt ends at the right
        self.calls.append((ids.shape[0], ids.shape[1], max_new_tokens))
        new = torch.arange(100, 100 + max_new_tokens).expand(ids.shape[0], -1)
        return torch.cat([ids, new], dim=1)


def test_peer_runs_static_batches(monkeypatch) -> None:
    from benchmarks import peer

    fake = FakeHF()
    asked = []
    monkeypatch.setattr(peer, "load_hf_model", lambda model: asked.append(model) or fake)
    reqs = ds.random_dataset(5, parse_lengths("uniform:3:9"), parse_lengths("uniform:2:7"),
                             5000, seed=1)
    lens = [r.output_len for r in reqs]
    p = peer.peer_figures([list(r.token_ids or []) for r in reqs], lens, batch_size=2,
                          threads=1, model="dummy:smollm2-135m", pad_id=0)
    assert asked == ["dummy:smollm2-135m"] and p["model"] == "dummy:smollm2-135m"
    assert p["device"] == "cpu" and "float32" in p["system"]
    # A warm-up batch, then [0, 1], [2, 3], [4]: each runs to its longest member.
    assert fake.calls[1:] == [
        (len(b), max(len(r.token_ids or []) for r in b), max(r.output_len for r in b))
        for b in (reqs[0:2], reqs[2:4], reqs[4:5])
    ]
    assert p["requests"] == 5 and p["output_tokens"] == sum(lens)  # only its own length counts
    assert p["steps"] == sum(max(lens[i : i + 2]) for i in (0, 2, 4))


def test_peer_runs_as_a_child_process_and_reports_the_ratio() -> None:
    """`llm-worker-bench --peer`: the client hands the prompt ids to `python -m
    benchmarks.peer` and reads its figures back (it imports nothing of the engine)."""
    from clients.bench.peer import run_peer

    reqs = ds.random_dataset(3, parse_lengths("uniform:3:6"), parse_lengths("uniform:2:3"),
                             5000, seed=2)
    p = run_peer("transformers", reqs, batch_size=2, threads=1, tokenizer=None,
                 ours_output_throughput=100.0, model="dummy:smollm2-135m")
    lens = [r.output_len for r in reqs]
    assert p["model"] == "dummy:smollm2-135m" and p["batch_size"] == 2 and p["threads"] == 1
    assert p["requests"] == 3 and p["output_tokens"] == sum(lens)
    assert p["steps"] == max(lens[:2]) + lens[2]
    assert p["ratio"] == pytest.approx(100.0 / p["output_throughput"])
    with pytest.raises(ValueError, match="tokenizer"):  # chats need the model's tokenizer
        run_peer("transformers", ds.chat_dataset(1, parse_lengths("2"), 0), batch_size=1,
                 threads=1, tokenizer=None, ours_output_throughput=1.0)


def test_peer_builds_a_dummy_model_of_the_workers_shape() -> None:
    """`--peer-model dummy:SHAPE`: transformers' own Llama of the worker's dummy shape (on the
    CPU here in float32; bfloat16 on CUDA), generating exactly the asked-for tokens."""
    import torch

    from benchmarks.peer_transformers import hf_generate_batch, load_hf_model
    from worker.weights.dummy import dummy_config

    hf = load_hf_model("dummy:smollm2-135m")
    c, hc = dummy_config("smollm2-135m"), hf.config
    assert (hc.num_hidden_layers, hc.hidden_size, hc.num_key_value_heads, hc.vocab_size) == (
        c.num_layers, c.hidden_size, c.num_kv_heads, c.vocab_size)
    assert hf.dtype == (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    rows = hf_generate_batch(hf, [[5, 6, 7], [9]], 3, pad_id=0)
    assert [len(r) for r in rows] == [3, 3]
    with pytest.raises(ValueError, match="--peer-model"):
        load_hf_model("llama")


def test_unreachable_server_fails_cleanly(tmp_path: Path, capsys) -> None:
    argv = ["--target", "127.0.0.1:1", "--timeout", "2", "--num-requests", "1", "--no-progress",
            "--output-json", str(tmp_path / "x.json")]
    assert main(argv) == 1
    assert "error:" in capsys.readouterr().err


def test_report_compare_gives_ratios_per_rate(tmp_path) -> None:
    from clients.bench.report import render_comparison

    def result(name: str, tput: float, itl: float) -> dict:
        dist = {"mean": itl, "median": itl, "p90": itl, "p99": itl}
        return {"name": name, "runs": [{"request_rate": 0.5, "summary": {
            "output_throughput": tput, "itl_ms": dist, "tpot_ms": dist, "ttft_ms": dist}}]}

    base, new = tmp_path / "b.json", tmp_path / "n.json"
    base.write_text(json.dumps(result("off", 20.0, 900.0)))
    new.write_text(json.dumps(result("on", 18.0, 300.0)))
    text = render_comparison(base, new)
    assert "**on** against **off**" in text
    assert "20.0 → 18.0 (0.90x)" in text and "900.0 → 300.0 (3.00x)" in text
