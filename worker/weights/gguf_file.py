"""A GGUF file's model config, its tensors' Hugging Face names, and the float values of a
tensor (the `gguf` package's dequantizers); worker/weights/gguf_load.py builds the model
from them one tensor at a time."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from ops.rotary import RopeScaling
from worker.models.llama import QK_NORM_ARCHITECTURES, LlamaConfig
from worker.weights import gguf_families
from worker.weights.gguf_meta import Metadata
from worker.weights.gguf_reader import GGUFFile

# GGUF architecture -> (HF architecture, are q/k stored permuted for interleaved rotary?)
# (phi3, gemma2, gemma3: worker/weights/gguf_families.py)
_ARCHS = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False),
          "qwen3": ("Qwen3ForCausalLM", False), "phi3": ("Phi3ForCausalLM", False),
          "gemma2": ("Gemma2ForCausalLM", False), "gemma3": ("Gemma3ForCausalLM", False)}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
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


def count(reader: GGUFFile, path: Path, key: str, default: int | None = None) -> int:
    """A positive integer the model's shape needs; missing or other: refused naming the key."""
    v = field(reader, key, default)
    if v is None:
        raise ValueError(f"{path}: GGUF metadata has no {key} (the model's shape needs it)")
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
        raise ValueError(f"{path}: GGUF {key} = {str(v)[:100]!r}: a positive integer expected "
                         "(one value for every layer)")
    return int(v)


