"""The A/B tool: two or more sides (checkouts, or settings of one) measured in alternating
rounds on one machine, with each side's median and spread and the paired ratio, as JSON.

    python -m benchmarks.ab step --side before=../wt-main --side after=. --batch-sizes 1,64 --rounds 12
    python -m benchmarks.ab step --side f32=. --side f16=.,--kv-cache-dtype=float16 --context 1650
    python -m benchmarks.ab native --side before=../wt-main --side after=. --batch 1 --rounds 30
    python -m benchmarks.ab linear --side before=../wt-main --side after=. --rows 4 --rounds 40
    python -m benchmarks.ab prefill --side before=../wt-main --side after=. --prompts 300,1000
    python -m benchmarks.ab offline --side before=../wt-main --side after=.
    python -m benchmarks.ab served --side before=../wt-main --side after=. --workloads one_stream

A side is NAME=PATH[,VAR=value...][,--flag[=value]...]: the checkout whose code it runs (`.`
this one), environment variables for its process, and `llm-worker serve` flags (its
settings). Without --side, one side `this=.`: a plain measurement. The shared 2-core machines
drift by 10-50% within minutes, so sides are compared within a round, never across runs.

Where the sides run:
- step, prefill, offline (the engine, `benchmarks/ab_engine.py`): in this process, one
  engine per side, where every side is this checkout with no environment of its own; else
  (or with --processes) each side in a warm process of its own, its checkout's code first on
  the path, the sides taking turns measurement by measurement.
- native, linear (the kernels, `benchmarks/ab_kernels.py`): in this process; a side's path
  gives the kernel's sources (and for linear the code that packs the weight).
- served: an `llm-worker serve` per side, all up at once, measured by `llm-worker-bench`
  (`benchmarks.llamacpp_side_by_side`'s workloads; round r's prompts from seed r).

Each of --rounds rounds measures every side once, in an order reversed every other round,
after --warmup rounds that are not kept. Per metric and side: the median, p10, p90, fastest
and slowest over every sample of every round; and, per side, the median over rounds of its
paired ratio to the first side (times: first / side; rates: side / first; above 1 the side is
ahead).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clients.bench.environment import environment, recorded

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ("step", "prefill", "offline")
KERNELS = ("native", "linear")
WORKLOADS = (*ENGINE, *KERNELS, "served")


@dataclass(frozen=True)
class Side:
    name: str
    root: Path
    env: dict[str, str] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)


def parse_side(text: str) -> Side:
    """'passive=.,OMP_WAIT_POLICY=passive,--max-num-seqs=8' -> Side(name, root, env, flags)."""
    name, _, rest = text.partition("=")
    path, *items = rest.split(",") if rest else ("",)
    if not name or not path:
        raise argparse.ArgumentTypeError(f"--side: NAME=PATH[,VAR=value][,--flag=value], not {text[:80]!r}")
    root = (ROOT / path).resolve()
    if not (root / "worker").is_dir():
        raise argparse.ArgumentTypeError(f"--side {name}: {path[:80]!r} is not a checkout (no worker/)")
    env = dict(i.split("=", 1) for i in items if not i.startswith("--"))
    return Side(name, root, env, [i for i in items if i.startswith("--")])


def higher_is_better(metric: str) -> bool:
    return "tok_s" in metric


def stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    n = len(s)
    return {"median": statistics.median(s), "p10": s[n // 10], "p90": s[min(n - 1, 9 * n // 10)],
            "min": s[0], "max": s[-1], "n": n}


def summarize(rounds: list[dict[str, dict[str, list[float]]]], names: list[str]) -> dict[str, Any]:
    metrics = list(dict.fromkeys(m for r in rounds for s in r.values() for m in s))
    out: dict[str, Any] = {}
    for m in metrics:
        sides = {n: stats([x for r in rounds for x in r.get(n, {}).get(m, [])]) for n in names
                 if any(m in r.get(n, {}) for r in rounds)}
        up, first = higher_is_better(m), names[0]
        vs = {}
        for n in sides:
            if n == first or first not in sides:
                continue
            pairs = [(statistics.median(r[first][m]), statistics.median(r[n][m])) for r in rounds
                     if m in r.get(first, {}) and m in r.get(n, {})]
            vs[n] = statistics.median(b / a if up else a / b for a, b in pairs)
        out[m] = {"higher_is_better": up, "sides": sides, f"vs_{first}": vs}
    return out


def render_markdown(report: dict[str, Any]) -> str:
    names = [s["name"] for s in report["sides"]]
    first = names[0]
    head = ["metric", *(f"{n}: median (p10-p90, fastest)" for n in names), *(f"{n} vs {first}" for n in names[1:])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, s in report["summary"].items():
        best = "max" if s["higher_is_better"] else "min"
        cells = [m] + [f"{s['sides'][n]['median']:.4g} ({s['sides'][n]['p10']:.4g}-{s['sides'][n]['p90']:.4g}, "
                       f"{s['sides'][n][best]:.4g})" if n in s["sides"] else "-" for n in names]
        cells += [f"{s[f'vs_{first}'][n]:.3f}x" if n in s[f"vs_{first}"] else "-" for n in names[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


class _EngineInProcess:
    """Engine workloads on settings of this checkout: an engine per side in this process
    (sides with the same settings share one loaded model)."""

    def __init__(self, workload: str, sides: list[Side], o: dict[str, Any], model: str, threads: int) -> None:
        from benchmarks.ab_engine import EngineSide

        self.workload, self.o = workload, o
        first: dict[tuple[str, ...], EngineSide] = {}
        self.sides: dict[str, EngineSide] = {}
        for s in sides:  # a model may not be shared by engines of other settings (the runner packs it)
            key = tuple(s.flags)
            shared = first[key].loaded if key in first else None
            self.sides[s.name] = EngineSide(model, s.flags, threads, loaded=shared)
            first.setdefault(key, self.sides[s.name])

    def measure(self, name: str, r: int) -> dict[str, list[float]]:
        return self.sides[name].measure(self.workload, self.o)

    def report(self) -> dict[str, Any]:
        return {"kernels": {n: s.kernels for n, s in self.sides.items()}}


class _EngineChild:
    """One side's engine in a warm process of its checkout (benchmarks/ab_engine.py's protocol)."""

    def __init__(self, side: Side, model: str, threads: int, log: Path) -> None:
        self.log = log
        pythonpath = os.pathsep.join([str(side.root), str(side.root / "protos")])
        env = {**os.environ, **side.env, "PYTHONPATH": pythonpath}
        code = f"import runpy; runpy.run_path({str(ROOT / 'benchmarks' / 'ab_engine.py')!r}, run_name='__main__')"
        setup = json.dumps({"model": model, "flags": side.flags, "threads": threads})
        self.proc = subprocess.Popen([sys.executable, "-c", code, setup], cwd=side.root, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"))
        self.kernels = ""
        self._answer()

    def _answer(self) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("AB "):
                return line[3:].strip()
        tail = self.log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"a side's process exited ({self.proc.wait()}):\n{tail}")

    def measure(self, workload: str, o: dict[str, Any]) -> dict[str, list[float]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"workload": workload, "options": o}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self._answer())
        self.kernels = answer["kernels"]
        return answer["metrics"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class _EngineProcesses:
    def __init__(self, workload: str, sides: list[Side], o: dict[str, Any], model: str, threads: int,
                 stack: contextlib.ExitStack, tmp: Path) -> None:
        self.workload, self.o = workload, o
        self.sides: dict[str, _EngineChild] = {}
        for s in sides:
            self.sides[s.name] = _EngineChild(s, model, threads, tmp / f"{len(self.sides)}.log")
            stack.callback(self.sides[s.name].close)

    def measure(self, name: str, r: int) -> dict[str, list[float]]:
        return self.sides[name].measure(self.workload, self.o)

    def report(self) -> dict[str, Any]:
        return {"kernels": {n: s.kernels for n, s in self.sides.items()}}


class _Served:
    """An `llm-worker serve` per side, all up at once; `llm-worker-bench` against each in turn."""

    def __init__(self, sides: list[Side], o: dict[str, Any], stack: contextlib.ExitStack, tmp: Path) -> None:
        from benchmarks.llamacpp_side_by_side import WORKLOADS as BENCH
        from benchmarks.llamacpp_side_by_side import our_worker, write_gguf_tokenizer

        unknown = [w for w in o["workloads"] if w not in BENCH]
        if unknown:
            raise SystemExit(f"--workloads: {', '.join(unknown)} not among {', '.join(BENCH)}")
        self.o, self.tokenizer = o, write_gguf_tokenizer(tmp)
        self.addrs = {s.name: stack.enter_context(our_worker(s.flags, s.root, s.env)) for s in sides}

    def measure(self, name: str, r: int) -> dict[str, list[float]]:
        from benchmarks.llamacpp_side_by_side import bench

        out = {}
        for w in self.o["workloads"]:
            got = bench(["--backend", "grpc", "--target", self.addrs[name]], w, self.tokenizer, seed=r,
                        extra=self.o["bench_args"])
            for key, metric in (("decode_tokens_per_s", "decode_tok_s"), ("output_throughput", "output_tok_s"),
                                ("ttft_ms_median", "ttft_ms")):
                if got.get(key) is not None:
                    out[f"{w} {metric}"] = [got[key]]
        return out

    def report(self) -> dict[str, Any]:
        from benchmarks.llamacpp_side_by_side import WORKLOADS as BENCH

        return {"bench_args": {w: BENCH[w] + self.o["bench_args"] for w in self.o["workloads"]}}


def _shown(root: Path) -> str:
    """A side's checkout as a record names it: from this one's root (`.`, `../wt-main`), or by
    its name alone where that would climb further (no machine's directories in a record)."""
    rel = os.path.relpath(root, ROOT)
    return rel if rel.count("..") <= 1 else root.name


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _sampling(text: str) -> dict[str, float | int]:
    """'temperature=0.7,top_k=50' -> {'temperature': 0.7, 'top_k': 50}."""
    out: dict[str, float | int] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out[key] = int(value) if value.lstrip("-").isdigit() else float(value)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=WORKLOADS)
    ap.add_argument("--side", action="append", type=parse_side, default=[],
                    help="NAME=PATH[,VAR=value][,--flag=value] (repeatable; default this=.)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and not kept")
    ap.add_argument("--processes", action="store_true",
                    help="engine workloads: each side in a process of its own even when it is this checkout")
    ap.add_argument("--model", default="default", help="engine workloads: the model every side loads")
    ap.add_argument("--threads", type=int, default=0, help="engine workloads: torch threads; 0 = torch's default")
    ap.add_argument("--isa", default=None,
                    help="in this process: build the kernels for this ISA (one this CPU has, e.g. avx2 on an "
                         "AVX-512 machine: the AVX2-only machines' path)")
    g = ap.add_argument_group("step")
    g.add_argument("--batch-sizes", type=_ints, default=[1, 64], help="decode batches (comma list)")
    g.add_argument("--steps", type=int, default=30, help="timed decode steps a measurement and batch")
    g.add_argument("--sampling", type=_sampling, default={},
                   help="the requests' SamplingParams, e.g. temperature=0.8,top_p=0.95 (default greedy)")
    g = ap.add_argument_group("step, offline, native")
    g.add_argument("--context", type=int, default=100, help="prompt tokens a request")
    g = ap.add_argument_group("prefill")
    g.add_argument("--prompts", type=_ints, default=[300, 1000], help="prompt lengths, each alone, whole")
    g.add_argument("--prompt-logprobs", type=int, default=0, help="ask for N prompt logprobs (0: none)")
    g = ap.add_argument_group("offline")
    g.add_argument("--num-requests", type=int, default=64)
    g.add_argument("--max-tokens", type=int, default=64, help="output tokens a request (EOS ignored)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g = ap.add_argument_group("native")
    g.add_argument("--batch", type=int, default=1, help="requests in the captured step")
    g.add_argument("--drafts", type=int, default=0, help="drafted tokens a request: a verification step")
    g.add_argument("--prefill", action="store_true", help="the prompts' prefill call instead of a decode step")
    g.add_argument("--breakdown", action="store_true",
                   help="also the first side's call without the LM head, without the matmuls, and with each matmul a plain "
                        "read of its records; and a plain sum's time for the records' bytes")
    g = ap.add_argument_group("native, linear")
    g.add_argument("--calls", type=int, default=10, help="calls a side a round")
    g = ap.add_argument_group("linear")
    g.add_argument("--weight", default="token_embd.weight",
                   help="a tensor of the default GGUF, or with --shape a GGUF type (Q4_K, Q6_K, ...): random blocks")
    g.add_argument("--shape", default=None, help="NxK (out x in features) of a --weight given as a type")
    g.add_argument("--rows", type=int, default=1, help="rows of x (a decode step's batch)")
    g = ap.add_argument_group("served")
    g.add_argument("--workloads", type=lambda t: [w for w in t.split(",") if w], default=["one_stream"],
                   help="llm-worker-bench workloads: one_stream, long_prompt, long_context, 64_streams")
    g.add_argument("--bench-arg", action="append", default=[], help="added to every llm-worker-bench run")
    ap.add_argument("--output-json", type=Path)
    return ap


def options(workload: str, a: argparse.Namespace) -> dict[str, Any]:
    """The options a workload reads (recorded in the JSON)."""
    return {
        "step": {"batch_sizes": a.batch_sizes, "context": a.context, "steps": a.steps, "sampling": a.sampling},
        "prefill": {"prompts": a.prompts, "prompt_logprobs": a.prompt_logprobs},
        "offline": {"num_requests": a.num_requests, "context": a.context, "max_tokens": a.max_tokens,
                    "max_num_seqs": a.max_num_seqs},
        "native": {"batch": a.batch, "context": a.context, "drafts": a.drafts, "prefill": a.prefill,
                   "breakdown": a.breakdown, "calls": a.calls},
        "linear": {"weight": a.weight, "shape": a.shape, "rows": a.rows, "calls": a.calls},
        "served": {"workloads": a.workloads, "bench_args": a.bench_arg},
    }[workload]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = build_parser()
    a = ap.parse_args(argv)
    sides: list[Side] = a.side or [parse_side("this=.")]
    names = [s.name for s in sides]
    if len(set(names)) != len(names):
        ap.error("sides need distinct names")
    if a.rounds < 1 or a.warmup < 0:
        ap.error("--rounds at least 1, --warmup at least 0")
    w, o = a.workload, options(a.workload, a)
    processes = w in ENGINE and (a.processes or any(s.root != ROOT or s.env for s in sides))
    if a.isa and (processes or w == "served"):
        ap.error("--isa applies in this process only (not to served sides or side processes)")
    if w in KERNELS and any(s.env for s in sides):
        ap.error(f"{w} runs every side in this process: a side's environment cannot apply")
    mode = "servers" if w == "served" else "processes" if processes else "in-process"
    from ops import cpu_kernels

    rounds: list[dict[str, dict[str, list[float]]]] = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack, cpu_kernels.forced_isa(a.isa):
        if w == "served":
            runner: Any = _Served(sides, o, stack, Path(tmp))
        elif w in KERNELS:
            from benchmarks import ab_kernels

            runner = (ab_kernels.Native if w == "native" else ab_kernels.Linear)(sides, o, Path(tmp))
        elif processes:
            runner = _EngineProcesses(w, sides, o, a.model, a.threads, stack, Path(tmp))
        else:
            runner = _EngineInProcess(w, sides, o, a.model, a.threads)
        for r in range(a.warmup + a.rounds):
            order = names if r % 2 == 0 else names[::-1]
            one = {n: runner.measure(n, r - a.warmup) for n in order}
            if r >= a.warmup:
                rounds.append(one)
            print(f"round {r + 1 - a.warmup}{' (warm-up)' if r < a.warmup else ''}: " + "; ".join(
                f"{n} " + ", ".join(f"{m} {statistics.median(v):.4g}" for m, v in one[n].items()) for n in names),
                flush=True)
        details = runner.report()
    argv_recorded = sys.argv if argv is None else [str(Path(__file__)), *argv]
    report = {"tool": "benchmarks.ab", "workload": w, "mode": mode, "options": o, "rounds_kept": a.rounds,
              "warmup_rounds": a.warmup, "model": a.model, "isa": a.isa or cpu_kernels.isa(),
              "sides": [{"name": s.name, "root": _shown(s.root), "env": s.env, "flags": s.flags} for s in sides],
              "summary": summarize(rounds, names), "details": recorded(details), "rounds": rounds,
              "environment": environment(argv_recorded)}
    print(render_markdown(report))
    if a.output_json:
        a.output_json.parent.mkdir(parents=True, exist_ok=True)
        a.output_json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {a.output_json}")
    return report


if __name__ == "__main__":
    main()
