"""Multi-LoRA serving against transformers + peft, a reference no one here wrote: random
adapters made and saved by peft, loaded by our worker from their folders, give the same
last-position logits (float32, relative error <= 1e-4) and greedy tokens; a batch that
mixes adapters and the base model gives every request what it gets alone."""

from __future__ import annotations

import pytest
import torch

from scheduler.request import SamplingParams
from tests.lora_helpers import (
    ALL,
    SPECS,
    hf_base_model,
    make_adapters,
    our_last_logits,
    peft_greedy,
    peft_last_logits,
)
from worker.config import CacheConfig, LoraConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.weights import load_model

NEW_TOKENS = 12
# Float32 arithmetic in the quantized linears (the CPU's default may be int16, which
# matches transformers to about 1e-2 but not within 1e-4).
MODEL = ModelConfig(cpu_activations="float32", max_model_len=2048)


@pytest.fixture(scope="module")
def ours():
    """Our own load of the default model (the runner changes its linears in place)."""
    torch.set_num_threads(2)
    return load_model("default")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_model):
    """(peft model with a0..a3, {name: folder}): SPECS' ranks and targets."""
    return make_adapters(hf_base_model(hf_model), tmp_path_factory.mktemp("loras"), SPECS)


def _engine(loaded, paths, max_loras: int = 4, seqs: int = 64, budget: int = 256) -> Engine:
    conf = WorkerConfig(
        model=MODEL, cache=CacheConfig(kv_cache_memory=0.25),
        scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget),
        lora=LoraConfig(enable_lora=True, max_loras=max_loras, max_lora_rank=16,
                        lora_modules=tuple(f"{n}={p}" for n, p in paths.items())))
    return Engine(conf, loaded=loaded)


def _clean(engine: Engine) -> None:
    assert not engine.scheduler.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.budget.num_blocks
    engine.kv.check_integrity()
    assert not engine.loras.in_use(), "a finished request still holds its adapter"


@pytest.mark.parametrize("fused", [True, False], ids=["fused-c-decoder", "op-by-op"])
def test_last_position_logits_match_peft(ours, adapters, chat_prompt_ids, fused) -> None:
    """Both ways our CPU runs a model: the fused C decoder, which adds the deltas in its own
    layers (ops/cpu_kernels/lora.c; what the engine uses here), and op by op (ops/lora.py)."""
    peft_model, paths = adapters
    engine = _engine(ours, paths)
    assert engine.runner.cpu_decoder is not None and engine.runner.cpu_decoder.has_lora
    for name in [None, *paths]:
        for ids in chat_prompt_ids[:2]:
            got = our_last_logits(engine, name, ids, fused=fused)
            want = peft_last_logits(peft_model, name, ids)
            rel = ((got - want).abs().max() / want.abs().max()).item()
            assert rel <= 1e-4, f"adapter {name}: relative max logit error {rel:.2e}"
            if name is not None:  # the adapter matters: far from the base model's logits
                base = peft_last_logits(peft_model, None, ids)
                moved = ((want - base).abs().max() / base.abs().max()).item()
                assert moved > 1e-2, f"adapter {name} hardly changes the logits ({moved:.1e})"


def test_greedy_tokens_match_peft_in_one_mixed_batch(ours, adapters, chat_prompt_ids) -> None:
    """Every adapter and the base model, over the same prompts, all in one engine run:
    each request's tokens are transformers + peft's for its adapter."""
    peft_model, paths = adapters
    engine = _engine(ours, paths)
    prompts = chat_prompt_ids[:3]
    names = [None, *paths]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    reqs = [engine.make_request(ids, params, lora_name=n) for n in names for ids in prompts]
    done = engine.generate(reqs)
    _clean(engine)
    got = {(n, i): c.token_ids for (n, i), c in
           zip([(n, i) for n in names for i in range(len(prompts))], done, strict=True)}
    for n in names:
        for i, ids in enumerate(prompts):
            assert got[n, i] == peft_greedy(peft_model, n, ids, NEW_TOKENS), f"adapter {n}, prompt {i}"
    for n in paths:  # each adapter changes some output
        assert any(got[n, i] != got[None, i] for i in range(len(prompts))), f"{n} changed nothing"


def test_base_request_beside_adapter_requests_is_identical(ours, adapters, chat_prompt_ids) -> None:
    """A base request's tokens and logprobs (to the bit) are the same alone and in steps
    full of adapter rows (decodes and prefill chunks of all four adapters)."""
    _, paths = adapters
    engine = _engine(ours, paths, budget=64)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=3)
    ids = chat_prompt_ids[4]
    (alone,) = engine.generate([engine.make_request(ids, params)])
    others = [engine.make_request(p, params, lora_name=n)
              for n in paths for p in chat_prompt_ids[5:8]]
    mixed = engine.generate([*others[:6], engine.make_request(ids, params), *others[6:]])
    _clean(engine)
    beside = mixed[6]
    assert beside.token_ids == alone.token_ids
    assert beside.logprobs == alone.logprobs, "a base row's logprobs changed beside adapter rows"


def test_turning_lora_on_leaves_base_requests_bit_identical(ours, adapters, chat_prompt_ids) -> None:
    """--enable-lora keeps the fused CPU decoder (the deltas are added in its layers, base
    rows untouched): base requests get the tokens and logprobs, to the bit, of a worker
    without LoRA, in a batch full of adapter rows too."""
    _, paths = adapters
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=3)
    prompts = chat_prompt_ids[:4]
    off = Engine(WorkerConfig(model=MODEL, cache=CacheConfig(kv_cache_memory=0.25)), loaded=ours)
    want = off.generate([off.make_request(ids, params) for ids in prompts])
    engine = _engine(ours, paths)
    names = [None, *paths]
    got = engine.generate([engine.make_request(ids, params, lora_name=n) for ids in prompts for n in names])
    _clean(engine)
    base = got[:: len(names)]
    assert [c.token_ids for c in base] == [c.token_ids for c in want]
    assert [c.logprobs for c in base] == [c.logprobs for c in want]


