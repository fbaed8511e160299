"""Gemma 2 and Gemma 3 against transformers (float32): tiny random checkpoints made by
transformers' config classes and save_pretrained (Gemma2Config; Gemma3TextConfig; and a
Gemma3Config, a language model beside a vision tower, as the 4B-27B checkpoints ship), their
norms' weights random (transformers initializes them to zero, where 1 + w would test
nothing) and their linears Q8_0-exact. Greedy tokens identical and each token's logprob
within 1e-4 on a short prompt and on one six windows long, in the fused C decoder (the
linears as Q8_0 blocks), op by op on the C kernels and in Triton's interpreter; the long
prompt's last logits within 1e-4 relative; through chunked prefill (a token budget of 8),
after a prefix-cache hit and under n-gram speculation. Each family's operations change
transformers' own answer (the window, soft-capping, the local rope base), so a path that
ignored one would fail. Then a checkpoint without a norm is refused naming it."""

from __future__ import annotations

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
from worker.weights import load_model

WINDOW, NEW, SPEC_NEW = 16, 6, 32
_rng = random.Random(52)
SHORT = [_rng.randrange(3, 256) for _ in range(10)]
LONG = [_rng.randrange(3, 256) for _ in range(100)]  # six windows
REPEATED = [_rng.randrange(3, 256) for _ in range(7)] * 9  # n-gram drafts, past two windows
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
             sliding_window=WINDOW, query_pre_attn_scalar=24, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LAYERS = ["sliding_attention", "full_attention"]


def gemma_config(name: str):
    from transformers import Gemma2Config, Gemma3Config, Gemma3TextConfig

    if name == "gemma2":  # soft-capping small enough to bite on random weights
        return Gemma2Config(**SHAPE, attn_logit_softcapping=2.0, final_logit_softcapping=0.5)
    text = Gemma3TextConfig(**SHAPE, layer_types=LAYERS, rope_theta=1e6, rope_local_base_freq=1e4,
                            rope_scaling={"rope_type": "linear", "factor": 8.0})
    if name == "gemma3":
        return text
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    return Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and each one's logprob, a whole forward pass a token."""
    out, lps = [], []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids + out]), use_cache=False).logits[0, -1].double()
        out.append(int(logits.argmax()))
        lps.append(float(logits.log_softmax(-1)[out[-1]]))
    return out, lps


class Checkpoint:
    """A folder (random norms, linears Q8_0-exact), its transformers model and its answers."""

    def __init__(self, name: str, folder) -> None:
        self.name, self.folder = name, folder
        model = save_tiny_checkpoint(gemma_config(name), folder)
        torch.manual_seed(1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.normal_(0.0, 0.3)
                elif name == "gemma2" and n.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(8.0)  # scores past the soft cap: random weights' are far below it
        round_linears_to_q8_0(model)  # linears Q8_0-exact: the fused decoder's blocks hold them as they are
        model.save_pretrained(folder)
        self.hf = model
        self.want = {k: hf_greedy(model, ids, n) for k, ids, n in
                     (("short", SHORT, NEW), ("long", LONG, NEW), ("repeated", REPEATED, SPEC_NEW))}


    def load(self, quantized: bool = False):
        """Our load of the folder; `quantized`: its layers' linears made Q8_0 QuantLinears
        (their rows quantize to themselves, checked), so the fused C decoder takes them."""
        loaded = load_model(str(self.folder))
        if quantized:
            assert q8_0_linears(loaded) == 4 * 2
        return loaded


_MADE: dict[str, Checkpoint] = {}


def _checkpoint(name: str, tmp_path_factory) -> Checkpoint:
    if name not in _MADE:
        _MADE[name] = Checkpoint(name, tmp_path_factory.mktemp(name))
    return _MADE[name]


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "gemma3-vlm"])
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    return _checkpoint(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def text_checkpoint(request, tmp_path_factory) -> Checkpoint:
    """The multimodal folder's language model is Gemma 3's: Triton's interpreter, the
    slowest path here, runs the two text families."""
    return _checkpoint(request.param, tmp_path_factory)


def _engine(ckpt: Checkpoint, kernels: str, budget: int = 512, spec: NgramSpeculation | None = None) -> Engine:
    conf = WorkerConfig(
        model=ModelConfig(device="cpu", kernels=kernels, cpu_activations="float32"),
        cache=CacheConfig(kv_cache_memory=0.01),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget),
        speculative=SpeculativeConfig(spec),
    )
    fused = kernels == "auto"
    engine = Engine(conf, loaded=ckpt.load(quantized=fused))
    assert (engine.runner.cpu_decoder is not None) == fused, "the fused decoder fell back"
    return engine


def _check(ckpt: Checkpoint, engine: Engine, name: str, ids: list[int], *more: tuple[str, list[int]]):
    """Prompt `ids` (and `more`, in the same batch) against transformers' answer `name`."""
    prompts = [(name, ids), *more]
    reqs = [engine.make_request(p, SamplingParams(temperature=0.0, max_tokens=len(ckpt.want[n][0]),
                                                  ignore_eos=True, logprobs=0)) for n, p in prompts]
    outs = engine.generate(reqs)
    assert engine.kv.num_free_blocks == engine.budget.num_blocks
    for (n, _), done in zip(prompts, outs, strict=True):
        tokens, lps = ckpt.want[n]
        assert done.token_ids == tokens, f"{ckpt.name} {n} prompt: ours {done.token_ids}, transformers {tokens}"
        np.testing.assert_allclose([r.logprob for r in done.logprobs], lps, rtol=0, atol=1e-4,
                                   err_msg=f"{ckpt.name} {n} prompt's logprobs")
    return outs[0]


