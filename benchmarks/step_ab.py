"""Decode step time of this checkout against another (e.g. main's code in a second worktree),
alternating in one run, so that both see the same machine:

    python -m benchmarks.step_ab --against ../main --batch-sizes 1,64 --rounds 5 \\
        --variant default --variant int8=cpu_int8_activations=true

Each round runs every side once, in a fresh process with that side's code first on
PYTHONPATH: the other checkout (named `before`), then each `--variant` of this one (a name
and ModelConfig fields, e.g. `int8=cpu_int8_activations=true`, or `env.NAME=value` for the
side's environment, e.g. `passive=env.OMP_WAIT_POLICY=passive`). A side loads the model, then
per batch size submits that many requests of `--context` prompt tokens, takes two warm-up
steps and times `--steps` decode steps one by one. A table row gives, per side, the median
over every timed step of every round and the fastest step: on a machine shared with other
work the fastest step is the one nothing interrupted.
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

# Runs inside each side's own code: only APIs both sides have.
_MEASURE = r"""
import json, sys, time
import torch
from scheduler.request import SamplingParams
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.weights import load_model

args = json.loads(sys.argv[1])
if args["threads"]:
    torch.set_num_threads(args["threads"])
loaded = load_model(args["model"])
out = {"kernels": None, "steps_ms": {}}
for b in args["batches"]:
    conf = WorkerConfig(model=ModelConfig(**args["fields"]), cache=CacheConfig(kv_cache_memory=0.5),
                        scheduler=SchedulerConfig(max_num_seqs=b, max_num_batched_tokens=8192))
    engine = Engine(conf, loaded=loaded)
    out["kernels"] = engine.runner.describe_kernels()
    sampling = {"temperature": 0, **args.get("sampling", {})}
    params = SamplingParams(**sampling, max_tokens=args["steps"] + 4, ignore_eos=True)
    for i in range(b):
        engine.submit(engine.make_request([(7 * i + j) % 40000 + 100 for j in range(args["context"])], params))
    engine.step()  # prefill
    engine.step()
    times = []
    for _ in range(args["steps"]):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1000)
    out["steps_ms"][str(b)] = times
out["threads"] = torch.get_num_threads()
if args["breakdown"]:
    # One more batch-1 engine; time its parts step by step (wrappers add a few us each).
    from ops.quantized_linear import QuantLinear
    conf = WorkerConfig(model=ModelConfig(**args["fields"]), cache=CacheConfig(kv_cache_memory=0.5),
                        scheduler=SchedulerConfig(max_num_seqs=1))
    engine = Engine(conf, loaded=loaded)
    engine.submit(engine.make_request([j % 40000 + 100 for j in range(args["context"])],
                                      SamplingParams(temperature=0, max_tokens=args["steps"] + 4, ignore_eos=True)))
    engine.step()
    engine.step()
    runner, parts = engine.runner, {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts.setdefault(name, []).append((time.perf_counter() - t0) * 1000)
        return wrapper

    decoder = getattr(runner, "cpu_decoder", None)
    if decoder is not None and hasattr(decoder, "decode"):  # the head inside its call: counted here
        decoder.decode = timed("forward (layers)", decoder.decode)
    elif decoder is not None and hasattr(decoder, "forward"):  # (an older checkout's runner)
        decoder.forward = timed("forward (layers)", decoder.forward)
    elif decoder is not None:
        runner.cpu_decoder = timed("forward (layers)", decoder)
    else:
        runner.model.forward = timed("forward (layers)", runner.model.forward)
    runner.model.compute_logits = timed("head", runner.model.compute_logits)
    runner._sample = timed("sampling", runner._sample)
    runner.execute = timed("runner.execute", runner.execute)
    linear_forward = QuantLinear.forward
    QuantLinear.forward = timed("QuantLinear calls", linear_forward)
    steps = []
    for _ in range(args["steps"]):
        t0 = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t0) * 1000)
    QuantLinear.forward = linear_forward
    n = len(steps)
    out["breakdown"] = {"engine.step": steps, **{k: [sum(v[i::n]) for i in range(n)] if len(v) % n == 0 else v
                                                  for k, v in parts.items()},
                        "calls per step": {k: len(v) / n for k, v in parts.items()}}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine.step()
    out["breakdown"]["torch ops per step"] = sum(e.count for e in prof.key_averages()) / 5
    # The memory floor: every weight is read once a step.
    weights = {id(m.packed): m.packed.numel() for m in runner.model.modules() if isinstance(m, QuantLinear)}
    out["breakdown"]["weight MB per step"] = sum(weights.values()) / 1e6
    big = torch.ones(128 * 1024 * 1024)  # 512 MB, read by a sum (best of 10)
    sums = []
    for _ in range(10):
        t0 = time.perf_counter()
        big.sum()
        sums.append(time.perf_counter() - t0)
    out["breakdown"]["read GB/s"] = big.numel() * 4 / min(sums) / 1e9
