"""GGUF weights (the embedded default model): dequantized with the `gguf` package
and renamed to Hugging Face names; the quantized blocks of the linear layers are also kept
(`quantized_linears`) for the CPU kernel that computes on them (ops/quantized_linear.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ops.quantized_linear import QuantizedWeight, supports
from worker.models.llama import LlamaConfig, fuse_shards, our_name
from worker.weights.gguf_reader import GGUFFile

# GGUF architecture -> (HF architecture, are q/k stored permuted for interleaved rotary?)
_ARCHS = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_reader(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def config_from_gguf(reader: GGUFFile, path: Path) -> LlamaConfig:
    arch = field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"{path}: unknown GGUF architecture {arch!r}; supported: {', '.join(_ARCHS)}")
    hidden = int(field(reader, f"{arch}.embedding_length"))
    heads = int(field(reader, f"{arch}.attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = field(reader, f"{arch}.vocab_size") or len(reader.fields.get("tokenizer.ggml.tokens", ()))
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path}: GGUF files with rope_freqs (Llama 3.1 scaling) are not supported; "
                         "load the Hugging Face folder instead")
    return LlamaConfig(
        architecture=_ARCHS[arch][0],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(field(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (interleaved pairs -> rotate-half halves).

    Per head, llama.cpp stores rows as (x0, x_half, x1, x_half+1, ...); Hugging
    Face's rotate-half layout wants (x0, x1, ..., x_half, ...).
    """
    head_rows = w.shape[0] // n_head
    return w.reshape(n_head, head_rows // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 values of a tensor's data, bit for bit as gguf.quants.dequantize gives them
    (the same float32 operations in the same order), for the common block types over the
    whole tensor at once: gguf's own goes through row groups, ~2x slower on the default
    model's Q4_1 linears."""
    if qtype not in _BLOCK_LAYOUT:
        from gguf.quants import dequantize

        return dequantize(data, qtype).astype(np.float32, copy=False)
    head, block = _BLOCK_LAYOUT[qtype]
    b = data.reshape(-1, block)  # one row a block
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    if qtype == GGMLQuantizationType.Q8_0:
        values = b[:, head:].view(np.int8).astype(np.float32) * d
    else:
        qs = b[:, head:]  # 16 bytes: the block's first 16 quants in low nibbles, the rest high
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        if qtype == GGMLQuantizationType.Q4_0:
            values = d * (q.view(np.int8) - np.int8(8)).astype(np.float32)
        else:
            m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
            values = (d * q.astype(np.float32)) + m
    return values.reshape(*data.shape[:-1], -1)


# block type -> (bytes before the quants, bytes of a block of 32)
_BLOCK_LAYOUT = {GGMLQuantizationType.Q4_0: (2, 18), GGMLQuantizationType.Q4_1: (4, 20),
                 GGMLQuantizationType.Q8_0: (2, 34)}


def iter_gguf_weights(
    reader: GGUFFile, cfg: LlamaConfig, arch: str, quantized: dict[str, QuantizedWeight] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor; with `quantized`, also put there
    the file's blocks of every 2-D weight the CPU kernel can run (rows unpermuted alike)."""
    permuted = _ARCHS[arch][1]
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if m:
            if m.group(2) not in _LAYER_NAMES:
                raise ValueError(f"unexpected GGUF tensor {t.name!r}")
            hf = f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
        elif t.name in _GLOBAL_NAMES:
            hf = _GLOBAL_NAMES[t.name]
        else:
            raise ValueError(f"unexpected GGUF tensor {t.name!r}")
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dims fastest-first
        w = dequantize_tensor(t.data, t.tensor_type).reshape(shape)
        blocks = np.asarray(t.data)  # [rows, bytes per row] for a block-quantized matrix
        heads = None
        if permuted and m and m.group(2) in ("attn_q.weight", "attn_q.bias"):
            heads = cfg.num_heads
        elif permuted and m and m.group(2) in ("attn_k.weight", "attn_k.bias"):
            heads = cfg.num_kv_heads
        if heads:
            w = _unpermute(w, heads)
        qtype = t.tensor_type.name
        if quantized is not None and supports(qtype, tuple(shape)) and blocks.shape[0] == shape[0]:
            # A permutation of rows: each row's blocks move whole.
            quantized[hf] = QuantizedWeight(qtype, _unpermute(blocks, heads) if heads else blocks,
                                            (shape[0], shape[1]))
        yield hf, torch.from_numpy(np.require(w, requirements=["C", "W"]))


def quantized_linears(by_hf_name: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    """Quantized weights keyed by the model's module names ("layers.0.self_attn.qkv_proj",
    "embed_tokens"), fused as the model fuses them; a fusion of mixed types is left out."""
    named = ((our_name(h), qw) for h, qw in by_hf_name.items())
    weights = ((n, qw) for n, qw in named if n is not None and n.endswith(".weight"))
    return {name.removesuffix(".weight"): qw for name, qw in fuse_shards(weights, _cat_rows, set())}


def _cat_rows(ws: list[QuantizedWeight]) -> QuantizedWeight | None:
    """Shards stacked by rows, as torch.cat stacks the float32 ones; None for mixed types."""
    if len({w.qtype for w in ws}) != 1:
        return None
    blocks = np.concatenate([w.blocks for w in ws])
    return QuantizedWeight(ws[0].qtype, blocks, (blocks.shape[0], ws[0].shape[1]))
