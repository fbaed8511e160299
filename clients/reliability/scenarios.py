"""The scenarios (see the package docstring). Each starts its own worker process, returns a
`Record`, and leaves nothing running."""

from __future__ import annotations

import asyncio
import collections
import random
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from llmworker.v1 import worker_pb2 as pb
from llmworker.v1 import worker_pb2_grpc

from clients.reliability import flatness
from clients.reliability.checks import Record
from clients.reliability.process import WorkerProcess
from clients.reliability.streams import (
    CANCELLED_BY_CLIENT,
    PROMPTS,
    Outcome,
    Plan,
    is_idle,
    load_dict,
    percentile,
    rng,
    run_all,
    run_plan,
    wait_idle,
)

Stub = worker_pb2_grpc.WorkerServiceStub
SERVING = health_pb2.HealthCheckResponse.SERVING


async def _serving(channel: grpc.aio.Channel) -> bool:
    resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
    return resp.status == SERVING


def _statuses(outcomes: list[Outcome]) -> dict[str, int]:
    return dict(collections.Counter(o.status for o in outcomes))


async def _with_worker(rec: Record, flags: list[str],
                       body: Callable[[WorkerProcess, grpc.aio.Channel, Stub], Awaitable[None]],
                       fault_file: Path | None = None, env: dict[str, str] | None = None) -> None:
    rec.worker_flags = flags
    with WorkerProcess(*flags, fault_file=fault_file, env=env) as w:
        async with grpc.aio.insecure_channel(w.address) as channel:
            await body(w, channel, Stub(channel))


async def _end_state(rec: Record, channel: grpc.aio.Channel, stub: Stub) -> None:
    """The checks every scenario ends with: idle, every block back, still SERVING."""
    load = load_dict(await wait_idle(stub))
    rec.figures["load_after"] = load
    rec.check("every block back, nothing running, waiting or swapped", is_idle(load), load)
    rec.check("health SERVING afterwards", await _serving(channel))


async def _capacity(stub: Stub, plans: list[Plan], concurrency: int) -> float:
    """Completed requests/s running `plans` with `concurrency` streams always busy."""
    t = time.monotonic()
    await run_all(stub, plans, concurrency)
    return len(plans) / (time.monotonic() - t)


async def _poisson_until(stub: Stub, start: float, duration_s: float, rate: float,
                         r: random.Random, make_plan: Callable[[int], Plan], wait_s: float,
                         tick: Callable[[float], None] | None = None) -> list[Outcome]:
    """From `start` (a `time.monotonic()`, also the zero of each outcome's `sent_at`), send
    `make_plan(i)` at Poisson times (`rate`/s, gaps drawn from `r` after each plan) for
    `duration_s`, then wait up to `wait_s` for every stream; `tick(now)` runs before each
    send."""
    tasks: list[asyncio.Task[Outcome]] = []
    i = 0
    while (now := time.monotonic()) - start < duration_s:
        if tick is not None:
            tick(now)
        tasks.append(asyncio.create_task(run_plan(stub, make_plan(i), start)))
        i += 1
        await asyncio.sleep(r.expovariate(rate))
    return list(await asyncio.wait_for(asyncio.gather(*tasks), wait_s))


# ----- storm -------------------------------------------------------------------------------


