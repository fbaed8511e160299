"""Whether a latency stayed flat over a soak: a verdict that noise does not trip.

The soak used to compare the p99 TTFT of its first and last windows: of ~20 requests each,
that is each window's maximum, one request's bad luck (a CI machine's neighbour, a GC).
Here both of two robust estimates must have grown past `max_growth` for a slowdown:

- the median of the last full window against the first's (each median shrugs off up to
  half its window), and
- the Theil-Sen trend of all requests' TTFTs against their send times (the median of all
  pairwise slopes, shrugging off ~29% of the points anywhere), from the run's start to the
  last full window's end.

A leak or a list that grows per request raises TTFTs steadily, so it moves both; a burst
of load beside the worker moves the window medians it falls in but hardly the trend, and
a steady load beside it moves neither (it slows the first window as much as the last).
Values under `floor_s` count as `floor_s`: a doubling from 10 to 20 ms is no slowdown.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MAX_PAIRS = 200_000  # beyond this many points' pairs, every k-th point (a long soak's 600 s)


@dataclass(frozen=True)
class Flatness:
    first_median_s: float
    last_median_s: float
    trend_start_s: float
    trend_end_s: float
    max_growth: float
    floor_s: float

    @property
    def window_growth(self) -> float:
        return max(self.last_median_s, self.floor_s) / max(self.first_median_s, self.floor_s)

    @property
    def trend_growth(self) -> float:
        return max(self.trend_end_s, self.floor_s) / max(self.trend_start_s, self.floor_s)

    @property
    def flat(self) -> bool:
        return self.window_growth <= self.max_growth or self.trend_growth <= self.max_growth

    def __str__(self) -> str:
        return (f"window medians {self.first_median_s:.3f}s -> {self.last_median_s:.3f}s "
                f"(x{self.window_growth:.2f}); trend {self.trend_start_s:.3f}s -> "
                f"{self.trend_end_s:.3f}s (x{self.trend_growth:.2f}); slowdown when both > "
                f"x{self.max_growth:g}")


def theil_sen(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(slope, intercept) of the median pairwise slope and the median residual."""
    pts = sorted(points)
    step = 1
    while (len(pts) // step) ** 2 // 2 > MAX_PAIRS:
        step += 1
    pts = pts[::step]
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(pts)
              for x2, y2 in pts[i + 1:] if x2 > x1]
    slope = statistics.median(slopes) if slopes else 0.0
    return slope, statistics.median(y - slope * x for x, y in pts)


def judge(samples: Sequence[tuple[float, float]], window_s: float, duration_s: float,
          max_growth: float = 2.0, floor_s: float = 0.05) -> Flatness:
    """`samples`: (sent at, seconds from the start; TTFT) of the requests that got a first
    token. Windows of `window_s` from 0; the last one counts only if the run filled it."""
    if not samples:
        raise ValueError("no samples to judge")
    num_full = max(1, int(duration_s // window_s))
    windows = [[t for s, t in samples if k * window_s <= s < (k + 1) * window_s]
               for k in range(num_full)]
    full = [w for w in windows if w] or [[t for _, t in samples]]
    slope, intercept = theil_sen(samples)
    return Flatness(first_median_s=statistics.median(full[0]),
                    last_median_s=statistics.median(full[-1]),
                    trend_start_s=intercept, trend_end_s=intercept + slope * num_full * window_s,
                    max_growth=max_growth, floor_s=floor_s)
