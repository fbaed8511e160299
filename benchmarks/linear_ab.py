"""One quantized linear's kernel, A/B across checkouts whose tile records may differ (issue 21):

    python -m benchmarks.linear_ab --against ../wt-before --weight token_embd.weight --rows 1 \\
        --rounds 300 --output-json bench-results/linear-ab.json

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

from benchmarks.native_ab import timing_ms
from clients.bench.environment import environment
from ops import cpu_kernels
from ops.quantized_linear import ACTIVATIONS, QuantizedWeight, resolve_activations
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


def _their_quantized_linear(checkout: Path, tag: str) -> ModuleType:
    """`checkout`'s ops/quantized_linear.py as a module of its own (it imports this
    checkout's `ops.cpu_kernels`, whose API it only uses to find and build libraries)."""
    spec = importlib.util.spec_from_file_location(f"_linear_ab_{tag}", checkout / "ops" / "quantized_linear.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


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
    p.add_argument("--rows", type=int, default=1, help="rows of x (a decode step's batch)")
    p.add_argument("--activations", default="auto", help=f"auto or one of {', '.join(ACTIVATIONS)}")
    p.add_argument("--threads", type=int, default=0, help="0: torch's")
    p.add_argument("--rounds", type=int, default=300, help="calls a side")
    p.add_argument("--isa", default=None, help="build every side for this ISA (one the CPU has)")
    p.add_argument("--output-json", default=None)
    a = p.parse_args(argv)
    if cpu_kernels.isa() is None:
        raise SystemExit("no C kernels here (no gcc, or no AVX2)")
    with cpu_kernels.forced_isa(a.isa):
        activations = resolve_activations(a.activations)
        planes = ACTIVATIONS[activations]
        threads = a.threads or torch.get_num_threads()
        weight = gguf_weight(a.weight)
        with tempfile.TemporaryDirectory() as tmp:
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
    out = {"weight": a.weight, "qtype": weight.qtype, "shape": list(weight.shape), "rows": a.rows,
           "activations": activations, "threads": threads, "rounds": a.rounds,
           "isa": a.isa or cpu_kernels.isa(), "sides": {}}
    print(f"{a.weight} ({weight.qtype} {weight.shape[0]}x{weight.shape[1]}), {a.rows} row(s), {activations} "
          f"activations, {threads} threads, {a.rounds} calls a side")
    print("| side | record bytes | ms: median (p10, fastest) | GB/s at the median | output as the first side's |")
    print("|---|---|---|---|---|")
    first = ys[order[0]]
    for name, t in times.items():
        packed = sides[name].packed.numel()
        row = {**timing_ms(t), "packed_bytes": packed, "same_output": bool(torch.equal(ys[name], first))}
        out["sides"][name] = row
        print(f"| {name} | {packed:,} | {row['median_ms']:.3f} ({row['p10_ms']:.3f}, {row['min_ms']:.3f}) | "
              f"{packed / row['median_ms'] / 1e6:.1f} | {'yes' if row['same_output'] else 'no'} |")
    if a.output_json:
        out["environment"] = environment()
        Path(a.output_json).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.output_json}")


if __name__ == "__main__":
    main()
