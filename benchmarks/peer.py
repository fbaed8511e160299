"""``python -m benchmarks.peer``: transformers' static batching on given prompts, for
``llm-worker-bench --peer transformers``, which runs it as a child process (the load
generator imports nothing of the engine or of transformers).

Reads one JSON object on stdin::

    {"prompts": [[token ids], ...], "output_lens": [n, ...], "batch_size": B,
     "threads": T or null, "model": "default" | "dummy:SHAPE", "pad_id": id}

and writes the figures as one JSON object on stdout (`peer_figures`). The prompts are the
ids the worker computes (the client tokenizes with the worker's own tokenizer files).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

from benchmarks.peer_transformers import load_hf_model, run_static_batches


def peer_figures(
    prompts: list[list[int]], output_lens: list[int], *, batch_size: int,
    threads: int | None, model: str, pad_id: int,
) -> dict[str, Any]:
    """Every prompt through transformers' `generate`, B at a time; the wall time and counts."""
    import torch

    if len(prompts) != len(output_lens) or not prompts:
        raise ValueError(f"{len(prompts)} prompts for {len(output_lens)} output lengths")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    torch.set_num_threads(threads or os.cpu_count() or 1)
    hf = load_hf_model(model)
    r = run_static_batches(hf, prompts, output_lens, batch_size, pad_id)
    del r["tokens"]
    return {
        "system": f"transformers static batching (generate, greedy, {str(hf.dtype).removeprefix('torch.')})",
        "model": model,
        "device": str(hf.device),
        "batch_size": batch_size,
        "threads": torch.get_num_threads(),
        **r,
    }


def main() -> int:
    job = json.load(sys.stdin)
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the result alone
        out = peer_figures(job["prompts"], job["output_lens"], batch_size=job["batch_size"],
                           threads=job.get("threads"), model=job.get("model", "default"),
                           pad_id=job.get("pad_id", 0))
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
