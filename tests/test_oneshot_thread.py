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


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled(baseline: int, timeout_s: float = 3.0) -> int:
    """The process's thread count once it stops falling towards `baseline` (exiting threads
    take a moment to go)."""
    deadline = time.monotonic() + timeout_s
    while _threads() > baseline and time.monotonic() < deadline:
        time.sleep(0.02)
    return _threads()


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
    async def main() -> tuple[int, int, int]:
        before = _settled(0, 0.0)
        await in_oneshot_thread(_parallel_op)
        after_oneshot = _settled(before)
        # What the engine's build did before: an executor thread runs the same op, and it and
        # its OpenMP pool stay (this is what libgomp counts against the CPUs).
        await asyncio.to_thread(_parallel_op)
        after_executor = _settled(before, 0.5)
        return before, after_oneshot, after_executor

    before, after_oneshot, after_executor = asyncio.run(main())
    assert after_oneshot == before, (before, after_oneshot)
    assert after_executor >= before + 2, (before, after_executor)  # the executor thread + its pool
