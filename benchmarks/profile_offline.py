"""Where an offline run's engine steps spend their time: inside the model (ModelRunner.execute)
or outside it (scheduler, KV-cache bookkeeping, outputs), under cProfile. For changes to the
bookkeeping, whose cost is lost in a whole run's noise on a shared machine:

    python -m benchmarks.profile_offline -- --seed 0 --batch-size 8 --systems continuous --repeat 1

`--module clients.bench_offline` profiles an older checkout's offline benchmark (before issue 18).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import runpy
import sys


def _cumulative(stats: pstats.Stats, path_suffix: str, name: str) -> tuple[int, float]:
    calls, seconds = 0, 0.0
    for (fn, _line, fname), (_cc, nc, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if fname == name and fn.replace("\\", "/").endswith(path_suffix):
            calls, seconds = calls + nc, seconds + ct
    return calls, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--module", default="benchmarks.offline", help="the offline benchmark to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments, after --")
    a = p.parse_args()
    sys.argv = [a.module, *[x for x in a.args if x != "--"]]
    prof = cProfile.Profile()
    prof.enable()
    try:
        runpy.run_module(a.module, run_name="__main__")
    except SystemExit:
        pass
    prof.disable()
    stats = pstats.Stats(prof)
    steps, step_s = _cumulative(stats, "worker/engine.py", "step")
    _, model_s = _cumulative(stats, "worker/model_runner.py", "execute")
    outside = step_s - model_s
    print(f"engine steps {steps}: {step_s:.2f} s, of which the model {model_s:.2f} s and outside "
          f"it {outside:.3f} s ({1000 * outside / max(steps, 1):.3f} ms a step, under cProfile)")


if __name__ == "__main__":
    main()
