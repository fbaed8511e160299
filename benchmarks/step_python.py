"""The Python of a batch-1 decode step outside its native call, in warm and in swept caches
(issue 21), in one process:

    python -m benchmarks.step_python --steps 200 --rounds 6 --output-json out.json

One engine generates one stream (greedy, or `--sampling temperature=0.8,top_p=0.95`); its
steps alternate in blocks of `--steps` between three ways:

- `call`: the step as it runs. The native call is timed alone; the step's time less the
  call's is the Python around it (scheduling, the runner, sampling, detokenizing, outputs).
- `warm`: the call is a stand-in that writes the logits of an earlier real call and the
  greedy token (100), and returns: the same Python in caches that nothing swept.
- `swept`: the stand-in first reads a buffer as large as the weights a step reads (a float32
  sum of `--sweep-mb`), as the call does, and its time is left out: the same Python in caches
  a call has just swept.

A step's Python costs several times more after a call than warm: its code and data (and
torch's, numpy's and ctypes' dispatch paths) come back from memory. The table gives, per way,
the median step and the median Python a step.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.step import step_config
from clients.bench.environment import environment, recorded
from ops import cpu_kernels
from scheduler.request import SamplingParams
from worker.engine import Engine

WAYS = ("call", "warm", "swept")


class _Timed:
    """The decoder's library, its call timed (into `calls`) or replaced by a stand-in."""

    def __init__(self, lib: Any, way: str, calls: list[float], sweep: np.ndarray, logits: np.ndarray) -> None:
        self._lib, self._way, self._calls, self._sweep, self._logits = lib, way, calls, sweep, logits

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._lib, name)
        if name != "cpu_decoder_decode":
            return real

        def call(model: Any, step: Any) -> int:
            t0 = time.perf_counter()
            s = step._obj  # (ctypes.byref's object)
            row = self._logits.nbytes
            if self._way == "call":
                rc = real(model, step)
                if s.logits and s.M == 1:  # kept for the stand-ins (the sampler's work depends on them)
                    ctypes.memmove(self._logits.ctypes.data, s.logits, row)
            else:
                if self._way == "swept":
                    self._sweep.sum()
                for r in range(s.M if s.logits else 0):
                    ctypes.memmove(s.logits + r * row, self._logits.ctypes.data, row)
                for r in range(s.M if s.argmax else 0):
                    ctypes.c_int64.from_address(s.argmax + 8 * r).value = 100
                rc = 0
            self._calls.append(time.perf_counter() - t0)
            return rc

        return call


def _params(spec: str, tokens: int) -> SamplingParams:
    fields: dict[str, Any] = {"temperature": 0.0}
    for item in filter(None, spec.split(",")):
        k, v = item.split("=")
        fields[k] = int(v) if k in ("seed", "top_k") else float(v)
    return SamplingParams(max_tokens=tokens, ignore_eos=True, **fields)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="steps a way a round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--context", type=int, default=100, help="prompt tokens")
    ap.add_argument("--sampling", default="", help="SamplingParams fields, e.g. temperature=0.8,top_p=0.95")
    ap.add_argument("--sweep-mb", type=int, default=96, help="what the swept way reads first")
    ap.add_argument("--isa", choices=cpu_kernels.supported_isas(),
                    help="the kernels built for this ISA instead of the CPU's best (e.g. avx2: the "
                         "AVX2-only machines' path, with its default activations)")
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    with cpu_kernels.forced_isa(args.isa):  # before the first kernel loads (a fresh process)
        _run(args)


def _run(args: argparse.Namespace) -> None:
    engine = Engine(step_config(1))
    decoder = engine.runner.cpu_decoder
    if decoder is None:
        raise SystemExit("no fused C decoder here (no gcc, or no AVX2)")
    lib, sweep = decoder._lib, np.ones(args.sweep_mb << 18, dtype=np.float32)
    assert decoder.head is not None, "a model whose logits come from the call"
    logits = np.zeros(decoder.head.out_features, dtype=np.float32)  # a real call's, once one ran
    steps: dict[str, list[float]] = {w: [] for w in WAYS}
    calls: dict[str, list[float]] = {w: [] for w in WAYS}
    prompt = [(7 * j) % 40000 + 100 for j in range(args.context)]
    try:
        for _ in range(args.rounds):
            for way in WAYS:
                # a fresh stream a block: the context stays near --context
                engine.submit(engine.make_request(prompt, _params(args.sampling, args.steps + 8)))
                decoder._lib = lib
                engine.step()
                engine.step()
                mine: list[float] = []
                decoder._lib = _Timed(lib, way, mine, sweep, logits)
                for i in range(args.steps):
                    t0 = time.perf_counter()
                    engine.step()
                    if i >= 4:  # each block's first steps aside
                        steps[way].append(time.perf_counter() - t0)
                        calls[way].append(mine[-1])
                decoder._lib = lib
                while engine.has_work():
                    engine.step()
    finally:
        decoder._lib = lib
    rows = {}
    print("| way | step ms: median | native call (or stand-in) ms: median | Python a step us: median |")
    print("|---|---|---|---|")
    for way in WAYS:
        python = [s - c for s, c in zip(steps[way], calls[way], strict=True)]
        rows[way] = {"step_ms": statistics.median(steps[way]) * 1e3, "call_ms": statistics.median(calls[way]) * 1e3,
                     "python_us": statistics.median(python) * 1e6, "steps": len(python)}
        r = rows[way]
        print(f"| {way} | {r['step_ms']:.3f} | {r['call_ms']:.3f} | {r['python_us']:.0f} |")
    print(f"swept / warm Python: **{rows['swept']['python_us'] / rows['warm']['python_us']:.1f}x**")
    if args.output_json:
        out = {"info": {**environment(), "args": recorded(vars(args)), "kernels": engine.runner.describe_kernels()},
               "ways": rows}
        Path(args.output_json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
