"""The runner's plain sampled path against the general one, in one process (issue 21):

    python -m benchmarks.plain_sampling --batch-sizes 1,64 --rounds 6 \\
        --output-json bench-results/plain-sampling.json

Rows sampled with no penalty, logprobs, mask or logit bias (a gateway's usual chat request:
here temperature 0.7, top-p 0.9, seeded) take `ModelRunner._plain_rows`: the C sampler
called from the requests' own lists (`ops.cpu_sampling.sample_plain`). The `general` side
turns that path off, so the same rows build SamplingTensors and go through `ops.sample` as
before. One engine (the default model, prefix caching off) generates the same requests on
both sides in alternating rounds; each round reports, per side, the median time of the
runner's `_sample` call a step and decode tokens/s (output tokens after the first over the
time from the first step to the last). Seeded requests: both sides must give the same
tokens, which is checked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from clients.bench.chat import pick_questions, user_turn
from clients.bench.environment import environment
from scheduler.request import SamplingParams
from worker.config import CacheConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.model_runner import ModelRunner


def _round(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[float], float, list]:
    """(the `_sample` calls' ms, decode tok/s, each request's tokens)."""
    runner = engine.runner
    sample, times = runner._sample, []

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = sample(*a, **k)
        times.append((time.perf_counter() - t0) * 1e3)
        return out

    runner._sample = timed
    stamps: list[float] = []
    try:
        done = engine.generate([engine.make_request(p, params) for p in prompts],
                               lambda _outs: stamps.append(time.perf_counter()))
    finally:
        del runner._sample
    tokens = [c.token_ids for c in done]
    decoded = sum(len(t) for t in tokens) - len(tokens)
    return times[1:], decoded / (stamps[-1] - stamps[0]), tokens


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    engine = Engine(WorkerConfig(cache=CacheConfig(kv_cache_memory=0.5, enable_prefix_caching=False),
                                 scheduler=SchedulerConfig(max_num_seqs=max(sizes))))
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=1234, max_tokens=args.max_tokens, ignore_eos=True)
    plain = ModelRunner.__dict__["_plain_rows"]  # the staticmethod itself
    report: dict = {"info": environment(), "params": repr(params), "results": {}}
    print("| requests at once | side | `_sample` ms a step: median of rounds | decode tok/s: median of rounds |")
    print("|---|---|---|---|")
    for b in sizes:
        prompts = [tok.encode_chat(user_turn(q)) for q in pick_questions(b, 3)]
        _round(engine, prompts, params)  # warm-up
        runs: dict[str, dict[str, list[float]]] = {s: {"sample_ms": [], "tok_s": []} for s in ("general", "plain")}
        want = None
        for r in range(args.rounds):
            for side in (("general", "plain") if r % 2 == 0 else ("plain", "general")):
                ModelRunner._plain_rows = plain if side == "plain" else staticmethod(lambda *a, **k: None)
                try:
                    times, tok_s, tokens = _round(engine, prompts, params)
                finally:
                    ModelRunner._plain_rows = plain
                if want is None:
                    want = tokens
                elif tokens != want:
                    raise SystemExit(f"{side} gave other tokens than the first side at batch {b}")
                runs[side]["sample_ms"].append(statistics.median(times))
                runs[side]["tok_s"].append(tok_s)
        res = {side: {k: round(statistics.median(v), 4) for k, v in r.items()} | {"rounds": r}
               for side, r in runs.items()}
        res["tok_s_ratio_plain_over_general"] = round(res["plain"]["tok_s"] / res["general"]["tok_s"], 3)
        report["results"][str(b)] = res
        for side in ("general", "plain"):
            print(f"| {b} | {side} | {res[side]['sample_ms']:.3f} | {res[side]['tok_s']:.1f} |")
        print(f"| {b} | plain / general | | **{res['tok_s_ratio_plain_over_general']:.3f}x** |")
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
