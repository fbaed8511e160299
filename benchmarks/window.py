"""A sliding window's decode cost against the context: flat past the window, where a global
layer's grows.

    python -m benchmarks.window --window 1024 --contexts 1024,4096 --output-json bench-results/window.json

Two copies of the default model (SmolLM2-135M, Q8_0/Q4_1 blocks, the fused C decoder): one
with every layer's attention given a `--window` (its weights were trained without one: the
tokens mean nothing, the step's cost is what is measured), one global as it ships. For each
context, a request is prefilled to it and its decode steps timed, the engines taking turns
`--steps` steps at a time for `--rounds` rounds (median kept), so the machine's drift falls
on every row alike. Then the C decode attention alone (ops.cpu_attention.decode, the default
model's heads), windowed and global, over the same contexts. `ratio` is a row's time over the
first context's: ~1.0 for the windowed rows (the kernel reads the window's keys only), about
the context's ratio for the global attention alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from clients.bench.environment import environment, recorded
from ops import cpu_attention
from scheduler.request import SamplingParams
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.weights import LoadedModel, load_model

BLOCK = 16


def _engine(loaded: LoadedModel, context: int, max_tokens: int, batch: int) -> Engine:
    """An engine whose `batch` requests are prefilled to `context` tokens and decoding."""
    per_token = loaded.config.num_layers * 2 * loaded.config.num_kv_heads * loaded.config.head_dim * 4
    gib = batch * (context + max_tokens + 64) * per_token / 2**30 + 0.05
    conf = WorkerConfig(model=ModelConfig(max_model_len=context + max_tokens + 16), cache=CacheConfig(kv_cache_memory=gib, enable_prefix_caching=False),
                        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * context))
    engine = Engine(conf, loaded=loaded)
    assert engine.runner.cpu_decoder is not None, "the fused decoder does not run this model"
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.submit(engine.make_request([(7 * i + j) % 40000 + 100 for j in range(context)], params))
    engine.step()  # the prefill
    engine.step()
    return engine


def _steps_ms(engine: Engine, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e3


def step_rows(window: int, contexts: list[int], batch: int, steps: int, rounds: int) -> list[dict]:
    models = {"windowed": load_model("default"), "global": load_model("default")}
    for layer in models["windowed"].model.layers:
        layer.self_attn.window = window  # before the engine: the fused decoder reads it once
    max_tokens = steps * (rounds + 1) + 8
    engines = {(v, c): _engine(m, c, max_tokens, batch) for v, m in models.items() for c in contexts}
    times: dict[tuple[str, int], list[float]] = {k: [] for k in engines}
    for _ in range(rounds):
        for k, engine in engines.items():
            times[k].append(_steps_ms(engine, steps))
    return _rows(times, contexts, "step_ms")


def attention_rows(window: int, contexts: list[int], batch: int, calls: int, rounds: int) -> list[dict]:
    """cpu_attention.decode over random float32 caches: 9 query heads, 3 kv heads, head_dim 64."""
    hq, hkv, d = 9, 3, 64
    rng = np.random.default_rng(0)
    args = {}
    for c in contexts:
        blocks = -(-c // BLOCK)
        k = torch.from_numpy(rng.standard_normal((batch * blocks, BLOCK, hkv, d), dtype=np.float32))
        v = torch.from_numpy(rng.standard_normal((batch * blocks, BLOCK, hkv, d), dtype=np.float32))
        tables = torch.randperm(batch * blocks).view(batch, blocks).long()
        q = torch.randn(batch, hq, d)
        args[c] = (q, k, v, torch.arange(batch), tables, torch.full((batch,), c), d**-0.5, torch.empty_like(q))
    times: dict[tuple[str, int], list[float]] = {(v, c): [] for v in ("windowed", "global") for c in contexts}
    for _ in range(rounds + 1):  # the first round warms up
        for v, c in list(times):
            t0 = time.perf_counter()
            for _ in range(calls):
                cpu_attention.decode(*args[c], window=window if v == "windowed" else None)
            times[v, c].append((time.perf_counter() - t0) / calls * 1e3)
    return _rows({k: t[1:] for k, t in times.items()}, contexts, "call_ms")


def _rows(times: dict[tuple[str, int], list[float]], contexts: list[int], unit: str) -> list[dict]:
    rows = []
    for v in ("windowed", "global"):
        first = statistics.median(times[v, contexts[0]])
        for c in contexts:
            ms = statistics.median(times[v, c])
            rows.append({"variant": v, "context": c, unit: round(ms, 4), "ratio": round(ms / first, 3),
                         "rounds_ms": [round(t, 4) for t in times[v, c]]})
            print(f"{unit[:-3]:>9} {v:>8} context {c:6d}: {ms:9.3f} ms  ({ms / first:.3f}x the first)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--contexts", default="1024,4096", help="prompt tokens per request (comma-separated)")
    ap.add_argument("--batch", type=int, default=1, help="requests decoding at once")
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50, help="attention calls timed per round")
    ap.add_argument("--no-steps", action="store_true", help="time the attention alone")
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.window < 1 or not contexts or min(contexts) < 1 or args.rounds < 1:
        ap.error("--window, --contexts and --rounds must be positive")
    report = {"info": {**environment(argv), "threads": torch.get_num_threads(), "args": recorded(vars(args))},
              "attention": attention_rows(args.window, contexts, args.batch, args.calls, args.rounds)}
    if not args.no_steps:
        report["step"] = step_rows(args.window, contexts, args.batch, args.steps, args.rounds)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