async def storm(n: int = 500, witnesses: int = 16, concurrency: int = 96, max_tokens: int = 96,
                seed: int = 0) -> Record:
    rec = Record("storm", {"cancelled_streams": n, "witnesses": witnesses,
                           "concurrency": concurrency, "max_tokens": max_tokens, "seed": seed})
    r = rng(seed)

    async def body(w: WorkerProcess, channel: grpc.aio.Channel, stub: Stub) -> None:
        def witness(i: int, tag: str) -> Plan:
            return Plan(f"w{i}-{tag}", PROMPTS[i % len(PROMPTS)], max_tokens=48)

        solo = await run_all(stub, [witness(i, "solo") for i in range(witnesses)], witnesses)
        plans: list[Plan] = []
        for i in range(n):
            mt = r.randint(8, max_tokens)
            p = Plan(f"s{i}", r.choice(PROMPTS), max_tokens=mt)
            if r.random() < 0.25:  # by time: some before admission, some mid-prefill
                p.cancel_after_s = r.uniform(0.0, 2.0)
            else:  # after k chunks, k from 0 (at once) to just before the end
                p.cancel_after_chunks = r.randint(0, mt - 1)
            plans.append(p)
        every = max(1, n // witnesses)
        for i in range(witnesses):  # spread through the storm, so each overlaps it
            plans.insert(min(len(plans), (i + 1) * every), witness(i, "storm"))
        t = time.monotonic()
        outs = await run_all(stub, plans, concurrency)
        rec.figures["storm_seconds"] = round(time.monotonic() - t, 1)
        by_id = {o.request_id: o for o in outs}
        storm_outs = [o for o in outs if o.request_id.startswith("s")]
        rec.counts = {"sent": len(outs), "storm": _statuses(storm_outs),
                      "witnesses": _statuses([o for o in outs if o.request_id.startswith("w")])}
        rec.check("every storm stream ended cancelled by its client or complete (OK)",
                  all(o.status in (CANCELLED_BY_CLIENT, "OK") for o in storm_outs),
                  _statuses(storm_outs))
        rec.check("most storm streams were cancelled (the storm happened)",
                  _statuses(storm_outs).get(CANCELLED_BY_CLIENT, 0) >= 0.8 * n,
                  _statuses(storm_outs))
        same = [by_id[f"w{i}-storm"].token_ids == solo[i].token_ids
                and by_id[f"w{i}-storm"].status == "OK" for i in range(witnesses)]
        rec.counts["witnesses_unchanged"] = sum(same)
        rec.check("witness outputs identical to their run without the storm", all(same),
                  f"{sum(same)}/{witnesses}")
        status = await stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)
        rec.figures["worker_finish_reasons"] = dict(status.requests_by_finish_reason)
        await _end_state(rec, channel, stub)

    await _with_worker(rec, [], body)
    return rec


# ----- overload ----------------------------------------------------------------------------

PRIORITIES = (-1, 0, 1)  # urgent, normal, batch (lower runs first)


