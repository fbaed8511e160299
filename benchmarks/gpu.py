"""GPU figures for BENCHMARKS.md (issue 6), in one run:

    python -m benchmarks.gpu --output-json bench-results/gpu.json

1. copy: the device's measured copy bandwidth (device to device, bytes read + written),
   the ceiling every memory-bound figure below is a fraction of.
2. attention: the paged-attention kernel on a decode batch (default 64 requests x 4,096
   tokens of context, Llama-3-8B heads: 32 query / 8 KV heads of 128, bfloat16, 16-token
   blocks scattered at random); bytes = the K and V read once plus q and the output.
3. step: one whole decode step (engine.step(): schedule, graph replay or eager forward,
   sampling, host copy) of a dummy Llama-3-8B in bfloat16 at batch 1, with and without
   CUDA graphs, against its roofline: the weights read once (the embedding table only
   for one row) over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch

from clients.bench.environment import command, git_commit, recorded

GiB = 1 << 30


def _bench(fn, reps: int = 50) -> float:
    """Median milliseconds of fn() with CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(gib: float = 2.0) -> dict[str, float]:
    n = int(gib * GiB) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src), reps=30)
    torch.cuda.empty_cache()
    return {"bytes": 2 * n * 2, "ms": ms, "gb_per_s": 2 * n * 2 / ms / 1e6}


def attention_decode(batch: int, context: int, tunables: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from ops.attention import paged_attention_ref
    from ops.attention_triton import paged_attention_triton

    hq, hkv, d, bs = 32, 8, 128, 16
    per_seq = -(-context // bs)
    num_blocks = batch * per_seq + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn(num_blocks, bs, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(num_blocks, bs, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    tables = torch.randperm(num_blocks - 1, device="cuda", generator=gen)[: batch * per_seq] + 1
    tables = tables.view(batch, per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int64, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int64, device="cuda")
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = d**-0.5
    args = (q, k_cache, v_cache, tables, seq_lens, qsl, 1, context, scale)
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), *args[3:])
    kv_bytes = 2 * batch * context * hkv * d * 2
    io_bytes = kv_bytes + 2 * q.numel() * 2 + tables.numel() * 4
    rows = []
    for tun in tunables:
        out = paged_attention_triton(*args, **tun)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ms = _bench(lambda tun=tun: paged_attention_triton(*args, **tun))
        rows.append({"tunables": tun, "ms": ms, "bytes": io_bytes, "gb_per_s": io_bytes / ms / 1e6,
                     "rel_err_vs_fp32_ref": err})
    return rows


def median_step_ms(engine, steps: int, warmup: int = 5) -> float:
    """Median wall milliseconds of `steps` engine steps after `warmup` (each step ends with
    the sampled tokens on the host: a full sync)."""
    for _ in range(warmup):
        engine.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def decode_step(model: str, context: int, steps: int) -> dict[str, Any]:
    from scheduler.request import SamplingParams
    from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
    from worker.engine import Engine
    from worker.weights import load_model

    loaded = load_model(model, "cuda", torch.bfloat16)
    m = loaded.model
    weight_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    if m.lm_head is not None:  # an untied embedding table is read one row per token
        emb = m.embed_tokens.weight
        weight_bytes -= emb.numel() * emb.element_size() - emb.shape[1] * emb.element_size()
    result: dict[str, Any] = {"model": model, "context": context, "weight_bytes": weight_bytes}
    for graphs in (True, False):
        conf = WorkerConfig(
            model=ModelConfig(cuda_graphs=graphs, max_model_len=4096),
            cache=CacheConfig(kv_cache_memory=2.0),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048),
        )
        engine = Engine(conf, loaded=loaded)
        params = SamplingParams(temperature=0, max_tokens=steps + 10, ignore_eos=True)
        engine.submit(engine.make_request([(13 * j) % 100000 + 100 for j in range(context)], params))
        engine.step()  # prefill
        key = "graphs" if graphs else "eager"
        result[f"{key}_step_ms"] = median_step_ms(engine, steps)
        result[f"{key}_engine_config"] = json.loads(conf.to_json())
        if graphs:
            assert engine.runner.graphs is not None
            graph, _ = engine.runner.graphs.graphs[1]
            result["graph_replay_ms"] = _bench(graph.replay)
        del engine
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--attn-tunables", default="[{}]",
                    help="JSON list of keyword sets for paged_attention_triton to time")
    ap.add_argument("--step-model", default="dummy:llama-3-8b")
    ap.add_argument("--step-context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: attention,step")
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    import triton

    # A copy without .git (e.g. a git-archive snapshot on a GPU machine) names its commit in
    # LLMWORKER_COMMIT (see git_commit).
    commit = (git_commit() or "")[:12]
    info = {"device": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__, "host": platform.node(),
            "commit": commit, "date": time.strftime("%Y-%m-%d"), "args": recorded(vars(args)),
            "command": command(sys.argv)}
    print(f"# {info['device']}, torch {info['torch']}, triton {info['triton']}, commit {info['commit']}")
    report: dict[str, Any] = {"info": info}
    copy = report["copy"] = copy_bandwidth()
    bw = copy["gb_per_s"]
    print(f"copy bandwidth: {bw:.0f} GB/s (read + write)", flush=True)
    if "attention" not in skip:
        rows = report["attention"] = attention_decode(args.batch, args.context, json.loads(args.attn_tunables))
        for r in rows:
            print(f"attention decode B={args.batch} ctx={args.context} {r['tunables']}: {r['ms']:.3f} ms, "
                  f"{r['gb_per_s']:.0f} GB/s = {r['gb_per_s'] / bw:.1%} of copy; rel err {r['rel_err_vs_fp32_ref']:.1e}",
                  flush=True)
    if "step" not in skip:
        st = report["step"] = decode_step(args.step_model, args.step_context, args.steps)
        roof_ms = st["weight_bytes"] / bw / 1e6
        st["roofline_ms"] = roof_ms
        print(f"decode step {args.step_model} bf16 batch 1: roofline {roof_ms:.2f} ms "
              f"({st['weight_bytes'] / 1e9:.2f} GB / {bw:.0f} GB/s); "
              f"graphs {st['graphs_step_ms']:.2f} ms ({st['graphs_step_ms'] / roof_ms:.2f}x), "
              f"replay alone {st['graph_replay_ms']:.2f} ms ({st['graph_replay_ms'] / roof_ms:.2f}x), "
              f"eager {st['eager_step_ms']:.2f} ms ({st['eager_step_ms'] / roof_ms:.2f}x); "
              f"graphs speed-up {st['eager_step_ms'] / st['graphs_step_ms']:.2f}x", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
