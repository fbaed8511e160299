"""Memory while a GGUF model loads and the runner is built: no float32 copy of what the
kernels take, not even for a moment.

Each figure is a fresh process (`_MEASURE`) that imports what serve imports, builds the
engine (load + runner + KV cache) and reports its peak (VmHWM) and resident (VmRSS) memory.
The runtime's fixed cost (python, torch, grpc, our imports, the compiled kernels, the
tokenizer of 49,152 tokens) is what a tiny model with the default model's tokenizer costs
beyond its tensors and KV cache; a model then must stay within

    1.1 x its GGUF tensor bytes + its KV cache + that fixed cost

at its peak and after. The 1B-class Q4_K_M (benchmarks/make_gguf_models.py --billion) is
measured where its file is in the cache (slow; skipped without it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import make_gguf_models as made
from ops import quantized_linear
from tests.gguf_tiny import write_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
_MiB = 1 << 20

_MEASURE = r"""
import json, sys
def status():
    s = open("/proc/self/status").read()
    return {k: int(s.split(k + ":")[1].split()[0]) << 10 for k in ("VmHWM", "VmRSS")}
spec, kv_gib = sys.argv[1], float(sys.argv[2])
import worker.server  # what serve imports
from worker.config import CacheConfig, ModelConfig, WorkerConfig
from worker.engine import Engine
from worker.weights import default_model_path
from worker.weights.gguf_reader import GGUFFile
engine = Engine(WorkerConfig(model=ModelConfig(model=spec, max_model_len=256),
                             cache=CacheConfig(kv_cache_memory=kv_gib)))
after = status()
runner = engine.runner
kv = sum(t.nbytes for pair in runner.kv_caches for t in pair)  # (the swap space is never touched here)
path = str(default_model_path()) if spec == "default" else spec
tensors = sum(t.n_bytes for t in GGUFFile(path).tensors)
print(json.dumps({"peak": after["VmHWM"], "resident": after["VmRSS"], "kv": kv, "tensors": tensors,
                  "weights": engine.loaded.describe_weights(), "kernels": runner.describe_kernels()}))
"""


def measure(spec: str, kv_gib: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protos"),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _MEASURE, spec, str(kv_gib)], capture_output=True,
                          text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fixed_cost(tmp_path_factory) -> int:
    """The runtime's bytes beyond a model's tensors and KV cache, on a tiny model (hidden
    64, one layer) with the default model's tokenizer."""
    tiny = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", vocab="default")
    m = measure(str(tiny), 0.01)
    cost = m["peak"] - m["tensors"] - m["kv"]
    print(f"fixed cost: {cost / _MiB:.0f} MiB (peak {m['peak'] / _MiB:.0f} MiB, tensors "
          f"{m['tensors'] / _MiB:.1f} MiB, KV {m['kv'] / _MiB:.0f} MiB)")
    return cost


def _within_bound(m: dict, fixed: int) -> None:
    bound = 1.1 * m["tensors"] + m["kv"] + fixed
    print(f"peak {m['peak'] / _MiB:.0f} MiB, resident {m['resident'] / _MiB:.0f} MiB, bound "
          f"{bound / _MiB:.0f} MiB (tensors {m['tensors'] / _MiB:.1f} MiB, KV {m['kv'] / _MiB:.0f} MiB, "
          f"fixed {fixed / _MiB:.0f} MiB); {m['weights']}")
    assert m["resident"] <= bound, f"resident {m['resident'] / _MiB:.0f} MiB > {bound / _MiB:.0f} MiB"
    assert m["peak"] <= bound, f"peak {m['peak'] / _MiB:.0f} MiB > {bound / _MiB:.0f} MiB"


@pytest.mark.skipif(not quantized_linear.available(), reason="the C kernels need gcc and AVX2")
def test_the_default_model_loads_within_its_file_size(fixed_cost: int) -> None:
    m = measure("default", 0.02)
    assert "QuantLinear" in m["kernels"] and "float32 (no native kernel" not in m["weights"]
    _within_bound(m, fixed_cost)


@pytest.mark.slow
@pytest.mark.skipif(not quantized_linear.available(), reason="the C kernels need gcc and AVX2")
def test_a_billion_parameter_q4_k_m_loads_within_its_file_size(fixed_cost: int) -> None:
    path = made.cache_dir() / f"billion-Q4_K_M-{made.RECIPE}.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not made (python -m benchmarks.make_gguf_models --billion)")
    m = measure(str(path), 0.02)
    if "no native kernel" in m["weights"]:
        pytest.skip(f"a type of the file has no native kernel yet: {m['weights']}")
    _within_bound(m, fixed_cost)
