"""One linear call of a pre-quantized checkpoint's int8 / int4 weight on the CPU kernels'
records (Q8_CH: W8A8 / W8A16 per channel; Q4_G128: AWQ / GPTQ with zero points) against
the same weight dequantized to float32 at load (torch's F.linear: what the CPU ran before),
and the GGUF kernels of as many bits a weight (Q8_0; Q4_0, and Q4_1 whose d q + m is Q4_G128's: random blocks) for scale, at
decode-shaped rows, sides alternating within each round; medians in ms and each side's
ratio to float32 (above 1: faster), as JSON.

    python -m benchmarks.checkpoint_linear --shape 4096,4096 --rows 1,8 --rounds 15 \
        --out bench-results/issue53-checkpoint-linear.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.gguf_blocks import random_weight
from clients.bench.environment import environment
from ops import quantized_linear as ql
from ops.scaled_linear import ScaledWeight, dequantize, pack_int4
from worker.weights.hf_quantized import checkpoint_records


def _weights(n: int, k: int) -> dict[str, ScaledWeight]:
    g = torch.Generator().manual_seed(0)
    int8 = ScaledWeight("int8", torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g),
                        torch.rand(n, generator=g) * 0.01, (n, k))
    int4 = ScaledWeight("int4", pack_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)),
                        (torch.rand(n, k // 128, generator=g) * 0.02).half().float(), (n, k),
                        zero=torch.randint(0, 16, (n, k // 128), dtype=torch.uint8, generator=g), group_size=128)
    return {"int8": int8, "int4": int4}


def _time(fn, x: torch.Tensor, calls: int) -> float:
    fn(x)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - t0) / calls * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4096,4096", help="N,K of the linear")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=5, help="calls per measurement")
    ap.add_argument("--activations", default="float32,int16")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    n, k = (int(v) for v in args.shape.split(","))
    sides = {}
    for kind, w in _weights(n, k).items():
        dense = dequantize(w)
        sides[f"{kind} dequantized float32"] = (lambda x, d=dense: F.linear(x, d), dense.nbytes)
        qw = checkpoint_records(w)
        for act in args.activations.split(","):
            layer = ql.QuantLinear(qw, activations=act)
            sides[f"{kind} {qw.qtype} {act}"] = (layer, layer.packed.nbytes)
            # GGUF types of as many bits a weight (fp16 scales), for scale.
            for qtype in ("Q8_0",) if kind == "int8" else ("Q4_0", "Q4_1"):
                gw = random_weight(qtype, n, k, seed=1)
                if qtype == "Q8_0":  # no quant of -128 (the Q8_0 integer kernels refuse them)
                    b = gw.blocks.reshape(n, k // 32, 34).copy()
                    b[..., 2:][b[..., 2:] == 0x80] = 0x81
                    gw = ql.QuantizedWeight("Q8_0", b.reshape(n, -1), (n, k))
                gguf = ql.QuantLinear(gw, activations=act)
                sides[f"{kind} gguf-{qtype} {act}"] = (gguf, gguf.packed.nbytes)
    results = {}
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, k)
        samples: dict[str, list[float]] = {name: [] for name in sides}
        order = list(sides)
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                samples[name].append(_time(sides[name][0], x, args.calls))
        med = {name: statistics.median(v) for name, v in samples.items()}
        results[str(rows)] = {
            name: {"median_ms": round(med[name], 4), "p10_ms": round(sorted(v)[len(v) // 10], 4),
                   "p90_ms": round(sorted(v)[len(v) * 9 // 10], 4), "weight_bytes": sides[name][1],
                   "speedup_vs_float32": round(med[f"{name.split()[0]} dequantized float32"] / med[name], 3)}
            for name, v in samples.items()}
    record = {"benchmark": "checkpoint_linear", "shape": [n, k], "rounds": args.rounds, "calls": args.calls,
              "threads": torch.get_num_threads(), "isa": ql.cpu_kernels.isa(), "results": results,
              "note": "shared machine (other sessions running): compare sides within this run only",
              **environment(argv)}
    text = json.dumps(record, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
