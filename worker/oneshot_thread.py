"""Torch work off the engine thread, in a thread that ends when the work does.

Why not ``asyncio.to_thread``: the first parallel torch op (or kernel) a thread runs gives it
a pool of OpenMP threads (libgomp, shared with torch), and the pool lives as long as its
thread. An executor's threads never end, so building the engine there left a second pool
beside the engine thread's. libgomp then manages more threads than the machine has CPUs and
throttles every waiting thread to ~100 spins before it sleeps (GOMP_SPINCOUNT covers only
the unthrottled case): the engine thread's partner slept between steps and after torch ops,
and each parallel region began with a futex wake-up (1.5 sleeps a token, measured served;
none offline, where one pool exists). A thread that ends takes its pool with it.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def in_oneshot_thread(fn: Callable[..., T], *args: Any, thread_name: str = "oneshot") -> T:
    """``fn(*args)`` in a new thread (with the caller's context variables, as
    ``asyncio.to_thread``); its result or exception. Cancelling the wait leaves the thread
    to finish on its own."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()
    ctx = contextvars.copy_context()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():  # the waiter was cancelled
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run() -> None:
        try:
            result = (True, ctx.run(fn, *args))
        except BaseException as e:  # handed to the waiter, never lost in the thread
            result = (False, e)
        try:
            loop.call_soon_threadsafe(settle, *result)
        except RuntimeError:  # the loop closed meanwhile: nobody waits any more
            pass

    threading.Thread(target=run, name=thread_name, daemon=True).start()
    return await fut
