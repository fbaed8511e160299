"""Greedy tokens on every CPU kernel path equal transformers': `--kernels torch` with
torch's own linears (the pure reference model) and `--kernels c` (the C kernels: decode
attention, quantized linears), each also with a float16 KV cache (`--kv-cache-dtype
float16`: every key and value rounded to half). The Triton path is checked on a GPU
(test_gpu_e2e.py)."""

from __future__ import annotations

import pytest
import torch

import ops
from scheduler.request import SamplingParams
from tests.helpers import hf_greedy
from worker.config import CacheConfig, ModelConfig, WorkerConfig
from worker.engine import Engine
from worker.weights import load_model

NEW_TOKENS = 16
PROMPTS = 4


REPETITION_PENALTY = 1.3


@pytest.fixture(scope="module")
def hf_outputs(hf_model, chat_prompt_ids) -> list[list[int]]:
    return [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in chat_prompt_ids[:PROMPTS]]


@pytest.fixture(scope="module")
def hf_penalized(hf_model, chat_prompt_ids) -> list[list[int]]:
    """transformers' repetition penalty divides (or multiplies) the logit of every token in
    the prompt and the output so far, as ours does."""
    return [hf_greedy(hf_model, ids, NEW_TOKENS, repetition_penalty=REPETITION_PENALTY)
            for ids in chat_prompt_ids[:PROMPTS]]


_NO_C = pytest.mark.skipif(not ops.c_kernels_available(), reason="the C kernels cannot be built here")
_TORCH = ModelConfig(kernels="torch", cpu_quantized_linear=False, cpu_packed_linear=False)
_HALF = CacheConfig(kv_cache_dtype="float16")


@pytest.mark.parametrize(("model", "cache"), [
    (_TORCH, CacheConfig()),
    pytest.param(ModelConfig(kernels="c"), CacheConfig(), marks=_NO_C),
    # int16 activations, the default with AVX-512 VNNI, on every machine (AVX2 too: same bits)
    pytest.param(ModelConfig(kernels="c", cpu_activations="int16"), CacheConfig(), marks=_NO_C),
    (_TORCH, _HALF),
    pytest.param(ModelConfig(kernels="c"), _HALF, marks=_NO_C),
], ids=["torch", "c", "c-int16", "torch-kv-float16", "c-kv-float16"])
def test_greedy_tokens_match_transformers_on_each_path(model, cache, chat_prompt_ids, hf_outputs,
                                                       hf_penalized) -> None:
    with ops.use_backend("auto"):  # restored after the engine sets its own
        engine = Engine(WorkerConfig(model=model, cache=cache), loaded=load_model("default"))
        assert all(k.dtype == v.dtype == engine.kv_dtype for k, v in engine.runner.kv_caches)
        assert engine.kv_dtype == (torch.float16 if cache.kv_cache_dtype == "float16" else torch.float32)
        kernels = engine.runner.describe_kernels()
        assert f"KV cache {str(engine.kv_dtype).removeprefix('torch.')}" in kernels  # the start-up log says
        if model.kernels == "torch":
            assert "linear layers: 120 Linear; embedding: table; decode attention: torch;" in kernels
        else:
            assert "decode attention: C kernel" in kernels and "QuantLinear" in kernels
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
        done = engine.generate([engine.make_request(ids, params) for ids in chat_prompt_ids[:PROMPTS]])
        # The penalty in a batch with an unpenalized row: each row counts its own tokens only.
        penalized = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, repetition_penalty=REPETITION_PENALTY)
        pen = engine.generate([engine.make_request(ids, penalized) for ids in chat_prompt_ids[:PROMPTS]]
                              + [engine.make_request(chat_prompt_ids[0], params)])
        assert engine.kv.num_free_blocks == engine.budget.num_blocks
    for i, (c, want) in enumerate(zip(done, hf_outputs, strict=True)):
        assert c.token_ids == want, f"prompt {i} ({model.kernels}): {c.token_ids} != {want}"
    assert pen[-1].token_ids == hf_outputs[0]
    assert [c.token_ids for c in pen[:-1]] != hf_outputs  # the penalty changed some continuation
    for i, (c, want) in enumerate(zip(pen, hf_penalized, strict=False)):
        assert c.token_ids == want, f"prompt {i} ({model.kernels}, penalized): {c.token_ids} != {want}"
