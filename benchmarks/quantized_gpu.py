"""GPU figures of pre-quantized weights and the FP8 KV cache (issue 53), in one run:

    python -m benchmarks.quantized_gpu --output-json bench-results/quantized-gpu.json

The model is `dummy:llama-3-8b` in bfloat16, its linears (not the head) quantized here by
round-to-nearest into the loader's layouts (`quantize_model`: what a checkpoint of that
scheme loads into, ops/scaled_linear.py), so no checkpoint is needed:

1. copy: the device's copy bandwidth (benchmarks/gpu.py), the roofline's ceiling.
2. step: a decode step at batch 1 (engine.step with CUDA graphs) per scheme (bf16,
   fp8-block, w4a16 by default) against its roofline: the bytes a step reads (the
   quantized linears as held, the rest in bf16, one embedding row) over the copy bandwidth.
   Targets: <= 1.2x the roofline; FP8 >= 1.5x bf16's speed at batch 1.
3. throughput: 64 requests of 128 prompt + 128 output tokens per scheme, output tokens/s.
4. kv: a decode step at --kv-context (8k) tokens of context, batch --kv-batch, bf16 weights,
   --kv-cache-dtype auto against fp8.
5. prefill tiles: scaled_linear_triton at 512 rows of Llama-3-8B's gate/up with 16-row
   tiles (the default: batch invariance) against 64-row ones: what invariance costs prefill.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any

import torch
from torch import nn

from benchmarks.gpu import _bench, copy_bandwidth, median_step_ms
from clients.bench.environment import command, git_commit, recorded
from ops.scaled_linear import FP8_MAX, ScaledLinear, ScaledWeight, pack_int4

SCHEMES = ("bf16", "fp8-block", "fp8-channel", "w4a16", "w8a8")


@torch.no_grad()
def quantize_weight(w: torch.Tensor, scheme: str) -> ScaledWeight:
    """Round-to-nearest of a [N, K] weight into `scheme`'s ScaledWeight (scales from amax)."""
    n, k = w.shape
    w = w.float()
    if scheme == "fp8-block":
        blocks = w.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))
        scale = blocks.abs().amax((1, 3)).clamp_min(1e-12) / FP8_MAX
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).flatten(2, 3).flatten(0, 1)
        return ScaledWeight("fp8", q, scale, (n, k), block=(128, 128), act="group")
    if scheme in ("fp8-channel", "w8a8"):
        top = FP8_MAX if scheme == "fp8-channel" else 127.0
        scale = w.abs().amax(1).clamp_min(1e-12) / top
        y = w / scale[:, None]
        q = y.to(torch.float8_e4m3fn) if scheme == "fp8-channel" else y.round().clamp(-127, 127).to(torch.int8)
        return ScaledWeight("fp8" if scheme == "fp8-channel" else "int8", q, scale, (n, k), act="token")
    assert scheme == "w4a16", scheme
    g = w.unflatten(1, (-1, 128))
    scale = g.abs().amax(-1).clamp_min(1e-12) / 7.0
    u = (g / scale[..., None]).round().clamp(-8, 7).add(8).flatten(1).to(torch.uint8)
    return ScaledWeight("int4", pack_int4(u), scale, (n, k), group_size=128)


def quantize_model(model: nn.Module, scheme: str) -> int:
    """Every linear of the decoder layers (not the head) replaced, in place, by a ScaledLinear
    of `scheme`; returns how many."""
    count = 0
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, ScaledLinear(quantize_weight(child.weight, scheme), child.bias))
                    count += 1
    torch.cuda.empty_cache()
    return count