async def overload(factor: float = 4.0, duration_s: float = 60.0, max_tokens: int = 96,
                   cancel_fraction: float = 0.1, max_num_seqs: int = 8, max_waiting: int = 16,
                   seed: int = 0) -> Record:
    """A KV cache of 0.03 GiB holds ~660 tokens: fewer than `max_num_seqs` requests at full
    length need, so the scheduler must preempt (the KV cache running out is preemption,
    never a crash); the short waiting queue makes the overload show as refusals."""
    flags = ["--max-num-seqs", str(max_num_seqs), "--max-waiting", str(max_waiting),
             "--kv-cache-memory", "0.03", "--max-model-len", "512"]
    rec = Record("overload", {"factor": factor, "duration_s": duration_s,
                              "max_tokens": max_tokens, "cancel_fraction": cancel_fraction,
                              "priorities": list(PRIORITIES), "seed": seed})
    r = rng(seed)

    async def body(w: WorkerProcess, channel: grpc.aio.Channel, stub: Stub) -> None:
        # Capacity: completed requests/s with every seat busy, the same request mix.
        calib = [Plan(f"c{i}", r.choice(PROMPTS), max_tokens=r.randint(16, max_tokens))
                 for i in range(2 * max_num_seqs)]
        capacity = await _capacity(stub, calib, max_num_seqs)
        rate = factor * capacity
        rec.figures.update(capacity_rps=round(capacity, 3), arrival_rps=round(rate, 3))

        def plan(i: int) -> Plan:
            p = Plan(f"o{i}", r.choice(PROMPTS), max_tokens=r.randint(16, max_tokens),
                     priority=r.choice(PRIORITIES))
            if r.random() < cancel_fraction:
                p.cancel_after_s = r.uniform(0.0, 5.0)
            return p

        outs = await _poisson_until(stub, time.monotonic(), duration_s, rate, r, plan, 600)
        st = _statuses(outs)
        completed = st.get("OK", 0)
        refused = st.get("RESOURCE_EXHAUSTED", 0)
        cancelled = st.get(CANCELLED_BY_CLIENT, 0)
        rec.counts = {"sent": len(outs), "completed": completed, "refused": refused,
                      "cancelled": cancelled, "statuses": st}
        rec.check("sent = completed + refused + cancelled",
                  len(outs) == completed + refused + cancelled, st)
        rec.check("the worker refused some (it was overloaded)", refused > 0, refused)
        refusals = [o for o in outs if o.status == "RESOURCE_EXHAUSTED"]
        rec.check("every refusal names the waiting queue",
                  all("queue" in o.details for o in refusals),
                  refusals[0].details if refusals else "")
        per: dict[str, dict[str, float]] = {}
        for prio in PRIORITIES:
            mine = [o for o in outs if o.priority == prio]
            done = [o for o in mine if o.status == "OK"]
            ttft = [o.ttft_s for o in done if o.ttft_s is not None]
            per[str(prio)] = {"sent": len(mine), "completed": len(done),
                              "refused": sum(o.status == "RESOURCE_EXHAUSTED" for o in mine),
                              "ttft_p50_s": round(percentile(ttft, 50), 3),
                              "ttft_p99_s": round(percentile(ttft, 99), 3)}
        rec.figures["by_priority"] = per
        status = await stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)
        rec.figures["num_preemptions"] = status.num_preemptions
        rec.figures["worker_finish_reasons"] = dict(status.requests_by_finish_reason)
        rec.check("the KV cache ran out and requests were preempted, not failed",
                  status.num_preemptions > 0 and "error" not in status.requests_by_finish_reason,
                  f"{status.num_preemptions} preemptions")
        await _end_state(rec, channel, stub)

    await _with_worker(rec, flags, body)
    return rec


# ----- SIGTERM -----------------------------------------------------------------------------


async def sigterm(streams: int = 40, grace_s: float = 20.0, long_tokens: int = 1500) -> Record:
    flags = ["--drain-grace-s", str(grace_s)]
    rec = Record("sigterm", {"streams": streams, "grace_s": grace_s, "long_tokens": long_tokens})

    async def body(w: WorkerProcess, channel: grpc.aio.Channel, stub: Stub) -> None:
        plans = [Plan(f"t{i}", PROMPTS[i % len(PROMPTS)],
                      max_tokens=16 if i % 2 else long_tokens) for i in range(streams)]
        tasks = [asyncio.create_task(run_plan(stub, p)) for p in plans]
        while (await stub.GetLoad(pb.GetLoadRequest(), timeout=10)).num_running < streams // 2:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        w.terminate()
        signalled = time.monotonic()
        await asyncio.sleep(0.2)
        late = await asyncio.gather(*(run_plan(stub, Plan(f"late{i}", PROMPTS[0], 4))
                                      for i in range(5)))
        outs = list(await asyncio.wait_for(asyncio.gather(*tasks), grace_s + 30))
        ended = time.monotonic() - signalled
        code = await asyncio.to_thread(w.wait, 60)
        exited = time.monotonic() - signalled
        st = _statuses(outs)
        reasons = collections.Counter(o.finish_reason for o in outs if o.status == "OK")
        rec.counts = {"in_flight": len(outs), "statuses": st, "finish_reasons": dict(reasons),
                      "late": _statuses(late)}
        rec.figures.update(all_streams_ended_s=round(ended, 2), exited_s=round(exited, 2),
                           exit_code=code)
        short = [o for i, o in enumerate(outs) if i % 2]
        rec.check("every in-flight stream ended OK with a complete (none hung, none dropped)",
                  st == {"OK": len(outs)}, st)
        rec.check("the short ones finished their work within the grace",
                  all(o.finish_reason == "FINISH_REASON_LENGTH" for o in short), reasons)
        rec.check("the long ones were aborted at the end of the grace",
                  reasons.get("FINISH_REASON_ABORT", 0) > 0, reasons)
        rec.check("calls after the signal got UNAVAILABLE",
                  all(o.status == "UNAVAILABLE" and "drain" in o.details for o in late),
                  _statuses(late))
        rec.check("every stream ended within the grace (+5 s)", ended <= grace_s + 5, ended)
        rec.check("exit code 0", code == 0, code)

    await _with_worker(rec, flags, body)
    return rec


