"""``--peer transformers``: the same requests through transformers' static batching, in the
same invocation, and the ratio of our output tokens/s to theirs.

The worker's figure is its first run's output throughput (use ``--request-rate inf`` for an
offline-style comparison: everything queued at once, as the peer sees it). The peer runs
after the worker has answered, in this process, so the two never share the CPU.
"""

from __future__ import annotations

import os
from typing import Any

from clients.bench.dataset import BenchRequest

PEERS = ("transformers",)


def run_peer(
    name: str,
    requests: list[BenchRequest],
    *,
    batch_size: int,
    threads: int | None,  # CPU threads (the peer's torch.set_num_threads)
    tokenizer_path: str | None,
    ours_output_throughput: float,
    model: str = "default",
) -> dict[str, Any]:
    assert name == "transformers", name
    import torch

    from clients.bench.peer_transformers import load_hf_model, run_static_batches
    from clients.bench.tokenizer import load_tokenizer, prompt_ids

    torch.set_num_threads(threads or os.cpu_count() or 1)
    tok = load_tokenizer(tokenizer_path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_ids[0]
    prompts = [prompt_ids(r, tok) for r in requests]
    hf = load_hf_model(model)
    r = run_static_batches(
        hf, prompts, [q.output_len for q in requests], batch_size, pad
    )
    del r["tokens"]
    return {
        "system": f"transformers static batching (generate, greedy, {str(hf.dtype).removeprefix('torch.')})",
        "model": model,
        "device": str(hf.device),
        "batch_size": batch_size,
        "threads": torch.get_num_threads(),
        **r,
        "ours_output_throughput": ours_output_throughput,
        "ratio": ours_output_throughput / r["output_throughput"],
    }
