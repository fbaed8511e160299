"""When each request is sent, and how many may be in flight at once.

- Poisson at `rate` requests/s: exponential gaps with mean 1/rate (seeded); the first
  request goes at once.
- Burst (rate ``inf``): every request at time 0.
- Fixed concurrency: a cap on requests in flight (``--max-concurrency C``); with a burst it
  keeps exactly C busy, with Poisson it bounds the queue the server sees. A request waiting
  for a slot is not yet sent: its TTFT starts when it gets one (as in vLLM).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")
R = TypeVar("R")


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds after the start: Poisson at `rate`, or all 0 when it is inf."""
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    gaps = np.random.default_rng([seed, 30]).exponential(1.0 / rate, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


async def dispatch(
    items: Sequence[T],
    send: Callable[[T], Awaitable[R]],
    offsets: Sequence[float],
    max_concurrency: int | None = None,
    on_done: Callable[[R], None] | None = None,
) -> tuple[list[R], int]:
    """Call `send(item)` for each item at its offset, under the concurrency cap.

    Returns the results in item order and the most requests that were ever in flight.
    """
    assert len(items) == len(offsets)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    in_flight = peak = 0
    start = time.perf_counter()

    async def one(item: T) -> R:
        nonlocal in_flight, peak
        if sem is not None:
            await sem.acquire()
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            result = await send(item)
        finally:
            in_flight -= 1
            if sem is not None:
                sem.release()
        if on_done is not None:
            on_done(result)
        return result

    tasks: list[asyncio.Task[R]] = []
    for item, at in zip(items, offsets, strict=True):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(item)))
    results = await asyncio.gather(*tasks)
    return list(results), peak
