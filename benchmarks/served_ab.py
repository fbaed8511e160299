"""Served A/B: `llm-worker serve` from two or more sides (checkouts, environments, flags),
all up at once, measured by `llm-worker-bench` in alternating rounds on one machine:

    python -m benchmarks.served_ab --side before=../main-worktree --side after=. \\
        --workloads one_stream,64_streams --rounds 4 \\
        --bench-arg=--temperature=0.7 --bench-arg=--top-p=0.9 \\
        --output-json bench-results/served-ab.json

A side is NAME=PATH[,VAR=value...][,--flag=value...]: the checkout whose code the worker
runs (`.` this one), environment variables for its process, and serve flags. The
workloads are `benchmarks.llamacpp_side_by_side`'s (one stream alone, a long prompt, long
context, 64 chat streams); `--bench-arg` values are added to each (e.g. sampling
settings). Each round runs every side once, in an order that reverses every other round;
round r's prompts come from seed r (every side the same). A side's ratio against the first
is the median of the rounds' ratios (this machine's drift cancels within a round), of
decode tokens/s for one-stream workloads, output tokens/s for 64 streams and time to first
token (first side's / this side's, above 1 faster) for the long prompt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.llamacpp_side_by_side import (
    RATIOS,
    WORKLOADS,
    bench,
    our_worker,
    write_gguf_tokenizer,
)
from clients.bench.environment import environment, recorded

ROOT = Path(__file__).resolve().parents[1]


def parse_side(text: str) -> tuple[str, Path, dict[str, str], list[str]]:
    """'passive=.,OMP_WAIT_POLICY=passive,--max-num-seqs=8' -> (name, root, env, flags)."""
    name, _, rest = text.partition("=")
    path, *items = rest.split(",")
    if not name or not path:
        raise ValueError(f"--side: NAME=PATH[,VAR=value][,--flag=value], not {text[:80]!r}")
    env = dict(i.split("=", 1) for i in items if not i.startswith("--"))
    flags = [i for i in items if i.startswith("--")]
    return name, (ROOT / path).resolve(), env, flags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", action="append", required=True, help="NAME=PATH[,VAR=value][,--flag=value]")
    ap.add_argument("--workloads", default="one_stream,64_streams")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--bench-arg", action="append", default=[], help="added to every bench run")
    ap.add_argument("--output-json", type=Path)
    a = ap.parse_args()
    sides = [parse_side(s) for s in a.side]
    names = [s[0] for s in sides]
    workloads = [w for w in a.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or len(set(names)) != len(names) or len(sides) < 2:
        ap.error(f"two or more sides of distinct names; workloads among {', '.join(WORKLOADS)}")
    rounds: dict[str, list[dict[str, Any]]] = {w: [] for w in workloads}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tok = write_gguf_tokenizer(Path(tmp))
        addrs = {name: stack.enter_context(our_worker(flags, root, env))
                 for name, root, env, flags in sides}
        for w in workloads:
            for r in range(a.rounds):
                order = names if r % 2 == 0 else names[::-1]
                one = {n: bench(["--backend", "grpc", "--target", addrs[n]], w, tok, seed=r,
                                extra=a.bench_arg) for n in order}
                rounds[w].append(one)
                key = RATIOS[w][1]
                print(f"{w} round {r + 1}: " + ", ".join(f"{n} {one[n][key]:.1f}" for n in names),
                      flush=True)
    summary: dict[str, Any] = {}
    for w in workloads:
        # The side-by-side's metric and direction: above 1, this side is ahead of the first.
        _, key, higher_better = RATIOS[w]
        med = {n: statistics.median(x[n][key] for x in rounds[w]) for n in names}
        ratios = {}
        for n in names[1:]:
            per_round = [(x[n][key] / x[names[0]][key]) if higher_better else (x[names[0]][key] / x[n][key])
                         for x in rounds[w]]
            ratios[n] = statistics.median(per_round)
        summary[w] = {"metric": key, "median": med, f"over_{names[0]}": ratios}
        print(f"{w}: {key} medians " + ", ".join(f"{n} {v:.1f}" for n, v in med.items()) + "; against "
              f"{names[0]}: " + ", ".join(f"{n} {v:.2f}x" for n, v in ratios.items()))
    if a.output_json:
        result = {"command": recorded(" ".join(["python -m benchmarks.served_ab", *sys.argv[1:]])),
                  "sides": [{"name": n, "root": os.path.relpath(root, ROOT), "env": env, "flags": flags}
                            for n, root, env, flags in sides],
                  "workloads": {w: WORKLOADS[w] + a.bench_arg for w in workloads},
                  "rounds": rounds, "summary": summary, "environment": environment()}
        a.output_json.parent.mkdir(parents=True, exist_ok=True)
        a.output_json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {a.output_json}")


if __name__ == "__main__":
    main()
