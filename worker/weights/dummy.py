"""Random weights of a named shape, for benchmarks that send token ids."""

from __future__ import annotations

import torch

from ops.rotary import RopeScaling
from worker.models.llama import LlamaConfig, LlamaForCausalLM

_LLAMA3 = dict(architecture="LlamaForCausalLM", vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0)

SHAPES: dict[str, LlamaConfig] = {
    "llama-3-8b": LlamaConfig(
        **_LLAMA3, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=8192, tie_word_embeddings=False,
    ),
    # Llama 3.1 70B's shape: 141 GB in bfloat16, more than one 80 GB GPU (tensor parallelism).
    "llama-3-70b": LlamaConfig(
        **_LLAMA3, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
        num_kv_heads=8, head_dim=128, max_position_embeddings=8192, tie_word_embeddings=False,
    ),
    "llama-3.2-1b": LlamaConfig(
        **_LLAMA3, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
    ),
    "smollm2-135m": LlamaConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
    ),
}


def dummy_config(shape: str) -> LlamaConfig:
    if shape not in SHAPES:
        raise ValueError(f"unknown dummy shape {shape!r}; known: {', '.join(SHAPES)}")
    return SHAPES[shape]


@torch.no_grad()
def init_dummy(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Small random weights (std 0.02; norms 1) so activations stay finite."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm") or name.endswith("layernorm"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
