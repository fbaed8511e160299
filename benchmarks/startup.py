"""Start-up time of `llm-worker serve`: from the process's spawn to its log line "listening"
(imports done, the port bound) and to "serving" (model loaded, KV cache allocated, warm-up
done: health says SERVING), for this checkout and optionally another, alternately:

    python -m benchmarks.startup --against ../wt-ab --rounds 5

Each round starts one worker of each side in turn (the order flips every round, as the
machine's speed drifts over minutes), waits for "serving", and kills it. The serve flags
are the integration tests' (`--kv-cache-memory 0.25 --max-model-len 2048`) plus --flags.
A row gives each side's median and fastest, and the median of the rounds' paired ratios
before / after (above 1: after starts faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from clients.bench.environment import environment

MARKS = ("listening", "serving")


def start_once(root: Path, flags: list[str], timeout_s: float = 300) -> dict[str, float]:
    """Seconds from spawn to each of MARKS in one worker's log; the worker is killed after."""
    cmd = [sys.executable, "-m", "worker.cli", "serve", "--port", "0", "--kv-cache-memory", "0.25",
           "--max-model-len", "2048", *flags]
    env = {**os.environ, "PYTHONPATH": str(root), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    seen: dict[str, float] = {}
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            for mark in MARKS:
                if mark not in seen and f"llm-worker: {mark} " in line:
                    seen[mark] = time.perf_counter() - t0
            if len(seen) == len(MARKS) or time.perf_counter() - t0 > timeout_s:
                break
    finally:
        proc.kill()
        proc.wait(30)
    if len(seen) < len(MARKS):
        raise RuntimeError(f"{root}: the worker exited or timed out before {set(MARKS) - set(seen)}")
    return seen


def render_markdown(report: dict) -> str:
    sides = [s for s in ("before", "after") if report["times"][s][MARKS[0]]]
    head = " | ".join(f"{s} s: median (fastest)" for s in sides)
    out = [f"| spawn to | {head} |" + (" before / after, paired median |" if len(sides) == 2 else ""),
           "|---|" + "---|" * (len(sides) + (len(sides) == 2))]
    for mark in MARKS:
        cells = [report["times"][s][mark] for s in sides]
        row = f"| {mark} | " + " | ".join(f"{statistics.median(c):.2f} ({min(c):.2f})" for c in cells) + " |"
        if len(sides) == 2:
            ratio = statistics.median(b / a for b, a in zip(*cells, strict=True))
            row += f" **{ratio:.2f}x** |"
        out.append(row)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", help="root of another checkout, started as 'before'")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--flags", default="", help="more serve flags, space-separated")
    ap.add_argument("--output-json")
    ap.add_argument("--report", metavar="JSON", help="print the markdown table of an --output-json file and exit")
    args = ap.parse_args(argv)
    if args.report:
        print(render_markdown(json.loads(Path(args.report).read_text())))
        return
    roots = {"after": Path(__file__).resolve().parents[1]}
    if args.against:
        roots["before"] = Path(args.against).resolve()
    report: dict = {"environment": environment(), "flags": args.flags,
                    "times": {s: {m: [] for m in MARKS} for s in ("before", "after")}}
    for i in range(args.rounds):
        order = sorted(roots, reverse=i % 2 == 1)  # "after" first on even rounds
        for side in order:
            for mark, s in start_once(roots[side], args.flags.split()).items():
                report["times"][side][mark].append(s)
        print(f"round {i + 1}: " + json.dumps({s: {m: round(v[-1], 2) for m, v in t.items() if v}
                                               for s, t in report["times"].items()}), flush=True)
    print(render_markdown(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
