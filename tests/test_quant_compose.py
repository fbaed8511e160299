"""Pre-quantized bases compose with the rest: LoRA adapters on an FP8 and on a W4A16 base
equal transformers + peft on the dequantized base (the peft adapters made and saved by peft
itself); speculation, prefix caching and structured outputs on a W4A16 base give the tokens
of a plain run (the CPU serves these bases dequantized at load, so every path is the float
folder's)."""

from __future__ import annotations

import re

import pytest

from scheduler.request import SamplingParams
from tests import quant_checkpoints as qc
from tests import test_quant_checkpoints as checkpoints
from tests.lora_helpers import make_adapters, our_last_logits, peft_greedy, peft_last_logits
from worker.config import (
    CacheConfig,
    LoraConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    WorkerConfig,
    parse_speculative_config,
)
from worker.engine import Engine
from worker.structured import Constraint, GrammarCompiler
from worker.weights import load_model

pytest.importorskip("compressed_tensors")
PROMPTS = checkpoints.PROMPTS
float_folder, folder = checkpoints.float_folder, checkpoints.folder  # the session's checkpoints (fixtures)
SPECS = [(8, ["q_proj", "v_proj", "down_proj"], False),
         (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True)]
NEW_TOKENS = 12


def _engine(loaded, **over) -> Engine:
    conf = dict(model=ModelConfig(max_model_len=128), cache=CacheConfig(kv_cache_memory=0.01))
    conf.update(over)
    return Engine(WorkerConfig(**conf), loaded=loaded)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["ct-fp8-block", "ct-w4a16-asym"])
def test_lora_on_a_quantized_base_is_peft_on_the_dequantized_base(fmt, folder, tmp_path) -> None:
    path = folder(fmt)
    base = qc.transformers_model(path, qc.ct_dequantized(path))
    peft_model, paths = make_adapters(base, tmp_path / "loras", SPECS)
    # float32 activations: the bound below is LoRA's composition, not int16 activations' (the
    # auto path on AVX-512 VNNI, whose own bound the kernel tests state).
    engine = _engine(load_model(str(path)), model=ModelConfig(max_model_len=128, cpu_activations="float32"),
                     scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                     lora=LoraConfig(enable_lora=True, max_loras=2, max_lora_rank=16,
                                     lora_modules=tuple(f"{n}={p}" for n, p in paths.items())))
    for name in [None, *paths]:
        for ids in PROMPTS[:1]:
            got = our_last_logits(engine, name, ids)
            want = peft_last_logits(peft_model, name, ids)
            assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4, name
    names = [None, *paths]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    done = engine.generate([engine.make_request(ids, params, lora_name=n) for n in names for ids in PROMPTS])
    got = [c.token_ids for c in done]
    want = []
    for n in names:
        for ids in PROMPTS:
            peft_model.generation_config.eos_token_id = None
            want.append(peft_greedy(peft_model, n, ids, NEW_TOKENS))
    assert got == want
    assert got[len(PROMPTS):2 * len(PROMPTS)] != got[:len(PROMPTS)], "the adapter changed nothing"


def test_speculation_prefix_caching_and_structured_outputs_on_a_w4a16_base(folder) -> None:
    loaded = load_model(str(folder("ct-w4a16")))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = _engine(loaded, cache=CacheConfig(kv_cache_memory=0.01, enable_prefix_caching=False))
    # A prompt, its continuation and the prompt again: the n-gram drafts propose the
    # continuation, which the verification steps check (a random model rejects them: what
    # is shown is that verifying changes no token).
    firsts = [c.token_ids for c in plain.generate([plain.make_request(p, params) for p in PROMPTS])]
    prompts = [p + y + p for p, y in zip(PROMPTS, firsts, strict=True)]
    want = [c.token_ids for c in plain.generate([plain.make_request(p, params) for p in prompts])]
    spec = _engine(loaded, speculative=SpeculativeConfig(parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}')))
    got = [c.token_ids for c in spec.generate([spec.make_request(p, params) for p in prompts])]
    again = [spec.make_request(p, params) for p in prompts]
    got += [c.token_ids for c in spec.generate(again)]
    assert got == want + want
    assert spec.num_draft_tokens > 0, "no draft was verified"
    assert sum(r.num_cached_tokens for r in again) > 0, "no prefix was served from the cache"
    # A regex-constrained request: its text is the pattern's, on the quantized base.
    tok = loaded.tokenizer
    grammar = GrammarCompiler(tok, loaded.config.vocab_size, loaded.eos_token_ids).compile(
        Constraint("regex", "(fox|dog) [a-z]{1,5}"))
    req = spec.make_request(tok.encode("hello world"), SamplingParams(temperature=0, max_tokens=8))
    req.grammar = grammar.matcher()
    (done,) = spec.generate([req])
    assert re.fullmatch("(fox|dog) [a-z]{1,5}", done.text), done.text
    assert spec.kv.blocks_in_use() == 0
