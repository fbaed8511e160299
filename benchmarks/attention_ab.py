"""The CPU decode attention kernel alone, its tile path against its key-by-key path, in one
process (ops/cpu_kernels/paged_attention.c):

    python -m benchmarks.attention_ab --heads 32 --kv-heads 8 --head-dim 128 --context 1000,4000 \\
        --output-json bench-results/attention-ab-d128.json

The kernel's source is built twice, as is and with `-DATTN_PER_KEY` (the key-by-key
arithmetic, which every head size took before the tiles reached it, and which head sizes
that are not a multiple of 64 still take), and `paged_decode_attention` (the op-by-op
model's entry; the fused decoder runs the same functions) is called on the same random
float32 cache, the two builds alternating `--calls` calls at a time for `--rounds` rounds.
The outputs must be equal bit for bit. Default shapes: Llama 3 8B's (32 query heads, 8 kv
heads, head_dim 128), one request.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from clients.bench.environment import environment
from ops import cpu_kernels

KERNELS = Path(cpu_kernels.__file__).parent
BLOCK = 16


def _build(folder: Path, name: str, flags: list[str]) -> ctypes.CDLL:
    so = folder / f"{name}.so"
    if not cpu_kernels.build(KERNELS / "paged_attention.c", so, flags):
        raise SystemExit("cannot build paged_attention.c here (no gcc, or no AVX2)")
    lib = ctypes.CDLL(str(so))
    p, i32 = ctypes.c_void_p, ctypes.c_int
    lib.paged_decode_attention.argtypes = [p, p, p, i32, i32, i32, i32, p, p, i32, p, i32, ctypes.c_float, p, i32,
                                           ctypes.c_int64]
    lib.paged_decode_attention.restype = i32
    return lib


def _measure(libs: dict[str, ctypes.CDLL], hq: int, hkv: int, d: int, context: int, batch: int,
             rounds: int, calls: int, threads: int) -> dict:
    rng = np.random.default_rng(context)
    blocks = -(-context // BLOCK)
    k = rng.standard_normal((batch * blocks, BLOCK, hkv, d), dtype=np.float32)
    v = rng.standard_normal((batch * blocks, BLOCK, hkv, d), dtype=np.float32)
    tables = rng.permutation(batch * blocks).reshape(batch, blocks).astype(np.int64)
    q = rng.standard_normal((batch, hq * d), dtype=np.float32)
    rows = np.arange(batch, dtype=np.int64)
    lens = np.full(batch, context, dtype=np.int64)
    outs = {name: np.zeros_like(q) for name in libs}

    def call(name: str) -> float:
        t0 = time.perf_counter()
        rc = libs[name].paged_decode_attention(q.ctypes.data, k.ctypes.data, v.ctypes.data, BLOCK, hkv, hq, d,
                                              rows.ctypes.data, tables.ctypes.data, blocks, lens.ctypes.data,
                                              batch, 1.0 / d**0.5, outs[name].ctypes.data, threads, 0)
        if rc:
            raise SystemExit(f"the kernel refused the arguments ({rc})")
        return (time.perf_counter() - t0) * 1e3

    times: dict[str, list[float]] = {name: [] for name in libs}
    for r in range(rounds + 1):  # the first round warms up
        for name in libs:
            for _ in range(calls):
                t = call(name)
                if r:
                    times[name].append(t)
    first = next(iter(outs.values()))
    same = all(np.array_equal(first.view(np.uint32), o.view(np.uint32)) for o in outs.values())
    if not same:
        raise SystemExit(f"the builds' outputs differ at context {context}")
    res = {name: {"median_ms": round(statistics.median(t), 4), "p10_ms": round(float(np.percentile(t, 10)), 4)}
           for name, t in times.items()}
    names = list(libs)
    res["speedup"] = round(res[names[1]]["median_ms"] / res[names[0]]["median_ms"], 3)
    res["cache_mb"] = round((k.nbytes + v.nbytes) / 1e6, 1)
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--context", default="1000,4000", help="keys per request (comma-separated)")
    ap.add_argument("--batch", type=int, default=1, help="requests (decode rows)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    report: dict = {"info": environment(), "shapes": {"heads": args.heads, "kv_heads": args.kv_heads,
                                                      "head_dim": args.head_dim, "batch": args.batch,
                                                      "threads": args.threads}, "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"tiles": _build(Path(tmp), "tiles", []),
                "key by key": _build(Path(tmp), "per_key", ["-DATTN_PER_KEY"])}
        print("| keys | KV cache MB | tiles ms: median (p10) | key by key ms | key by key / tiles |\n"
              "|---|---|---|---|---|")
        for n in (int(x) for x in args.context.split(",")):
            r = _measure(libs, args.heads, args.kv_heads, args.head_dim, n, args.batch, args.rounds, args.calls,
                         args.threads)
            report["results"][str(n)] = r
            print(f"| {n} | {r['cache_mb']} | {r['tiles']['median_ms']:.3f} ({r['tiles']['p10_ms']:.3f}) | "
                  f"{r['key by key']['median_ms']:.3f} ({r['key by key']['p10_ms']:.3f}) | **{r['speedup']:.2f}x** |")
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
