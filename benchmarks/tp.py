"""The decode step under tensor parallelism on this CPU, against TP = 1:

    python -m benchmarks.tp --tp 3 --batch-sizes 1,8 --rounds 2 --output-json bench-results/tp.json

Variants, each an in-process engine over the default model (this process is rank 0; the
followers are processes of their own, over gloo):
- `tp1-quantized`: TP = 1 as served by default (GGUF blocks, the fused C decoder);
- `tp1-float32`: TP = 1 on the dequantized weights, op by op;
- `tpK`: TP = K as served by default (each rank its slices of the GGUF blocks, op by op
  with the C kernels: the fused decoder does not run sharded), with rank 0's all-reduces a
  step (count and seconds) and its step messages' seconds (two broadcasts a step: the
  header, then the arrays).

This is a test bed, not a speed-up: the ranks share the machine's cores (each gets
cores / K torch threads), so the step is slower at TP > 1; the figures say where its time
goes. NCCL on GPUs is not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from clients.bench.environment import environment, recorded
from scheduler.request import SamplingParams
from worker.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine


def config(variant: str, batch: int, tp: int) -> WorkerConfig:
    model = ModelConfig(cpu_quantized_linear=variant != "tp1-float32", max_model_len=2048)
    return WorkerConfig(model=model, parallel=ParallelConfig(tensor_parallel_size=tp),
                        cache=CacheConfig(kv_cache_memory=0.25, swap_space=0),
                        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=8192))


def measure(engine: Engine, batch: int, context: int, steps: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.submit(engine.make_request([(7 * i + j) % 40000 + 100 for j in range(context)], params))
    engine.step()  # prefill
    engine.step()
    tp = engine.tensor_parallel
    c = tp.collectives if tp is not None else None
    before = (c.num_all_reduces, c.all_reduce_s, c.num_messages, c.send_s, c.num_gathers, c.gather_s) if c else None
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = (time.perf_counter() - t0) / steps
    row = {"step_ms": dt * 1000}
    if c is not None and before is not None:
        row.update(all_reduces_per_step=(c.num_all_reduces - before[0]) / steps,
                   all_reduce_ms_per_step=(c.all_reduce_s - before[1]) / steps * 1000,
                   messages_per_step=(c.num_messages - before[2]) / steps,
                   send_ms_per_step=(c.send_s - before[3]) / steps * 1000,
                   gathers_per_step=(c.num_gathers - before[4]) / steps,  # the head's logits to rank 0
                   gather_ms_per_step=(c.gather_s - before[5]) / steps * 1000)
    while engine.has_work():  # free the blocks for the next round
        engine.step()
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    batches = [int(x) for x in args.batch_sizes.split(",")]
    variants = {"tp1-quantized": 1, "tp1-float32": 1, f"tp{args.tp}": args.tp}
    rows = []
    threads = torch.get_num_threads()
    for name, tp in variants.items():
        torch.set_num_threads(threads)  # (a TP engine sets cores / K)
        engine = Engine(config(name, max(batches), tp))
        try:
            for b in batches:
                rounds = [measure(engine, b, args.context, args.steps) for _ in range(args.rounds)]
                best = sorted(rounds, key=lambda r: r["step_ms"])[(args.rounds - 1) // 2]
                row = {"variant": name, "tp": tp, "batch": b, **{k: round(v, 3) for k, v in best.items()},
                       "rounds_ms": [round(r["step_ms"], 2) for r in rounds],
                       "torch_threads": torch.get_num_threads(),
                       "engine_config": json.loads(config(name, b, tp).to_json())}
                rows.append(row)
                extra = (f"  all-reduce {row['all_reduce_ms_per_step']:.2f} ms "
                         f"({row['all_reduces_per_step']:.0f} a step), messages {row['send_ms_per_step']:.2f} ms, "
                         f"logits gather {row['gather_ms_per_step']:.2f} ms"
                         if tp > 1 else "")
                print(f"{name:>14} batch {b:3d}: {row['step_ms']:8.2f} ms/step{extra}", flush=True)
        finally:
            engine.shutdown()
    if args.output_json:
        info = {**environment(), "args": recorded(vars(args)), "load_average_at_end": os.getloadavg(),
                "note": "2-core machine shared with other jobs; ranks share its cores"}
        with open(args.output_json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