def config_from_gguf(reader: GGUFFile, path: Path) -> LlamaConfig:
    meta = Metadata(reader.fields, path)
    arch = meta.string("general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"{path}: unknown GGUF architecture {arch!r}; supported: {', '.join(_ARCHS)}")
    hidden = count(reader, path, f"{arch}.embedding_length")
    heads = count(reader, path, f"{arch}.attention.head_count")
    names = {t.name for t in reader.tensors}
    vocab = meta.integer(f"{arch}.vocab_size", low=1) or len(meta.strings("tokenizer.ggml.tokens") or ())
    if not vocab:
        raise ValueError(f"{path}: GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    head_dim = count(reader, path, f"{arch}.attention.key_length", hidden // heads)
    _refuse_unused(meta, path, arch, head_dim)
    rotary_dim = _rotary_dim(reader, path, arch, head_dim)
    context = count(reader, path, f"{arch}.context_length", 4096)
    scaling = _rope_scaling(meta, arch, path, context)
    if scaling is not None and scaling.context_length is not None:
        context = max(context, scaling.context_length)
    fields = dict(
        architecture=_ARCHS[arch][0],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=count(reader, path, f"{arch}.feed_forward_length"),
        num_layers=count(reader, path, f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=count(reader, path, f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=meta.number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta.number(f"{arch}.rope.freq_base", 10000.0),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        rope_freq_factors=_rope_freq_factors(reader, path, head_dim),
        rope_scaling=scaling,
        partial_rotary_factor=rotary_dim / head_dim,
        qk_norm=_ARCHS[arch][0] in QK_NORM_ARCHITECTURES,
    )
    if arch == "phi3":
        fields.update(gguf_families.phi3_fields(reader, path, fields, rotary_dim))
    if arch in gguf_families.GEMMA:
        return gguf_families.gemma_config(reader, path, arch, fields)
    return LlamaConfig(**fields)


def _rotary_dim(reader: GGUFFile, path: Path, arch: str, head_dim: int) -> int:
    """{arch}.rope.dimension_count: how many of a head's dimensions rotate (its first ones,
    llama.cpp's NEOX rotary as transformers' partial_rotary_factor). A permuted (interleaved)
    layout rotating part of a head is refused: unpermute works on whole heads."""
    key = f"{arch}.rope.dimension_count"
    dim = count(reader, path, key, head_dim)
    if dim == head_dim:
        return dim
    if _ARCHS[arch][1]:
        raise ValueError(f"{path}: GGUF {key} = '{dim}': rotary over part of a head (head_dim {head_dim}) is "
                         f"not supported where q/k are stored permuted ({arch})")
    if dim > head_dim or dim % 2 or int(head_dim * (dim / head_dim)) != dim:
        raise ValueError(f"{path}: GGUF {key} = '{dim}': the rotating dimensions of a head of {head_dim} "
                         "must be an even count, at most head_dim")
    return dim


def _rope_scaling(meta: Metadata, arch: str, path: Path, context: int) -> RopeScaling | None:
    """The rope scaling convert_hf_to_gguf wrote ({arch}.rope.scaling.*: Qwen's YaRN), as the
    Hugging Face config's would be; llama3's goes to rope_freqs instead (_rope_freq_factors)."""
    kind = meta.string(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "longrope" and arch == "phi3":
        return None  # its factors are tensors: gguf_families.phi3_fields
    if kind not in ("linear", "yarn"):
        raise ValueError(f"{path}: {arch}.rope.scaling.type {str(kind)[:40]!r} is not supported (linear, yarn)")
    key = f"{arch}.rope.scaling"
    rs = {"rope_type": kind, "factor": meta.number(f"{key}.factor"),
          "original_max_position_embeddings": meta.integer(f"{key}.original_context_length", low=1),
          "attention_factor": meta.number(f"{key}.attn_factor"),
          "beta_fast": meta.number(f"{key}.yarn_beta_fast"),
          "beta_slow": meta.number(f"{key}.yarn_beta_slow")}
    try:
        return RopeScaling.from_hf({k: v for k, v in rs.items() if v is not None}, context)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def _refuse_unused(meta: Metadata, path: Path, arch: str, head_dim: int) -> None:
    """Refuse metadata that would change the model's arithmetic if it were ignored: the
    model would load and compute something else. (llama.cpp's keys, llama-arch.cpp.)"""
    def bad(key: str, value: Any, why: str) -> ValueError:
        return ValueError(f"{path}: GGUF {key} = {str(value)[:100]!r}: {why}")

    # {arch}.rope.scaling.type: _rope_scaling takes linear and yarn and refuses the rest
    key = f"{arch}.expert_count"
    if n := meta.integer(key, 0):
        raise bad(key, n, "mixture-of-experts models are not supported")
    key = f"{arch}.attention.value_length"
    if (n := meta.integer(key, head_dim, low=1)) != head_dim:
        raise bad(key, n, f"a value head size other than the key's ({head_dim}) is not supported")


def _rope_freq_factors(reader: GGUFFile, path: Path, head_dim: int) -> tuple[float, ...] | None:
    """The `rope_freqs` tensor (Llama 3.1+: llama.cpp's freq_factors): one divisor per pair of
    rotary dimensions, applied to the base frequencies (theta_i / factor_i). convert_hf_to_gguf
    writes it from the Hugging Face config's llama3 rope_scaling; None without it."""
    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return None
    if t.tensor_type.name != "F32" or t.shape != (head_dim // 2,):
        raise ValueError(f"{path}: rope_freqs is {t.tensor_type.name} of shape {list(t.shape)}; "
                         f"F32 of [{head_dim // 2}] (head_dim / 2) expected")
    factors = np.array(t.data, dtype=np.float32)
    if not (np.isfinite(factors).all() and (factors > 0).all()):
        raise ValueError(f"{path}: rope_freqs holds a factor that is not finite and positive")
    return tuple(float(f) for f in factors)


# Tensors that are not model weights: read into the config (rope_freqs, LongRoPE's factors).
CONFIG_TENSORS = ("rope_freqs.weight", *gguf_families.LONGROPE_TENSORS)


def hf_name(name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor of an `arch` model ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight"); ValueError for a tensor we do not know."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    names = {**_LAYER_NAMES, **gguf_families.LAYER_NAMES.get(arch, {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    raise ValueError(f"unexpected GGUF tensor {name[:100]!r}")


def permuted_heads(name: str, cfg: LlamaConfig, arch: str) -> int | None:
    """How many heads a q/k tensor's rows are permuted over (llama.cpp's interleaved rotary
    layout, `unpermute` undoes it), or None for a tensor stored as Hugging Face stores it."""
    if not _ARCHS[arch][1]:
        return None
    part = name.rpartition(".")[0].rpartition(".")[2]  # "blk.3.attn_q.weight" -> "attn_q"
    return {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(part) if name.startswith("blk.") else None


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
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
