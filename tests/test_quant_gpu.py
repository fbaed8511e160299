"""Pre-quantized weights through the engine on a GPU (skipped without one): dummy Llama-3.2-1B
with its linears quantized into each kernel's layout (benchmarks/quantized_gpu.py's
round-to-nearest, as a checkpoint of that scheme loads), CUDA graphs on. Shown there: the
graphs' tokens are the eager run's; a request's tokens are the same alone and in a batch of
8 (a row's result does not depend on its batch); the last logits close to the reference
arithmetic (`scaled_linear_ref`, ops backend torch). On the CPU: the benchmark's quantizer
itself (its weights within RTN's error of the float ones) and its command line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from benchmarks.quantized_gpu import SCHEMES, quantize_weight
from ops.scaled_linear import dequantize
from tests.helpers import requires_cuda


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s != "bf16"])
def test_the_benchmarks_quantizer(scheme) -> None:
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(0)) * 0.02
    q = quantize_weight(w, scheme)
    err = ((dequantize(q) - w).norm() / w.norm()).item()
    assert err < (0.12 if scheme == "w4a16" else 0.05), err


def test_the_benchmark_command_line() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.quantized_gpu", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--kv-context" in out.stdout


@requires_cuda
@pytest.mark.parametrize("scheme", ["fp8-block", "fp8-channel", "w4a16", "w8a8"])
def test_quantized_engine_on_the_gpu(scheme) -> None:
    import ops
    from benchmarks.quantized_gpu import quantize_model
    from scheduler.request import SamplingParams
    from tests.helpers import last_logits
    from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
    from worker.engine import Engine
    from worker.weights import load_model

    loaded = load_model("dummy:llama-3.2-1b", "cuda", torch.bfloat16)
    assert quantize_model(loaded.model, scheme) == 4 * loaded.config.num_layers
    prompts = [[(31 * j + i) % 5000 + 10 for j in range(40 + 9 * i)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(graphs: bool, batch: list[list[int]]) -> list[list[int]]:
        engine = Engine(WorkerConfig(model=ModelConfig(max_model_len=512, cuda_graphs=graphs),
                                     cache=CacheConfig(kv_cache_memory=0.5),
                                     scheduler=SchedulerConfig(max_num_seqs=8)), loaded=loaded)
        out = [c.token_ids for c in engine.generate([engine.make_request(p, params) for p in batch])]
        assert engine.kv.blocks_in_use() == 0
        if graphs:
            assert engine.runner.num_graph_steps > 0
        return out

    together = run(True, prompts)
    assert together == run(False, prompts)
    assert [run(True, [p])[0] for p in prompts[:2]] == together[:2]
    ours = last_logits(loaded.model, prompts[0])
    with ops.use_backend("torch"):
        ref = last_logits(loaded.model, prompts[0])
    assert ((ours.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2
