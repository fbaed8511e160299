"""The CPU's activation arithmetics side by side (issue 21): accuracy against transformers,
greedy tokens on the parity prompts, and decode-step time, in one run:

    python -m benchmarks.activations --tokens 64 --rounds 10

For each `--cpu-activations` (float32, int24, int16, int8; `--arithmetics` picks) one engine
of the default model, prefix caching off:
- accuracy: every prompt token's logprob (prompt_logprobs=0) against transformers'
  log-softmax of the same GGUF in float32, over the test suite's parity prompts and a longer
  paragraph; transformers in bfloat16 (the arithmetic GPU engines serve in) is the yardstick;
- greedy: the first output position where each parity prompt's `--tokens` greedy tokens leave
  transformers' (none: equal throughout);
- speed: decode steps at batch 1 and at `--batch`, the engines taking turns every round in
  this one process (this machine's speed drifts by 10-50% within minutes: process-per-side
  runs disagree by more than the arithmetics do).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from clients.bench.environment import environment
from scheduler.request import SamplingParams
from tests.conftest import CHAT_PROMPTS  # the parity prompts
from tests.helpers import hf_greedy
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.weights import default_model_path, load_model

PARAGRAPH = ("The three primary colors are red, yellow and blue. Mixing two of them gives a "
             "secondary color: red and yellow make orange, and red and blue make purple, while "
             "yellow and blue make green. Painters have known this for centuries, and children "
             "learn it in school with a box of crayons.")


def _errors(got: list[torch.Tensor], refs: list[torch.Tensor]) -> dict[str, float]:
    e = torch.cat([(g - r).abs() for g, r in zip(got, refs, strict=True)]).double()
    return {"median": e.median().item(), "p99": e.quantile(0.99).item(), "max": e.max().item(), "n": e.numel()}


def _chosen(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Each prompt token's logprob (after the first) from [T, V] logits."""
    lp = torch.log_softmax(logits.float(), -1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def _hf(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()


def _first_divergence(ours: list[int], want: list[int]) -> int | None:
    for j, (a, b) in enumerate(zip(ours, want, strict=False)):  # lengths compared below
        if a != b:
            return j
    return None if len(ours) == len(want) else min(len(ours), len(want))


def _step_ms(engines: dict[str, Engine], batch: int, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """Decode steps of `batch` requests (100-token prompts), engine after engine each round."""
    times: dict[str, list[float]] = {a: [] for a in engines}
    for rnd in range(rounds + 1):  # the first round warms up
        for a, e in engines.items():
            for i in range(batch):
                ids = [(j * 7 + rnd + 13 * i) % 40000 + 100 for j in range(100)]
                e.submit(e.make_request(ids, SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)))
            while e.step().num_batched_tokens != batch:  # the prefills
                pass
            for _ in range(steps):
                t0 = time.perf_counter()
                out = e.step()
                if rnd:
                    times[a].append((time.perf_counter() - t0) * 1e3)
                assert out.num_batched_tokens == batch
            while e.has_work():
                e.step()
    return {a: {"median_ms": statistics.median(t), "min_ms": min(t)} for a, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arithmetics", default="float32,int24,int16,int8")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per parity prompt")
    ap.add_argument("--batch", type=int, default=64, help="the larger decode batch timed")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (0: no timing)")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per round")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    arithmetics = args.arithmetics.split(",")

    tok = load_model("default").tokenizer
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
             for p in CHAT_PROMPTS]
    prompts = [tok.encode(PARAGRAPH), *chats]
    with torch.inference_mode():
        hf = _hf(torch.float32)
        refs = [_chosen(hf(torch.tensor([ids])).logits[0], ids) for ids in prompts]
        want = [hf_greedy(hf, ids, args.tokens) for ids in chats]
        bf16 = _hf(torch.bfloat16)
        out: dict = {"tokens": args.tokens, "prompts": len(prompts), "arithmetics": {},
                     "transformers_bfloat16": {"logprob_error": _errors(
                         [_chosen(bf16(torch.tensor([ids])).logits[0], ids) for ids in prompts], refs)}}
        del hf, bf16
    engines: dict[str, Engine] = {}
    for a in arithmetics:
        # A load of its own each: an engine rewrites its model's linears in place.
        e = engines[a] = Engine(WorkerConfig(
            model=ModelConfig(cpu_activations=a), cache=CacheConfig(kv_cache_memory=0.5, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=max(64, args.batch), max_num_batched_tokens=8192)),
            loaded=load_model("default"))
        got = []
        for ids in prompts:
            [c] = e.generate([e.make_request(ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))])
            got.append(torch.tensor([p.logprob for p in c.prompt_logprobs], dtype=torch.float32))
        done = e.generate([e.make_request(ids, SamplingParams(temperature=0.0, max_tokens=args.tokens))
                           for ids in chats])
        out["arithmetics"][a] = {
            "kernels": e.runner.describe_kernels(),
            "logprob_error": _errors(got, refs),
            "greedy_first_divergence": [_first_divergence(c.token_ids, w) for c, w in zip(done, want, strict=True)],
        }
    if args.rounds:
        for batch in (1, args.batch):
            for a, row in _step_ms(engines, batch, args.rounds, args.steps).items():
                out["arithmetics"][a][f"step_b{batch}"] = row
    print(f"| arithmetic | logprob error vs transformers float32: median / p99 / max | greedy tokens equal "
          f"({args.tokens} per prompt) | step ms at batch 1: median (fastest) | at batch {args.batch} |")
    print("|---|---|---|---|---|")
    rows = {"transformers bfloat16": out["transformers_bfloat16"], **out["arithmetics"]}
    for a, r in rows.items():
        e = r["logprob_error"]
        div = r.get("greedy_first_divergence")
        equal = "-" if div is None else f"{sum(d is None for d in div)} of {len(div)}"
        steps = [f"{r[k]['median_ms']:.2f} ({r[k]['min_ms']:.2f})" if k in r else "-"
                 for k in ("step_b1", f"step_b{args.batch}")]
        print(f"| {a} | {e['median']:.1e} / {e['p99']:.1e} / {e['max']:.1e} | {equal} | {steps[0]} | {steps[1]} |")
    if args.output_json:
        out["environment"] = environment()
        Path(args.output_json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
