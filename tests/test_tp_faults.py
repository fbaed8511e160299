"""Tensor parallelism's failures are loud (served, a tiny model at -tp 2 over gloo): a
follower killed, stopped past --distributed-timeout-seconds, or raising in a step ends the
stream UNAVAILABLE within the bound, health leaves SERVING, `serve` exits non-zero and no
process is left; rank 0 killed takes its followers with it; a follower that cannot load
makes `serve` exit non-zero with its message. The workers start together (their imports
overlap)."""

from __future__ import annotations

import os
import signal
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2

from tests.tp_helpers import fail_time, followers, gone, long_stream, start_all, tiny_checkpoint

pytestmark = pytest.mark.slow
SERVING = health_pb2.HealthCheckResponse.SERVING
PROMPT = [1, 17, 33, 49, 65, 81]
FAULT = "LLMWORKER_TP_TEST_FAULT"


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    model = tiny_checkpoint(tmp_path_factory.mktemp("tp_faults"), kv_heads=2)
    flags = ("--model", model, "-tp", "2",
             "--max-num-seqs", "4")
    made = start_all({
        "kill": (flags, None),
        "stop": ((*flags, "--distributed-timeout-seconds", "5"), None),
        "raise": (flags, {FAULT: "1:step:8"}),
        "rank0": (flags, None),
        "load": (flags, {FAULT: "1:load"}),
    } if os.environ.get("TP_ONLY") is None else {os.environ["TP_ONLY"]: (flags, None)})
    # Each fault is its own worker's: none may reach this process's environment, which later
    # workers inherit (patching os.environ from the starting threads once leaked "1:step:8").
    assert FAULT not in os.environ
    yield made
    for w in made.values():
        procs = followers(w) if w.proc.poll() is None else []
        w.close()
        for p in procs:
            p.kill()


def _health_left_serving(w) -> bool:
    try:
        return w.health.Check(health_pb2.HealthCheckRequest(), timeout=2).status != SERVING
    except grpc.RpcError:  # the process has gone already
        return w.proc.poll() is not None


def _loud(w, fault, bound_s: float) -> None:
    w.wait_ready()
    procs = followers(w)
    assert len(procs) == 1
    code, took, details = fail_time(long_stream(w, PROMPT), lambda: fault(procs[0]))
    assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
    assert "tensor parallel" in details, details
    assert took < bound_s, took
    assert _health_left_serving(w)
    assert w.proc.wait(30) != 0
    assert gone(procs, 5), "a follower outlived the worker"


def test_a_follower_killed_mid_stream(workers) -> None:
    _loud(workers["kill"], lambda p: p.send_signal(signal.SIGKILL), 2.0)


def test_a_follower_stopped_past_the_timeout(workers) -> None:
    _loud(workers["stop"], lambda p: p.send_signal(signal.SIGSTOP), 6.0)


def test_a_follower_that_raises_in_a_step(workers) -> None:
    w = workers["raise"]
    _loud(w, lambda p: None, 2.0)
    assert any("injected fault in rank 1's step 8" in line for line in w.lines)


def test_rank_0_killed_takes_its_followers(workers) -> None:
    w = workers["rank0"].wait_ready()
    procs = followers(w)
    assert procs
    t0 = time.monotonic()
    os.kill(w.proc.pid, signal.SIGKILL)
    assert gone(procs, 2.0), "followers outlived rank 0 by 2 s"
    assert time.monotonic() - t0 < 2.0


def test_a_follower_that_cannot_load(workers) -> None:
    w = workers["load"]
    assert w.proc.wait(120) != 0
    w.wait_for(r"tensor parallel rank 1 could not load the model: injected load failure on rank 1",
               timeout=5)
    assert gone(_marked("1:load"), 5), "a follower outlived the failed start"


def _marked(fault: str) -> list[psutil.Process]:
    """The followers started with this fault in their environment (this worker's only)."""
    found = []
    for p in psutil.process_iter():
        try:
            if ("worker.parallel.follower" in " ".join(p.cmdline())
                    and p.environ().get(FAULT) == fault):
                found.append(p)
        except psutil.Error:
            pass
    return found
