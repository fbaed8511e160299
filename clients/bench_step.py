"""Decode step time against batch size, for the engine on this machine:

    python -m clients.bench_step --batch-sizes 1,8,16,32,64

On a GPU decode is weight-read bound and a step costs about the same at batch 1
and 64, which is where continuous batching wins most; this shows how far a
given machine is from that.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from scheduler.request import SamplingParams
from worker.config import CacheConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.weights import LoadedModel, load_model


def step_ms(loaded: LoadedModel, batch: int, context: int, steps: int) -> float:
    conf = WorkerConfig(cache=CacheConfig(kv_cache_memory=0.5),
                        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=8192))
    engine = Engine(conf, loaded=loaded)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.submit(engine.make_request([(7 * i + j) % 40000 + 100 for j in range(context)], params))
    engine.step()  # prefill
    engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1000


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch-sizes", default="1,8,16,32,64")
    ap.add_argument("--context", type=int, default=100, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    loaded = load_model(args.model)
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        ms = step_ms(loaded, b, args.context, args.steps)
        rows.append({"batch": b, "step_ms": round(ms, 1), "tokens_per_s": round(b / ms * 1000, 1)})
        print(f"batch {b:3d}: {ms:7.1f} ms/step  {b / ms * 1000:7.1f} tok/s", flush=True)
    if args.output_json:
        info = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                "torch": torch.__version__, "threads": torch.get_num_threads(), "args": vars(args)}
        with open(args.output_json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
