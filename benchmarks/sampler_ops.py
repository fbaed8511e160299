"""The sampler's parts on the CPU, the torch reference against the C kernels, in one process:

    python -m benchmarks.sampler_ops --output-json bench-results/sampler-ops.json

Per batch size (default 1 and 64) on the default model's vocabulary (49,152), each row with
a 100-token prompt and 60 output tokens seen (some repeated):

- `penalties`: repetition 1.1, presence 0.5, frequency 0.2. The reference builds the [B, V]
  prompt mask and output counts from the seen tokens (`PenaltyTokens.dense`, as the runner
  did every step before the tokens went sparse) and makes its passes over them
  (`apply_penalties`); the C path penalizes the seen tokens alone (`penalize_c`);
- `logprobs`: the chosen token's logprob and the top 5 (`token_logprobs_ref` against
  `token_logprobs_c`);
- `sample`: a whole `ops.sample` call at temperature 0.7, top-p 0.9 with the penalties and
  5 logprobs (`sample_ref` against `sample_c`).

Each figure is the median of `--repeat` calls (after one warm-up), alternating the two
sides call by call so that both see the same machine. Logits are Gaussian (scale 3), so a
row's top-p set is a few thousand tokens: model logits are more peaked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from clients.bench.environment import environment
from ops.cpu_logprobs import token_logprobs_c
from ops.cpu_sampling import penalize_c, sample_c
from ops.sampling import (
    PenaltyTokens,
    SamplingTensors,
    apply_penalties,
    sample_ref,
    token_logprobs_ref,
)

VOCAB = 49152


def _tensors(b: int, seed: int) -> SamplingTensors:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        prompt = torch.randint(0, VOCAB, (100,), generator=g).tolist()
        output = torch.randint(0, VOCAB, (40,), generator=g).tolist()
        rows.append((prompt, output + output[:20]))

    def col(x: float) -> torch.Tensor:
        return torch.full((b,), x, dtype=torch.float32)

    return SamplingTensors(
        temperature=col(0.7), top_p=col(0.9), top_k=torch.zeros(b, dtype=torch.int64), min_p=col(0.0),
        repetition_penalty=col(1.1), presence_penalty=col(0.5), frequency_penalty=col(0.2),
        penalty_tokens=PenaltyTokens.from_lists(rows), seeds=[None] * b, steps=[0] * b,
        all_greedy=False, num_logprobs=5,
    )


def _paired(ref: Callable[[], object], c: Callable[[], object], repeat: int) -> dict[str, float]:
    ref()
    c()
    times: dict[str, list[float]] = {"reference": [], "c": []}
    for _ in range(repeat):
        for name, fn in (("reference", ref), ("c", c)):
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1000)
    out = {f"{k}_ms": round(statistics.median(v), 4) for k, v in times.items()}
    out["ratio"] = round(out["reference_ms"] / out["c_ms"], 2)
    return out


def _measure(b: int, repeat: int) -> dict[str, dict[str, float]]:
    logits = torch.randn(b, VOCAB, generator=torch.Generator().manual_seed(b)) * 3.0
    st = _tensors(b, seed=b)
    tokens = torch.randint(0, VOCAB, (b,), generator=torch.Generator().manual_seed(7))
    return {
        "penalties": _paired(lambda: apply_penalties(logits, st), lambda: penalize_c(logits, st), repeat),
        "logprobs": _paired(lambda: token_logprobs_ref(logits, tokens, 5),
                            lambda: token_logprobs_c(logits, tokens, 5), repeat),
        "sample": _paired(lambda: sample_ref(logits, st), lambda: sample_c(logits, st), repeat),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--repeat", type=int, default=0, help="calls per figure (default 200 at batch 1, 20 above)")
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    report: dict = {"info": environment(), "threads": torch.get_num_threads(), "results": {}}
    for b in (int(x) for x in args.batch_sizes.split(",")):
        report["results"][str(b)] = _measure(b, args.repeat or (200 if b == 1 else 20))
    print("| batch | part | reference ms | C ms | reference / C |\n|---|---|---|---|---|")
    for b, parts in report["results"].items():
        for part, r in parts.items():
            print(f"| {b} | {part} | {r['reference_ms']:.3f} | {r['c_ms']:.3f} | **{r['ratio']:.1f}x** |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
