"""Length distributions for prompts and outputs, written as short specs on the command line.

    128                     fixed: every request 128 tokens (also ``fixed:128``)
    uniform:64:256          uniform integers in [64, 256]
    lognormal:24:0.8:320    lognormal with median 24 and sigma 0.8, clipped to [1, 320]
    longtail                the chat output model (below); ``longtail:64`` caps it at 64

The long tail: lognormal with median 24 (sigma 0.8) clipped to [4, 200], then (n + 8) // 16
requests (4 of 64) at seeded positions get 201..320 tokens. Most requests are short and a
few are long, which is where static batching wastes work and continuous batching does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KINDS = ("fixed", "uniform", "lognormal", "longtail")


def long_tailed(n: int, rng: np.random.Generator, max_len: int = 320) -> list[int]:
    """The long-tailed output lengths (module docstring), drawn from `rng`, capped at `max_len`."""
    lens = np.clip(np.rint(np.exp(rng.normal(np.log(24), 0.8, n))), 4, 200).astype(int)
    n_long = (n + 8) // 16
    where = rng.choice(n, size=n_long, replace=False)
    lens[where] = rng.integers(201, 321, size=n_long)
    return [int(x) for x in np.clip(lens, 1, max_len)]


def output_lengths(n: int, seed: int, max_len: int = 320) -> list[int]:
    """`long_tailed` from its own seeded stream (what benchmarks.offline has always used)."""
    return long_tailed(n, np.random.default_rng(seed), max_len)


@dataclass(frozen=True)
class LengthDist:
    """One distribution of token counts; `spec` is how it was written."""

    kind: str
    a: float = 0.0  # fixed: the length; uniform: low; lognormal: median
    b: float = 0.0  # uniform: high; lognormal: sigma
    cap: int = 320  # lognormal and longtail: the largest length

    def sample(self, n: int, rng: np.random.Generator) -> list[int]:
        if self.kind == "fixed":
            return [int(self.a)] * n
        if self.kind == "uniform":
            return [int(x) for x in rng.integers(int(self.a), int(self.b) + 1, size=n)]
        if self.kind == "lognormal":
            x = np.rint(np.exp(rng.normal(np.log(self.a), self.b, n)))
            return [int(v) for v in np.clip(x, 1, self.cap)]
        assert self.kind == "longtail", self.kind
        return long_tailed(n, rng, self.cap)

    @property
    def spec(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        if self.kind == "lognormal":
            return f"lognormal:{self.a:g}:{self.b:g}:{self.cap}"
        return f"longtail:{self.cap}"


def parse_lengths(spec: str) -> LengthDist:
    """`LengthDist` from a spec (module docstring); ValueError names what is wrong."""
    kind, _, rest = spec.strip().partition(":")
    if kind.isdigit():
        kind, rest = "fixed", kind
    args = [x for x in rest.split(":") if x] if rest else []
    try:
        if kind == "fixed" and len(args) == 1:
            d = LengthDist("fixed", int(args[0]))
            ok = d.a >= 1
        elif kind == "uniform" and len(args) == 2:
            d = LengthDist("uniform", int(args[0]), int(args[1]))
            ok = 1 <= d.a <= d.b
        elif kind == "lognormal" and len(args) in (2, 3):
            cap = int(args[2]) if len(args) == 3 else 4096
            d = LengthDist("lognormal", float(args[0]), float(args[1]), cap)
            ok = d.a > 0 and d.b >= 0 and cap >= 1
        elif kind == "longtail" and len(args) <= 1:
            d = LengthDist("longtail", cap=int(args[0]) if args else 320)
            ok = d.cap >= 1
        else:
            ok = False
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"bad length spec {spec!r}: use N, uniform:LO:HI, lognormal:MEDIAN:SIGMA[:MAX] "
            "or longtail[:MAX]"
        )
    return d