def _short_and_long(checkpoint: Checkpoint, kernels: str) -> None:
    """Both prompts in one batch, prefilled whole, then decoded; the long prompt's last logits
    within 1e-4 relative."""
    import ops

    engine = _engine(checkpoint, kernels)
    _check(checkpoint, engine, "short", SHORT, ("long", LONG))
    with ops.use_backend(kernels):
        ours = last_logits(engine.runner.model, LONG)
    with torch.inference_mode():
        ref = checkpoint.hf(input_ids=torch.tensor([LONG]), use_cache=False).logits[0, -1]
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, f"{checkpoint.name}: relative max logit error {rel:.2e}"


@pytest.mark.parametrize("kernels", ["auto", "c"])
def test_the_c_paths_match_transformers(checkpoint, kernels) -> None:
    """The fused C decoder ("auto" on Q8_0 linears: soft-capping, (1 + w) norms, GeGLU, the
    post norms, scaled embeddings and two rope tables in its C) and op by op on the C kernels
    (a float folder: decode attention in C)."""
    _short_and_long(checkpoint, kernels)


def test_triton_matches_transformers(text_checkpoint) -> None:
    pytest.importorskip("triton")
    _short_and_long(text_checkpoint, "triton")


def test_chunked_prefill_prefix_hits_and_speculation_match_transformers(checkpoint) -> None:
    """The fused C decoder: the long prompt in chunks of 8, then again (a prefix-cache hit: its
    rows attend cached keys), then n-gram speculation (verification rows)."""
    engine = _engine(checkpoint, "auto", budget=8)
    _check(checkpoint, engine, "long", LONG)
    again = _check(checkpoint, engine, "long", LONG)
    assert again.cached_tokens >= 96
    spec = NgramSpeculation(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = _engine(checkpoint, "auto", spec=spec)
    _check(checkpoint, engine, "repeated", REPEATED)
    assert engine.num_accepted_tokens > 0, "no draft accepted: the verification rows went untested"


def _hf_text(ckpt: Checkpoint):
    """The checkpoint's transformers config (the text config of a multimodal one) and its
    text model's state, for variants built beside it."""
    cfg = ckpt.hf.config
    if ckpt.name == "gemma3-vlm":
        return cfg.text_config, {k.replace("model.language_model.", "model."): v for k, v in
                                 ckpt.hf.state_dict().items() if "language_model" in k or k == "lm_head.weight"}
    return cfg, ckpt.hf.state_dict()


def test_gemma_operations_are_taken_and_matter(checkpoint, caplog) -> None:
    """The load takes each operation (and says what it skipped of a multimodal folder), and
    each changes transformers' answer on the long prompt: the window, Gemma 2's soft-capping,
    Gemma 3's local rope base."""
    from transformers import AutoModelForCausalLM

    with caplog.at_level(logging.INFO, logger="worker.models.gemma"):
        loaded = load_model(str(checkpoint.folder))
    cfg = loaded.config
    assert [cfg.window_of(i) for i in range(2)] == [WINDOW, None]
    assert [layer.self_attn.scale for layer in loaded.model.layers] == [24**-0.5] * 2
    gemma2 = checkpoint.name == "gemma2"
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == ((2.0, 0.5) if gemma2 else (None, None))
    assert cfg.qk_norm == (not gemma2) and cfg.rope_local_theta == (None if gemma2 else 1e4)
    assert ("vision tower and projector tensors" in caplog.text) == (checkpoint.name == "gemma3-vlm")
    text_cfg, state = _hf_text(checkpoint)
    changes = [{"sliding_window": 4 * len(LONG)}]  # (None: transformers' Gemma masks refuse it)
    if gemma2:
        changes += [{"attn_logit_softcapping": None}, {"final_logit_softcapping": None}]
    else:
        changes += [{"rope_parameters": {**text_cfg.rope_parameters, "sliding_attention": {
            "rope_type": "default", "rope_theta": 1e6}}}]
    with torch.inference_mode():
        for change in changes:
            variant = type(text_cfg)(**{**text_cfg.to_dict(), **change})
            model = AutoModelForCausalLM.from_config(variant, dtype=torch.float32).eval()
            model.load_state_dict(state, strict=False)
            a = model(input_ids=torch.tensor([LONG]), use_cache=False).logits[0, -1]
            b = checkpoint.hf(input_ids=torch.tensor([LONG]), use_cache=False).logits[0, -1]
            assert ((a - b).abs().max() / b.abs().max()).item() > 1e-3, f"{change} changes nothing"


@pytest.mark.parametrize("missing", ["model.layers.1.post_feedforward_layernorm.weight",
                                     "model.layers.0.self_attn.k_norm.weight"])
def test_a_checkpoint_without_its_norms_is_refused_naming_it(tmp_path, missing) -> None:
    from safetensors.torch import load_file, save_file

    from worker.weights import ModelLoadError

    save_tiny_checkpoint(gemma_config("gemma3"), tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors[missing]
    save_file(tensors, path)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path))
    name = missing.removeprefix("model.").removesuffix(".weight")
    assert "without its norms" in str(e.value) and name in str(e.value)
