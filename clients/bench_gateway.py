"""Through SMG: one replica against two, and the gateway's cost in time to first token.

    python -m clients.bench_gateway --out-dir bench-results/gateway

Starts the worker processes and `smg launch` itself (loopback, free ports) and drives them
with `llm-worker-bench` (a subprocess per run, so each run's JSON is the load generator's
own, with its environment and command line):

1. ``direct-ttft``, ``smg1-ttft``: the chat workload one request at a time (concurrency 1,
   short outputs), straight to a worker over gRPC and through SMG in front of that worker:
   the difference in TTFT is what the gateway adds (HTTP + JSON, its chat template and
   tokenizer, its gRPC hop).
2. ``smg1``, ``smg2``: the chat workload all at once (rate inf, --ignore-eos) through SMG
   in front of one replica, then of two (round robin, so the split is even); the ratio of
   output tokens/s is the scale-out figure. Each replica is its own process with its own
   torch threads: on a machine with fewer cores than replicas x threads they share them,
   and the ratio says so.

A summary JSON (``gateway-summary.json``) holds the figures and ratios, each worker's
configuration as its GetServerStatus gives it (the flags it ran with), the commit and the
command; `llm-worker-bench report` renders the runs. It starts workers as processes (the
reliability package's helper) and speaks to them over the wire only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from clients.bench.environment import command
from clients.client import WorkerClient
from clients.reliability.process import WorkerProcess


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def smg(workers: list[WorkerProcess], policy: str) -> Iterator[str]:
    """`smg launch` in front of `workers`; yields its base URL once every worker is ready."""
    exe = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    port = _free_port()
    urls = [f"grpc://{w.address}" for w in workers]
    cmd = [exe, "launch", "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
           "--worker-urls", *urls, "--policy", policy, "--shutdown-grace-period-secs", "1",
           "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0"]
    env = {**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"smg exited {proc.returncode}:\n{''.join(lines[-20:])}")
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(base + "/workers", timeout=5) as resp:
                    ready = {w["url"] for w in json.load(resp)["workers"]
                             if w["status"] == "ready" and w["is_healthy"]}
                loaded = any(re.search("Successfully loaded tokenizer", ln) for ln in lines)
                if ready == set(urls) and loaded:
                    break
            if time.monotonic() > end:
                raise RuntimeError(f"smg not ready:\n{''.join(lines[-20:])}")
            time.sleep(0.25)
        yield base
    finally:
        proc.kill()
        proc.wait(30)


def worker_config(w: WorkerProcess) -> dict:
    """The worker's flags and versions, from its own GetServerStatus."""
    with WorkerClient(w.address, timeout=30) as c:
        status = c.status()
    return {"flags": list(w.cmd[w.cmd.index("--port"):]),
            "config": json.loads(status.config_json), "versions": dict(status.versions)}


