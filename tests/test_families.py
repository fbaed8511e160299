"""The Llama decoder's families against transformers (float32): Llama 3 (the control, its
llama3 rope scaling), Qwen3 (q/k norms, YaRN), Phi-3 (fused weights on disk, LongRoPE, a
sliding window) and a Phi-4-mini-like Phi-3 (partial rotary 0.75, LongRoPE), each a tiny
random checkpoint made by transformers' config class and save_pretrained. Greedy tokens
identical and each token's logprob within 1e-4 on a short prompt and on one past the
window and the original context; through chunked prefill (a token budget of 8), after a
prefix-cache hit and under n-gram speculation; in the fused C decoder (the linears as Q8_0
blocks, gguf-py's, against transformers on the dequantized weights) and in Triton's
interpreter. Then the RoPE variants alone (linear, dynamic NTK, YaRN, LongRoPE): the last
position's logits within 1e-4 relative of transformers beyond the original context, each
first shown to change transformers' own logits; and the configs refused at load.

LongRoPE's short and long factors are chosen once for the served context (--max-model-len:
ops/rotary.py says why), so its short prompt runs in an engine serving the original
context, and the long one in an engine serving the model's."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch

from scheduler.request import SamplingParams
from tests.helpers import last_logits, q8_0_linears, round_linears_to_q8_0, save_tiny_checkpoint
from worker.config import (
    CacheConfig,
    ModelConfig,
    NgramSpeculation,
    SchedulerConfig,
    SpeculativeConfig,
    WorkerConfig,
)
from worker.engine import Engine
from worker.models.llama import LlamaConfig
from worker.weights import load_model

ORIGINAL, WINDOW, NEW, SPEC_NEW = 32, 24, 8, 40
TRITON_LEN, TRITON_NEW, TRITON_SPEC_NEW = 34, 2, 10  # Triton's interpreter costs per token
_rng = random.Random(51)
SHORT = [_rng.randrange(3, 256) for _ in range(10)]
LONG = [_rng.randrange(3, 256) for _ in range(72)]  # past the window and the original context, twice
REPEATED = [_rng.randrange(3, 256) for _ in range(7)] * 8  # n-gram drafts (and past ORIGINAL)
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _factors(n: int, step: float) -> list[float]:
    return [1.0 + step * i for i in range(n)]


def family_config(name: str):
    """transformers' config of each family, at a tiny size."""
    from transformers import LlamaConfig as HFLlama
    from transformers import Phi3Config, Qwen3Config

    if name == "llama3":
        return HFLlama(**SHAPE, head_dim=32, max_position_embeddings=256, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=ORIGINAL))
    if name == "qwen3":
        return Qwen3Config(**SHAPE, head_dim=32, max_position_embeddings=128, rope_scaling=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL))
    if name == "phi3":  # head_dim 32, all of it rotating; a window on every layer
        return Phi3Config(**SHAPE, max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
                          sliding_window=WINDOW, rope_scaling=dict(
                              rope_type="longrope", short_factor=_factors(16, 0.1), long_factor=_factors(16, 0.6)))
    assert name == "phi4-mini"  # 24 of 32 dimensions rotating: 12 pairs
    return Phi3Config(**SHAPE, max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
                      partial_rotary_factor=0.75, rope_scaling=dict(
                          rope_type="longrope", short_factor=_factors(12, 0.1), long_factor=_factors(12, 0.6)))


FAMILIES = ["llama3", "qwen3", "phi3", "phi4-mini"]


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and each one's logprob, a whole forward pass a token."""
    out, lps = [], []
    for _ in range(n):
        logits = model(torch.tensor([ids + out]), use_cache=False).logits[0, -1].double()
        out.append(int(logits.argmax()))
        lps.append(float(logits.log_softmax(-1)[out[-1]]))
    return out, lps


class Checkpoint:
    """A folder (linears Q8_0-exact), its transformers model, and transformers' answers."""

    def __init__(self, name: str, folder) -> None:
        self.name, self.folder = name, folder
        model = save_tiny_checkpoint(family_config(name), folder)
        round_linears_to_q8_0(model)
        model.save_pretrained(folder)
        self.hf = model
        self.longrope = name.startswith("phi")
        self.want = {k: hf_greedy(model, ids, n) for k, ids, n in
                     (("short", SHORT, NEW), ("long", LONG, NEW), ("repeated", REPEATED, SPEC_NEW))}

    def load(self, quantized: bool):
        """Our load of the folder; `quantized`: its layers' linears (q/k/v and gate/up fused
        as we hold them) made Q8_0 QuantLinears, for the fused decoder. Their rows are the
        checkpoint's Q8_0-exact rows, which quantize to themselves (checked)."""
        loaded = load_model(str(self.folder))
        if quantized:
            assert q8_0_linears(loaded) == 4 * 2
        return loaded


