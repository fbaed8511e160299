"""``--peer transformers``: the same requests through transformers' static batching, in the
same invocation, and the ratio of our output tokens/s to theirs.

The worker's figure is its first run's output throughput (use ``--request-rate inf`` for an
offline-style comparison: everything queued at once, as the peer sees it). The peer runs
after the worker has answered, as a child process (``python -m benchmarks.peer``, which
needs the worker's packages and transformers installed), so the two never share the CPU
and this package imports nothing of the engine. Its prompts are the ids the worker
computes, made here with the worker's own tokenizer files (`clients.bench.tokenizer`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from clients.bench.dataset import BenchRequest
from clients.bench.tokenizer import pad_id, prompt_ids

PEERS = ("transformers",)
PEER_COMMAND = (sys.executable, "-m", "benchmarks.peer")


def run_peer(
    name: str,
    requests: list[BenchRequest],
    *,
    batch_size: int,
    threads: int | None,  # CPU threads (the peer's torch.set_num_threads)
    tokenizer: Any,  # a `load_tokenizer` result; None when every request is token ids
    ours_output_throughput: float,
    model: str = "default",
) -> dict[str, Any]:
    assert name == "transformers", name
    job = {
        "prompts": [prompt_ids(r, tokenizer) for r in requests],
        "output_lens": [r.output_len for r in requests],
        "batch_size": batch_size,
        "threads": threads,
        "model": model,
        "pad_id": pad_id(tokenizer),
    }
    done = subprocess.run(PEER_COMMAND, input=json.dumps(job), capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the peer ({' '.join(PEER_COMMAND[1:])}) exited {done.returncode}: "
                           f"{done.stderr[-2000:]}")
    r = json.loads(done.stdout)
    return {**r, "ours_output_throughput": ours_output_throughput,
            "ratio": ours_output_throughput / r["output_throughput"]}
