"""The transformers peer: `generate` in static batches on transformers' own load of the GGUF.

What a server without continuous batching does: take B requests, left-pad them, decode
greedily until the longest is done, then the next B. Each request must produce exactly its
asked-for number of tokens (EOS ignored) and only those count, so both systems do the same
useful work. Shared by benchmarks.offline and benchmarks.peer (llm-worker-bench --peer).
Runs in this process: the default model in float32 on the CPU; a ``dummy:SHAPE`` model
(random weights of one of the worker's dummy shapes, for token-id workloads) on CUDA in
bfloat16 when a GPU is present, as the worker serves it.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from typing import Any


def load_hf_model(model: str = "default") -> Any:
    """transformers' own model: the default GGUF (float32, as tests/conftest.py loads it), or
    ``dummy:SHAPE``, transformers' LlamaForCausalLM of that shape with its own random init,
    on CUDA in bfloat16 when a GPU is present (else the CPU in float32)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from worker.weights import default_model_path

    hf_logging.disable_progress_bar()
    if model.startswith("dummy:"):
        return _dummy_hf_model(model.removeprefix("dummy:"))
    if model != "default":
        raise ValueError(f"--peer-model: 'default' or dummy:SHAPE, not {model!r}")
    path = default_model_path()
    with contextlib.redirect_stderr(io.StringIO()):  # its GGUF loader's own progress bar
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return hf.eval()


def _dummy_hf_model(shape: str) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from worker.weights.dummy import dummy_config

    c = dummy_config(shape)
    rope = None
    if c.rope_scaling is not None:
        r = c.rope_scaling
        rope = {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                "high_freq_factor": r.high_freq_factor,
                "original_max_position_embeddings": r.original_max_position_embeddings}
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, rope_scaling=rope, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    cuda = torch.cuda.is_available()
    with torch.device("cuda" if cuda else "cpu"):
        hf = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
    return hf.eval()


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
    ids, mask = ids.to(hf_model.device), mask.to(hf_model.device)
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
