"""One quantized linear's kernel, A/B across checkouts whose tile records may differ (issue 21),
or across GGUF types of one shape (issue 49):

    python -m benchmarks.linear_ab --against ../wt-before --weight token_embd.weight --rows 1 \\
        --rounds 300 --output-json bench-results/linear-ab.json
    python -m benchmarks.linear_ab --types Q4_1,Q8_0,Q4_K,Q6_K --shape 2048x8192 --rows 64

`benchmarks.native_ab` times the whole decode call, but it hands every side this checkout's
packed weights, so it cannot compare a change of the records' layout. Here each side repacks a
weight of the default GGUF with its own checkout's `ops/quantized_linear.py` and multiplies it
with its own build of `ops/cpu_kernels/quant_matmul_int8.c` (`quant_matmul.c` for float32
activations), built with this machine's flags, alternating call by call in one process. A
64 MB buffer is written before each call, so every call reads its weight from memory, as a
decode step does. The sides' outputs must be equal bit for bit where their arithmetic is the
same (the table says).

The default weight is the tied LM head (`token_embd.weight`, Q8_0, 30 MB: a third of what a
batch-1 step reads); `--weight blk.0.ffn_up.weight` takes a layer's (Q4_1).

With `--types`, every side is this checkout's kernel on a weight of random blocks of one type
(any bit pattern with finite scales is a valid block), all of `--shape` (out x in), against
the same x: a type's GB/s of records read at one row (a decode step's case, bound by memory:
compare with the plain read the table's header gives) and its time per weight at many rows
(bound by arithmetic). Outputs differ between types (their weights do).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from benchmarks.native_ab import read_gbps, timing_ms
from clients.bench.environment import environment
from ops import cpu_kernels
from ops.quantized_linear import ACTIVATIONS, QuantizedWeight, activations_for, resolve_activations
from worker.weights import default_model_path

ROOT = Path(__file__).resolve().parents[1]


def gguf_weight(name: str) -> QuantizedWeight:
    """The default GGUF's tensor `name` as the file stores it (no row permutation: a
    kernel's speed does not depend on the rows' order)."""
    from gguf import GGUFReader

    for t in GGUFReader(default_model_path()).tensors:
        if t.name == name:
            blocks = np.asarray(t.data)
            return QuantizedWeight(t.tensor_type.name, blocks, (blocks.shape[0], int(t.shape[0])))
    raise SystemExit(f"the default GGUF has no tensor {name!r}")


def _module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _their_quantized_linear(checkout: Path, tag: str) -> ModuleType:
    """`checkout`'s ops/quantized_linear.py as a module of its own (it imports this
    checkout's `ops.cpu_kernels`, whose API it only uses to find and build libraries), with its
    own ops/quant_records.py where it has one (its records' layouts)."""
    records = checkout / "ops" / "quant_records.py"
    if not records.exists():
        return _module(checkout / "ops" / "quantized_linear.py", f"_linear_ab_{tag}")
    ours = sys.modules.get("ops.quant_records")
    sys.modules["ops.quant_records"] = _module(records, f"_linear_ab_records_{tag}")
    try:
        return _module(checkout / "ops" / "quantized_linear.py", f"_linear_ab_{tag}")
    finally:
        if ours is None:
            del sys.modules["ops.quant_records"]
        else:
            sys.modules["ops.quant_records"] = ours


# Bytes (from a block's start) of each type's fp16 scales and of its fp16 mins.
FP16_SCALES = {"Q4_0": [0], "Q4_1": [0], "Q5_0": [0], "Q5_1": [0], "Q8_0": [0], "IQ4_NL": [0], "Q4_K": [0],
               "Q5_K": [0], "Q6_K": [208], "IQ4_XS": [0]}
FP16_MINS = {"Q4_1": 2, "Q5_1": 2, "Q4_K": 2, "Q5_K": 2}


def random_weight(qtype: str, n: int, k: int, seed: int, scale: float = 1.0) -> QuantizedWeight:
    """A weight of random GGUF blocks: random bytes, their fp16 scales and mins replaced by
    random finite values of either sign (d about 0.05 `scale` per step of a 32-block's quants;
    F16 and BF16: random normal values of 0.05 `scale`)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(seed)
    if qtype in ("F16", "BF16"):
        w = (rng.standard_normal((n, k)) * 0.05 * scale).astype(np.float32)
        if qtype == "F16":
            return QuantizedWeight(qtype, w.astype(np.float16).view(np.uint8), (n, k))
        return QuantizedWeight(qtype, (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8), (n, k))
    size, block = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, (n, k // size, block), dtype=np.uint8)

    def fp16(lo: int, magnitude: float) -> None:
        v = rng.uniform(0.1, 1.0, raw.shape[:2]) * magnitude * scale * rng.choice([-1, 1], raw.shape[:2])
        raw[..., lo : lo + 2] = v.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)

    for lo in FP16_SCALES[qtype]:
        fp16(lo, 0.05 * 32 / size)  # a 256-block's d multiplies 6-bit sub-scales
    if qtype in FP16_MINS:
        fp16(FP16_MINS[qtype], 0.4 if size == 32 else 0.01)
    return QuantizedWeight(qtype, raw.reshape(n, -1), (n, k))


class Side:
    """One checkout's records of the weight and its kernel, called through ctypes."""

    def __init__(self, checkout: Path, tag: str, weight: QuantizedWeight, planes: int, build_dir: Path) -> None:
        ql = _their_quantized_linear(checkout, tag)
        self.packed = ql.repack_int8(weight) if planes else ql.repack(weight)
        source = checkout / "ops" / "cpu_kernels" / ("quant_matmul_int8.c" if planes else "quant_matmul.c")
        so = build_dir / f"{tag}.so"
        if not cpu_kernels.build(source, so):
            raise SystemExit(f"cannot build {source}")
        lib = ctypes.CDLL(str(so))
        self.fn = getattr(lib, f"{weight.qtype.lower()}{'_i8' if planes else ''}_matmul")
        self.planes = planes
        self.activations = next(name for name, p in ACTIVATIONS.items() if p == planes)
        self.N, self.K = weight.shape

    def __call__(self, x: torch.Tensor, y: torch.Tensor, threads: int) -> None:
        args = [ctypes.c_void_p(x.data_ptr()), x.shape[0], self.K, ctypes.c_void_p(self.packed.data_ptr()),
                self.N, ctypes.c_void_p(y.data_ptr()), threads]
        if self.planes:
            args.append(self.planes)
        if self.fn(*args):
            raise RuntimeError("the kernel refused its arguments")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", action="append", default=[], help="another checkout (repeatable)")
    p.add_argument("--weight", default="token_embd.weight", help="a tensor of the default GGUF")
    p.add_argument("--types", default=None,
                   help="comma-separated GGUF types: one side each, this checkout's kernel on random blocks")
    p.add_argument("--shape", default="2048x8192", help="with --types: out x in features")
    p.add_argument("--rows", type=int, default=1, help="rows of x (a decode step's batch)")
    p.add_argument("--activations", default="auto", help=f"auto or one of {', '.join(ACTIVATIONS)}")
    p.add_argument("--threads", type=int, default=0, help="0: torch's")
    p.add_argument("--rounds", type=int, default=300, help="calls a side")
    p.add_argument("--isa", default=None, help="build every side for this ISA (one the CPU has)")
    p.add_argument("--output-json", default=None)
    a = p.parse_args(argv)
    if cpu_kernels.isa() is None:
        raise SystemExit("no C kernels here (no gcc, or no AVX2)")
    if a.types and a.against:
        raise SystemExit("--types compares this checkout's kernels: no --against with it")
    with cpu_kernels.forced_isa(a.isa):
        activations = resolve_activations(a.activations)
        planes = ACTIVATIONS[activations]
        threads = a.threads or torch.get_num_threads()
        with tempfile.TemporaryDirectory() as tmp:
            if a.types:
                n, k = (int(v) for v in a.shape.lower().split("x"))
                sides = {}
                for i, qtype in enumerate(a.types.split(",")):
                    w = random_weight(qtype, n, k, seed=i)
                    side_planes = ACTIVATIONS[activations_for(w, activations)]
                    sides[qtype] = Side(ROOT, f"type{i}", w, side_planes, Path(tmp))
                weight = w
            else:
                weight = gguf_weight(a.weight)
                sides = {"this": Side(ROOT, "this", weight, planes, Path(tmp))}
                for i, other in enumerate(a.against):
                    path = Path(other).resolve()
                    sides[path.name] = Side(path, f"other{i}", weight, planes, Path(tmp))
            torch.manual_seed(0)
            x = torch.randn(a.rows, weight.shape[1])
            ys = {name: torch.empty(a.rows, weight.shape[0]) for name in sides}
            scrub = torch.ones(64 * 2**20 // 4)
            times: dict[str, list[float]] = {name: [] for name in sides}
            order = list(sides)
            for r in range(a.rounds + 10):  # the first 10 are warm-up
                for name in order if r % 2 else order[::-1]:
                    scrub.add_(1.0)
                    t0 = time.perf_counter()
                    sides[name](x, ys[name], threads)
                    if r >= 10:
                        times[name].append((time.perf_counter() - t0) * 1e3)
    reads = read_gbps()
    out = {"weight": f"random {a.types}" if a.types else a.weight, "qtype": weight.qtype, "shape": list(weight.shape),
           "rows": a.rows, "activations": activations, "threads": threads, "rounds": a.rounds,
           "isa": a.isa or cpu_kernels.isa(), "read_gbps": reads, "sides": {}}
    what = f"random blocks of {a.types}" if a.types else f"{a.weight} ({weight.qtype})"
    print(f"{what}, {weight.shape[0]}x{weight.shape[1]}, {a.rows} row(s), {activations} activations, {threads} "
          f"threads, {a.rounds} calls a side; a plain read of 100 MB: {reads['4k']:.1f} GB/s")
    print("| side | activations | record bytes | ms: median (p10, fastest) | GB/s at the median | "
          "ps per weight and row | output as the first side's |")
    print("|---|---|---|---|---|---|---|")
    first = ys[order[0]]
    for name, t in times.items():
        side = sides[name]
        packed = side.packed.numel()
        row = {**timing_ms(t), "packed_bytes": packed, "activations": side.activations,
               "same_output": bool(torch.equal(ys[name], first))}
        out["sides"][name] = row
        per_weight = row["median_ms"] * 1e9 / (side.N * side.K * a.rows)
        print(f"| {name} | {side.activations} | {packed:,} | {row['median_ms']:.3f} ({row['p10_ms']:.3f}, "
              f"{row['min_ms']:.3f}) | {packed / row['median_ms'] / 1e6:.1f} | {per_weight:.2f} | "
              f"{'yes' if row['same_output'] else 'no'} |")
    if a.output_json:
        out["environment"] = environment()
        Path(a.output_json).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.output_json}")


if __name__ == "__main__":
    main()
