"""Decode step time against batch size, for the engine on this machine:

    python -m benchmarks.step --batch-sizes 1,8,16,32,64

On a GPU decode is weight-read bound and a step costs about the same at batch 1
and 64, which is where continuous batching wins most; this shows how far a
given machine is from that.

    python -m benchmarks.step --variants quantized,float32 --rounds 3

times the CPU's linear-layer paths against each other in one run, alternating: `quantized`
(the default: GGUF blocks, ops/quantized_linear.py), `float32` (dequantized at load,
oneDNN-packed) and `float32-sdpa` (also the torch gather + SDPA for decode attention instead of
ops/cpu_attention.py); each variant has its own copy of the model. A row reports the median round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
from collections.abc import Iterator

import torch

from clients.bench.environment import environment, recorded
from ops import cpu_attention
from scheduler.request import SamplingParams
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.weights import LoadedModel, load_model

VARIANTS = {"quantized": ModelConfig(), "float32": ModelConfig(cpu_quantized_linear=False),
            "float32-sdpa": ModelConfig(cpu_quantized_linear=False)}  # + the torch decode attention


def step_config(batch: int, model: ModelConfig | None = None) -> WorkerConfig:
    """What a row runs under (recorded beside it in the JSON)."""
    return WorkerConfig(model=model or ModelConfig(), cache=CacheConfig(kv_cache_memory=0.5),
                        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=8192))


def step_ms(loaded: LoadedModel, batch: int, context: int, steps: int,
            model: ModelConfig | None = None) -> float:
    engine = Engine(step_config(batch, model), loaded=loaded)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.submit(engine.make_request([(7 * i + j) % 40000 + 100 for j in range(context)], params))
    engine.step()  # prefill
    engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1000


@contextlib.contextmanager
def _torch_attention(on: bool) -> Iterator[None]:
    saved = cpu_attention.usable
    if on:
        cpu_attention.usable = lambda *a: False
    try:
        yield
    finally:
        cpu_attention.usable = saved


def render_markdown(report: dict) -> str:
    """A BENCHMARKS.md table from `--output-json`: ms/step per variant and each variant's
    step time over the first variant's (the speed-up of the first)."""
    rows = report["rows"]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    ms = {(r["variant"], r["batch"]): r for r in rows}
    base = variants[0]
    head = ["decode batch"] + [f"{v} ms/step (rounds)" for v in variants]
    head += [f"{base} faster than {v}" for v in variants[1:]] + [f"{base} output tok/s"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in batches:
        cells = [str(b)]
        cells += [f"{ms[v, b]['step_ms']} ({', '.join(map(str, ms[v, b].get('rounds_ms', [])))})"
                  for v in variants]
        cells += [f"**{ms[v, b]['step_ms'] / ms[base, b]['step_ms']:.2f}x**" for v in variants[1:]]
        cells.append(str(ms[base, b]["tokens_per_s"]))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch-sizes", default="1,8,16,32,64")
    ap.add_argument("--context", type=int, default=100, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--variants", default="quantized",
                    help=f"comma list of {', '.join(VARIANTS)}, timed alternately (default quantized)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds per batch size; the median is kept")
    ap.add_argument("--output-json")
    ap.add_argument("--report", metavar="JSON", help="print the markdown table of an --output-json file and exit")
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            print(render_markdown(json.load(f)))
        return
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: choose from {', '.join(VARIANTS)}")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    loaded = {v: load_model(args.model) for v in variants}  # in-place layer swaps: one copy each
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v in variants:
                # float32-sdpa: the torch reference's gather + SDPA instead of the C decode kernel
                with _torch_attention(v == "float32-sdpa"):
                    times[v].append(step_ms(loaded[v], b, args.context, args.steps, VARIANTS[v]))
        for v in variants:
            ms = sorted(times[v])[(args.rounds - 1) // 2]
            rows.append({"variant": v, "batch": b, "step_ms": round(ms, 1),
                         "tokens_per_s": round(b / ms * 1000, 1), "rounds_ms": [round(t, 1) for t in times[v]],
                         "torch_decode_attention": v == "float32-sdpa",
                         "engine_config": json.loads(step_config(b, VARIANTS[v]).to_json())})
            print(f"{v:>10} batch {b:3d}: {ms:7.1f} ms/step  {b / ms * 1000:7.1f} tok/s", flush=True)
    if args.output_json:
        info = {**environment(), "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                "torch": torch.__version__, "threads": torch.get_num_threads(), "args": recorded(vars(args))}
        with open(args.output_json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
