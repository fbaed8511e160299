"""Multi-LoRA serving against the base model, in-process (the offline engine), on one
workload: --num-requests concurrent requests (greedy, EOS ignored, --max-tokens each) over
the same prompts, run three ways, alternating side by side in each of --rounds rounds:

- base: the worker as it runs without --enable-lora (on the CPU: the fused C decoder);
- base, LoRA on: --enable-lora, every request on the base model (what turning LoRA on
  costs by itself; on the CPU the fused decoder stays on and adds the adapters' deltas in
  its own layers, ops/cpu_kernels/lora.c, so base rows run exactly the base model's code);
- lora: --enable-lora, the requests spread round robin over --num-adapters random adapters
  of rank --rank on --target-modules (PEFT format, written to a temporary folder), with
  --max-loras = --num-adapters so that every step mixes all of them.

Per side: output tokens/s (median over rounds), model steps and ms per step. The per-step
LoRA cost is the lora side's step time less the LoRA-on base side's (the same batch
shapes); where the model runs op by op (no fused decoder: a GPU, an unquantized model) the
time inside the LoRA op (ops.lora_add, all layers) is reported too. The figure of merit is
lora's throughput over base's (target >= 0.8).

    python -m benchmarks.lora --rounds 3 --output-json bench-results/lora.json
    python -m benchmarks.lora --num-requests 4 --max-tokens 4 --rounds 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import ops
from clients.bench.environment import environment, recorded
from scheduler.request import SamplingParams
from worker.config import CacheConfig, LoraConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.lora.adapter import TARGETS, module_shapes
from worker.models.llama import LlamaConfig
from worker.weights import LoadedModel, load_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a five-year-old.",
    "List three uses of a paperclip.",
    "Why do cats purr? Answer in two sentences.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Give me a name for a pet goldfish.",
]


def write_adapters(folder: Path, cfg: LlamaConfig, n: int, rank: int, targets: list[str],
                   b_std: float = 0.01) -> dict[str, Path]:
    """`n` random adapters in the PEFT format (as peft's save_pretrained names them); `b_std`,
    the spread of lora_B, sets how far they move the model."""
    shapes = module_shapes(cfg)
    paths = {}
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(cfg.num_layers):
            for proj in targets:
                block = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                n_in, n_out = shapes[proj]
                key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in**0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * b_std
        path = folder / f"adapter{i}"
        path.mkdir()
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}))
        paths[f"adapter{i}"] = path
    return paths


def _engine(loaded: LoadedModel, args: argparse.Namespace, paths: dict[str, Path] | None) -> Engine:
    lora = (LoraConfig(enable_lora=True, max_loras=max(1, len(paths)), max_lora_rank=args.rank,
                       lora_modules=tuple(f"{n}={p}" for n, p in paths.items()))
            if paths is not None else LoraConfig())
    conf = WorkerConfig(model=ModelConfig(max_model_len=2048), cache=CacheConfig(kv_cache_memory=0.5),
                        scheduler=SchedulerConfig(max_num_seqs=max(args.num_requests, 1),
                                                  max_num_batched_tokens=args.max_num_batched_tokens),
                        lora=lora)
    return Engine(conf, loaded=loaded)


class _LoraTimer:
    """Wall time inside ops.lora_add (the model looks it up on `ops` at each call)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._op = ops.lora_add

    def __enter__(self) -> _LoraTimer:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return self._op(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        ops.lora_add = timed
        return self

    def __exit__(self, *exc: object) -> None:
        ops.lora_add = self._op


def _run(engine: Engine, prompts: list[list[int]], names: list[str | None], max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [engine.make_request(prompts[i % len(prompts)], params, lora_name=n)
            for i, n in enumerate(names)]
    engine.kv.reset_prefix_cache()  # every round computes its prompts (no hits from the last)
    steps = engine.num_steps
    with _LoraTimer() as timer:
        t0 = time.perf_counter()
        done = engine.generate(reqs)
        dt = time.perf_counter() - t0
    n_steps = engine.num_steps - steps
    tokens = sum(len(d.token_ids) for d in done)
    return {"output_tokens_per_s": tokens / dt, "seconds": dt, "output_tokens": tokens,
            "steps": n_steps, "ms_per_step": 1000 * dt / max(n_steps, 1),
            "lora_ms_per_step": 1000 * timer.seconds / max(n_steps, 1), "lora_calls": timer.calls,
            "tokens": [d.token_ids for d in done]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--num-adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--target-modules", default=",".join(TARGETS),
                    help="comma list (default: all seven projections, the costliest case)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-json", default="bench-results/lora.json")
    args = ap.parse_args(argv)
    targets = [t for t in args.target_modules.split(",") if t]

    loaded = load_model(args.model)
    tok = loaded.tokenizer
    assert tok is not None, "the benchmark renders chat prompts: use a model with a tokenizer"
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}],
                                                  add_generation_prompt=True)) for p in PROMPTS]
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_adapters(Path(tmp), loaded.config, args.num_adapters, args.rank, targets)
        # Each engine changes the shared model's linears in place the same way (quantized
        # blocks by default); LoRA lives beside them in the runner's slots.
        sides = {
            "base": (_engine(loaded, args, None), [None] * args.num_requests),
            "base_lora_enabled": (_engine(loaded, args, {}), [None] * args.num_requests),
            "lora": (_engine(loaded, args, paths),
                     [f"adapter{i % args.num_adapters}" for i in range(args.num_requests)]),
        }
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
        for _ in range(args.rounds):
            for name, (engine, names) in sides.items():
                runs[name].append(_run(engine, prompts, names, args.max_tokens))
                r = runs[name][-1]
                print(f"{name:18s} {r['output_tokens_per_s']:8.1f} tok/s  {r['ms_per_step']:7.1f} ms/step"
                      f"  LoRA {r['lora_ms_per_step']:6.2f} ms/step", flush=True)
    summary = {}
    for name, rs in runs.items():
        summary[name] = {k: statistics.median(r[k] for r in rs)
                         for k in ("output_tokens_per_s", "ms_per_step", "lora_ms_per_step", "steps")}
    base = summary["base"]["output_tokens_per_s"]
    lora_cost = summary["lora"]["ms_per_step"] - summary["base_lora_enabled"]["ms_per_step"]
    report = {
        "info": {**environment(), "args": recorded(vars(args)), "threads": torch.get_num_threads(),
                 "kernels": sides["lora"][0].runner.describe_kernels(),
                 "base_kernels": sides["base"][0].runner.describe_kernels()},
        "summary": summary,
        "lora_over_base": summary["lora"]["output_tokens_per_s"] / base,
        "lora_enabled_base_over_base": summary["base_lora_enabled"]["output_tokens_per_s"] / base,
        "lora_cost_ms_per_step": lora_cost,
        "lora_share_of_step": lora_cost / summary["lora"]["ms_per_step"],
        "lora_op_ms_per_step": summary["lora"]["lora_ms_per_step"],
        "base_tokens_equal_with_lora_enabled": runs["base"][0]["tokens"] == runs["base_lora_enabled"][0]["tokens"],
        "runs": {k: [{kk: v for kk, v in r.items() if kk != "tokens"} for r in rs] for k, rs in runs.items()},
    }
    print(f"lora / base throughput: {report['lora_over_base']:.3f}; LoRA on, base requests: "
          f"{report['lora_enabled_base_over_base']:.3f}; LoRA "
          f"{lora_cost:.2f} ms of {summary['lora']['ms_per_step']:.1f} ms per step (op by op: "
          f"{summary['lora']['lora_ms_per_step']:.2f} ms in ops.lora_add)")
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