# ----- an injected model-step fault --------------------------------------------------------


async def fault(streams: int = 48, max_tokens: int = 64) -> Record:
    rec = Record("fault", {"streams": streams, "max_tokens": max_tokens})
    flags = ["--max-num-seqs", "16"]  # so some wait while a step fails, and finish later
    trigger = Path(tempfile.mkdtemp(prefix="llmworker-fault-")) / "fail-next-step"

    async def body(w: WorkerProcess, channel: grpc.aio.Channel, stub: Stub) -> None:
        plans = [Plan(f"f{i}", PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens)
                 for i in range(streams)]
        tasks = [asyncio.create_task(run_plan(stub, p)) for p in plans]
        while (await stub.GetLoad(pb.GetLoadRequest(), timeout=10)).num_running < 16:
            await asyncio.sleep(0.05)
        trigger.touch()
        outs = list(await asyncio.wait_for(asyncio.gather(*tasks), 300))
        st = _statuses(outs)
        internal = [o for o in outs if o.status == "INTERNAL"]
        named = [o for o in internal if "injected fault" in o.details and o.request_id in o.details]
        rec.counts = {"streams": len(outs), "statuses": st}
        rec.check("one step failed: its requests ended INTERNAL with the cause",
                  bool(internal) and len(named) == len(internal), st)
        rec.check("every other stream completed",
                  st.get("OK", 0) + len(internal) == len(outs), st)
        rec.check("the fault was consumed (exactly one step failed)", not trigger.exists())
        after = await run_all(stub, [Plan(f"a{i}", PROMPTS[i], 16) for i in range(8)], 8)
        rec.counts["after"] = _statuses(after)
        rec.check("requests after the fault complete", _statuses(after) == {"OK": 8},
                  _statuses(after))
        await _end_state(rec, channel, stub)

    await _with_worker(rec, flags, body, fault_file=trigger)
    return rec


# ----- slow readers ------------------------------------------------------------------------


