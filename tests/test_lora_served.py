"""LoRA adapters on a real `llm-worker serve` process (the default model): per-request adapters on our protocol,
the admin RPCs under load (load, unload, LRU eviction from host memory while requests of
several adapters stream), unload of an adapter in use refused, unknown adapters refused at
the door, and what GetServerStatus and the metrics say."""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from llmworker.v1 import worker_pb2 as pb

from benchmarks.lora import write_adapters
from tests.test_server import GREEDY, Worker, code_of, run, wait_until
from worker.weights.dummy import dummy_config

MODEL = "default"
PROMPTS = [[(7 * i + j) % 40000 + 100 for j in range(20 + i)] for i in range(6)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    # The default model's shapes; lora_B large enough that an adapter changes its greedy tokens.
    return write_adapters(tmp_path_factory.mktemp("loras"), dummy_config("smollm2-135m"), 5, 8,
                          ["q_proj", "v_proj", "down_proj"], b_std=0.2)


@pytest.fixture(scope="module")
def lora_worker(adapters):
    metrics_port = _free_port()
    w = Worker("--model", MODEL, "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2",
               "--max-lora-rank", "8", "--lora-modules", f"adapter0={adapters['adapter0']}",
               f"adapter1={adapters['adapter1']}", "--metrics-port", str(metrics_port))
    w.metrics_port = metrics_port
    try:
        yield w.wait_ready()
    finally:
        w.close()


def _gen(w: Worker, prompt: list[int], lora: str = "", max_tokens: int = 12) -> list[int]:
    chunks, complete = run(w.stub, token_ids=pb.TokenIdsInput(ids=prompt), sampling=GREEDY,
                           stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
                           lora_name=lora)
    assert complete.finish_reason == pb.FINISH_REASON_LENGTH
    return [t for c in chunks for t in c.token_ids]


def _tokens_until_cancelled(call) -> tuple[int, bool]:
    """(tokens streamed, whether the stream completed) of a Generate call, read until it ends
    or is cancelled."""
    n = 0
    try:
        for resp in call:
            if not resp.HasField("chunk"):
                return n, True
            n += len(resp.chunk.token_ids)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.CANCELLED, e
    return n, False


def _adapters(w: Worker) -> dict[str, pb.LoraAdapter]:
    return {a.name: a for a in w.stub.ListLoraAdapters(pb.ListLoraAdaptersRequest(), timeout=10).adapters}


def test_requests_name_adapters_and_unknown_ones_are_refused(lora_worker) -> None:
    w = lora_worker
    base = _gen(w, PROMPTS[0])
    tuned = _gen(w, PROMPTS[0], "adapter0")
    assert tuned != base and _gen(w, PROMPTS[0], "adapter0") == tuned
    with pytest.raises(grpc.RpcError) as e:
        _gen(w, PROMPTS[0], "nope")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lora_name: unknown LoRA adapter 'nope'" in e.value.details()
    listed = w.stub.ListLoraAdapters(pb.ListLoraAdaptersRequest(), timeout=10)
    assert (listed.max_loras, listed.max_lora_rank, listed.max_cpu_loras) == (2, 8, 2)
    status = w.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)
    assert {a.name for a in status.lora_adapters} >= {"adapter0", "adapter1"}
    assert any(a.num_requests >= 2 for a in status.lora_adapters if a.name == "adapter0")
    # The request's log line names its adapter (the span carries it too).
    wait_until(lambda: any("request finished" in line and '"lora_name": "adapter0"' in line
                           for line in list(w.lines)), what="a log line naming adapter0")


