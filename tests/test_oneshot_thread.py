"""worker.oneshot_thread: torch work off the engine thread leaves no OpenMP pool behind."""

from __future__ import annotations

import asyncio
import contextvars
import os
import time

import pytest
import torch

from worker.oneshot_thread import in_oneshot_thread

_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("_VAR", default="unset")


def _tids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _new_threads(before: set[str], timeout_s: float = 3.0) -> set[str]:
    """Threads alive now that were not in `before`, once they stop going away (exiting threads
    take a moment). Counted by id, not number: a thread an earlier test left may exit meanwhile."""
    deadline = time.monotonic() + timeout_s
    while (new := _tids() - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    return new


def _parallel_op() -> float:
    x = torch.arange(1 << 22, dtype=torch.float32)
    return float((x * 0.5).sum())  # large enough for torch to use its OpenMP threads


def test_result_exception_and_context() -> None:
    async def main() -> None:
        _VAR.set("caller's")
        assert await in_oneshot_thread(lambda a, b: (a + b, _VAR.get()), 2, 3) == (5, "caller's")
        with pytest.raises(ZeroDivisionError):
            await in_oneshot_thread(lambda: 1 / 0)

    asyncio.run(main())


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
                    reason="needs /proc and two torch threads")
def test_parallel_torch_work_leaves_no_pool_behind() -> None:
    async def main() -> tuple[set[str], set[str]]:
        before = _tids()
        await in_oneshot_thread(_parallel_op)
        left_by_oneshot = _new_threads(before)
        # What the engine's build did before: an executor thread runs the same op, and it and
        # its OpenMP pool stay (this is what libgomp counts against the CPUs).
        await asyncio.to_thread(_parallel_op)
        left_by_executor = _new_threads(before, 0.5)
        return left_by_oneshot, left_by_executor

    left_by_oneshot, left_by_executor = asyncio.run(main())
    assert not left_by_oneshot, left_by_oneshot
    assert len(left_by_executor) >= 2, left_by_executor  # the executor thread + its pool