async def slow_reader(normal: int = 32, stalled: int = 4, max_tokens: int = 64) -> Record:
    """The normal streams run once alone (outputs, duration T0), then again beside clients
    that stop reading after their first chunk for 3 T0 + 5 s: the normal ones must finish
    before the stall ends (nothing waits on a slow reader) with the same outputs."""
    rec = Record("slow_reader", {"normal": normal, "stalled": stalled,
                                 "max_tokens": max_tokens})

    async def body(w: WorkerProcess, channel: grpc.aio.Channel, stub: Stub) -> None:
        def plan(tag: str, i: int) -> Plan:
            return Plan(f"{tag}{i}", PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens)

        t = time.monotonic()
        solo = await run_all(stub, [plan("solo", i) for i in range(normal)], normal)
        alone_s = time.monotonic() - t
        want = [o.token_ids for o in solo]
        stall_s = 3 * alone_s + 5
        rss0 = w.resources()["rss_kib"]
        plans = [plan("n", i) for i in range(normal)]
        for i in range(stalled):  # half read on after the stall, half disconnect
            p = plan("slow", i)
            p.stall_after_chunks, p.stall_s = 1, stall_s
            p.disconnect_after_stall = i % 2 == 1
            plans.append(p)
        t = time.monotonic()
        tasks = [asyncio.create_task(run_plan(stub, p)) for p in plans]
        normals = await asyncio.gather(*tasks[:normal])
        normal_done = time.monotonic() - t
        rss_mid = w.resources()["rss_kib"]
        slow = await asyncio.gather(*tasks[normal:])
        rec.figures.update(normal_alone_s=round(alone_s, 2), stall_s=round(stall_s, 2),
                           normal_beside_stalled_s=round(normal_done, 2),
                           rss_growth_during_stall_kib=rss_mid - rss0,
                           resumed_chunks=[o.num_chunks for o in slow[::2]])
        rec.counts = {"normal": _statuses(list(normals)), "stalled": _statuses(list(slow))}
        rec.check("normal streams complete while the slow readers stall",
                  all(o.status == "OK" for o in normals) and normal_done < stall_s,
                  f"{_statuses(list(normals))} in {normal_done:.1f}s (stall {stall_s:.1f}s)")
        rec.check("normal outputs equal their run alone",
                  all(o.token_ids == want[i] for i, o in enumerate(normals)))
        rec.check("stalled readers that resume get their whole output",
                  all(o.status == "OK" and o.token_ids == want[2 * k]
                      for k, o in enumerate(slow[::2])),
                  [(o.status, len(o.token_ids)) for o in slow[::2]])
        rec.check("stalled readers that disconnect are cancelled",
                  all(o.status == CANCELLED_BY_CLIENT for o in slow[1::2]),
                  _statuses(list(slow[1::2])))
        await _end_state(rec, channel, stub)

    await _with_worker(rec, [], body)
    return rec


# ----- deadlines ---------------------------------------------------------------------------


async def deadline(normal: int = 32, expiring: int = 16, deadline_s: float = 8.0,
                   max_tokens: int = 48) -> Record:
    rec = Record("deadline", {"normal": normal, "expiring": expiring, "deadline_s": deadline_s,
                              "max_tokens": max_tokens})

    async def body(w: WorkerProcess, channel: grpc.aio.Channel, stub: Stub) -> None:
        plans = [Plan(f"n{i}", PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens)
                 for i in range(normal)]
        for i in range(expiring):
            p = Plan(f"d{i}", PROMPTS[i % len(PROMPTS)], max_tokens=1500)
            p.deadline_s = deadline_s * (1 + i / expiring)  # spread over [d, 2d)
            plans.append(p)
        outs = await run_all(stub, plans, len(plans))
        normals, expired = outs[:normal], outs[normal:]
        rec.counts = {"normal": _statuses(normals), "expiring": _statuses(expired)}
        rec.figures["expired_tokens_received_min"] = min(len(o.token_ids) for o in expired)
        rec.check("expiring streams end DEADLINE_EXCEEDED",
                  all(o.status == "DEADLINE_EXCEEDED" for o in expired), _statuses(expired))
        rec.check("they expired mid-generation (tokens had arrived)",
                  all(o.token_ids for o in expired),
                  [len(o.token_ids) for o in expired])
        rec.check("the others complete", all(o.status == "OK" for o in normals),
                  _statuses(normals))
        await _end_state(rec, channel, stub)

    await _with_worker(rec, [], body)
    return rec


# ----- soak --------------------------------------------------------------------------------


CALIBRATION = 32  # requests that measure the worker's capacity before the soak


