"""Memory while a GGUF model loads and the runner is built: no float32 copy of what the
kernels take, not even for a moment.

Each figure is a fresh process (benchmarks/load_memory.py's `measure`) that imports what
serve imports, builds the engine (load + runner + KV cache) and reports its peak (VmHWM) and
resident (VmRSS) memory after. The runtime's fixed cost (python, torch, grpc, our imports,
the compiled kernels, the tokenizer of 49,152 tokens) is what a tiny model with the default
model's tokenizer costs beyond its tensors and KV cache; a model then must stay within

    1.1 x its GGUF tensor bytes + its KV cache + that fixed cost

at its peak and after. The 1B-class Q4_K_M (benchmarks/make_gguf_models.py --billion) is
measured where its file is in the cache (slow; skipped without it).
"""

from __future__ import annotations

import pytest

from benchmarks import load_memory
from benchmarks import make_gguf_models as made
from ops import quantized_linear

pytestmark = pytest.mark.skipif(not quantized_linear.available(), reason="the C kernels need gcc and AVX2")


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[dict, dict]:
    """The tiny model (hidden 64, one layer, the default model's tokenizer: the runtime's
    bytes beyond a model's tensors and KV cache) and the default model, measured at once."""
    tiny, models = load_memory.measure_at_once(tmp_path_factory.mktemp("tiny"), ["default"], 0.02)
    print(f"fixed cost: {tiny['fixed'] >> 20} MiB (peak {tiny['peak'] >> 20} MiB, tensors "
          f"{tiny['tensors'] >> 20} MiB, KV {tiny['kv'] >> 20} MiB)")
    return tiny, models["default"]


@pytest.fixture(scope="module")
def fixed_cost(measured) -> int:
    return measured[0]["fixed"]


def _within_bound(m: dict, fixed: int) -> None:
    print(load_memory.describe(m, fixed))
    bound = load_memory.bound(m, fixed)
    assert "float32 (no native kernel" not in m["weights"], m["weights"]
    assert m["resident"] <= bound, f"resident {m['resident'] >> 20} MiB > {bound >> 20} MiB"
    assert m["peak"] <= bound, f"peak {m['peak'] >> 20} MiB > {bound >> 20} MiB"


def test_the_default_model_loads_within_its_file_size(measured, fixed_cost: int) -> None:
    m = measured[1]
    assert "QuantLinear" in m["kernels"]
    _within_bound(m, fixed_cost)


@pytest.mark.slow
def test_a_billion_parameter_q4_k_m_loads_within_its_file_size(fixed_cost: int) -> None:
    path = made.cache_dir() / f"billion-Q4_K_M-{made.RECIPE}.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not made (python -m benchmarks.make_gguf_models --no-default --billion)")
    _within_bound(load_memory.measure(str(path), 0.02), fixed_cost)
