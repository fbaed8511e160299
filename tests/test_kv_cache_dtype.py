"""--kv-cache-dtype float16 on the CPU: half the bytes a token, so twice the blocks in the
same memory (swap space too); swapped and recomputed requests get the tokens they get with
room for all; a GPU or a non-float32 model is refused with a clear error. Greedy tokens
against transformers' on each path: test_kernel_paths.py; the decoder's bits and
closeness: test_cpu_decoder.py::test_a_float16_cache."""

from __future__ import annotations

import random

import pytest
import torch

from scheduler.request import SamplingParams
from worker import plan
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.memory import kv_cache_dtype

GiB = 1 << 30
HALF_BLOCK = 16 * 2 * 30 * 3 * 64 * 2  # a 16-token block of SmolLM2-135M in float16


def test_float16_holds_twice_the_tokens(default_model) -> None:
    engines = {
        dt: Engine(WorkerConfig(model=ModelConfig(max_model_len=512),
                                cache=CacheConfig(kv_cache_memory=0.1, swap_space=0.05, kv_cache_dtype=dt)),
                   loaded=default_model)
        for dt in ("auto", "float16")
    }
    full, half = engines["auto"], engines["float16"]
    assert half.budget.num_blocks in (2 * full.budget.num_blocks, 2 * full.budget.num_blocks + 1)
    assert half.budget.bytes_per_token * 2 == full.budget.bytes_per_token
    assert half.kv.num_cpu_blocks in (2 * full.kv.num_cpu_blocks, 2 * full.kv.num_cpu_blocks + 1)
    k, v = half.runner.kv_caches[0]
    assert k.dtype == v.dtype == torch.float16 and half.runner.cpu_caches[0][0].dtype == torch.float16
    assert full.runner.kv_caches[0][0].dtype == torch.float32


def test_float16_is_for_a_float32_model_on_the_cpu() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kv_cache_dtype("auto", cuda, torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("float16", cpu, torch.float32) == torch.float16
    with pytest.raises(ValueError, match=r"--kv-cache-dtype float16 is for a float32 model on the CPU.*bfloat16 on cuda"):
        kv_cache_dtype("float16", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="float16 on cpu"):
        kv_cache_dtype("float16", cpu, torch.float16)
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, float16, fp8, fp8_e4m3, got 'fp9'"):
        CacheConfig(kv_cache_dtype="fp9")
    # the capacity planner refuses it alike (one rule, worker/memory.py)
    with pytest.raises(ValueError, match=r"is for a float32 model on the CPU.*bfloat16 on cuda"):
        plan.make_plan(plan.read_model("dummy:smollm2-135m"), plan.DEVICES["h100"], plan.Workload(100, 10),
                       cache=CacheConfig(kv_cache_dtype="float16"))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_float16_under_preemption(default_model, mode) -> None:
    """24 requests sharing prompt prefixes, in a 30-block float16 cache (480 tokens): the
    greedy tokens of a cache with room for all (prefix caching on, as by default)."""
    tok = default_model.tokenizer
    rng = random.Random(3)
    systems = [" ".join(f"Rule {k}.{j}: be brief." for j in range(rng.randint(2, 20))) for k in range(4)]
    work = []
    for i in range(24):
        msgs = [{"role": "system", "content": systems[i % 4]},
                {"role": "user", "content": f"Question {i}: what is {i} times {i + 2}?"}]
        work.append((tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True)), rng.randint(4, 16)))

    def run(blocks: int, swap_blocks: int) -> tuple[list[list[int]], Engine]:
        engine = Engine(WorkerConfig(
            model=ModelConfig(max_model_len=384),
            cache=CacheConfig(kv_cache_memory=blocks * HALF_BLOCK / GiB, swap_space=swap_blocks * HALF_BLOCK / GiB,
                              kv_cache_dtype="float16"),
            scheduler=SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=128, preemption_mode=mode)),
            loaded=default_model)
        assert engine.kv.num_blocks == blocks
        reqs = [engine.make_request(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for ids, n in work]
        out = [c.token_ids for c in engine.generate(reqs)]
        engine.kv.check_integrity()
        assert engine.kv.blocks_in_use() == 0
        return out, engine

    want, _ = run(24 * 12, 200 if mode == "swap" else 0)
    got, engine = run(30, 200 if mode == "swap" else 0)
    assert engine.num_preemptions > 0, "the small cache never preempted"
    assert got == want
