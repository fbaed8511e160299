"""The CPU decode step of each family's shape against the Llama shape's, at the default
model's size (SmolLM2-135M: hidden 576, 30 layers, 9 heads / 3 KV heads of 64,
intermediate 1536), random weights as Q8_0 blocks, the fused C decoder.

    python -m benchmarks.families --batches 1,64 --output-json bench-results/families.json

Shapes: `llama` (as the default model), `qwen3` (its q/k norms: an RMSNorm of every q and
k head before rotary), `phi4-mini` (partial rotary 0.75: 48 of 64 dimensions rotating,
LongRoPE's table), `gemma2` (its four norms a layer, GeGLU with tanh GELU, scaled
embedding, attention scale from query_pre_attn_scalar, attention and final soft-caps 50 and
30, every other layer windowed) and `gemma3` (Gemma 2's layer without soft-caps, plus q/k
norms and a second rotary table for its windowed layers, five windowed in six). The
heads, sizes and vocabulary stay the default model's in every shape (Gemma's real head_dim
256 and vocabulary 256k are sizes, not operations). The weights are the same blocks in
every shape, so a row's time differs from llama's only by the family's extra operations. Each batch's requests are prefilled to
`--context` tokens, then the engines take turns `--steps` decode steps at a time for
`--rounds` rounds (median kept), so the machine's drift falls on every row alike. `ratio`:
a row's step time over the llama shape's at the same batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np
import torch

from clients.bench.environment import environment, recorded
from ops.quantized_linear import QuantizedWeight, quantize_linears, resolve_activations
from ops.rotary import RopeScaling
from scheduler.request import SamplingParams
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.weights import LoadedModel, dummy

SHAPES = ("llama", "qwen3", "phi4-mini", "gemma2", "gemma3")
# Gemma's window, past this benchmark's contexts: the windowed layers' cost is the window
# benchmark's (benchmarks/window.py); here only the extra operations are timed.
GEMMA_WINDOW = 4096


def family_config(shape: str):
    base = dummy.dummy_config("smollm2-135m")
    if shape == "llama":
        return base
    if shape == "qwen3":
        return dataclasses.replace(base, architecture="Qwen3ForCausalLM", qk_norm=True)
    if shape.startswith("gemma"):
        from worker.models.gemma import GemmaConfig

        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        gemma2 = shape == "gemma2"
        every = 2 if gemma2 else 6  # one global layer in `every`
        types = tuple("sliding_attention" if (i + 1) % every else "full_attention" for i in range(base.num_layers))
        return GemmaConfig(**{**fields, "architecture": "Gemma2ForCausalLM" if gemma2 else "Gemma3ForCausalLM",
                              "qk_norm": not gemma2, "sliding_window": GEMMA_WINDOW, "layer_types": types},
                           query_pre_attn_scalar=float(base.head_dim),
                           attn_logit_softcapping=50.0 if gemma2 else None,
                           final_logit_softcapping=30.0 if gemma2 else None,
                           rope_local_theta=None if gemma2 else 10000.0)
    assert shape == "phi4-mini"
    pairs = 24  # of 48 rotating dimensions
    rope = RopeScaling(rope_type="longrope", factor=base.max_position_embeddings / 4096,
                       original_max_position_embeddings=4096, short_factor=(1.0,) * pairs,
                       long_factor=tuple(1.0 + 0.1 * i for i in range(pairs)))
    return dataclasses.replace(base, architecture="Phi3ForCausalLM", partial_rotary_factor=0.75, rope_scaling=rope)


def _blocks(model) -> dict[str, QuantizedWeight]:
    """Each layer linear's weight as Q8_0 blocks (gguf-py's quantizer)."""
    from gguf import GGMLQuantizationType, quants

    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.startswith("layers."):
            w = mod.weight.detach().numpy()
            out[name] = QuantizedWeight("Q8_0", np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType.Q8_0)),
                                        w.shape)
    return out


def _loaded(shape: str, blocks: dict[str, QuantizedWeight] | None) -> tuple[LoadedModel, dict]:
    cfg = family_config(shape)
    from worker.models.gemma import GemmaConfig, GemmaForCausalLM
    from worker.models.llama import LlamaForCausalLM

    model = (GemmaForCausalLM if isinstance(cfg, GemmaConfig) else LlamaForCausalLM)(cfg).eval().requires_grad_(False)
    dummy.init_dummy(model)
    blocks = blocks if blocks is not None else _blocks(model)
    quantize_linears(model, blocks, resolve_activations("auto"))
    return LoadedModel(model, cfg, None, f"dummy:{shape}", "dummy", torch.device("cpu"), torch.float32), blocks


def _engine(loaded: LoadedModel, context: int, max_tokens: int, batch: int) -> Engine:
    per_token = loaded.config.num_layers * 2 * loaded.config.num_kv_heads * loaded.config.head_dim * 4
    gib = batch * (context + max_tokens + 64) * per_token / 2**30 + 0.05
    conf = WorkerConfig(model=ModelConfig(max_model_len=context + max_tokens + 16),
                        cache=CacheConfig(kv_cache_memory=gib, enable_prefix_caching=False),
                        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * context))
    engine = Engine(conf, loaded=loaded)
    assert engine.runner.cpu_decoder is not None, "the fused decoder does not run this model"
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.submit(engine.make_request([(7 * i + j) % 40000 + 100 for j in range(context)], params))
    engine.step()  # the prefill
    engine.step()
    return engine


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64", help="requests decoding at once (comma-separated)")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    max_tokens = args.steps * (args.rounds + 1) + 8
    blocks = None
    engines = {}
    for shape in SHAPES:
        for b in batches:
            loaded, blocks = _loaded(shape, blocks)  # one model per engine: a runner takes its load
            engines[shape, b] = _engine(loaded, args.context, max_tokens, b)
    times: dict[tuple[str, int], list[float]] = {k: [] for k in engines}
    for _ in range(args.rounds):
        for k, engine in engines.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[k].append((time.perf_counter() - t0) / args.steps * 1e3)
    rows = []
    for b in batches:
        base = statistics.median(times["llama", b])
        for shape in SHAPES:
            ms = statistics.median(times[shape, b])
            rows.append({"shape": shape, "batch": b, "step_ms": round(ms, 4), "ratio": round(ms / base, 3),
                         "rounds_ms": [round(t, 4) for t in times[shape, b]]})
            print(f"batch {b:3d} {shape:>10}: {ms:8.3f} ms a step ({ms / base:.3f}x llama)", flush=True)
    report = {"info": {**environment(argv), "threads": torch.get_num_threads(), "args": recorded(vars(args)),
                       "decoder": engines["llama", batches[0]].runner.cpu_decoder.describe()},
              "step": rows}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
