"""Memory while a GGUF model loads and its runner is built, against the bound issue 49 sets:

    peak and resident <= 1.1 x the GGUF's tensor bytes + the KV cache + the runtime's fixed cost

    python -m benchmarks.load_memory --billion --output-json bench-results/load-memory.json

Each figure is a fresh process (`MEASURE`) that imports what serve imports, builds the
engine (load + runner + KV cache) and reports its peak (VmHWM, = ru_maxrss) and resident
(VmRSS) memory after. The runtime's fixed cost (python, torch, grpc, our imports, the
compiled kernels, the tokenizer of 49,152 tokens) is what a tiny model (hidden 64, one
layer) with the default model's tokenizer peaks at beyond its tensors and KV cache.
tests/test_load_memory.py asserts the bound with the same functions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_MiB = 1 << 20

MEASURE = r"""
import json, resource, sys, time
def status():
    s = open("/proc/self/status").read()
    return {k: int(s.split(k + ":")[1].split()[0]) << 10 for k in ("VmHWM", "VmRSS")}
spec, kv_gib = sys.argv[1], float(sys.argv[2])
t0 = time.perf_counter()
import worker.server  # what serve imports
from worker.config import CacheConfig, ModelConfig, WorkerConfig
from worker.engine import Engine
from worker.weights import default_model_path
from worker.weights.gguf_reader import GGUFFile
imported = status()
t1 = time.perf_counter()
engine = Engine(WorkerConfig(model=ModelConfig(model=spec, max_model_len=256),
                             cache=CacheConfig(kv_cache_memory=kv_gib)))
after = status()
t2 = time.perf_counter()
runner = engine.runner
kv = sum(t.nbytes for pair in runner.kv_caches for t in pair)  # (the swap space is never touched here)
path = str(default_model_path()) if spec == "default" else spec
tensors = sum(t.n_bytes for t in GGUFFile(path).tensors)
print(json.dumps({"peak": after["VmHWM"], "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10,
                  "resident": after["VmRSS"], "resident_after_imports": imported["VmRSS"],
                  "kv": kv, "tensors": tensors, "import_s": round(t1 - t0, 2), "load_s": round(t2 - t1, 2),
                  "weights": engine.loaded.describe_weights(), "kernels": runner.describe_kernels()}))
"""


def _start(spec: str, kv_gib: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protos"),
                                                        os.environ.get("PYTHONPATH", "")])}
    # Output to files, not pipes: a process run beside others never waits on a full pipe.
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-c", MEASURE, spec, str(kv_gib)], stdout=out, stderr=err,
                            env=env, cwd=ROOT)
    proc.files = (out, err)  # type: ignore[attr-defined]  (Popen keeps only pipes)
    return proc


def _result(spec: str, proc: subprocess.Popen) -> dict:
    try:
        proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    out, err = (_read(f) for f in proc.files)  # type: ignore[attr-defined]
    if proc.returncode:
        raise RuntimeError(f"measuring {spec} failed ({proc.returncode}): {err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _read(f) -> str:
    f.seek(0)
    text = f.read().decode(errors="replace")
    f.close()
    return text


def measure(spec: str, kv_gib: float) -> dict:
    """One fresh process's figures for the model `spec` ("default" or a GGUF path)."""
    return _result(spec, _start(spec, kv_gib))


def tiny_model(tmp: Path) -> Path:
    from tests.gguf_tiny import write_tiny_llama

    return write_tiny_llama(tmp / "tiny.gguf", vocab="default")


def with_fixed(m: dict) -> dict:
    """The tiny model's figures, `fixed` its peak beyond its tensors and KV cache."""
    return {**m, "fixed": m["peak"] - m["tensors"] - m["kv"]}


def fixed_cost(tmp: Path) -> dict:
    return with_fixed(measure(str(tiny_model(tmp)), 0.01))


def measure_at_once(tmp: Path, specs: list[str], kv_gib: float) -> tuple[dict, dict[str, dict]]:
    """The tiny model's figures (`with_fixed`) and each spec's, all processes at once (each
    its own peak; their times are not each alone's)."""
    procs = {spec: _start(spec, kv_gib) for spec in specs}
    tiny = _start(str(tiny_model(tmp)), 0.01)
    return with_fixed(_result("the tiny model", tiny)), {spec: _result(spec, p) for spec, p in procs.items()}


def bound(m: dict, fixed: int) -> int:
    return int(1.1 * m["tensors"] + m["kv"] + fixed)


def describe(m: dict, fixed: int) -> str:
    return (f"peak {m['peak'] / _MiB:.0f} MiB, resident {m['resident'] / _MiB:.0f} MiB, bound "
            f"{bound(m, fixed) / _MiB:.0f} MiB (tensors {m['tensors'] / _MiB:.1f} MiB, KV {m['kv'] / _MiB:.0f} MiB, "
            f"fixed {fixed / _MiB:.0f} MiB); {m['weights']}")


def main(argv: list[str] | None = None) -> int:
    from benchmarks import make_gguf_models as made
    from clients.bench.environment import environment

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--billion", action="store_true",
                    help="also the 1B-class Q4_K_M (python -m benchmarks.make_gguf_models --billion)")
    ap.add_argument("--model", action="append", default=[], help="another GGUF to measure (repeatable)")
    ap.add_argument("--kv-cache-memory", type=float, default=0.02, help="GiB of KV cache per model")
    ap.add_argument("--note", default="", help="kept in the JSON (say if the machine was shared)")
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    models = ["default", *args.model]
    if args.billion:
        path = made.cache_dir() / f"billion-Q4_K_M-{made.RECIPE}.gguf"
        if not path.is_file():
            print(f"{path} not made (python -m benchmarks.make_gguf_models --no-default --billion)", file=sys.stderr)
            return 2
        models.append(str(path))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        tiny = fixed_cost(Path(tmp))
    fixed = tiny["fixed"]
    print(f"fixed cost: {fixed / _MiB:.0f} MiB (tiny model: peak {tiny['peak'] / _MiB:.0f} MiB, "
          f"tensors {tiny['tensors'] / _MiB:.1f} MiB, KV {tiny['kv'] / _MiB:.0f} MiB)", flush=True)
    rows = {}
    for spec in models:
        m = measure(spec, args.kv_cache_memory)
        m["bound"] = bound(m, fixed)
        m["within"] = m["peak"] <= m["bound"] and m["resident"] <= m["bound"]
        rows[spec] = m
        print(f"{Path(spec).name}: {describe(m, fixed)}", flush=True)
    report = {"environment": environment(), "note": args.note, "fixed_cost": fixed, "tiny": tiny,
              "models": rows, "seconds": round(time.monotonic() - t0, 1),
              "bound": "peak and resident <= 1.1 x tensors + kv + fixed_cost (bytes)"}
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(report, indent=1))
    return 0 if all(m["within"] for m in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
