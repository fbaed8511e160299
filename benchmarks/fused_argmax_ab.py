"""The batch-1 engine step with the greedy token found inside the fused decoder's call
(`CpuDecoder.decode(argmax=...)`) against numpy's argmax after the call, in one process
(issue 21). This project's 2-core machines drift 10-30% within a minute, more than the
change, so one engine generates one greedy stream and its steps alternate between the two
ways in blocks of 8: the decoder as it is, and a stand-in that writes -1 for every row
(the runner then falls back to `greedy_ids_cpu` on the call's logits, the path before).
Both give the same tokens; the step's median wall time per way is compared.

    python -m benchmarks.fused_argmax_ab --generations 6 --output-json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.spec_decode import _engine, task_prompt
from clients.bench.environment import environment, recorded
from scheduler.request import SamplingParams
from worker.engine import Engine
from worker.weights import load_model


class _NumpyArgmax:
    """The decoder, but its call leaves the greedy tokens to the runner (as before)."""

    def __init__(self, decoder: Any) -> None:
        self._decoder = decoder

    def decode(self, *args: Any, argmax: np.ndarray | None = None, **kwargs: Any) -> Any:
        if argmax is not None:
            argmax.fill(-1)
        return self._decoder.decode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._decoder, name)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generations", type=int, default=6, help="greedy streams of --max-tokens, one at a time")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--task", default="code", help="the prompt (benchmarks.spec_decode's tasks)")
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    loaded = load_model("default", "cpu", None)
    assert loaded.tokenizer is not None
    engine = _engine(loaded, None, 1)
    fused = engine.runner.cpu_decoder
    assert fused is not None, "the fused C decoder is not in use here (no gcc or no AVX2?)"
    ways = {"in the call": fused, "numpy after the call": _NumpyArgmax(fused)}
    names = list(ways)
    times: dict[str, list[float]] = {w: [] for w in ways}
    outputs: list[list[int]] = []
    count = 0
    step = Engine.step

    def timed_step(self: Engine) -> Any:
        nonlocal count
        way = names[(count // 8) % 2]
        self.runner.cpu_decoder = ways[way]
        t0 = time.perf_counter()
        out = step(self)
        if count >= 4:  # the prefill and the first decodes aside
            times[way].append(time.perf_counter() - t0)
        count += 1
        return out

    prompt = task_prompt(loaded.tokenizer, args.task)

    def generate() -> list[int]:
        req = engine.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                        ignore_eos=True))
        return engine.generate([req])[0].token_ids

    engine.runner.cpu_decoder = ways["numpy after the call"]
    reference = generate()  # and a warm-up
    Engine.step = timed_step  # type: ignore[method-assign]
    try:
        for _ in range(args.generations):
            count = 0
            names.reverse()  # each way first in every other generation
            outputs.append(generate())
    finally:
        Engine.step = step  # type: ignore[method-assign]
        engine.runner.cpu_decoder = fused
    med = {w: statistics.median(t) * 1e3 for w, t in times.items()}
    same = all(out == reference for out in outputs)  # steps of both ways: the numpy way's tokens
    before, after = med["numpy after the call"], med["in the call"]
    print(f"| greedy token | batch-1 step ms (median of {len(times[names[0]])} and {len(times[names[1]])}) |")
    print("|---|---|")
    for w in ways:
        print(f"| {w} | {med[w]:.3f} |")
    print(f"before / after: **{before / after:.3f}x** ({before - after:.3f} ms a step); same tokens: {same}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({
            "info": {**environment(), "args": recorded(vars(args)), "threads": torch.get_num_threads(),
                     "kernels": engine.runner.describe_kernels()},
            "median_ms": med, "ratio_before_over_after": before / after, "same_tokens": same,
            "steps_ms": {w: [t * 1e3 for t in ts] for w, ts in times.items()}}, indent=2))


if __name__ == "__main__":
    main()
