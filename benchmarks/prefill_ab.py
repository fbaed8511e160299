"""Prefill time of this checkout against another (e.g. main's code in a second worktree),
paired, so that both see the same machine:

    python -m benchmarks.prefill_ab --against ../wt-ab --prompts 300,1000,2000 --rounds 4

Both sides run at once as two warm processes (the other checkout is `before`, this one
`after`, each with its own code first on PYTHONPATH, the default model loaded), taking turns:
each measurement runs on one side, then the same on the other (the order flips every round),
so that both see the same minute of a machine whose speed drifts by 20-30% over minutes.
Workloads: per prompt length P, one request of P new tokens and one output token (the
whole prefill one step: the token budget is P); `prompt_logprobs` (with --workloads): the
same requests asking for 5 prompt logprobs (`logprobs:P`, how an evaluation harness scores
a text); `mixed`: 32 requests of 100 prompt tokens
and 8 output tokens each under a 256-token budget, prefill chunks sharing most steps with
decodes; `decode64`: 64 requests of 8 prompt tokens and 48 output tokens each, at once (one
prefill step of 512 rows, then 47 decode steps of 64 rows: mostly the 64-stream step); `spec` and `plain` (with
--workloads): the four input-grounded prompts of benchmarks.spec_decode one at a time, greedy, up to 128 tokens, with n-gram speculation
(its DEFAULT_SPEC, k = 3) or without, on one engine each (prompts cached after the first
round, so these time mostly decode and verification steps). A table row gives each side's
median and fastest over the rounds, and the median of the rounds' paired ratios before /
after (above 1: after is faster).

    python -m benchmarks.prefill_ab --against ../wt-ab --workloads spec,plain --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from clients.bench.environment import environment

# Runs inside each side's own code (only APIs both sides have): one measurement per line
# read from stdin, its seconds written back.
_CHILD = r"""
import json, sys, time
import torch
from scheduler.request import SamplingParams
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.weights import load_model

args = json.loads(sys.argv[1])
if args["threads"]:
    torch.set_num_threads(args["threads"])
loaded = load_model("default")
engines = {}

def engine(budget, seqs):
    if (budget, seqs) not in engines:
        conf = WorkerConfig(model=ModelConfig(max_model_len=max(args["prompts"]) + 64),
                            cache=CacheConfig(kv_cache_memory=0.5),
                            scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget))
        engines[budget, seqs] = Engine(conf, loaded=loaded)
    return engines[budget, seqs]

def task_requests(spec):
    from benchmarks.spec_decode import DEFAULT_SPEC, TASKS
    from worker.config import SpeculativeConfig, parse_speculative_config
    if spec not in engines:
        conf = WorkerConfig(model=ModelConfig(max_model_len=2048), cache=CacheConfig(kv_cache_memory=0.25),
                            scheduler=SchedulerConfig(max_num_seqs=1),
                            speculative=SpeculativeConfig(parse_speculative_config(DEFAULT_SPEC) if spec else None))
        engines[spec] = Engine(conf, loaded=loaded)
    e, tok = engines[spec], loaded.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True))
               for t in TASKS.values()]
    return e, [[e.make_request(p, SamplingParams(temperature=0, max_tokens=128))] for p in prompts]

print("READY", flush=True)
for n, line in enumerate(sys.stdin):
    work = json.loads(line)  # a prompt length, "mixed", "decode64", "spec" or "plain"; n keeps prompts distinct
    if work in ("spec", "plain"):
        e, batches = task_requests(work == "spec")
        t0 = time.perf_counter()
        for reqs in batches:  # one stream: each prompt alone
            e.generate(reqs)
        print(json.dumps(time.perf_counter() - t0), flush=True)
        continue
    if work == "mixed":
        e = engine(256, 64)
        reqs = [e.make_request([(7 * i + j + 1000 * n) % 40000 + 100 for j in range(100)],
                               SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) for i in range(32)]
    elif work == "decode64":
        e = engine(512, 64)
        reqs = [e.make_request([(7 * i + j + 1000 * n) % 40000 + 100 for j in range(8)],
                               SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)) for i in range(64)]
    else:  # P, or "logprobs:P": the same with 5 prompt logprobs (an evaluation harness's scoring)
        plp = 5 if isinstance(work, str) else None
        length = int(work.split(":")[1]) if plp else work
        e = engine(length, 1)
        reqs = [e.make_request([(7 * j + n) % 40000 + 100 for j in range(length)],
                               SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=plp))]
    t0 = time.perf_counter()
    e.generate(reqs)
    print(json.dumps(time.perf_counter() - t0), flush=True)
"""


class _Side:
    def __init__(self, root: Path, args: argparse.Namespace, prompts: list[int]) -> None:
        env = {**os.environ, "PYTHONPATH": str(root)}
        payload = json.dumps({"prompts": prompts, "threads": args.threads})
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, payload], cwd=root, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if self._line() != "READY":
            raise RuntimeError(f"side {root} did not start")

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a side exited ({self.proc.wait()})")
        return line.strip()

    def run(self, work: int | str) -> float:
        self.proc.stdin.write(json.dumps(work) + "\n")
        self.proc.stdin.flush()
        return float(self._line())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def render_markdown(report: dict) -> str:
    out = ["| workload | before s: median (fastest) | after s: median (fastest) | before / after, paired median |",
           "|---|---|---|---|"]
    for w, sides in report["times"].items():
        b, a = sides["before"], sides["after"]
        ratio = statistics.median(x / y for x, y in zip(b, a, strict=True))
        out.append(f"| {w} | {statistics.median(b):.2f} ({min(b):.2f}) | {statistics.median(a):.2f} ({min(a):.2f}) "
                   f"| **{ratio:.2f}x** |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", help="root of the other checkout (its code runs as 'before')")
    ap.add_argument("--prompts", default="300,1000,2000", help="prompt lengths timed alone")
    ap.add_argument("--workloads", default="prompts,mixed",
                    help="comma list of: prompts (each of --prompts), prompt_logprobs (each of "
                         "--prompts with 5 prompt logprobs), mixed, decode64, spec, plain")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch (and kernel) threads; 0 = torch's default")
    ap.add_argument("--output-json")
    ap.add_argument("--report", metavar="JSON", help="print the markdown table of an --output-json file and exit")
    args = ap.parse_args(argv)
    if args.report:
        print(render_markdown(json.loads(Path(args.report).read_text())))
        return
    if not args.against:
        ap.error("--against is required")
    prompts = [int(x) for x in args.prompts.split(",")]
    here = Path(__file__).resolve().parents[1]
    workloads: list[int | str] = []
    for w in args.workloads.split(","):
        if w not in ("prompts", "prompt_logprobs", "mixed", "decode64", "spec", "plain"):
            ap.error(f"unknown workload {w!r}")
        workloads += prompts if w == "prompts" else [f"logprobs:{p}" for p in prompts] if w == "prompt_logprobs" else [w]
    report: dict = {"environment": environment(), "prompts": prompts,
                    "times": {str(w): {"before": [], "after": []} for w in workloads}}
    sides = {"before": _Side(Path(args.against).resolve(), args, prompts), "after": _Side(here, args, prompts)}
    try:
        for i in range(args.rounds):
            for w in workloads:
                for name in (["before", "after"] if i % 2 == 0 else ["after", "before"]):
                    report["times"][str(w)][name].append(sides[name].run(w))
            print(f"round {i + 1}: " + json.dumps({w: {k: v[-1] for k, v in t.items()}
                                                   for w, t in report["times"].items()}), flush=True)
    finally:
        for side in sides.values():
            side.close()
    print(render_markdown(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