_MADE: dict[str, Checkpoint] = {}


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    """Each family's checkpoint made once in the module, whatever order pytest runs the
    tests parametrized over a subset in (it would make one again on each regrouping)."""
    if request.param not in _MADE:
        _MADE[request.param] = Checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return _MADE[request.param]


def _engine(ckpt: Checkpoint, kernels: str, budget: int = 512, spec: NgramSpeculation | None = None,
            max_model_len: int = 0) -> Engine:
    fused = kernels == "auto"
    conf = WorkerConfig(
        model=ModelConfig(device="cpu", kernels=kernels, cpu_activations="float32", max_model_len=max_model_len),
        cache=CacheConfig(kv_cache_memory=0.01),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget),
        speculative=SpeculativeConfig(spec),
    )
    engine = Engine(conf, loaded=ckpt.load(quantized=fused))
    assert (engine.runner.cpu_decoder is not None) == fused, "the fused decoder fell back"
    return engine


def _check(ckpt: Checkpoint, engine: Engine, name: str, ids: list[int], n: int | None = None):
    tokens, lps = ckpt.want[name]
    tokens, lps = tokens[:n], lps[:n]
    params = SamplingParams(temperature=0.0, max_tokens=len(tokens), ignore_eos=True, logprobs=0)
    (done,) = engine.generate([engine.make_request(ids, params)])
    assert engine.kv.num_free_blocks == engine.budget.num_blocks
    assert done.token_ids == tokens, f"{ckpt.name} {name} prompt: ours {done.token_ids}, transformers {tokens}"
    np.testing.assert_allclose([r.logprob for r in done.logprobs], lps, rtol=0, atol=1e-4,
                               err_msg=f"{ckpt.name} {name} prompt's logprobs")
    return done


def _last_logits_close(ckpt: Checkpoint, engine: Engine, kernels: str, ids: list[int]) -> None:
    import ops

    with ops.use_backend(kernels):
        ours = last_logits(engine.runner.model, ids)
    with torch.inference_mode():
        ref = ckpt.hf(torch.tensor([ids]), use_cache=False).logits[0, -1]
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, f"{ckpt.name}: relative max logit error {rel:.2e}"


def _short_engine(ckpt: Checkpoint, kernels: str) -> Engine:
    """An engine for the short prompt: LongRoPE's serves the original context (short factors)."""
    return _engine(ckpt, kernels, max_model_len=ORIGINAL if ckpt.longrope else 0)


def test_short_and_long_prompts_match_transformers_in_the_fused_decoder(checkpoint) -> None:
    """The fused C decoder (Q8_0 linears, float32 activations): prompts prefilled whole,
    then decoded."""
    engine = _short_engine(checkpoint, "auto")
    _check(checkpoint, engine, "short", SHORT)
    if checkpoint.longrope:
        engine = _engine(checkpoint, "auto")
    _check(checkpoint, engine, "long", LONG)


@pytest.mark.parametrize("checkpoint", ["llama3", "qwen3", "phi4-mini"], indirect=True)
def test_the_long_prompt_matches_transformers_in_triton(checkpoint) -> None:
    """Triton's kernels op by op (the interpreter here: TRITON_INTERPRET=1, float32): Llama 3
    (its llama3 table), Qwen3 (q/k norms), Phi-4-mini (partial rotary over LongRoPE's table;
    Phi-3's window and full-width LongRoPE in the tests below): the long prompt, past
    the original context, prefilled whole, its last logits within 1e-4, and TRITON_NEW
    greedy tokens. (The interpreter runs a Python loop a program, ~0.15 s a token here, so
    a prompt costs per token: this one is 34, past the original 32; the short prompt runs in
    the fused decoder.)"""
    pytest.importorskip("triton")
    ids = LONG[:TRITON_LEN]
    checkpoint.want["triton"] = hf_greedy(checkpoint.hf, ids, TRITON_NEW)
    engine = _engine(checkpoint, "triton")
    _check(checkpoint, engine, "triton", ids)
    _last_logits_close(checkpoint, engine, "triton", ids)


