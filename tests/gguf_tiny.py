"""Tiny Llama GGUF files written with gguf-py's GGUFWriter (random blocks: any bit pattern
with finite scales is a valid block), for load-level tests that need no llama.cpp."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from benchmarks.gguf_blocks import random_weight
from worker.weights import default_model_path
from worker.weights.gguf_reader import GGUFFile


def _tiny_vocab(w: gguf.GGUFWriter, pre: str) -> int:
    """A byte-level vocabulary of 256 + a few tokens (as tests/test_tokenizer.py's)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    tokens = ["<|begin|>", "<|end|>", *alphabet, "Ġt"]
    tokens += [f"<|pad{i}|>" for i in range(288 - len(tokens))]  # 288: whole tiles of 32
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * 257 + [3] * (len(tokens) - 259))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    return len(tokens)


def _gguf_type(value: object) -> gguf.GGUFValueType:
    return {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32,
            str: gguf.GGUFValueType.STRING}[type(value)]


def _default_vocab(w: gguf.GGUFWriter, pre: str | None) -> int:
    """The default model's tokenizer metadata, every key copied (`pre` replacing its own),
    read with our reader (gguf-py's takes ~10 s over its 98,000 strings), typed as
    llama.cpp's converter writes them (ids u32, token types i32)."""
    src = GGUFFile(default_model_path())
    if pre is not None:
        w.add_tokenizer_pre(pre)
    for key, value in src.fields.items():
        if key.startswith("tokenizer.") and not (pre is not None and key == "tokenizer.ggml.pre"):
            if isinstance(value, list):
                sub = gguf.GGUFValueType.INT32 if key == "tokenizer.ggml.token_type" else _gguf_type(value[0])
                w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=sub)
            else:
                w.add_key_value(key, value, _gguf_type(value))
    return len(src.fields["tokenizer.ggml.tokens"])


def write_tiny_llama(path: Path, qtype: str = "Q8_0", hidden: int = 64, layers: int = 1,
                     vocab: str = "tiny", pre: str | None = None, seed: int = 0,
                     types: dict[str, str] | None = None,
                     more: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """A Llama of `layers` layers (hidden / 32 heads of 32, 1 KV head, intermediate 2 x hidden), its
    matrices in `qtype` (quantized by gguf-py from N(0, 0.05) values) or as `types` says by
    the tensor's kind ({"attn_v": "Q6_K"}: a Q4_K_M-like mix), norms F32, the embedding tied.
    `vocab`: "tiny" or "default" (the default model's tokenizer); `more` adds metadata."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    n_vocab = _default_vocab(w, pre) if vocab == "default" else _tiny_vocab(w, pre or "gpt2")
    head_dim, inter = 32, 2 * hidden
    heads = hidden // head_dim
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if more is not None:
        more(w)

    def matrix(name: str, rows: int, cols: int) -> None:
        values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        kind = name.removesuffix(".weight").rpartition(".")[2]  # "blk.0.attn_v.weight" -> "attn_v"
        q = (types or {}).get(kind, qtype)
        if q == "F32":
            w.add_tensor(name, values)
            return
        t = gguf.GGMLQuantizationType[q]
        try:
            data = gguf.quants.quantize(values, t)
        except NotImplementedError:  # gguf-py quantizes no K-quant: random valid blocks
            data = random_weight(q, rows, cols, int(rng.integers(1 << 30)), scale=0.2).blocks
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=t)

    matrix("token_embd.weight", n_vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        matrix(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_k.weight", head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        matrix(f"blk.{i}.ffn_gate.weight", inter, hidden)
        matrix(f"blk.{i}.ffn_up.weight", inter, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