def step_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads: every weight once, the untied embedding table one row."""
    total = sum(m.weight.nbytes for m in model.modules() if isinstance(m, ScaledLinear))
    total += sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        emb = model.embed_tokens.weight
        total -= (emb.shape[0] - 1) * emb.shape[1] * emb.element_size()
    return total


def _engine(loaded, kv: str = "auto", seqs: int = 64, max_len: int = 4096, kv_gib: float = 8.0):
    from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
    from worker.engine import Engine

    conf = WorkerConfig(model=ModelConfig(max_model_len=max_len), cache=CacheConfig(kv_cache_memory=kv_gib,
                                                                                     kv_cache_dtype=kv),
                        scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=2048))
    return Engine(conf, loaded=loaded), conf


def decode_step(loaded, context: int, steps: int, batch: int = 1, kv: str = "auto") -> float:
    from scheduler.request import SamplingParams

    engine, _ = _engine(loaded, kv, seqs=max(8, batch), max_len=context + steps + 64)
    params = SamplingParams(temperature=0, max_tokens=steps + 10, ignore_eos=True)
    for b in range(batch):
        engine.submit(engine.make_request([(13 * j + b) % 100000 + 100 for j in range(context)], params))
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # the prefills
    ms = median_step_ms(engine, steps)
    del engine
    torch.cuda.empty_cache()
    return ms


def throughput(loaded, requests: int, prompt: int, output: int) -> float:
    from scheduler.request import SamplingParams

    engine, _ = _engine(loaded, seqs=requests, max_len=prompt + output + 16)
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    reqs = [engine.make_request([(7 * j + i) % 100000 + 100 for j in range(prompt)], params) for i in range(requests)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    done = engine.generate(reqs)
    secs = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for c in done)
    del engine
    torch.cuda.empty_cache()
    return tokens / secs


def prefill_tiles(rows: int = 512) -> list[dict[str, Any]]:
    from ops.scaled_linear_triton import scaled_linear_triton

    w0 = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    out = []
    for scheme in ("fp8-block", "w4a16"):
        w = quantize_weight(w0, scheme)
        for bm in (16, 64):
            ms = _bench(lambda w=w, bm=bm: scaled_linear_triton(x, w, block_m=bm))
            out.append({"scheme": scheme, "rows": rows, "block_m": bm, "ms": ms,
                        "tflops": 2 * rows * 28672 * 4096 / ms / 1e9})
    bf16 = _bench(lambda: x @ w0.t())
    out.append({"scheme": "bf16 (torch matmul)", "rows": rows, "ms": bf16, "tflops": 2 * rows * 28672 * 4096 / bf16 / 1e9})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-3-8b")
    ap.add_argument("--schemes", default="bf16,fp8-block,w4a16", help=f"comma list of {', '.join(SCHEMES)}")
    ap.add_argument("--context", type=int, default=128, help="the batch-1 step's context")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-context", type=int, default=8192)
    ap.add_argument("--kv-batch", type=int, default=8)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: step,throughput,kv,tiles")
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    import triton

    from worker.weights import load_model

    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "host": platform.node(), "commit": (git_commit() or "")[:12], "date": time.strftime("%Y-%m-%d"),
            "args": recorded(vars(args)), "command": command(sys.argv)}
    print(f"# {info['device']}, torch {info['torch']}, triton {info['triton']}, commit {info['commit']}")
    report: dict[str, Any] = {"info": info, "copy": copy_bandwidth(), "schemes": {}}
    bw = report["copy"]["gb_per_s"]
    print(f"copy bandwidth: {bw:.0f} GB/s", flush=True)
    for scheme in args.schemes.split(","):
        assert scheme in SCHEMES, scheme
        loaded = load_model(args.model, "cuda", torch.bfloat16)
        if scheme != "bf16":
            quantize_model(loaded.model, scheme)
        row: dict[str, Any] = {"step_bytes": step_bytes(loaded.model)}
        row["roofline_ms"] = row["step_bytes"] / bw / 1e6
        if "step" not in skip:
            row["step_ms"] = decode_step(loaded, args.context, args.steps)
            print(f"{scheme}: batch-1 step {row['step_ms']:.2f} ms, roofline {row['roofline_ms']:.2f} ms "
                  f"({row['step_ms'] / row['roofline_ms']:.2f}x; {row['step_bytes'] / 1e9:.2f} GB)", flush=True)
        if "throughput" not in skip:
            row["output_tokens_per_s"] = throughput(loaded, args.requests, args.prompt_len, args.output_len)
            print(f"{scheme}: {args.requests} requests, {row['output_tokens_per_s']:.0f} output tok/s", flush=True)
        report["schemes"][scheme] = row
        del loaded
        torch.cuda.empty_cache()
    base = report["schemes"].get("bf16")
    for scheme, row in report["schemes"].items():
        if base and scheme != "bf16" and "step_ms" in row and "step_ms" in base:
            row["speedup_vs_bf16_batch1"] = base["step_ms"] / row["step_ms"]
            print(f"{scheme}: batch-1 speed-up over bf16 {row['speedup_vs_bf16_batch1']:.2f}x")
    if "kv" not in skip:
        loaded = load_model(args.model, "cuda", torch.bfloat16)
        report["kv"] = {dt: decode_step(loaded, args.kv_context, args.steps, args.kv_batch, kv=dt)
                        for dt in ("auto", "fp8")}
        print(f"KV at {args.kv_context} context, batch {args.kv_batch}: bf16 {report['kv']['auto']:.2f} ms, "
              f"fp8 {report['kv']['fp8']:.2f} ms a step", flush=True)
        del loaded
    if "tiles" not in skip:
        report["tiles"] = prefill_tiles()
        for r in report["tiles"]:
            print(f"prefill {r['rows']} rows, {r['scheme']}, block_m {r.get('block_m', '-')}: {r['ms']:.3f} ms "
                  f"({r['tflops']:.0f} TFLOP/s)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