def test_chunked_prefill_prefix_hits_and_speculation_match_transformers_in_triton(checkpoint) -> None:
    """Triton's kernels, each family: a prompt of 34 in chunks of 8 (Phi-3's: later chunks'
    windows reach into cached blocks), again (a prefix-cache hit: the rows left to compute
    attend cached keys, the window's start inside them), and n-gram speculation on a
    repeated prompt (verification rows; the prompt prefilled whole: Phi-3 whole in Triton).
    Kept short for the interpreter (see above)."""
    pytest.importorskip("triton")
    ids = LONG[:TRITON_LEN]
    checkpoint.want["triton"] = hf_greedy(checkpoint.hf, ids, TRITON_NEW)
    engine = _engine(checkpoint, "triton", budget=8)
    _check(checkpoint, engine, "triton", ids)
    again = _check(checkpoint, engine, "triton", ids)
    assert again.cached_tokens >= 32
    repeated = REPEATED[:42]  # (these models' greedy tokens repeat themselves soon after 42)
    checkpoint.want["triton-spec"] = hf_greedy(checkpoint.hf, repeated, TRITON_SPEC_NEW)
    spec = NgramSpeculation(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = _engine(checkpoint, "triton", spec=spec)
    _check(checkpoint, engine, "triton-spec", repeated)
    assert engine.num_accepted_tokens > 0, "no draft accepted: the verification rows went untested"


def test_chunked_prefill_prefix_hits_and_speculation_match_transformers(checkpoint) -> None:
    """The fused C decoder: the long prompt in chunks of 8, then again (a prefix-cache hit:
    its rows attend cached keys), then n-gram speculation (verification rows)."""
    engine = _engine(checkpoint, "auto", budget=8)
    _check(checkpoint, engine, "long", LONG)
    again = _check(checkpoint, engine, "long", LONG)
    assert again.cached_tokens >= 64
    spec = NgramSpeculation(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = _engine(checkpoint, "auto", spec=spec)
    _check(checkpoint, engine, "repeated", REPEATED)
    assert engine.num_accepted_tokens > 0, "no draft accepted: the verification rows went untested"


def test_the_families_use_their_operations(checkpoint) -> None:
    """Each family's load takes its own operations (so the equalities above test them), and
    each changes transformers' answer: without Qwen3's q/k norms, Phi's rope scaling or
    partial rotary, or the window, the long prompt's tokens or logits differ."""
    cfg = checkpoint.hf.config
    ours = load_model(str(checkpoint.folder)).config
    assert ours.qk_norm == (checkpoint.name == "qwen3")
    assert ours.rotary_dim == (24 if checkpoint.name == "phi4-mini" else 32)
    assert ours.rope_scaling.rope_type == {"llama3": "llama3", "qwen3": "yarn"}.get(checkpoint.name, "longrope")
    assert [ours.window_of(i) for i in range(2)] == [WINDOW if checkpoint.name == "phi3" else None] * 2
    plain = {**cfg.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
             "sliding_window": None}
    with torch.inference_mode():
        base = type(checkpoint.hf)(type(cfg)(**plain)).eval()
        base.load_state_dict(checkpoint.hf.state_dict(), strict=False)
        if checkpoint.name == "qwen3":
            for layer in base.model.layers:  # q/k norms of all ones: RMSNorm alone still scales
                layer.self_attn.q_norm.weight.fill_(1.0)
                layer.self_attn.k_norm.weight.fill_(1.0)
        a = base(torch.tensor([LONG]), use_cache=False).logits[0, -1]
        b = checkpoint.hf(torch.tensor([LONG]), use_cache=False).logits[0, -1]
    assert ((a - b).abs().max() / b.abs().max()).item() > 1e-3


# ----- the RoPE variants alone -----


def _rope_config(kind: str):
    from transformers import LlamaConfig as HFLlama

    shape = {**SHAPE, "head_dim": 32}
    if kind == "linear":
        return HFLlama(**shape, max_position_embeddings=128, rope_scaling=dict(rope_type="linear", factor=4.0))
    if kind == "dynamic":  # transformers' original context is max_position_embeddings
        return HFLlama(**shape, max_position_embeddings=ORIGINAL, rope_scaling=dict(rope_type="dynamic", factor=4.0))
    if kind == "yarn":  # beta and mscale as DeepSeek's configs set them
        return HFLlama(**shape, max_position_embeddings=128, rope_scaling=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL, beta_fast=16.0,
            beta_slow=2.0, mscale=0.9, mscale_all_dim=0.7))
    from transformers import Phi3Config

    return Phi3Config(**SHAPE, max_position_embeddings=128, original_max_position_embeddings=ORIGINAL,
                      rope_scaling=dict(rope_type="longrope", short_factor=_factors(16, 0.2),
                                        long_factor=_factors(16, 0.9), attention_factor=1.3))


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "longrope"])
def test_rope_variants_beyond_the_original_context(kind, tmp_path) -> None:
    import ops
    from worker.models.llama import rope_cache

    hf = save_tiny_checkpoint(_rope_config(kind), tmp_path)
    model = load_model(str(tmp_path)).model
    ids = LONG[:60] + SHORT  # 70 tokens: past the original 32 (dynamic: its max_position_embeddings)
    assert model.config.rope_scaling.rope_type == kind
    # the served context as long as the prompt: dynamic NTK's frequencies are transformers'
    # for this length (LongRoPE's long factors for any past 32)
    model.serve_context(len(ids))
    with ops.use_backend("torch"):
        ours = last_logits(model, ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0, -1]
        plain = {**hf.config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
        base = type(hf)(type(hf.config)(**plain)).eval()
        base.load_state_dict(hf.state_dict(), strict=False)
        unscaled = base(torch.tensor([ids]), use_cache=False).logits[0, -1]
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, f"{kind}: relative max logit error {rel:.2e}"
    assert ((unscaled - ref).abs().max() / ref.abs().max()).item() > 1e-3, "the scaling changes nothing here"
    # and the table is what the model runs on: the default one gives other logits
    model.cos_sin = rope_cache(LlamaConfig(**{**model.config.__dict__, "rope_scaling": None}))
    with ops.use_backend("torch"):
        assert not torch.allclose(last_logits(model, ids), ours, rtol=1e-4, atol=0)


# ----- refused at load -----


def _hf_dict(**extra) -> dict:
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
         "max_position_embeddings": 128}
    return {**d, **extra}


