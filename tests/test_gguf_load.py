"""A GGUF load on files gguf-py's GGUFWriter makes (tests/gguf_tiny.py; no llama.cpp): its
metadata used or refused, the start-up log's bytes per type, and every tensor dequantized to
the runner's dtype where no kernel takes it (the CUDA path), as gguf-py dequantizes it."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.gguf_tiny import write_tiny_llama
from tests.helpers import last_logits, requires_cuda
from worker.weights import LoadedModel, ModelLoadError, load_model
from worker.weights.gguf_file import unpermute
from worker.weights.gguf_reader import GGUFFile

# A Q4_K_M-like mix (llama-quantize's: Q4_K, attn_v Q6_K, ffn_down a wider type), the
# embedding in Q6_K; hidden 256: whole K-quant blocks.
MIX = {"attn_v": "Q6_K", "ffn_down": "Q8_0", "token_embd": "Q6_K"}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("mix") / "mix.gguf", "Q4_K", hidden=256, types=MIX)


# ----- metadata -----

TEMPLATE = "{% for m in messages %}<|begin|>{{ m['content'] }}<|end|>{% endfor %}"


def _metadata(w: gguf.GGUFWriter) -> None:
    w.add_chat_template(TEMPLATE)
    w.add_eot_token_id(287)


def test_the_gguf_metadata_is_used_at_load(tmp_path: Path) -> None:
    """Context length, chat template, BOS/EOS/EOT ids and the pre-tokenizer, as the file says."""
    from worker.config import CacheConfig, ModelConfig, WorkerConfig
    from worker.engine import Engine

    path = write_tiny_llama(tmp_path / "t.gguf", pre="llama-bpe", more=_metadata)
    loaded = load_model(str(path))
    tok = loaded.tokenizer
    assert loaded.config.max_position_embeddings == 256  # llama.context_length
    assert tok.chat_template == TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|begin|>hi<|end|>"
    assert (tok.bos_token_id, tok.eos_token_ids) == (0, (1, 287))  # EOS, then EOT: both stop
    # llama-bpe (Llama 3's regex) splits digits in threes; gpt2's would keep "12345" whole.
    pieces = [p for p, _ in tok._tok.pre_tokenizer.pre_tokenize_str("12345")]
    assert pieces == ["123", "45"], pieces
    engine = Engine(WorkerConfig(model=ModelConfig(), cache=CacheConfig(kv_cache_memory=0.01)), loaded=loaded)
    assert engine.max_model_len == 256  # serve's default --max-model-len: the file's context
    with pytest.raises(ValueError, match="--max-model-len 512 exceeds the model's max_position_embeddings 256"):
        Engine(WorkerConfig(model=ModelConfig(max_model_len=512), cache=CacheConfig(kv_cache_memory=0.01)),
               loaded=load_model(str(path)))


@pytest.mark.parametrize(("key", "value", "complaint"), [
    ("llama.rope.scaling.type", "su", "llama.rope.scaling.type 'su' is not supported"),  # linear, yarn are
    ("llama.expert_count", 8, "llama.expert_count = '8': mixture-of-experts"),
    ("llama.rope.dimension_count", 16, "llama.rope.dimension_count = '16': rotary over part of a head"),
    ("llama.attention.value_length", 64, "llama.attention.value_length = '64': a value head size"),
])
def test_metadata_the_model_cannot_honour_is_refused_at_load(tmp_path: Path, key: str, value, complaint: str) -> None:
    """Keys that change the arithmetic: ignoring one would load and compute another model."""
    def more(w: gguf.GGUFWriter) -> None:
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)

    path = write_tiny_llama(tmp_path / "t.gguf", more=more)
    with pytest.raises(ModelLoadError, match=complaint) as e:
        load_model(str(path))
    assert str(path) in str(e.value)


# ----- what the start-up log says -----

def test_the_start_up_log_says_per_type_what_is_held(mixed: Path) -> None:
    loaded = load_model(str(mixed))
    line = loaded.describe_weights()
    tensors = GGUFFile(mixed).tensors
    for qtype in {t.tensor_type.name for t in tensors}:
        n, size = (sum(f(t) for t in tensors if t.tensor_type.name == qtype) for f in (lambda t: 1, lambda t: t.n_bytes))
        held = [h for h in loaded.held if h.qtype == qtype]
        assert len(held) == n and sum(h.file_bytes for h in held) == size, qtype
        counts = [int(part.split(" x")[1].split(":")[0]) for part in line.split("; ") if part.split(" x")[0].endswith(qtype)]
        assert sum(counts) == n, (qtype, line)
    assert f"in all {sum(t.n_bytes for t in tensors) / (1 << 20):.1f} MiB in the file" in line
    assert "records" in line  # the K-quants on their kernels (float32 load on the CPU)


# ----- dequantized to the runner's dtype (what CUDA loads) -----

def _expected(reader: GGUFFile, names: list[str], heads: list[int | None], dtype: torch.dtype) -> torch.Tensor:
    """gguf-py's float32 values of these tensors, q/k rows unpermuted, stacked, cast."""
    parts = []
    for name, h in zip(names, heads, strict=True):
        t = next(t for t in reader.tensors if t.name == name)
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        parts.append(unpermute(w, h) if h else w)
    return torch.from_numpy(np.concatenate(parts)).to(dtype)


def _dequantized_as_gguf_py_does(loaded: LoadedModel, path: Path, dtype: torch.dtype, why: str) -> None:
    assert {h.how for h in loaded.held} == {str(dtype)[6:]}
    assert all(why in h.note for h in loaded.held if "norm" not in h.name), loaded.held
    assert f"({why}" in loaded.describe_weights()
    reader, m = GGUFFile(path), loaded.model
    layer = m.layers[0]
    cases = [
        (layer.self_attn.qkv_proj.weight, ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"],
         [loaded.config.num_heads, loaded.config.num_kv_heads, None]),  # Q4_K, Q4_K, Q6_K
        (layer.mlp.gate_up_proj.weight, ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"], [None, None]),
        (layer.mlp.down_proj.weight, ["blk.0.ffn_down.weight"], [None]),  # Q8_0
        (m.embed_tokens.weight, ["token_embd.weight"], [None]),  # Q6_K
    ]
    for got, names, heads in cases:
        assert got.dtype == dtype
        assert torch.equal(got.cpu(), _expected(reader, names, heads, dtype)), names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_k_quants_dequantize_to_the_load_s_dtype_as_gguf_py_does(mixed: Path, dtype: torch.dtype) -> None:
    loaded = load_model(str(mixed), "cpu", dtype)
    _dequantized_as_gguf_py_does(loaded, mixed, dtype,
                                 f"the CPU kernels take float32 loads: dequantized at load to {str(dtype)[6:]}")


@pytest.mark.gpu
@requires_cuda
def test_a_k_quant_file_loads_on_cuda_dequantized_to_the_runner_s_dtype(mixed: Path) -> None:
    from worker.config import ModelConfig, WorkerConfig
    from worker.engine import Engine

    engine = Engine(WorkerConfig(model=ModelConfig(model=str(mixed), device="cuda", max_model_len=256)))
    loaded = engine.loaded
    assert loaded.device.type == "cuda"
    _dequantized_as_gguf_py_does(loaded, mixed, loaded.dtype, "no GGUF kernels on cuda: dequantized at load")
    ref = load_model(str(mixed), cpu_quantized_linear=False)  # float32, dequantized
    ids = list(range(10, 70))
    a, b = last_logits(loaded.model, ids).float().cpu(), last_logits(ref.model, ids)
    assert ((a - b).abs().max() / b.abs().max()).item() < 5e-2
