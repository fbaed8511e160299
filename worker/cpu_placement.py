"""Where a served worker's threads run on the CPU (issue 21: one stream served within 10%
of offline on a 2-core machine).

Served, every token also costs the event loop (the bridge, the stream, gRPC's aio write)
and the client some CPU on the cores that the engine's compute threads fill. Where that
work lands decides what it costs. On the engine thread's core it stops the step's serial
part (the engine's Python between two native calls, the call's own single-thread stages):
the step grows by all of it. On an OpenMP partner's core it costs about half: the partner's
share of the native call's work-shared loops is taken by the engine thread meanwhile
(`ops/cpu_kernels/workshare.h`), and between steps the partner only waits. Measured with a
process that burns 450 us a token beside an offline engine: 0.84 of the engine's speed
unplaced, 0.93 with the engine thread on a core of its own (BENCHMARKS.md, session 18).

So, once the engine's OpenMP team exists (after the warm-up): the engine thread runs on the
first CPU the process may use, and every other thread of the process (the loop, gRPC's
threads, the OpenMP partners) on the others. Only where the compute threads fill the CPUs
the process may use (at most one spare): that is where streaming competes with them, and on
a larger shared host (a container with a CPU quota but no cpuset sees every CPU) a thread
pinned to one CPU could wait behind other work there, so the OS keeps the choice. Threads started later inherit their starter's
set: the loop's, the others. The loop's token work is also timed to run during a native
call rather than between steps (`Engine.start`'s deferred wake): placed alone, the loop
took the GIL between steps and the engine thread waited for it.
"""

from __future__ import annotations

import os


def allowed_cpus() -> set[int]:
    """The CPUs this thread may run on (all of them where affinity is unknown here: empty)."""
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()


def unplace_threads(cpus: set[int]) -> None:
    """Every thread of this process back on `cpus` (what `place_threads` narrowed)."""
    if cpus and os.path.isdir("/proc/self/task"):
        for name in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(name), cpus)
            except ProcessLookupError:
                pass


def place_threads(engine_thread_id: int, compute_threads: int) -> str | None:
    """Puts the engine thread (a native thread id) on the first allowed CPU and every other
    thread of this process on the rest. Returns what it did, or None where it does nothing:
    one CPU, more CPUs than `compute_threads` + 1, or no per-thread affinity here."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if not 2 <= len(cpus) <= compute_threads + 1:
        return None
    engine, rest = {cpus[0]}, set(cpus[1:])
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            os.sched_setaffinity(tid, engine if tid == engine_thread_id else rest)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return f"engine thread on CPU {cpus[0]}, the other threads on CPUs {_ranges(cpus[1:])}"


def _ranges(cpus: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3,5'."""
    out: list[str] = []
    start = prev = cpus[0]
    for c in [*cpus[1:], -2]:
        if c != prev + 1:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = c
        prev = c
    return ",".join(out)
