"""The transformers peer: `generate` in static batches on transformers' own load of the GGUF.

What a server without continuous batching does: take B requests, left-pad them, decode
greedily until the longest is done, then the next B. Each request must produce exactly its
asked-for number of tokens (EOS ignored) and only those count, so both systems do the same
useful work. Shared with clients.bench_offline. Runs in this process, float32, on the CPU.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from typing import Any


def load_hf_model() -> Any:
    """transformers' own load of the default GGUF, float32 (as tests/conftest.py does)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from worker.weights import default_model_path

    hf_logging.disable_progress_bar()
    path = default_model_path()
    with contextlib.redirect_stderr(io.StringIO()):  # its GGUF loader's own progress bar
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


def hf_generate_batch(
    hf_model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int
) -> list[list[int]]:
    """One left-padded greedy batch of exactly `new_tokens` new tokens per row.

    ``eos_token_id=[]`` is transformers' ignore_eos: EOS neither stops a row nor is
    suppressed (``min_new_tokens`` alone would forbid EOS and change the greedy tokens
    wherever the model wants to end); ``min_new_tokens`` is then a no-op kept for intent.
    """
    import torch

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = hf_model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, eos_token_id=[], pad_token_id=pad_id,
        )
    assert out.shape[1] == width + new_tokens, (out.shape, width, new_tokens)
    return out[:, width:].tolist()


def run_static_batches(
    hf_model: Any, prompts: list[list[int]], output_lens: list[int], batch_size: int, pad_id: int
) -> dict[str, Any]:
    """Every request in order, B at a time, after a small warm-up batch; wall time and counts."""
    hf_generate_batch(hf_model, prompts[:2], 4, pad_id)
    tokens: list[list[int]] = []
    steps = 0
    t0 = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        lens = output_lens[b : b + batch_size]
        rows = hf_generate_batch(hf_model, prompts[b : b + batch_size], max(lens), pad_id)
        tokens += [row[:n] for row, n in zip(rows, lens, strict=True)]  # only its own length
        steps += max(lens)
    wall = time.perf_counter() - t0
    out = sum(map(len, tokens))
    return {"requests": len(tokens), "output_tokens": out, "wall_s": wall, "steps": steps,
            "output_throughput": out / wall, "tokens": tokens}
