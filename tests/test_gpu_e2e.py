"""End to end on a GPU: the Triton kernels and CUDA graphs must not change what a request
gets. Skipped without CUDA (CI has none); run on the device machine."""

from __future__ import annotations

import random

import pytest
import torch

import ops
from scheduler.request import SamplingParams
from tests.helpers import requires_cuda, requires_triton
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.weights import load_model

pytestmark = [requires_cuda, requires_triton]


def _engine(loaded, kernels: str, graphs: bool, seqs: int = 16, budget: int = 256) -> Engine:
    conf = WorkerConfig(
        model=ModelConfig(kernels=kernels, cuda_graphs=graphs, max_model_len=2048),
        cache=CacheConfig(kv_cache_memory=1.0),
        scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget),
    )
    return Engine(conf, loaded=loaded)


def _run(engine: Engine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    reqs = [
        engine.make_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, max_tokens, strict=True)
    ]
    out = [c.token_ids for c in engine.generate(reqs)]
    assert engine.kv.num_free_blocks == engine.budget.num_blocks
    engine.kv.check_integrity()
    return out


@pytest.fixture(scope="module")
def gpu_model_fp32():
    return load_model("default", "cuda", torch.float32)


@pytest.fixture(scope="module")
def gpu_prompts(gpu_model_fp32) -> tuple[list[list[int]], list[int]]:
    """The chat prompts of conftest plus random-length token runs (mixed prefills, chunked)."""
    from tests.conftest import CHAT_PROMPTS

    tok = gpu_model_fp32.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
        for p in CHAT_PROMPTS
    ]
    rng = random.Random(7)
    corpus = tok.encode(" ".join(CHAT_PROMPTS) * 40)
    for _ in range(14):
        n = rng.randint(20, 600)
        start = rng.randrange(len(corpus) - n)
        prompts.append(corpus[start : start + n])
    max_tokens = [rng.randint(8, 48) for _ in prompts]
    return prompts, max_tokens


def test_triton_and_graphs_equal_torch_references_fp32(gpu_model_fp32, gpu_prompts) -> None:
    """Greedy tokens of 24 concurrent requests (chunked prefills mixed with decodes; decode
    steps replayed from CUDA graphs) equal those of the torch references, in float32."""
    prompts, max_tokens = gpu_prompts
    try:
        ref = _run(_engine(gpu_model_fp32, "torch", graphs=False), prompts, max_tokens)
        fast_engine = _engine(gpu_model_fp32, "auto", graphs=True)
        assert fast_engine.runner.graphs is not None, "decode graphs were not captured"
        fast = _run(fast_engine, prompts, max_tokens)
        eager = _run(_engine(gpu_model_fp32, "auto", graphs=False), prompts, max_tokens)
    finally:
        ops.set_backend("auto")
    assert sum(len(t) for t in ref) == sum(max_tokens)
    mismatched = [i for i, (a, b) in enumerate(zip(ref, fast, strict=True)) if a != b]
    assert not mismatched, f"requests {mismatched} differ between Triton+graphs and torch"
    assert eager == fast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_matches_eager(dtype: torch.dtype) -> None:
    """Dummy Llama-3.2-1B shapes: one decode-only step of 11 requests (padded to the
    captured size 16) replayed from a graph gives the eager Triton step's logits. In float32
    within 1e-4 relative (the graph's attention may split the context differently); in
    bfloat16, with random weights whose logits swing with every rounding, the graph may
    differ from eager by no more than twice what the kernels differ from the torch
    references on the same step, plus 1e-3."""
    loaded = load_model("dummy:llama-3.2-1b", "cuda", dtype)
    engine = _engine(loaded, "auto", graphs=True)
    rng = random.Random(3)
    for _ in range(11):
        prompt = [rng.randrange(100, 120000) for _ in range(rng.randint(5, 300))]
        engine.submit(engine.make_request(prompt, SamplingParams(temperature=0, max_tokens=50)))
    for _ in range(20):  # prefill everything (chunked) and decode a few tokens
        engine.step()
    step = engine.scheduler.schedule()
    assert len(step.scheduled) == 11 and all(s.num_new_tokens == 1 for s in step.scheduled)
    runner = engine.runner
    captured: list[torch.Tensor] = []
    runner._sample = lambda reqs, logits, *_: captured.append(logits.float().clone()) or {}
    try:
        runner.execute(step)  # graph replay (writes this step's K/V)
        graphs, runner.graphs = runner.graphs, None
        runner.execute(step)  # eager Triton, rewriting the same slots
        ops.set_backend("torch")
        runner.execute(step)  # eager torch references
        runner.graphs = graphs
    finally:
        ops.set_backend("auto")
    graph_logits, eager_logits, ref_logits = captured
    assert graph_logits.shape == (11, loaded.config.vocab_size)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    graph_err, kernel_err = rel(graph_logits, eager_logits), rel(eager_logits, ref_logits)
    bound = 1e-4 if dtype == torch.float32 else 2 * kernel_err + 1e-3
    assert graph_err <= bound, f"graph vs eager {graph_err:.2e}, eager vs torch {kernel_err:.2e}"


