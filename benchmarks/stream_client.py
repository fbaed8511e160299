"""A streaming client in a process of its own, for `benchmarks.served_vs_offline`.

    python -m benchmarks.stream_client HOST:PORT

Each line on stdin is a round's ``max_tokens``; for each, one greedy chat request is streamed
with `WorkerClient` (as `llm-worker-cli generate` does) and one JSON line answers on stdout:
each token-bearing message's arrival time (``time.perf_counter``, whose clock the parent
shares on Linux) and token count, and this process's CPU seconds for the round. An empty
line or end of input ends it.

Why a process of its own: a user's client does not live in the process of an offline engine.
In the benchmark's own process, the client's thread paid for that process's size and shared
its interpreter with the loaded engine; measured, its CPU a token was ~0.45 ms there against
~0.33 ms here, and every one of those microseconds is taken from the served worker's two
compute threads on a two-core machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from clients.client import WorkerClient

PROMPT = ("Write a long, detailed story about a lighthouse keeper who finds a message in a "
          "bottle, with many characters and places.")


def stream_round(client: WorkerClient, max_tokens: int) -> dict[str, object]:
    cpu0 = time.process_time()
    times, counts = [time.perf_counter()], [0]
    for resp in client.generate(messages=[{"role": "user", "content": PROMPT}],
                                max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        if resp.HasField("chunk") and resp.chunk.token_ids:
            times.append(time.perf_counter())
            counts.append(len(resp.chunk.token_ids))
    return {"times": times, "counts": counts, "cpu_s": time.process_time() - cpu0}


def answer_rounds(run_round: Callable[[int], dict[str, Any]]) -> None:
    """A round child's side of the line protocol (this client's and
    benchmarks.offline_engine's): each stdin line a round's max_tokens, answered by one JSON
    line on stdout; an empty line or end of input ends it."""
    for line in sys.stdin:
        if not line.strip():
            break
        print(json.dumps(run_round(int(line))), flush=True)


def ask_round(child: subprocess.Popen[str], max_tokens: int) -> dict[str, Any]:
    """The parent's side: one round of `child` (this process sleeps until it ends)."""
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(f"{max_tokens}\n")
    child.stdin.flush()
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"{' '.join(map(str, child.args))[:200]} exited")
    return json.loads(line)


def main() -> None:
    (address,) = sys.argv[1:]
    with WorkerClient(address, timeout=600, retry=False) as client:
        answer_rounds(lambda max_tokens: stream_round(client, max_tokens))


if __name__ == "__main__":
    main()
