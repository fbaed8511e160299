"""Models with sliding windows against transformers (float32): a tiny Mistral (a 16-token
window on every layer) and a Qwen2 mixing windowed and global layers (`layer_types`), made
by transformers' config classes and save_pretrained. Greedy tokens identical and each
token's logprob within 1e-4 on a short prompt and on one six windows long, on every path:
the torch reference, the C kernels op by op, Triton (its interpreter without a GPU), and the
fused C decoder (the model's linears as Q8_0 blocks, gguf-py's, against transformers on the
dequantized weights); through chunked prefill (a token budget of 8), after a prefix-cache
hit, and under n-gram speculation. Each test first checks that the window changes
transformers' own tokens on the long prompt, so a path that ignored it would fail."""

from __future__ import annotations

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

WINDOW, NEW = 16, 12
SPEC_NEW = 40  # a random model's greedy output loops after a while: then drafts are accepted
_rng = random.Random(50)
SHORT = [_rng.randrange(3, 256) for _ in range(10)]
LONG = [_rng.randrange(3, 256) for _ in range(100)]  # six windows
# a phrase said over and over: n-gram drafts from the prompt, and from the output once it loops
# (past two windows: the verification rows' windows start at their own positions)
REPEATED = [_rng.randrange(3, 256) for _ in range(7)] * 9
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
             sliding_window=WINDOW, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _mistral():
    from transformers import MistralConfig

    return MistralConfig(**SHAPE)


def _qwen2_mixed():
    from transformers import Qwen2Config

    return Qwen2Config(**SHAPE, use_sliding_window=True,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])


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
    """A folder, its transformers model, and transformers' answers on the prompts."""

    def __init__(self, config, folder, quantize: bool) -> None:
        self.folder, self.quantize = folder, quantize
        model = save_tiny_checkpoint(config, folder)
        if quantize:  # the weights as Q8_0 blocks would give them back: both sides use those
            round_linears_to_q8_0(model)
            model.save_pretrained(folder)
        self.hf = model
        self.want = {name: hf_greedy(model, ids, n) for name, ids, n in
                     (("short", SHORT, NEW), ("long", LONG, NEW), ("repeated", REPEATED, SPEC_NEW))}
        # the window matters: transformers without it gives other tokens
        plain = {**config.to_dict(), "sliding_window": None}
        if "layer_types" in plain:
            plain["layer_types"] = ["full_attention"] * config.num_hidden_layers
        unwindowed = type(model)(type(config)(**plain)).eval()
        unwindowed.load_state_dict(model.state_dict())
        assert hf_greedy(unwindowed, LONG, NEW)[0] != self.want["long"][0]

    def load(self):
        loaded = load_model(str(self.folder))
        if self.quantize:
            assert q8_0_linears(loaded) == 4 * loaded.config.num_layers
        return loaded


@pytest.fixture(scope="module", params=["mistral", "qwen2-mixed"])
def checkpoint(request, tmp_path_factory):
    config = _mistral() if request.param == "mistral" else _qwen2_mixed()
    return Checkpoint(config, tmp_path_factory.mktemp(request.param), quantize=False)


@pytest.fixture(scope="module", params=["mistral", "qwen2-mixed"])
def quantized_checkpoint(request, tmp_path_factory):
    config = _mistral() if request.param == "mistral" else _qwen2_mixed()
    return Checkpoint(config, tmp_path_factory.mktemp(request.param + "-q8_0"), quantize=True)


def _engine(ckpt: Checkpoint, kernels: str, budget: int = 512, spec: NgramSpeculation | None = None) -> Engine:
    conf = WorkerConfig(
        model=ModelConfig(device="cpu", kernels=kernels, cpu_activations="float32"),
        cache=CacheConfig(kv_cache_memory=0.01),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget),
        speculative=SpeculativeConfig(spec),
    )
    return Engine(conf, loaded=ckpt.load())


def _generate(engine: Engine, ids: list[int], n: int):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    (done,) = engine.generate([engine.make_request(ids, params)])
    assert engine.kv.num_free_blocks == engine.budget.num_blocks
    engine.kv.check_integrity()
    return done


def _check(ckpt: Checkpoint, engine: Engine, name: str, ids: list[int]):
    tokens, lps = ckpt.want[name]
    done = _generate(engine, ids, len(tokens))
    assert done.token_ids == tokens, f"{name} prompt: ours {done.token_ids}, transformers {tokens}"
    got = [r.logprob for r in done.logprobs]
    np.testing.assert_allclose(got, lps, rtol=0, atol=1e-4, err_msg=f"{name} prompt's logprobs")
    return done


def _last_logits_close(ckpt: Checkpoint, model, kernels: str) -> None:
    """The long prompt's last-position logits (one whole-prompt pass) within 1e-4 relative."""
    import ops

    with ops.use_backend(kernels):
        ours = last_logits(model, LONG)
    with torch.inference_mode():
        ref = ckpt.hf(torch.tensor([LONG]), use_cache=False).logits[0, -1]
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, f"relative max logit error {rel:.2e}"


@pytest.mark.parametrize("kernels", ["torch", "c", pytest.param("triton", marks=pytest.mark.slow)])
def test_op_by_op_paths_match_transformers(checkpoint, kernels) -> None:
    """The torch reference, the C kernels and Triton (the interpreter here), each op by op:
    short and long prompts prefilled whole, then decoded."""
    engine = _engine(checkpoint, kernels)
    assert engine.runner.cpu_decoder is None
    windows = [layer.self_attn.window for layer in engine.runner.model.layers]
    assert windows == ([WINDOW] * 3 if checkpoint.folder.name.startswith("mistral") else [WINDOW, None, WINDOW])
    for name, ids in (("short", SHORT), ("long", LONG)):
        _check(checkpoint, engine, name, ids)
    _last_logits_close(checkpoint, engine.runner.model, kernels)


def _chunked_cached_speculative(ckpt: Checkpoint, kernels: str, fused: bool) -> None:
    """A token budget of 8 (the long prompt in chunks beside nothing else), then the same
    prompt again (a prefix-cache hit: its first blocks are not computed again, its rows
    attend the cached keys), then n-gram speculation (verification rows of one request)."""
    engine = _engine(ckpt, kernels, budget=8)
    assert (engine.runner.cpu_decoder is not None) == fused
    _check(ckpt, engine, "long", LONG)
    again = _check(ckpt, engine, "long", LONG)
    assert again.cached_tokens >= 96  # six blocks of the prompt's 100 tokens
    spec = NgramSpeculation(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = _engine(ckpt, kernels, spec=spec)
    assert (engine.runner.cpu_decoder is not None) == fused
    _check(ckpt, engine, "repeated", REPEATED)
    assert engine.num_accepted_tokens > 0, "no draft accepted: the verification rows went untested"


@pytest.mark.parametrize("kernels", ["torch", "c"])
def test_chunked_prefill_prefix_hits_and_speculation_match_transformers(checkpoint, kernels) -> None:
    _chunked_cached_speculative(checkpoint, kernels, fused=False)


def test_the_fused_decoder_matches_transformers(quantized_checkpoint) -> None:
    """The fused C decoder (every linear Q8_0, float32 activations): prompts prefilled whole,
    in chunks, after a prefix-cache hit and under speculation, each row its own window."""
    ckpt = quantized_checkpoint
    engine = _engine(ckpt, "auto")
    assert engine.runner.cpu_decoder is not None
    for name, ids in (("short", SHORT), ("long", LONG)):
        _check(ckpt, engine, name, ids)
    _chunked_cached_speculative(ckpt, "auto", fused=True)
