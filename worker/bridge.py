"""The asyncio side of the engine: per-request streams fed from the engine thread.

The engine thread calls the sink once per step with that step's `StepOutput`; the sink
queues it, and the engine wakes the loop through a pipe (one byte a step: as its next
native call begins, see `Engine.start`); `_drain` fans every queued step out on the loop::

    engine thread                      event loop
    step -> StepOutput --> inbox --->  _drain -> _dispatch: out A -> stream A, out B -> ...
            (outputs, KV events,  byte        tokens/s ring, finish counters,
             figures)             on a pipe   step observers (KV-event hub, metrics)

Outputs are routed by their request object, not by id: `abort` frees a request id at once
(a new request may take it as soon as Abort returns) while the old request's last output,
still on its way from the engine, reaches the old stream.

A stream holds at most ONE pending output per sample (n > 1: one per index): when its
reader is slower than the engine, a new output merges into the pending one of its sample
(text, token ids and logprobs concatenate; the final fields are kept). So buffering per
request is bounded and a reader gets at most one message per sample and engine step,
however far behind it falls. A stream ends when all its samples have finished.

`--stream-interval N` (vLLM's flag) holds a sample's output back until N tokens have come
since its last message; a sample's first tokens and its finished output go at once (time
to first token and the end are never delayed). Each message costs CPU on both ends of the
wire (~0.3 ms each on the machines in BENCHMARKS.md) that a CPU worker's compute threads
lose, so N > 1 buys back single-stream speed where a client does not need every token as
it comes. The count is kept on the engine thread (`_sink`), which then also leaves the
loop asleep for a step that makes no message due (`Engine.start`): the loop's own work a
step is saved too, not only gRPC's.

Everything here runs on the loop thread except `_sink`. Readers of the engine's own
state (`num_running`, `num_free_blocks`, ...) read plain ints and lengths and take no
lock: a Python int or `len()` read is atomic, and a figure one step stale is fine.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from scheduler.request import Request
from worker.engine import Engine, StepOutput
from worker.outputs import RequestOutput

log = logging.getLogger(__name__)


class DuplicateRequestError(ValueError):
    """A request id that is already in flight."""


class RequestStream:
    """One request's outputs: at most one pending (coalesced) output and an event.

    This is the bound on per-stream buffered chunks: however far the reader falls behind,
    `push` merges into the one pending `RequestOutput` (the buffered text and token ids grow
    by what the engine generated, at most max_tokens, never by a count of messages), and
    the reader sends one gRPC message per `next`. No queue of chunks exists to grow.
    """

    def __init__(self, request: Request, tracked: bool = True) -> None:
        self.request = request
        self.request_id = request.request_id
        self.tracked = tracked  # counted in the finish-reason and preemption counters
        self.finished = False  # every sample's finished output has arrived (maybe not read)
        self.aborting = False
        self.finish_as: str | None = None  # an abort we asked for ends with this reason
        self.num_samples = request.sampling_params.n
        self._finished_samples: set[int] = set()
        self._pending: dict[int, RequestOutput] = {}  # by sample index, oldest first
        self._due: set[int] = set()  # samples whose pending output goes out now
        self._ready = asyncio.Event()  # set when some pending output is due
        self._woken = False  # `wake` was called: `next` returns None once

    def push(self, out: RequestOutput, due: bool = True) -> None:
        """Queue a sample's output; `due` (always for a finished one): the reader may take
        it now, else it waits to be merged with later ones (--stream-interval)."""
        i = out.index
        assert i not in self._finished_samples, f"{self.request_id}[{i}]: output after the finished one"
        pending = self._pending.get(i)
        if pending is None:
            self._pending[i] = out
        else:
            pending.merge(out)
        if out.finished:
            self._finished_samples.add(i)
            self.finished = len(self._finished_samples) == self.num_samples
        if due or out.finished:
            self._due.add(i)
            self._ready.set()

    def wake(self) -> None:
        """Ends the reader's wait: its `next` returns None when no output is pending (a
        deadline timer's callback: one timer a request, not one a token)."""
        self._woken = True
        self._ready.set()

    async def next(self) -> RequestOutput | None:
        """One sample's outputs since the last call, merged into one (of the samples whose
        output is due, the one pending longest); waits for one, or returns None after
        `wake` with none due."""
        while True:
            for i in self._pending:
                if i in self._due:
                    self._due.discard(i)
                    return self._pending.pop(i)
            if self._woken:
                self._woken = False
                return None
            self._ready.clear()
            await self._ready.wait()


