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
import sys
import time

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


def main() -> None:
    (address,) = sys.argv[1:]
    with WorkerClient(address, timeout=600, retry=False) as client:
        for line in sys.stdin:
            if not line.strip():
                break
            print(json.dumps(stream_round(client, int(line))), flush=True)


if __name__ == "__main__":
    main()
