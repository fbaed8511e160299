"""One stream, served against offline (issue 21): the same greedy chat request, decoded by the
engine in a process of its own as `llm-worker generate` runs it (`Engine.generate`,
benchmarks.offline_engine) and by an `llm-worker serve` process over gRPC, in alternating
rounds on one machine. Decode speed is tokens after the first over the time from
the first to the last (time to first token is reported apart), so prompt work does not blur it.
The ratio is the median over rounds of served / offline within the round (its two halves run
back to back, so the machine's drift in memory bandwidth, which moves both by up to 2x within
minutes here, cancels); the ratio of the two medians is printed beside it.

    python -m benchmarks.served_vs_offline --max-tokens 128 --rounds 3 \\
        --output-json bench-results/served-vs-offline.json

Extra `--serve-arg` values go to `llm-worker serve` (e.g. `--serve-arg=--kernels=torch`); the
offline engine takes the same settings from `--engine-arg` (`ModelConfig` field=value pairs).
Prefix caching is off on both, so every round computes its prompt.

`--stream-intervals 1,4` serves the request from one worker per `--stream-interval` (all up
at once, idle but for their turn); each round runs offline, then every worker in turn, and
each worker gets its own ratio (results under `served@N`; `served` is the first one's).

The served request is streamed by `benchmarks.stream_client`, a client in a process of its own
as a user's is (`--clients inline`: by this process; `--clients process,inline` measures both,
a worker each, `served@N/inline`). Before session 20 the offline engine and the client both
lived in this process: the client's CPU a token was ~0.45 ms there against ~0.33 ms alone.

`--client-cpus 1` pins the client process (else the OS places it). On a 2-core machine the
served worker's engine thread has CPU 0 to itself and everything else of the worker shares
CPU 1: a client that lands on CPU 0 takes its CPU from the engine thread's serial work.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.stream_client import ask_round, stream_round
from clients.bench.environment import environment, recorded
from clients.client import WorkerClient

ROOT = Path(__file__).resolve().parents[1]


def _decode_rate(times: list[float], counts: list[int]) -> tuple[float, float]:
    """(time to first token from the start, tokens/s after the first) from (time, tokens) pairs
    whose first time is the request's start."""
    start, first = times[0], times[1]
    after = sum(counts[2:]) + counts[1] - 1  # tokens after the first one
    return first - start, after / (times[-1] - first)


class Offline:
    """The engine in a process of its own, as `llm-worker generate` runs it
    (benchmarks.offline_engine)."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.offline_engine", json.dumps(fields)], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("benchmarks.offline_engine exited before it was ready")
        self.info = json.loads(line)

    def round(self, max_tokens: int) -> dict[str, float]:
        got = ask_round(self.proc, max_tokens)
        ttft, rate = _decode_rate(got["times"], got["counts"])
        return {"ttft_s": ttft, "decode_tok_s": rate, "tokens": sum(got["counts"])}

    def close(self) -> None:
        self.proc.communicate("\n", timeout=60)


class Served:
    """An `llm-worker serve` child on a free loopback port, streamed to by a client in a
    process of its own (``client="process"``) or by this process (``"inline"``)."""

    def __init__(self, serve_args: list[str], client: str = "process", client_cpus: set[int] | None = None) -> None:
        cmd = [sys.executable, "-m", "worker.cli", "serve", "--port", "0",
               "--no-enable-prefix-caching", *serve_args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        address, deadline = None, time.monotonic() + 300
        assert self.proc.stderr is not None
        while address is None and time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("llm-worker serve exited before listening")
            if m := re.search(r"listening on (\S+):(\d+)", line):
                address = f"{m.group(1)}:{m.group(2)}"
        if address is None:
            raise RuntimeError("llm-worker serve did not listen within 300 s")
        # Keep draining its log so that it never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()
        self.client = WorkerClient(address, timeout=600, retry=False)
        deadline = time.monotonic() + 300
        while self.client.health() != "SERVING" and time.monotonic() < deadline:
            time.sleep(0.2)
        self.streamer: subprocess.Popen[str] | None = None
        if client == "process":  # a user's client: a process of its own (stream_client's why)
            self.streamer = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.stream_client", address], cwd=ROOT,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, client_cpus)) if client_cpus else None)

    def _loop_cpu_s(self) -> float:
        """CPU time of the worker's main thread so far: its event loop (gRPC, the bridge)."""
        pid = self.proc.pid  # the main thread is the task of the process id
        # schedstat's first field: nanoseconds on a CPU, exact (stat's ticks are sampled).
        return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9

    def round(self, max_tokens: int) -> dict[str, float]:
        loop0 = self._loop_cpu_s()
        got = (stream_round(self.client, max_tokens) if self.streamer is None
               else ask_round(self.streamer, max_tokens))
        loop_cpu = self._loop_cpu_s() - loop0
        tokens = sum(got["counts"])
        assert tokens == max_tokens, tokens
        ttft, rate = _decode_rate(got["times"], got["counts"])
        # The streaming's CPU beside the model (the request's admission and prompt included):
        # the worker's loop thread and the client's whole process; the summary divides the
        # rounds' sums by their tokens.
        return {"ttft_s": ttft, "decode_tok_s": rate, "tokens": tokens,
                "messages": len(got["counts"]) - 1, "loop_cpu_s": loop_cpu,
                "client_cpu_s": got["cpu_s"]}

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.communicate("\n", timeout=60)
        self.client.close()
        self.proc.terminate()
        self.proc.wait(60)