async def soak(duration_s: float = 600.0, window_s: float = 60.0, load: float = 0.6,
               max_tokens: int = 64, cancel_fraction: float = 0.05, seed: int = 0,
               leak_per_request: float = 0.0) -> Record:
    """`leak_per_request` F: run a worker whose steps slow down by F of their cost with every
    request it serves after the calibration's (benchmarks.faulty_worker's leak), to show
    that the flatness check catches it."""
    rec = Record("soak", {"duration_s": duration_s, "window_s": window_s, "load": load,
                          "max_tokens": max_tokens, "cancel_fraction": cancel_fraction,
                          "seed": seed, **({"leak_per_request": leak_per_request}
                                           if leak_per_request else {})})
    r = rng(seed)

    async def body(w: WorkerProcess, channel: grpc.aio.Channel, stub: Stub) -> None:
        calib = [Plan(f"c{i}", r.choice(PROMPTS), max_tokens=r.randint(8, max_tokens))
                 for i in range(CALIBRATION)]
        rate = load * await _capacity(stub, calib, CALIBRATION)
        rec.figures["arrival_rps"] = round(rate, 3)
        start = time.monotonic()
        windows: list[dict[str, float]] = []
        next_window = start + window_s

        def sample(now: float) -> None:  # the worker's resources at each window's end
            nonlocal next_window
            if now >= next_window:
                windows.append({"t_s": round(now - start), **w.resources()})
                next_window += window_s

        def plan(i: int) -> Plan:
            p = Plan(f"k{i}", r.choice(PROMPTS), max_tokens=r.randint(8, max_tokens))
            if r.random() < cancel_fraction:
                p.cancel_after_s = r.uniform(0.0, 3.0)
            return p

        outs = await _poisson_until(stub, start, duration_s, rate, r, plan, 300, sample)
        windows.append({"t_s": round(time.monotonic() - start), **w.resources()})
        for k, win in enumerate(windows):  # p99 TTFT of the requests sent in each window
            lo, hi = k * window_s, (k + 1) * window_s
            ttft = [o.ttft_s for o in outs if lo <= o.sent_at < hi and o.status == "OK"
                    and o.ttft_s is not None]
            win.update(requests=len(ttft), ttft_p50_s=round(percentile(ttft, 50), 3),
                       ttft_p99_s=round(percentile(ttft, 99), 3))
        rec.figures["windows"] = windows
        flat = flatness.judge([(o.sent_at, o.ttft_s) for o in outs if o.status == "OK"
                               and o.ttft_s is not None], window_s, duration_s)
        rec.figures["ttft_flatness"] = {"window_growth": round(flat.window_growth, 3),
                                        "trend_growth": round(flat.trend_growth, 3)}
        st = _statuses(outs)
        rec.counts = {"sent": len(outs), "statuses": st}
        rec.check("every request completed or was cancelled by its client",
                  st.get("OK", 0) + st.get(CANCELLED_BY_CLIENT, 0) == len(outs), st)
        # Medians and a trend, not one window's p99 (its maximum): clients/reliability/flatness.
        rec.check("TTFT flat (last window's median or the trend <= 2x the start's)",
                  flat.flat, flat)
        rss_growth = (windows[-1]["rss_kib"] - windows[0]["rss_kib"]) / windows[0]["rss_kib"]
        rec.figures["rss_growth_after_first_window"] = round(rss_growth, 4)
        rec.check("RSS flat after the first window (< 5% growth)", rss_growth < 0.05,
                  f"{windows[0]['rss_kib']} -> {windows[-1]['rss_kib']} KiB")
        rec.check("open file descriptors flat (+-4)",
                  abs(windows[-1]["fds"] - windows[0]["fds"]) <= 4,
                  f"{windows[0]['fds']} -> {windows[-1]['fds']}")
        rec.check("threads flat (+-2)", abs(windows[-1]["threads"] - windows[0]["threads"]) <= 2,
                  f"{windows[0]['threads']} -> {windows[-1]['threads']}")
        await _end_state(rec, channel, stub)

    if leak_per_request:
        with tempfile.TemporaryDirectory() as tmp:  # a trigger file that never appears
            await _with_worker(rec, [], body, Path(tmp) / "never",
                               {"FAULTY_WORKER_LEAK_PER_REQUEST": str(leak_per_request),
                                "FAULTY_WORKER_LEAK_AFTER": str(CALIBRATION)})
    else:
        await _with_worker(rec, [], body)
    return rec


SCENARIOS: dict[str, Callable[..., Awaitable[Record]]] = {
    "storm": storm, "overload": overload, "sigterm": sigterm, "fault": fault,
    "slow_reader": slow_reader, "deadline": deadline, "soak": soak,
}