def test_prefix_cache_is_keyed_by_adapter(ours, adapters, chat_prompt_ids) -> None:
    _, paths = adapters
    engine = _engine(ours, paths)
    ids = chat_prompt_ids[0] * 3  # several full blocks
    params = SamplingParams(temperature=0, max_tokens=2)

    def cached(name: str | None) -> int:
        (c,) = engine.generate([engine.make_request(ids, params, lora_name=name)])
        return c.cached_tokens

    assert cached("a0") == 0
    assert cached("a0") >= engine.kv.block_size  # the same adapter shares its blocks
    assert cached("a1") == 0  # another adapter never does
    assert cached(None) == 0  # nor the base model
    assert cached("a1") > 0 and cached(None) > 0
    _clean(engine)


def test_64_requests_over_8_adapters_and_the_base(ours, hf_model, tmp_path, chat_prompt_ids) -> None:
    """64 requests spread over 8 adapters and the base model, all at once: each gets the
    tokens it gets alone; again with --max-loras 3, where the scheduler holds requests
    whose adapter cannot join (never more than 3 adapters in a step) and all finish."""
    specs = [(8 if i % 2 else 16, ALL if i % 3 == 0 else ["q_proj", "v_proj", "down_proj"],
              i == 5) for i in range(8)]
    _, paths = make_adapters(hf_base_model(hf_model), tmp_path, specs, seed=1)
    names = [None, *paths]
    params = SamplingParams(temperature=0, max_tokens=6)
    work = [(chat_prompt_ids[i % len(chat_prompt_ids)], names[i % len(names)]) for i in range(64)]

    engine = _engine(ours, paths, max_loras=8)
    together = [c.token_ids for c in engine.generate(
        [engine.make_request(ids, params, lora_name=n) for ids, n in work])]
    _clean(engine)
    capped = _engine(ours, paths, max_loras=3)
    most = 0
    schedule = capped.scheduler.schedule

    def watch():
        nonlocal most
        out = schedule()
        most = max(most, len({s.request.lora_key for s in out.scheduled} - {None}))
        return out

    capped.scheduler.schedule = watch
    limited = [c.token_ids for c in capped.generate(
        [capped.make_request(ids, params, lora_name=n) for ids, n in work])]
    _clean(capped)
    assert most == 3
    for i, (ids, n) in enumerate(work):
        (alone,) = engine.generate([engine.make_request(ids, params, lora_name=n)])
        assert together[i] == alone.token_ids, f"request {i} (adapter {n}): batched != alone"
        assert limited[i] == alone.token_ids, f"request {i} (adapter {n}): capped != alone"
    _clean(engine)


def test_speculative_drafts_keep_each_adapters_tokens(ours, adapters, chat_prompt_ids) -> None:
    """n-gram drafts verified in adapter rows (a chunk of 1 + k tokens per request, each row
    with its request's adapter) give the tokens decoding without drafts gives."""
    from worker.config import NgramSpeculation, SpeculativeConfig

    _, paths = adapters
    plain = _engine(ours, paths)
    spec_conf = WorkerConfig(
        model=MODEL, cache=CacheConfig(kv_cache_memory=0.25),
        speculative=SpeculativeConfig(NgramSpeculation(num_speculative_tokens=3, prompt_lookup_min=1,
                                                       prompt_lookup_max=3, disable_by_batch_size=8)),
        lora=LoraConfig(enable_lora=True, max_loras=4, max_lora_rank=16,
                        lora_modules=tuple(f"{n}={p}" for n, p in paths.items())))
    spec = Engine(spec_conf, loaded=ours)
    params = SamplingParams(temperature=0, max_tokens=24)
    work = [(chat_prompt_ids[3] * 2, n) for n in (None, "a0", "a1")]
    want = [c.token_ids for c in plain.generate([plain.make_request(p, params, lora_name=n) for p, n in work])]
    got = [c.token_ids for c in spec.generate([spec.make_request(p, params, lora_name=n) for p, n in work])]
    assert spec.num_draft_tokens > 0, "nothing was drafted"
    assert got == want
    _clean(spec)


def test_n_samples_of_an_adapter_request_all_run_the_adapter(ours, adapters, chat_prompt_ids) -> None:
    """n > 1: every sample (forked onto the prompt's blocks) runs the request's adapter and
    holds it until it ends: seeded samples equal lone requests of the same adapter."""
    _, paths = adapters
    engine = _engine(ours, paths)
    ids = chat_prompt_ids[2]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    outs = engine.generate([engine.make_request(ids, params, lora_name="a1")])
    _clean(engine)
    for o in outs:
        (alone,) = engine.generate([engine.make_request(
            ids, SamplingParams(temperature=1.0, seed=5 + o.index, max_tokens=8, ignore_eos=True),
            lora_name="a1")])
        assert alone.token_ids == o.token_ids, f"sample {o.index}"
    (base,) = engine.generate([engine.make_request(
        ids, SamplingParams(temperature=1.0, seed=6, max_tokens=8, ignore_eos=True))])
    assert base.token_ids != outs[1].token_ids, "sample 1 looks like the base model's"
    _clean(engine)