@pytest.mark.parametrize("extra, field", [
    ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope_scaling type 'mrope'"),
    ({"rope_scaling": {"type": "ntk-by-parts", "factor": 2.0}}, "rope_scaling type 'ntk-by-parts'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}},
     "original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 32, "short_factor": [1.0]}},
     "short_factor and long_factor"),
    ({"partial_rotary_factor": 0.15625}, "partial_rotary_factor 0.15625 leaves 5"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor must be in (0, 1]"),
])
def test_bad_configs_are_refused_at_load_naming_the_field(tmp_path, extra, field) -> None:
    from worker.weights.hf_folder import read_config

    (tmp_path / "config.json").write_text(json.dumps(_hf_dict(**extra)))
    with pytest.raises(ValueError) as e:
        read_config(tmp_path)
    assert field in str(e.value)


def test_a_window_past_the_context_is_global_and_said(caplog) -> None:
    """Phi-3-mini-128k ships sliding_window 262144 over 131072 positions: transformers and
    vLLM take it as global, so do we, and the log names the field."""
    with caplog.at_level(logging.WARNING, logger="worker.models.llama"):
        cfg = LlamaConfig.from_hf(_hf_dict(architectures=["Phi3ForCausalLM"], sliding_window=256))
    assert cfg.window_of(0) is None
    assert "sliding_window 256 is not below max_position_embeddings 128" in caplog.text


# ----- a qwen3 GGUF, by llama.cpp's convert_hf_to_gguf -----


def test_a_qwen3_gguf_equals_transformers_on_its_folder() -> None:
    """convert_hf_to_gguf writes a Qwen3 folder (q/k norms, YaRN over an original context
    of 32) as architecture qwen3 with attn_q_norm / attn_k_norm and rope.scaling.*; our load
    of the file equals transformers on the folder within and beyond the original context.
    (The folder and file are kept in the GGUF tests' cache, as theirs.)"""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from benchmarks import make_gguf_models as made

    tools = made.find_converter()
    if tools is None:
        pytest.skip("convert_hf_to_gguf.py not found (benchmarks/make_gguf_models.py: find_converter)")
    folder = made.cache_dir() / f"qwen3-tiny-hf-{made.RECIPE}"
    if not (folder / "config.json").is_file():
        tmp = folder.with_name(folder.name + ".part")
        tmp.mkdir(parents=True, exist_ok=True)
        config = Qwen3Config(**{**SHAPE, "vocab_size": 49152, "pad_token_id": None}, head_dim=32,
                             max_position_embeddings=128, rope_scaling=dict(
                                 rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL))
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp)
        made._tokenizer_folder(tmp)  # the default model's tokenizer (the converter reads one)
        tmp.rename(folder)
    path = made.converted(tools, folder, "qwen3-tiny")
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours = load_model(str(path))
    assert ours.config.architecture == "Qwen3ForCausalLM" and ours.config.qk_norm
    assert ours.config.rope_scaling.rope_type == "yarn"
    for ids in (SHORT, LONG):
        with torch.inference_mode():
            ref = hf(torch.tensor([ids]), use_cache=False).logits[0, -1]
        rel = ((last_logits(ours.model, ids) - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-4, f"{len(ids)} tokens: relative max logit error {rel:.2e}"
