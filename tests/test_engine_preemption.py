"""Preemption and prefix caching on the default model must not change what any request
gets: swap and recompute under a tiny KV cache, prefix caching on and off."""

from __future__ import annotations

import random

import pytest

from scheduler.request import SamplingParams
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Completion, Engine

GiB = 1 << 30
BLOCK_BYTES = 16 * 2 * 30 * 3 * 64 * 4  # a 16-token block of SmolLM2-135M in float32


def _engine(loaded, *, blocks: int, mode: str = "auto", prefix: bool = True,
            swap_blocks: int = 0) -> Engine:
    conf = WorkerConfig(
        model=ModelConfig(max_model_len=512),
        cache=CacheConfig(kv_cache_memory=blocks * BLOCK_BYTES / GiB, enable_prefix_caching=prefix,
                          swap_space=swap_blocks * BLOCK_BYTES / GiB),
        # vLLM's one partial prefill: prompts admitted whole-budget first, as this workload's
        # preemption counts were set for (two split steps and preempt a little less).
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=128, preemption_mode=mode,
                                  max_num_partial_prefills=1),
    )
    engine = Engine(conf, loaded=loaded)
    assert engine.kv.num_blocks == blocks and engine.kv.num_cpu_blocks == (
        0 if mode == "recompute" else swap_blocks)
    return engine


@pytest.fixture(scope="module")
def workload(default_model) -> list[tuple[list[int], int]]:
    """64 requests: 8 shared system prompts (so prefixes repeat) with distinct questions,
    prompts 30 to 250 tokens, 4 to 24 new tokens each."""
    tok = default_model.tokenizer
    rng = random.Random(99)
    systems = [" ".join(f"Rule {k}.{j}: be brief." for j in range(rng.randint(2, 30)))
               for k in range(8)]
    work = []
    for i in range(64):
        msgs = [{"role": "system", "content": systems[i % 8]},
                {"role": "user", "content": f"Question {i}: what is {i} plus {3 * i}?"}]
        ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
        work.append((ids, rng.randint(4, 24)))
    return work


def _run(engine: Engine, work: list[tuple[list[int], int]]) -> list[Completion]:
    reqs = [engine.make_request(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for ids, n in work]
    out = engine.generate(reqs)
    engine.kv.check_integrity()
    assert not engine.scheduler.has_unfinished_requests()
    assert engine.kv.blocks_in_use() == 0 and engine.kv.num_free_cpu_blocks == engine.kv.num_cpu_blocks
    return out


@pytest.fixture(scope="module")
def reference(default_model, workload) -> list[list[int]]:
    """A cache big enough for everything at once: no preemption, no prefix caching."""
    engine = _engine(default_model, blocks=64 * 18, prefix=False)
    return [c.token_ids for c in _run(engine, workload)]


@pytest.mark.parametrize(
    ("mode", "prefix"),
    [("recompute", False), ("recompute", True), ("swap", False), ("swap", True)],
)
def test_greedy_identical_under_preemption(default_model, workload, reference, mode, prefix) -> None:
    """A 40-block cache (640 tokens) for 64 requests of up to ~270 tokens: preemption is
    constant. Swap mode gets a 200-block swap space."""
    engine = _engine(default_model, blocks=40, mode=mode, prefix=prefix,
                     swap_blocks=200 if mode == "swap" else 0)
    counts = {"preempt": 0, "swap_out": 0}

    def counting(obj, name: str, key: str) -> None:
        original = getattr(obj, name)

        def wrapper(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)

        setattr(obj, name, wrapper)

    counting(engine.scheduler, "_preempt", "preempt")
    counting(engine.kv, "swap_out", "swap_out")
    out = _run(engine, workload)
    assert counts["preempt"] > 10, f"only {counts['preempt']} preemptions: the test is not testing"
    assert (counts["swap_out"] > 0) == (mode == "swap"), counts
    mismatched = [i for i, c in enumerate(out) if c.token_ids != reference[i]]
    assert not mismatched, f"{mode}, prefix caching {prefix}: requests {mismatched} differ"
    hits = sum(c.cached_tokens for c in out)
    if prefix:
        assert hits > 0, "prefix caching on, shared system prompts, and no hits"
    else:
        assert hits == 0