print("RESULT " + json.dumps(out))
"""


def _parse_variant(text: str) -> tuple[str, dict[str, object]]:
    """'int8=cpu_int8_activations=true' -> ('int8', {'cpu_int8_activations': True})."""
    name, _, rest = text.partition("=")
    fields: dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        fields[key] = {"true": True, "false": False}.get(value.lower(), value)
    return name, fields


def _parse_sampling(text: str) -> dict[str, float | int]:
    """'temperature=0.7,top_k=50' -> {'temperature': 0.7, 'top_k': 50}."""
    out: dict[str, float | int] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out[key] = int(value) if value.lstrip("-").isdigit() else float(value)
    return out


def _run_side(root: Path, batches: list[int], args: argparse.Namespace, fields: dict) -> dict:
    # 'env.NAME=value' fields are the side's environment (read before torch loads), not config.
    env = {**os.environ, "PYTHONPATH": str(root),
           **{k.removeprefix("env."): str(v) for k, v in fields.items() if k.startswith("env.")}}
    fields = {k: v for k, v in fields.items() if not k.startswith("env.")}
    payload = json.dumps({"model": args.model, "batches": batches, "context": args.context,
                          "sampling": _parse_sampling(args.sampling),
                          "steps": args.steps, "fields": fields, "breakdown": args.breakdown,
                          "threads": args.threads})
    proc = subprocess.run([sys.executable, "-c", _MEASURE, payload], cwd=root, env=env, capture_output=True,
                          text=True, timeout=3600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"side {root} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(line.removeprefix("RESULT "))


def render_breakdown(report: dict) -> str:
    """Medians over every round's steps of each part of a batch-1 step, per side."""
    sides = [s for s in report["sides"] if "breakdown" in report["rounds"][0][s]]
    if not sides:
        return ""
    parts = list(dict.fromkeys(k for s in sides for k in report["rounds"][0][s]["breakdown"]
                               if k not in ("calls per step", "torch ops per step", "weight MB per step",
                                            "read GB/s")))
    out = ["| part of a batch-1 step | " + " | ".join(f"{s} ms (calls per step)" for s in sides) + " |",
           "|" + "---|" * (len(sides) + 1)]
    for part in parts:
        cells = []
        for s in sides:
            values = [t for r in report["rounds"] for t in r[s]["breakdown"].get(part, [])]
            calls = report["rounds"][0][s]["breakdown"]["calls per step"].get(part)
            cells.append(f"{statistics.median(values):.2f}" + (f" ({calls:g})" if calls else "") if values else "-")
        out.append(f"| {part} | " + " | ".join(cells) + " |")
    for key, fmt in (("torch ops per step", "{:.0f}"), ("weight MB per step", "{:.1f}"), ("read GB/s", "{:.1f}")):
        values = [[r[s]["breakdown"][key] for r in report["rounds"] if key in r[s]["breakdown"]] for s in sides]
        out.append(f"| {key} | " + " | ".join(fmt.format(statistics.median(v)) if v else "-" for v in values) + " |")
    return "\n".join(out)


def render_markdown(report: dict) -> str:
    sides = report["sides"]
    base = sides[0]
    head = ["decode batch"] + [f"{s} ms/step: median (fastest step)" for s in sides]
    head += [f"{base} / {s}" for s in sides[1:]]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in report["batch_sizes"]:
        med = {}
        cells = [str(b)]
        for s in sides:
            rounds = [r[s]["steps_ms"][str(b)] for r in report["rounds"]]
            med[s] = statistics.median(t for r in rounds for t in r)
            cells.append(f"{med[s]:.1f} ({min(t for r in rounds for t in r):.1f})")
        cells += [f"**{med[base] / med[s]:.2f}x**" for s in sides[1:]]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", help="root of the other checkout (its code runs as 'before')")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME[=FIELD=VALUE,...]: a side of this checkout with these ModelConfig fields "
                         "(default: one side named 'after' with the defaults)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--context", type=int, default=100, help="prompt tokens per request")
    ap.add_argument("--sampling", default="",
                    help="the requests' SamplingParams fields, e.g. temperature=0.7,top_p=0.9,seed=1 "
                         "(default greedy)")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per batch size and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch (and kernel) threads; 0 = torch's default")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the parts of a batch-1 step (forward, head, sampling, the rest) and "
                         "count its torch ops, per side and round")
    ap.add_argument("--output-json")
    ap.add_argument("--report", metavar="JSON", help="print the markdown table of an --output-json file and exit")
    args = ap.parse_args(argv)
    if args.report:
        report = json.loads(Path(args.report).read_text())
        print(render_markdown(report))
        print(render_breakdown(report))
        return
    here = Path(__file__).resolve().parents[1]
    variants = [_parse_variant(v) for v in args.variant] or [("after", {})]
    sides: list[tuple[str, Path, dict]] = [("before", Path(args.against).resolve(), {})] if args.against else []
    sides += [(name, here, fields) for name, fields in variants]
    batches = [int(x) for x in args.batch_sizes.split(",")]
    recorded = {**vars(args), "against": os.path.relpath(args.against, here) if args.against else None}
    report = {"info": {**environment(), "args": recorded}, "sides": [s[0] for s in sides],
              "batch_sizes": batches, "kernels": {}, "rounds": []}
    for r in range(args.rounds):
        results = {}
        for name, root, fields in sides:
            results[name] = _run_side(root, batches, args, fields)
            report["kernels"][name] = results[name]["kernels"]
            meds = ", ".join(f"batch {b}: {statistics.median(results[name]['steps_ms'][str(b)]):.1f} ms"
                             for b in batches)
            print(f"round {r + 1} {name:>8}: {meds}", flush=True)
        report["rounds"].append(results)
    print(render_markdown(report))
    print(render_breakdown(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
