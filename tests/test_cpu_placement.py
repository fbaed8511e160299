"""worker.cpu_placement: the engine thread on a CPU of its own, every other thread on the
rest (checked in a child process: affinity is the process's own state)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from worker.cpu_placement import _ranges

CHILD = r"""
import json, os, sys, threading
from worker.cpu_placement import place_threads, unplace_threads
cpus, threads = json.loads(sys.argv[1]), int(sys.argv[2])
os.sched_setaffinity(0, set(cpus))
stop = threading.Event()
engine = threading.Thread(target=stop.wait)
other = threading.Thread(target=stop.wait)
engine.start(); other.start()
said = place_threads(engine.native_id, threads)
late = threading.Thread(target=stop.wait)  # started by the main thread after placement
late.start()
out = {"said": said, "engine": sorted(os.sched_getaffinity(engine.native_id)),
       "other": sorted(os.sched_getaffinity(other.native_id)),
       "main": sorted(os.sched_getaffinity(threading.get_native_id())),
       "late": sorted(os.sched_getaffinity(late.native_id))}
unplace_threads(set(cpus))
out["undone"] = sorted({tuple(sorted(os.sched_getaffinity(t.native_id))) for t in (engine, other, late)}
                       | {tuple(sorted(os.sched_getaffinity(0)))})
stop.set()
print(json.dumps(out))
"""


def _child(cpus: list[int], threads: int = 2) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cpus), str(threads)], capture_output=True,
                          text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs to place threads on")
def test_the_engine_thread_gets_the_first_cpu_and_every_other_thread_the_rest() -> None:
    cpus = sorted(os.sched_getaffinity(0))[:2]
    out = _child(cpus)
    assert out["engine"] == cpus[:1]
    assert out["other"] == out["main"] == out["late"] == cpus[1:]
    assert out["said"] == f"engine thread on CPU {cpus[0]}, the other threads on CPUs {cpus[1]}"
    assert out["undone"] == [cpus], "unplace_threads gives every thread the CPUs back"


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no per-thread affinity here")
def test_one_cpu_is_left_alone() -> None:
    cpu = sorted(os.sched_getaffinity(0))[:1]
    out = _child(cpu)
    assert out["said"] is None
    assert out["engine"] == out["other"] == out["main"] == cpu


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs")
def test_more_cpus_than_the_compute_threads_fill_are_left_to_the_os() -> None:
    """Two CPUs and no compute thread to fill them (as 64 visible CPUs and 8 threads)."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    out = _child(cpus, threads=0)
    assert out["said"] is None
    assert out["engine"] == out["other"] == out["main"] == cpus


def test_cpu_ranges_read_as_lscpu_writes_them() -> None:
    assert _ranges([1]) == "1"
    assert _ranges([1, 2, 3, 5]) == "1-3,5"
    assert _ranges([0, 2, 3, 4, 7, 8]) == "0,2-4,7-8"


def test_the_setting_is_checked_from_the_flag_and_the_variable() -> None:
    from worker.config import ServerConfig

    assert ServerConfig().cpu_threads_bind == "auto"
    assert ServerConfig(cpu_threads_bind="nobind").cpu_threads_bind == "nobind"
    with pytest.raises(ValueError, match="--cpu-threads-bind must be auto or nobind, got 'bogus'"):
        ServerConfig(cpu_threads_bind="bogus")  # what LLMWORKER_CPU_THREADS_BIND=bogus gives
    env = {**os.environ, "LLMWORKER_CPU_THREADS_BIND": "x" * 500}
    done = subprocess.run([sys.executable, "-m", "worker.cli", "serve", "--port", "0"], env=env,
                          capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 2
    assert "--cpu-threads-bind must be auto or nobind, got 'xxxxxxxx" in done.stderr
    assert "x" * 41 not in done.stderr  # a bounded prefix
