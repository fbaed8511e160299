"""GGUF architectures phi3, gemma2 and gemma3 as llama.cpp's convert_hf_to_gguf.py writes
them (--outtype f32) from tiny random transformers checkpoints (config class +
save_pretrained: tests/test_families.py's Phi-3 with a window and LongRoPE and its
Phi-4-mini-like partial rotary; Gemma 2 with soft-caps that bite; Gemma 3 with q/k norms,
two rope bases and linear scaling, six layers so that llama.cpp's five-in-six pattern has a
global layer), their norms random (the converter stores Gemma's as 1 + w: folded twice, or
not at all, the logits differ). Our load of the file against transformers on the folder, in
float32: the config it reads, the last position's logits within 1e-4 relative on a short
prompt and on one past the window and the original context, and greedy tokens. Then bad
metadata refused at load naming the key.

Every file loads whole (load_model). Gemma 2's folder ships a SentencePiece tokenizer.model
(tests/test_tokenizer_spm.py's, shaped like Gemma's), which its converter writes as a
SentencePiece vocabulary (tokenizer.ggml.model "llama", worker/tokenizer_spm.py): the file's
tokenizer tokenizes as SentencePiece on the folder's model; Gemma 3's and Phi's take the
default model's byte-level BPE tokenizer (Phi-4's GPT2Tokenizer route)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import gguf
import pytest
import torch

from tests import test_families as fam
from tests import test_gemma as gem
from tests.helpers import last_logits, served_chat_matches_transformers
from worker.weights import gguf_file, load_model
from worker.weights.gguf_reader import GGUFFile

NEW = 4
RECIPE = "f2"  # bump when a folder's recipe changes: the cache keeps folders and files by name (both carry it)
VOCAB = 49152  # the default model's tokenizer (byte-level BPE the converter recognises)
SPM_VOCAB = 524  # Gemma 2's: its SentencePiece model's 520 pieces, padded by the converter
FAMILIES = ["gemma2", "gemma3", "phi3", "phi4-mini"]


def _config(name: str):
    from transformers import Gemma2Config, Gemma3TextConfig

    # query_pre_attn_scalar = head_dim: a GGUF has no such key (llama.cpp scales by head_dim)
    shape = {**gem.SHAPE, "query_pre_attn_scalar": 32}
    if name == "gemma2":  # its SentencePiece model's vocabulary and ids (_spm_model), as Gemma's
        return Gemma2Config(**{**shape, "vocab_size": SPM_VOCAB, "bos_token_id": 2, "eos_token_id": 1},
                            attn_logit_softcapping=2.0, final_logit_softcapping=0.5)
    if name == "gemma3":
        return Gemma3TextConfig(**{**shape, "vocab_size": VOCAB, "pad_token_id": None, "num_hidden_layers": 6},
                                rope_theta=1e6, rope_local_base_freq=1e4,
                                rope_scaling={"rope_type": "linear", "factor": 8.0})
    cfg = fam.family_config(name)
    cfg.vocab_size, cfg.pad_token_id = VOCAB, None
    return cfg


def _spm_model(folder: Path) -> None:
    """Gemma's tokenizer.model and tokenizer_config (a tiny SentencePiece BPE model with byte
    fallback, tests/test_tokenizer_spm.py's; Gemma 2's chat template): Gemma 2's converter
    reads its vocabulary and template from them."""
    from tests import test_tokenizer_spm as spm_tests  # deferred: it skips without sentencepiece

    model = spm_tests.train_spm(gemma=True)
    template = (Path(__file__).parent / "templates" / "gemma2.jinja").read_text()
    spm_tests.spm_folder(folder, model, gemma=True, chat_template=template)


def _make_folder(name: str, folder: Path) -> None:
    from benchmarks import make_gguf_models as made
    from tests.helpers import save_tiny_checkpoint

    model = save_tiny_checkpoint(_config(name), folder)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") and name.startswith("gemma"):
                p.normal_(0.0, 0.3)  # transformers' zeros: 1 + w would test nothing
            elif name == "gemma2" and n.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)  # scores past the soft cap
    model.save_pretrained(folder)
    if name == "gemma2":
        _spm_model(folder)
        return
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).unlink()
    made._tokenizer_folder(folder)
    if name.startswith("phi"):  # Phi-4's tokenizer class: the converter's byte-level BPE route
        cfg_path = folder / "tokenizer_config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "tokenizer_class": "GPT2Tokenizer"}))


def _folder(name: str) -> Path:
    """The family's folder in the GGUF tests' cache, made once."""
    from benchmarks import make_gguf_models as made

    folder = made.cache_dir() / f"{name}-tiny-hf-{RECIPE}"
    if not (folder / "config.json").is_file():
        tmp = folder.with_name(f"{folder.name}.part-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _make_folder(name, tmp)
        tmp.rename(folder)
    return folder


class Converted:
    """The folder and its GGUF (kept in the GGUF tests' cache), transformers on the folder,
    and our load of the file."""

    def __init__(self, name: str, tools) -> None:
        from transformers import AutoModelForCausalLM

        from benchmarks import make_gguf_models as made

        self.name = name
        folder = _folder(name)
        self.path = made.converted(tools, folder, f"{name}-tiny-{RECIPE}")
        self.hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        self.folder = folder
        loaded = load_model(str(self.path))
        self.config, self.model, self.tokenizer = loaded.config, loaded.model, loaded.tokenizer


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request) -> Converted:
    from benchmarks import make_gguf_models as made

    tools = made.find_converter()
    if tools is None:
        pytest.skip("convert_hf_to_gguf.py not found (benchmarks/make_gguf_models.py: find_converter)")
    return Converted(request.param, tools)


def test_the_file_reads_as_the_folder(converted) -> None:
    """The config read from the file is the folder's, field by field where it matters."""
    cfg, name = converted.config, converted.name
    hf = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}.get(name, "Phi3ForCausalLM")
    assert cfg.architecture == hf
    windows = [cfg.window_of(i) for i in range(cfg.num_layers)]
    if name == "gemma2":
        assert windows == [gem.WINDOW, None]
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (2.0, 0.5)
        _tokenizes_as_the_folder(converted)
    elif name == "gemma3":
        assert windows == [gem.WINDOW] * 5 + [None] and cfg.qk_norm
        assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling.rope_type) == (1e6, 1e4, "linear")
        assert cfg.final_logit_softcapping is None
    else:
        assert windows == [fam.WINDOW if name == "phi3" else None] * 2
        assert cfg.rotary_dim == (24 if name == "phi4-mini" else 32)
        rs = cfg.rope_scaling
        assert rs.rope_type == "longrope" and rs.original_max_position_embeddings == fam.ORIGINAL
        want = fam.family_config(name).rope_parameters
        assert list(rs.short_factor) == pytest.approx(want["short_factor"])
        assert list(rs.long_factor) == pytest.approx(want["long_factor"])


