"""The engine's deferred wake of a served worker's event loop (`Engine.start(wake_fd=...)`):
one byte per step it queued, written by the next step's native call where the CPU decoder
runs it, else after the step or when the engine goes idle; never lost, never doubled."""

from __future__ import annotations

import os
import threading
import time

import pytest

from scheduler.request import SamplingParams
from worker.config import CacheConfig, ModelConfig, WorkerConfig
from worker.engine import Engine


def _engine(loaded, kernels: str = "auto") -> Engine:
    return Engine(WorkerConfig(model=ModelConfig(kernels=kernels),
                               cache=CacheConfig(kv_cache_memory=0.5)), loaded=loaded)


def _pipe() -> tuple[int, int]:
    r, w = os.pipe()
    for fd in (r, w):
        os.set_blocking(fd, False)
    return r, w


def _read_all(fd: int) -> int:
    n = 0
    try:
        while chunk := os.read(fd, 4096):
            n += len(chunk)
    except BlockingIOError:
        pass
    return n


def test_the_cpu_decoders_call_writes_the_armed_byte_as_it_begins(default_model, chat_prompt_ids) -> None:
    engine = _engine(default_model)
    assert engine.runner.cpu_decoder is not None, "the default model on the CPU runs the C decoder"
    r, w = _pipe()
    try:
        engine.submit(engine.make_request(chat_prompt_ids[0], SamplingParams(temperature=0, max_tokens=4)))
        engine.step()  # the prompt, nothing armed
        assert _read_all(r) == 0 and engine.runner.wake_fd == -1
        engine.runner.wake_fd = w
        engine.step()  # a decode step: its native call takes the fd and writes once
        assert _read_all(r) == 1
        assert engine.runner.wake_fd == -1, "a taken fd is disarmed (one byte per arming)"
        engine.step()
        assert _read_all(r) == 0
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_every_queued_step_wakes_its_reader_exactly_once(default_model, chat_prompt_ids, kernels) -> None:
    """Both paths: with the C decoder the byte is deferred to the next call (or the idle
    engine), with torch's kernels it is written after each step. Requests come and go, so
    the engine idles between them with a step still queued."""
    engine = _engine(default_model, kernels)
    assert (engine.runner.cpu_decoder is not None) == (kernels == "auto")
    r, w = _pipe()
    queued = 0
    finished = threading.Event()
    lock = threading.Lock()
    done: list[str] = []

    def sink(step) -> None:
        nonlocal queued
        with lock:
            queued += 1
            done.extend(o.request_id for o in step.outputs if o.finished)
            if len(done) == 3:
                finished.set()

    engine.start(sink, wake_fd=w)
    woken = 0
    try:
        for i, ids in enumerate(chat_prompt_ids[:3]):
            engine.submit(engine.make_request(ids, SamplingParams(temperature=0, max_tokens=6 + i)))
            deadline = time.monotonic() + 60
            while len(done) <= i and time.monotonic() < deadline:  # each alone, then idle
                woken += _read_all(r)
                time.sleep(0.001)
            # The finished output's step was woken although no step came after it.
            deadline = time.monotonic() + 10
            while woken < queued and time.monotonic() < deadline:
                woken += _read_all(r)
                time.sleep(0.001)
            with lock:
                assert woken == queued, (i, woken, queued)
        assert finished.wait(60)
    finally:
        engine.shutdown()
    woken += _read_all(r)
    assert woken == queued and queued >= 6 + 7 + 8  # a step per token at least
    os.close(r)
    os.close(w)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_a_step_the_sink_asks_no_wake_for_is_announced_by_a_later_one_or_the_idle_engine(
        default_model, chat_prompt_ids, kernels) -> None:
    """--stream-interval: the bridge's sink returns False for a step that makes no message
    due. Such a step wakes nobody; the next step the sink wants woken announces it too (one
    byte); and where none comes, the engine going idle does: here a sink that wants every
    third step, then none at all (the last request's steps), so the idle engine wakes."""
    engine = _engine(default_model, kernels)
    r, w = _pipe()
    calls = 0
    wanted = 0
    done = threading.Event()
    want_any = True

    def sink(step) -> bool:
        nonlocal calls, wanted
        calls += 1
        want = want_any and calls % 3 == 0
        wanted += want
        if any(o.finished for o in step.outputs):
            done.set()
        return want

    engine.start(sink, wake_fd=w)
    try:
        engine.submit(engine.make_request(chat_prompt_ids[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)))
        assert done.wait(60)
        deadline = time.monotonic() + 10
        woken = 0
        while woken < wanted + 1 and time.monotonic() < deadline:
            woken += _read_all(r)
            time.sleep(0.001)
        # One byte per wanted step; one more at idle unless the last step was wanted.
        assert woken == wanted + (calls % 3 != 0) and wanted >= 4, (woken, wanted, calls)
        time.sleep(0.05)
        assert _read_all(r) == 0, "nothing more: the idle engine woke once"

        done.clear()
        want_any = False
        engine.submit(engine.make_request(chat_prompt_ids[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
        assert done.wait(60)
        deadline = time.monotonic() + 10
        while not (woken := _read_all(r)) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert woken == 1, "no step wanted a wake: the engine going idle announced them all"
    finally:
        engine.shutdown()
        os.close(r)
        os.close(w)