def test_preemption_and_prefix_caching_on_gpu_fp32() -> None:
    """Swap (pinned host memory, batched copies), recompute and prefix caching (with
    copy-on-write) on the GPU with the Triton kernels and graphs: greedy tokens of 32
    requests sharing prefixes under a 40-block cache equal those of a big cache without
    prefix caching (dummy SmolLM2 shapes, float32)."""
    loaded = load_model("dummy:smollm2-135m", "cuda", torch.float32)
    rng = random.Random(5)
    prefixes = [[rng.randrange(100, 40000) for _ in range(rng.choice((16, 32, 48, 70)))]
                for _ in range(4)]
    work = [(prefixes[i % 4] + [rng.randrange(100, 40000) for _ in range(rng.randint(0, 120))],
             rng.randint(6, 16)) for i in range(32)]

    def run(blocks: int, mode: str, prefix: bool) -> tuple[list[list[int]], Engine]:
        conf = WorkerConfig(
            model=ModelConfig(max_model_len=512),
            cache=CacheConfig(kv_cache_memory=blocks * 16 * 2 * 30 * 3 * 64 * 4 / (1 << 30),
                              enable_prefix_caching=prefix, swap_space=0.05),
            scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=128,
                                      preemption_mode=mode),
        )
        engine = Engine(conf, loaded=loaded)
        assert engine.runner.graphs is not None
        return _run(engine, [p for p, _ in work], [n for _, n in work]), engine

    reference, _ = run(1024, "recompute", prefix=False)
    for mode in ("swap", "recompute"):
        tokens, engine = run(40, mode, prefix=True)
        assert engine.kv.stats.num_hit_tokens > 0
        assert tokens == reference, f"{mode}: differs from the reference"


def test_speculative_decoding_keeps_greedy_tokens_on_gpu_fp32(gpu_model_fp32, gpu_prompts) -> None:
    """N-gram speculation on the GPU (verification rows through the Triton kernels, plain
    decode steps of the same engine replayed from graphs): 24 concurrent greedy requests get
    the tokens of the same engine without speculation, drafts are made and accepted, and
    no block outlives its request (float32, the default model)."""
    from worker.config import NgramSpeculation, SpeculativeConfig

    prompts, max_tokens = gpu_prompts
    plain = _run(_engine(gpu_model_fp32, "auto", graphs=True), prompts, max_tokens)
    spec = NgramSpeculation(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4,
                            disable_by_batch_size=64)
    conf = WorkerConfig(
        model=ModelConfig(cuda_graphs=True, max_model_len=2048),
        cache=CacheConfig(kv_cache_memory=1.0),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
        speculative=SpeculativeConfig(spec),
    )
    engine = Engine(conf, loaded=gpu_model_fp32)
    assert engine.runner.graphs is not None
    tokens = _run(engine, prompts, max_tokens)
    assert engine.num_draft_tokens > 0 and engine.num_accepted_tokens > 0
    mismatched = [i for i, (a, b) in enumerate(zip(tokens, plain, strict=True)) if a != b]
    assert not mismatched, f"requests {mismatched} differ with speculation"
