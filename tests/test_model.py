"""The model and its weight loaders against transformers, token for token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import engine_greedy, hf_greedy, last_logits
from worker.weights import ModelLoadError, default_model_path, load_model

NEW_TOKENS = 32


def test_default_model_loads_from_the_installed_package(default_model) -> None:
    path = default_model_path()
    assert path.name.endswith(".gguf") and "site-packages" in str(path)
    cfg = default_model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and default_model.source == "gguf"
    assert default_model.tokenizer is not None and default_model.tokenizer.chat_template
    assert 2 in default_model.eos_token_ids


def test_last_position_logits_match_transformers(default_model, hf_model, chat_prompt_ids) -> None:
    for ids in chat_prompt_ids:
        ours = last_logits(default_model.model, ids)
        with torch.inference_mode():
            ref = hf_model(torch.tensor([ids])).logits[0, -1].float()
        rel = ((ours - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-3, f"relative max logit error {rel:.2e} for a {len(ids)}-token prompt"


@pytest.fixture(scope="module")
def hf_greedy_outputs(hf_model, chat_prompt_ids) -> list[list[int]]:
    return [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in chat_prompt_ids]


def _engine_greedy(loaded, prompts: list[list[int]]) -> list[list[int]]:
    return engine_greedy(loaded, prompts, NEW_TOKENS)


def test_greedy_tokens_match_transformers(default_model, chat_prompt_ids, hf_greedy_outputs) -> None:
    assert len(chat_prompt_ids) >= 8
    ours = _engine_greedy(default_model, chat_prompt_ids)
    for i, (a, b) in enumerate(zip(ours, hf_greedy_outputs, strict=True)):
        assert a == b, f"prompt {i}: ours {a} != transformers {b}"


def test_safetensors_folder_gives_the_same_tokens(hf_model, chat_prompt_ids, hf_greedy_outputs, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    # A GGUF-loaded model refuses save_pretrained; copy its weights into a plain one.
    config = hf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(hf_model.state_dict())
    plain.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))
    loaded = load_model(str(tmp_path))
    assert loaded.source == "safetensors"
    assert _engine_greedy(loaded, chat_prompt_ids) == hf_greedy_outputs


def test_dummy_llama_3_2_1b_runs_a_forward_pass() -> None:
    loaded = load_model("dummy:llama-3.2-1b", dtype=torch.bfloat16)
    cfg = loaded.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (16, 2048, 128256)
    assert cfg.rope_scaling is not None and loaded.tokenizer is None
    logits = last_logits(loaded.model, list(range(100, 140)))
    assert logits.shape == (128256,) and torch.isfinite(logits).all()


# ----- bad input: a clear error naming the problem -----

def _write_config(folder: Path, **overrides) -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
           "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1, "max_position_embeddings": 64}
    cfg.update(overrides)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_folder_without_config_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(str(tmp_path))


def test_missing_path_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"))


def test_unknown_architecture_is_a_clear_error(tmp_path) -> None:
    _write_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="unknown architecture 'GPT2LMHeadModel'"):
        load_model(str(tmp_path))


def test_corrupt_safetensors_is_a_clear_error(tmp_path, default_model) -> None:
    _write_config(tmp_path)
    default_model.tokenizer  # noqa: B018 (a real tokenizer folder is needed to get that far)
    from transformers import AutoTokenizer

    path = default_model_path()
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is not a valid safetensors file"):
        load_model(str(tmp_path))


def test_missing_tokenizer_is_a_clear_error(tmp_path) -> None:
    _write_config(tmp_path)
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.randn(64, 16)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        load_model(str(tmp_path))


def test_pickled_weights_are_refused(tmp_path) -> None:
    _write_config(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match="never loaded"):
        load_model(str(tmp_path))


def test_unknown_dummy_shape_is_a_clear_error() -> None:
    with pytest.raises(ModelLoadError, match="unknown dummy shape 'gpt-5'"):
        load_model("dummy:gpt-5")


def test_cli_reports_a_bad_model_without_a_traceback(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "worker.cli", "generate", "hi", "--model", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "no config.json" in proc.stderr and "Traceback" not in proc.stderr