def test_load_unload_and_lru_eviction_under_load(lora_worker, adapters) -> None:
    """48 streams over 4 adapters and the base, max 2 adapters per step and 2 in host memory,
    while adapters are loaded and unloaded: every stream completes with the tokens it gets
    alone, an unload of an adapter in use is refused, idle adapters leave host memory."""
    w = lora_worker
    code = code_of(lambda: w.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(
        lora_name="bad", lora_path=str(adapters["adapter0"] / "nowhere")), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    for name in ("adapter2", "adapter3"):
        loaded = w.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(
            lora_name=name, lora_path=str(adapters[name])), timeout=30)
        assert loaded.adapter.name == name and loaded.adapter.rank == 8
    assert code_of(lambda: w.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(
        lora_name="adapter2", lora_path=str(adapters["adapter2"])), timeout=30)) == grpc.StatusCode.ALREADY_EXISTS
    # Four registered, at most two in host memory: the two least recently used were dropped.
    assert sum(a.resident for a in _adapters(w).values()) == 2

    names = ["", "adapter0", "adapter1", "adapter2", "adapter3"]
    work = [(PROMPTS[i % len(PROMPTS)], names[i % len(names)]) for i in range(48)]
    alone: dict[tuple[tuple[int, ...], str], list[int]] = {}
    for p, n in work:  # adapters read back into host memory as they are asked for
        if (tuple(p), n) not in alone:
            alone[tuple(p), n] = _gen(w, p, n)
    with ThreadPoolExecutor(17) as pool:
        # A request holds adapter1 for the whole test (its unload must be refused), and is
        # cancelled at the end: it asks for more tokens than the load takes to finish.
        held_call = w.stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIdsInput(ids=PROMPTS[5]), sampling=GREEDY, lora_name="adapter1",
            stopping=pb.StoppingCriteria(max_tokens=1900, ignore_eos=True)), timeout=600)
        held = pool.submit(_tokens_until_cancelled, held_call)
        wait_until(lambda: _adapters(w)["adapter1"].num_running >= 1, what="adapter1 in use")
        # Two of the four are out of host memory as the load starts: they are read back in
        # (and others dropped as they go idle) while it runs.
        assert sum(not a.resident for a in _adapters(w).values()) >= 2
        futures = [pool.submit(_gen, w, p, n, 12) for p, n in work]
        cycles = 0
        while not all(f.done() for f in futures):
            assert code_of(lambda: w.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(
                lora_name="adapter1"), timeout=10)) == grpc.StatusCode.FAILED_PRECONDITION
            # An adapter no request uses, loaded and unloaded while the others stream.
            # (Every quarter second: back to back, 750 cycles took half the engine's time.)
            w.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(
                lora_name="adapter4", lora_path=str(adapters["adapter4"])), timeout=30)
            w.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="adapter4"), timeout=10)
            cycles += 1
            time.sleep(0.25)
        results = [f.result(timeout=60) for f in futures]  # none failed
        held_call.cancel()
        streamed, finished = held.result(timeout=60)
        assert streamed >= 1 and not finished, (streamed, finished)
    assert cycles >= 1
    for (p, n), got in zip(work, results, strict=True):
        assert got == alone[tuple(p), n], f"adapter {n!r}: under load != alone"
    wait_until(lambda: not any(a.num_running for a in _adapters(w).values()), what="adapters idle")
    # Idle again: host memory back down to --max-cpu-loras, and every adapter unloadable.
    assert sum(a.resident for a in _adapters(w).values()) <= 2
    assert "adapter4" not in _adapters(w)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=10).read().decode()
    assert 'max_lora="2"' in metrics and "vllm:lora_requests_info{" in metrics
    assert 'llm_worker:lora_requests_total{' in metrics and 'lora_name="adapter3"' in metrics
    w.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="adapter3"), timeout=10)
    assert code_of(lambda: w.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(
        lora_name="adapter3"), timeout=10)) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: _gen(w, PROMPTS[0], "adapter3")) == grpc.StatusCode.INVALID_ARGUMENT


def test_lora_off_refuses_adapters_clearly(tmp_path) -> None:
    w = Worker("--model", MODEL, "--max-num-seqs", "2")
    try:
        w.wait_ready()
        with pytest.raises(grpc.RpcError) as e:
            _gen(w, PROMPTS[0], "adapter0")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--enable-lora" in e.value.details()
        assert code_of(lambda: w.stub.ListLoraAdapters(pb.ListLoraAdaptersRequest(), timeout=10)
                       ) == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        w.close()