def _engine_args(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in pairs:
        k, _, v = p.partition("=")
        out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="alternating offline/served rounds")
    p.add_argument("--serve-arg", action="append", default=[], help="an extra serve flag")
    p.add_argument("--engine-arg", action="append", default=[], help="ModelConfig field=value")
    p.add_argument("--stream-intervals", default="1",
                   help="comma-separated --stream-interval values, one worker each")
    p.add_argument("--clients", default="process",
                   help="comma-separated: 'process' (the client in a process of its own, as a "
                        "user's is) and/or 'inline' (in this process); a worker each, results "
                        "under served@N and served@N/inline")
    p.add_argument("--client-cpus", default="",
                   help="CPUs the client process may run on (e.g. 1): where the OS puts it "
                        "otherwise (the worker's engine thread has the first CPU to itself)")
    p.add_argument("--output-json", type=Path)
    a = p.parse_args()
    client_cpus = {int(x) for x in a.client_cpus.split(",") if x.strip()} or None
    intervals = [int(x) for x in a.stream_intervals.split(",")]
    clients = a.clients.split(",")
    if not clients or not set(clients) <= {"process", "inline"}:
        p.error(f"--clients: 'process' and/or 'inline', not {a.clients[:40]!r}")

    offline = Offline(_engine_args(a.engine_arg))
    served: dict[str, Served] = {}
    rounds: dict[str, list[dict[str, float]]] = {"offline": []}
    try:
        for n in intervals:
            for c in clients:
                mode = f"served@{n}" + ("" if c == "process" else "/inline")
                served[mode] = Served([*a.serve_arg, f"--stream-interval={n}"], client=c, client_cpus=client_cpus)
                rounds[mode] = []
        for worker in served.values():
            worker.round(8)  # warm-up
        for r in range(a.rounds):
            rounds["offline"].append(offline.round(a.max_tokens))
            line = f"round {r + 1}: offline {rounds['offline'][-1]['decode_tok_s']:.1f} tok/s"
            for mode, worker in served.items():
                rounds[mode].append(worker.round(a.max_tokens))
                line += f", {mode} {rounds[mode][-1]['decode_tok_s']:.1f}"
            print(line, flush=True)
    finally:
        offline.close()
        for worker in served.values():
            worker.close()
    summary: dict[str, dict[str, float]] = {}
    for mode, rs in rounds.items():
        summary[mode] = {k: statistics.median(x[k] for x in rs)
                         for k in ("decode_tok_s", "ttft_s", "messages") if k in rs[0]}
        for k in ("loop_cpu", "client_cpu"):
            if f"{k}_s" in rs[0]:
                summary[mode][f"{k}_ms_per_token"] = (sum(x[f"{k}_s"] for x in rs) * 1e3
                                                      / sum(x["tokens"] for x in rs))
    ratios, of_medians = {}, {}
    for mode in served:
        of_medians[mode] = summary[mode]["decode_tok_s"] / summary["offline"]["decode_tok_s"]
        ratios[mode] = statistics.median(
            s["decode_tok_s"] / o["decode_tok_s"]
            for o, s in zip(rounds["offline"], rounds[mode], strict=True))
        print(f"{mode}: median decode tok/s after the first: offline "
              f"{summary['offline']['decode_tok_s']:.1f}, served {summary[mode]['decode_tok_s']:.1f}; "
              f"served / offline: {ratios[mode]:.3f} (median of the rounds' ratios), "
              f"{of_medians[mode]:.3f} (ratio of the medians); {summary[mode]['messages']:.0f} "
              f"messages, CPU a token: loop {summary[mode]['loop_cpu_ms_per_token']:.3f} ms, "
              f"client {summary[mode]['client_cpu_ms_per_token']:.3f} ms")
    first = next(iter(served))
    summary["served"] = summary[first]  # the key earlier records have
    if a.output_json:
        result = {"command": recorded(" ".join(["python -m benchmarks.served_vs_offline", *sys.argv[1:]])),
                  "prompt_tokens": offline.info["prompt_tokens"], "max_tokens": a.max_tokens, "rounds": rounds,
                  "summary": summary, "served_over_offline": ratios[first],
                  "served_over_offline_of_medians": of_medians[first],
                  "stream_intervals": intervals, "clients": clients,
                  "client_cpus": sorted(client_cpus) if client_cpus else None,
                  "served_over_offline_by_mode": ratios,
                  "served_over_offline_of_medians_by_mode": of_medians,
                  "kernels": offline.info["kernels"],
                  "omp_wait_policy": offline.info["omp_wait_policy"], "environment": environment(),
                  "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
        a.output_json.parent.mkdir(parents=True, exist_ok=True)
        a.output_json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {a.output_json}")


if __name__ == "__main__":
    main()
