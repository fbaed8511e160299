"""A CPU install without triton starts the worker: triton is imported only when a Triton
kernel first runs. A subprocess blocks every `triton` import (a sys.meta_path finder that
refuses it, as if it were not installed), imports the worker's modules and runs CPU steps
of a small random model under each CPU backend."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import importlib.abc
    import sys

    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, NoTriton())
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the blocker let triton through")

    import worker.cli, worker.engine, worker.model_runner, worker.server  # noqa: E401,F401
    import ops
    import torch
    from scheduler.request import SamplingParams
    from worker.config import ModelConfig, SchedulerConfig, WorkerConfig
    from worker.engine import Engine
    from worker.models.llama import LlamaConfig, LlamaForCausalLM
    from worker.weights import LoadedModel, dummy

    try:
        ops.set_backend("triton")
    except ValueError as e:
        assert "triton package" in str(e), e
    else:
        raise SystemExit("set_backend('triton') accepted without triton")

    cfg = LlamaConfig(architecture="LlamaForCausalLM", vocab_size=300, hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=256, tie_word_embeddings=True)
    backends = ["torch", "auto"] + (["c"] if ops.c_kernels_available() else [])
    outputs = {}
    for kernels in backends:
        model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
        dummy.init_dummy(model, seed=1)
        loaded = LoadedModel(model, cfg, None, "tiny", "dummy", torch.device("cpu"), torch.float32)
        conf = WorkerConfig(model=ModelConfig(kernels=kernels),
                            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
        engine = Engine(conf, loaded=loaded)
        print(kernels, "|", engine.runner.describe_kernels())
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        reqs = [engine.make_request([5, 17, 42, 7 + i], params) for i in range(2)]
        for r in reqs:
            engine.submit(r)
        tokens = {r.request_id: [] for r in reqs}
        for _ in range(10):
            for out in engine.step().outputs:
                tokens[out.request_id] += out.new_token_ids
        assert all(len(t) == 3 for t in tokens.values()), tokens
        outputs[kernels] = sorted(tokens.values())
    assert all(o == outputs["torch"] for o in outputs.values()), outputs
    leaked = sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))
    assert not leaked, leaked
    print("OK", backends)
''')


def test_the_worker_imports_and_steps_without_triton() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK" in proc.stdout
    # Each CPU backend names its paths in the start-up line.
    assert "torch | " in proc.stdout and "(--kernels torch)" in proc.stdout
    assert "decode attention: torch" in proc.stdout.split("\n")[0]