def bench(out: Path, name: str, *args: str) -> dict:
    cmd = [sys.executable, "-m", "clients.bench.cli", "run", "--name", name,
           "--output-json", str(out), "--no-progress", *args]
    print("$", command(["llm-worker-bench", *cmd[4:]]), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def _summary(result: dict) -> dict:
    """The one run's summary block (`llm-worker-bench` writes a list of runs)."""
    runs = result["runs"]
    assert len(runs) == 1, "one rate per run here"
    return runs[0]["summary"]


def report(summary: dict) -> str:
    """The summary as a markdown table (for BENCHMARKS.md; the runs themselves render with
    `llm-worker-bench report`)."""
    env = summary["environment"]
    rows = [
        ("output tok/s, SMG + 1 replica", f"{summary['smg1_output_tok_s']:.1f}"),
        ("output tok/s, SMG + 2 replicas", f"{summary['smg2_output_tok_s']:.1f}"),
        ("scale-out ratio (2 / 1)", f"{summary['scale_out_ratio']:.2f}x"),
        ("TTFT p50 / p99 ms, direct gRPC", "{median:.1f} / {p99:.1f}".format(
            **summary["ttft_ms_direct"])),
        ("TTFT p50 / p99 ms, through SMG", "{median:.1f} / {p99:.1f}".format(
            **summary["ttft_ms_smg"])),
        ("gateway TTFT cost, p50 ms", f"{summary['gateway_ttft_overhead_ms_median']:+.1f}"),
    ]
    head = (f"{env.get('date', '')}; {env.get('cpu', '')} x{summary['cpus']}; torch "
            f"{env.get('torch', '')}; commit `{env.get('git_commit', '')[:12]}`"
            f"{' (uncommitted changes)' if env.get('git_dirty') else ''}\n\n"
            f"```bash\n{summary['command']}\n```\n\n")
    return head + "| figure | value |\n|---|---|\n" + "\n".join(
        f"| {k} | {v} |" for k, v in rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", type=Path, metavar="SUMMARY_JSON",
                    help="print a summary written by an earlier run as markdown, and exit")
    ap.add_argument("--out-dir", type=Path, default=Path("bench-results/gateway"))
    ap.add_argument("--num-requests", type=int, default=64, help="throughput runs")
    ap.add_argument("--output-len", default="longtail:128", help="throughput runs")
    ap.add_argument("--ttft-requests", type=int, default=24)
    ap.add_argument("--worker-flag", action="append", default=[],
                    help="extra flag for every worker (repeatable)")
    args = ap.parse_args(argv)
    if args.report:
        print(report(json.loads(args.report.read_text())))
        return 0
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    chat = ["--dataset", "chat", "--seed", "0"]
    ttft = [*chat, "--num-requests", str(args.ttft_requests), "--max-concurrency", "1",
            "--request-rate", "inf", "--output-len", "8", "--ignore-eos", "--warmup", "2"]
    load = [*chat, "--num-requests", str(args.num_requests), "--request-rate", "inf",
            "--output-len", args.output_len, "--ignore-eos", "--warmup", "4"]
    res: dict[str, dict] = {}
    workers: list[dict] = []
    with WorkerProcess(*args.worker_flag) as a:
        workers.append(worker_config(a))
        res["direct-ttft"] = bench(out / "direct-ttft.json", "direct gRPC, one at a time",
                                   "--target", a.address, *ttft)
        with smg([a], "round_robin") as base:
            res["smg1-ttft"] = bench(out / "smg1-ttft.json", "SMG + 1 replica, one at a time",
                                     "--backend", "openai", "--base-url", base, *ttft)
            res["smg1"] = bench(out / "smg1.json", "SMG + 1 replica, all at once",
                                "--backend", "openai", "--base-url", base, *load)
        with WorkerProcess(*args.worker_flag) as b, smg([a, b], "round_robin") as base:
            workers.append(worker_config(b))
            res["smg2"] = bench(out / "smg2.json", "SMG + 2 replicas, all at once",
                                "--backend", "openai", "--base-url", base, *load)
    s = {k: _summary(v) for k, v in res.items()}
    summary = {
        "scale_out_ratio": s["smg2"]["output_throughput"] / s["smg1"]["output_throughput"],
        "smg1_output_tok_s": s["smg1"]["output_throughput"],
        "smg2_output_tok_s": s["smg2"]["output_throughput"],
        "ttft_ms_direct": {k: s["direct-ttft"]["ttft_ms"][k] for k in ("median", "p99")},
        "ttft_ms_smg": {k: s["smg1-ttft"]["ttft_ms"][k] for k in ("median", "p99")},
        "gateway_ttft_overhead_ms_median": (s["smg1-ttft"]["ttft_ms"]["median"]
                                            - s["direct-ttft"]["ttft_ms"]["median"]),
        "cpus": os.cpu_count(),
        "environment": res["smg2"].get("environment", {}),
        "workers": workers,
        "command": command(["python", "-m", "clients.bench_gateway", *sys.argv[1:]]),
    }
    (out / "gateway-summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