class RequestObserver(Protocol):
    """Sees tracked requests' outputs on the loop (`worker.metrics`): `output` for each one
    dispatched (`t`: when its engine step ended), then `finished` once per request."""

    def output(self, stream: RequestStream, out: RequestOutput, t: float) -> None: ...

    def finished(self, stream: RequestStream, out: RequestOutput) -> None: ...


class StepObserver(Protocol):
    """Sees every engine step that published something, on the loop (`t`: when it ended):
    the KV-event hub (`worker.kv_events`) and the step metrics."""

    def step(self, step: StepOutput, t: float) -> None: ...


class EngineBridge:
    """Starts the engine thread and routes its outputs into `RequestStream`s."""

    def __init__(self, engine: Engine, rate_window_s: float = 10.0,
                 watchdog_period_s: float = 0.5, stream_interval: int = 1) -> None:
        self.engine = engine
        self.stream_interval = stream_interval  # tokens a message waits for (_sink)
        # Engine thread only: per sample, tokens published since its last due output (a
        # sample not here has had none, so its first tokens are due at once).
        self._since_due: dict[object, int] = {}
        self.rate_window_s = rate_window_s
        self.watchdog_period_s = watchdog_period_s
        # Called on the loop if the thread dies; what it returns (the drain that sets health
        # NOT_SERVING) is awaited, up to dead_drain_wait_s, before the streams fail.
        self.on_dead: Callable[[], Awaitable[object] | None] | None = None
        self.dead_drain_wait_s = 5.0
        self._loop: asyncio.AbstractEventLoop | None = None
        # Requests whose engine output has not ended, by request object (routing), and the
        # ids taken by open streams that were not aborted (duplicate check, abort by id).
        self._live: dict[Request, RequestStream] = {}
        self._streams: dict[str, RequestStream] = {}
        self._rate: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens)
        self._started_at = time.monotonic()
        self._watchdog: asyncio.Task[None] | None = None
        self.closed = False
        self.dead = False  # the engine thread died; every stream was failed
        self.unavailable = False  # ... because a tensor-parallel rank was lost
        # Counters for GetServerStatus (tracked requests only: not the warm-up).
        self.finish_counts: collections.Counter[str] = collections.Counter()
        self.num_preemptions = 0
        self.observers: list[RequestObserver] = []
        self.step_observers: list[StepObserver] = []
        # Steps from the engine thread (deque appends and pops are atomic) and the pipe
        # it wakes the loop through.
        self._inbox: collections.deque[tuple[StepOutput, float, set[int] | None]] = (
            collections.deque())
        self._wake_r = self._wake_w = -1

    # ----- lifecycle -----

    def start(self) -> None:
        """Start the engine thread; call on the loop that will read the streams."""
        self._loop = asyncio.get_running_loop()
        self._started_at = time.monotonic()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._loop.add_reader(self._wake_r, self._drain)
        self.engine.start(self._sink, wake_fd=self._wake_w)
        self._watchdog = self._loop.create_task(self._watch())

    async def close(self) -> None:
        """Stop the engine thread (without blocking the loop); streams still open end with
        finish_reason "error"."""
        if self.closed:
            return
        self.closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        await asyncio.to_thread(self.engine.shutdown)
        if self._loop is not None and self._wake_r >= 0:
            self._drain()  # the steps queued before the shutdown
            self._loop.remove_reader(self._wake_r)
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
        self._fail_all("the worker shut down before the request finished")

    async def _watch(self) -> None:
        """An engine thread that died would hang every stream: fail them instead, and call
        `on_dead` (the server drains: health NOT_SERVING, exit code 1). The engine thread
        also ends itself after `Engine.max_consecutive_failed_steps` failed model steps in
        a row, so a broken device lands here too."""
        while not self.closed:
            await asyncio.sleep(self.watchdog_period_s)
            thread = self.engine._thread
            if not self.closed and (thread is None or not thread.is_alive()):
                log.error("the engine thread died; failing %d requests", len(self._live))
                self.dead = True
                # A lost tensor-parallel rank (worker/parallel): the worker is gone, not broken
                # by the request; its streams end UNAVAILABLE (another replica may serve them).
                lost = getattr(self.engine, "lost", None)
                self.unavailable = lost is not None
                # Health says NOT_SERVING before any stream ends: a client that sees its
                # stream fail and then asks health must not be told SERVING.
                drained = self.on_dead() if self.on_dead is not None else None
                if drained is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(asyncio.shield(drained), self.dead_drain_wait_s)
                self._fail_all(lost or "the engine thread died")
                return

    def _fail_all(self, message: str) -> None:
        for stream in list(self._live.values()):
            req = stream.request
            # Every sample not finished (the engine may not have made the followers yet).
            samples = req.group.samples if req.group is not None else [req]
            for i in range(stream.num_samples):
                if i in stream._finished_samples:
                    continue
                done = samples[i].num_output_tokens if i < len(samples) else 0
                self._finish(stream, RequestOutput(
                    request_id=stream.request_id, new_token_ids=[], new_text="", finished=True,
                    finish_reason="error", error=message, prompt_tokens=req.num_prompt_tokens,
                    completion_tokens=done, cached_tokens=req.num_cached_tokens,
                    total_time_s=time.monotonic() - req.arrival_time, index=i,
                ))

    # ----- requests -----

    def open(self, request: Request, tracked: bool = True) -> RequestStream:
        """Submit `request` to the engine and return its stream."""
        if self.closed or self.dead:
            raise RuntimeError("the engine is not running")
        if request.request_id in self._streams:
            raise DuplicateRequestError(
                f"request_id {request.request_id[:64]!r} is already in flight")
        stream = RequestStream(request, tracked)
        self._streams[request.request_id] = stream
        self._live[request] = stream
        self.engine.submit(request)
        return stream

    def abort(self, request_id: str) -> bool:
        """Ask the engine to abort a request in flight; its stream then ends with "abort"
        and its blocks are freed in the next step. The id is free for a new request at
        once. False if it is not in flight."""
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            return False
        self._abort(stream)
        return True

    def _abort(self, stream: RequestStream) -> None:
        if not stream.aborting:
            stream.aborting = True
            # The engine reads its inbox in order: this abort reaches it before any new
            # request submitted under the same id.
            self.engine.abort([stream.request_id])
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    def expire(self, request_id: str, finish_reason: str = "length") -> bool:
        """End a request in flight through the abort path (blocks freed in the engine's
        next step) but report it finished with `finish_reason` (--max-generation-time-s).
        A request that finished on its own first keeps its own reason. False if it is not
        in flight."""
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            return False
        if not stream.aborting:
            stream.finish_as = finish_reason
        return self.abort(request_id)

    def abort_all(self) -> int:
        count = 0
        for stream in list(self._live.values()):
            if not stream.finished:
                self._abort(stream)
                count += 1
        return count

    # ----- the hop from the engine thread -----

    def _sink(self, step: StepOutput) -> bool:
        """Engine thread: queue the step, with which of its outputs are due; True if the
        loop is to be woken for it (the engine wakes it: Engine.start)."""
        t = time.monotonic()
        if self.stream_interval == 1:
            self._inbox.append((step, t, None))
            return True
        due = self._due_outputs(step)
        self._inbox.append((step, t, due))
        return bool(due) or not step.outputs

    def _due_outputs(self, step: StepOutput) -> set[int]:
        """Which of the step's outputs (positions) a stream sends now at --stream-interval
        N: a sample's finished one, its first with tokens, and one that brings the tokens
        since its sample's last due output to N."""
        due: set[int] = set()
        since = self._since_due
        for k, out in enumerate(step.outputs):
            leader = out.stream_key  # the admitted request (its id may be reused after it)
            key = (leader if leader is not None else out.request_id, out.index)
            if out.finished:
                since.pop(key, None)
                due.add(k)
            elif out.new_token_ids:
                n = since.get(key)
                n = self.stream_interval if n is None else n + len(out.new_token_ids)
                if n >= self.stream_interval:
                    due.add(k)
                    n = 0
                since[key] = n
        return due

    def _drain(self) -> None:
        """Loop: every step queued so far, in order (the pipe's bytes only wake it)."""
        try:  # one byte a step: a short read emptied the pipe (no second, failing call)
            while len(os.read(self._wake_r, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass
        while self._inbox:
            self._dispatch(*self._inbox.popleft())

    @staticmethod
    def _observe(call: Any, *args: Any) -> None:
        """One observer's call. Its failure is logged and goes no further: raised here, it
        dropped the step's outputs for every stream (a KV-event hub that could not encode a
        figure did so each step)."""
        try:
            call(*args)
        except Exception:
            log.exception("observer %s failed", getattr(call, "__qualname__", repr(call))[:80])

    def _dispatch(self, step: StepOutput, t: float, due: set[int] | None) -> None:
        tokens = 0
        for obs in self.step_observers:
            self._observe(obs.step, step, t)
        for k, out in enumerate(step.outputs):
            tokens += len(out.new_token_ids)
            key = out.stream_key
            stream = self._live.get(key) if key is not None else None
            if stream is None:
                log.warning("output for unknown request %s", out.request_id[:64])
                continue
            if stream.tracked:
                for obs in self.observers:
                    self._observe(obs.output, stream, out, t)
            if out.finished:
                self._finish(stream, out)
            else:
                stream.push(out, due is None or k in due)
        if tokens:
            self._rate.append((t, tokens))
            self._trim(t)

    def _finish(self, stream: RequestStream, out: RequestOutput) -> None:
        """A sample's finished output; the stream ends with its last sample's."""
        if stream.finish_as is not None and out.finish_reason == "abort":
            out.finish_reason = stream.finish_as
        stream.push(out)
        if not stream.finished:
            return
        del self._live[stream.request]
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        if stream.tracked:
            self.finish_counts[out.finish_reason or "error"] += 1
            self.num_preemptions += stream.request.num_preemptions
            for obs in self.observers:
                self._observe(obs.finished, stream, out)

    def _trim(self, now: float) -> None:
        while self._rate and self._rate[0][0] < now - self.rate_window_s:
            self._rate.popleft()

    # ----- figures (plain reads; never block on the engine thread) -----

    @property
    def num_in_flight(self) -> int:
        """Requests opened whose finished output has not arrived yet (aborted ones too)."""
        return len(self._live)

    @property
    def num_running(self) -> int:
        return self.engine.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        """Waiting for the engine: in its scheduler's queue or still in its inbox (swapped-out
        requests are counted apart). In flight minus running and swapped counts both without
        touching the inbox."""
        sched = self.engine.scheduler
        return max(sched.num_waiting, self.num_in_flight - self.num_running - sched.num_swapped)

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        self._trim(now)
        span = min(self.rate_window_s, now - self._started_at)
        return sum(n for _, n in self._rate) / max(span, 1.0)