def _tokenizes_as_the_folder(converted: Converted) -> None:
    """Gemma 2's file's own SentencePiece tokenizer: SentencePiece's ids on the folder's
    tokenizer.model and transformers' on the folder, chat text with its control tokens too."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from tests import test_tokenizer_spm as spm_tests

    sp = spm.SentencePieceProcessor(model_file=str(converted.folder / "tokenizer.model"))
    hf = AutoTokenizer.from_pretrained(str(converted.folder))
    tok = converted.tokenizer
    assert tok.vocab_size == SPM_VOCAB and (tok.bos_token_id, tok.eos_token_ids[0]) == (2, 1)
    for text in spm_tests.TEXTS:
        ids = tok.encode(text, add_special_tokens=True)
        assert ids == hf.encode(text), text
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        if not tok.has_special_text(text):  # (SentencePiece reads them as text, and writes <unk> " ⁇ ")
            assert ids == sp.encode(text, add_bos=True), text
            assert tok.decode(ids) == sp.decode(ids), text


def _ours_greedy(model, ids: list[int], n: int, longrope: bool) -> tuple[list[int], torch.Tensor]:
    """Our greedy tokens (a whole forward pass a token, as transformers' below) and the
    prompt's last logits."""
    import ops

    out: list[int] = []
    first = None
    with ops.use_backend("torch"):
        for _ in range(n):
            if longrope:  # LongRoPE's factors for this length, as transformers picks them
                model.serve_context(len(ids) + len(out))
            logits = last_logits(model, ids + out)
            first = logits if first is None else first
            out.append(int(logits.argmax()))
    return out, first


@pytest.mark.parametrize("prompt", ["short", "long"])
def test_the_file_equals_transformers_on_its_folder(converted, prompt) -> None:
    ids = fam.SHORT if prompt == "short" else gem.LONG
    tokens, logits = _ours_greedy(converted.model, ids, NEW, converted.name.startswith("phi"))
    with torch.inference_mode():
        ref = converted.hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    rel = ((logits - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, f"{converted.name} {prompt}: relative max logit error {rel:.2e}"
    want, _ = fam.hf_greedy(converted.hf, ids, NEW)
    assert tokens == want, f"{converted.name} {prompt}: ours {tokens}, transformers {want}"


def test_a_gemma2_file_s_chat_through_serve_and_grpc_matches_transformers() -> None:
    """`llm-worker serve --model <Gemma 2 GGUF>`: a chat over gRPC, rendered by the file's chat
    template and tokenized by its SentencePiece tokenizer, has the ids of transformers'
    apply_chat_template on the folder: its greedy tokens (float32) on those ids come back."""
    from benchmarks import make_gguf_models as made
    from tests.test_chat_gemma import CONVERSATION

    tools = made.find_converter()
    if tools is None:
        pytest.skip("convert_hf_to_gguf.py not found (benchmarks/make_gguf_models.py: find_converter)")
    folder = _folder("gemma2")
    path = made.converted(tools, folder, f"gemma2-tiny-{RECIPE}")
    served_chat_matches_transformers(folder, CONVERSATION, NEW, "--model", str(path))


# ----- bad metadata, refused at load naming the key -----


def _write(path: Path, arch: str, tensors: dict[str, list[float]] | None = None, **keys) -> Path:
    """A GGUF of `arch` holding only metadata (a tiny shape; `keys` over it, None drops one)
    and the given F32 vectors."""
    base = {"embedding_length": 64, "block_count": 2, "feed_forward_length": 128, "context_length": 256,
            "attention.head_count": 2, "attention.head_count_kv": 1, "vocab_size": 256}
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {**base, **keys}.items():
        if value is None:
            continue
        if isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    for name, values in (tensors or {}).items():
        w.add_tensor(name, torch.tensor(values, dtype=torch.float32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _config_of(path: Path):
    return gguf_file.config_from_gguf(GGUFFile(path), path)


@pytest.mark.parametrize("arch, keys, tensors, says", [
    ("gemma2", {"attention.head_count": None}, None, "no gemma2.attention.head_count"),
    ("phi3", {"attention.head_count_kv": [1, 1]}, None, "phi3.attention.head_count_kv"),
    ("gemma3", {"block_count": 0}, None, "gemma3.block_count = '0': a positive integer"),
    ("gemma3", {"attention.sliding_window": 16, "attention.sliding_window_pattern": [True, False, True]},
     None, "gemma3.attention.sliding_window_pattern"),
    ("phi3", {"rope.dimension_count": 21}, None, "phi3.rope.dimension_count = '21': the rotating"),
    ("llama", {"rope.dimension_count": 16}, None, "llama.rope.dimension_count = '16': rotary over part"),
    ("phi3", {}, {"rope_factors_long.weight": [1.0] * 16}, "rope_factors_short.weight"),
    ("phi3", {}, {"rope_factors_long.weight": [1.0] * 16, "rope_factors_short.weight": [1.0] * 16},
     "phi3.rope.scaling.original_context_length"),
])
def test_bad_metadata_is_refused_naming_the_key(tmp_path, arch, keys, tensors, says) -> None:
    path = _write(tmp_path / "bad.gguf", arch, tensors, **keys)
    with pytest.raises(ValueError) as e:
        _config_of(path)
    assert says in str(e.value)


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_a_window_past_the_context_is_global_and_said(tmp_path, caplog, arch) -> None:
    """As the Hugging Face folder's load takes such configs (tests/test_families.py: Phi-3-mini-
    128k's GGUF holds a 262,144 window over 131,072 positions): every layer global, logged
    naming the key; Gemma's windowed layers keep their type (their rope table)."""
    path = _write(tmp_path / "w.gguf", arch, **{"attention.sliding_window": 256})
    with caplog.at_level(logging.WARNING, logger="worker.weights.gguf_families"):
        cfg = _config_of(path)
    assert [cfg.window_of(i) for i in range(2)] == [None, None]
    assert f"{arch}.attention.sliding_window 256 is not below the context 256" in caplog.text


# ----- a Q8_0 file in the fused C decoder -----


def test_a_q8_0_gemma3_file_runs_in_the_fused_decoder_as_in_torch() -> None:
    """The converter's --outtype q8_0 file of Gemma 3: the fused C decoder on its blocks
    (the tied head and the embedding lookup on the Q8_0 records, the embedding scale, the
    float32 norms as stored) gives the tokens and logprobs (1e-4) of the torch path on the
    same file dequantized, over the long prompt (past the window). (Phi-3's fused attn_qkv
    and gate+up are one tensor each: a QuantLinear as any; checked by hand, not here.)"""
    name = "gemma3"
    import numpy as np

    from benchmarks import make_gguf_models as made
    from scheduler.request import SamplingParams
    from worker.config import CacheConfig, ModelConfig, WorkerConfig
    from worker.engine import Engine

    tools = made.find_converter()
    if tools is None:
        pytest.skip("convert_hf_to_gguf.py not found (benchmarks/make_gguf_models.py: find_converter)")
    path = made.converted(tools, _folder(name), f"{name}-tiny-{RECIPE}", "q8_0")
    runs = {}
    for kernels, quantized in (("auto", True), ("torch", False)):
        conf = WorkerConfig(model=ModelConfig(device="cpu", kernels=kernels, cpu_activations="float32"),
                            cache=CacheConfig(kv_cache_memory=0.01))
        engine = Engine(conf, loaded=load_model(str(path), cpu_quantized_linear=quantized, cpu_activations="float32"))
        assert (engine.runner.cpu_decoder is not None) == quantized, "the fused decoder fell back"
        params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
        (runs[kernels],) = engine.generate([engine.make_request(gem.LONG, params)])
    assert runs["auto"].token_ids == runs["torch"].token_ids
    np.testing.assert_allclose([r.logprob for r in runs["auto"].logprobs],
                               [r.logprob for r in runs["torch"].logprobs], rtol=0, atol=1e-4)
