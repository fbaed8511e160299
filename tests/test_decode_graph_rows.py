"""Which steps replay the decode graphs (worker/cuda_graphs.py), checked on the CPU: CUDA
graphs need a GPU, so a stand-in replaces the capture by running the forward it would have
captured, over the same static buffers. The staging (padding, slots, per-row block tables)
and the runner's choice of path are the real ones. On a GPU, tests/test_gpu_e2e.py runs the
same steps through real graphs."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from scheduler.request import SamplingParams
from worker.config import (
    CacheConfig,
    ModelConfig,
    NgramSpeculation,
    SchedulerConfig,
    SpeculativeConfig,
    WorkerConfig,
)
from worker.cuda_graphs import DecodeGraphs
from worker.engine import Engine, _max_verify_rows
from worker.weights import load_model


class ForwardGraphs(DecodeGraphs):
    """DecodeGraphs whose 'replay' runs the forward pass on the static buffers."""

    def _capture_all(self) -> None:
        self.replays: list[int] = []

    def _replay(self, b: int) -> torch.Tensor:
        self.replays.append(b)
        return self._forward(b)


@pytest.fixture(scope="module")
def model():
    return load_model("dummy:smollm2-135m", "cpu", torch.float32)


def _engine(model, spec: NgramSpeculation | None, graphs: bool, seqs: int = 4) -> Engine:
    conf = WorkerConfig(
        model=ModelConfig(device="cpu", kernels="torch", max_model_len=512),
        cache=CacheConfig(kv_cache_memory=0.05),
        scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=128),
        speculative=SpeculativeConfig(spec),
    )
    engine = Engine(conf, loaded=model)
    if graphs:
        r = engine.runner
        rows = max(seqs, _max_verify_rows(spec, seqs))
        r.graphs = ForwardGraphs(r.model, r.kv_caches, rows, 512, engine.config.cache.block_size, r.device)
    return engine


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    reqs = [engine.make_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            for p in prompts]
    out = [c.token_ids for c in engine.generate(reqs)]
    assert engine.kv.num_free_blocks == engine.budget.num_blocks
    engine.kv.check_integrity()
    return out


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(4)
    # Repeated phrases, so n-gram drafts are made from the prompt too.
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(3, 9))] * rng.randint(3, 6)
            for _ in range(n)]


def test_max_verify_rows() -> None:
    spec = NgramSpeculation(num_speculative_tokens=3, disable_by_batch_size=4)
    assert _max_verify_rows(None, 64) == 0
    assert _max_verify_rows(spec, 64) == 16  # 4 requests speculate at most, 4 rows each
    assert _max_verify_rows(spec, 1) == 4
    wide = NgramSpeculation(num_speculative_tokens=5, disable_by_batch_size=1000)
    assert _max_verify_rows(wide, 256) == 512  # capped: 256 x 6 rows would capture 1,536


def test_verification_steps_replay_the_decode_graphs(model) -> None:
    """Three requests speculating (k = 3): every step with no prompt chunk, verification
    steps included, goes through the graph buffers, and the greedy tokens are those of the
    same engine with neither graphs nor speculation."""
    prompts = _prompts(3)
    plain = _run(_engine(model, None, graphs=False), prompts, 24)
    spec = NgramSpeculation(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)
    engine = _engine(model, spec, graphs=True)
    graphs = engine.runner.graphs
    assert isinstance(graphs, ForwardGraphs) and graphs.sizes[-1] == 16
    calls: list[str] = []
    real_run, real_verify = graphs.run, engine.runner._verify
    graphs.run = lambda ids, *a: calls.append(f"graph {len(ids)}") or real_run(ids, *a)
    engine.runner._verify = lambda *a: calls.append("verify") or real_verify(*a)
    assert _run(engine, prompts, 24) == plain
    assert engine.num_accepted_tokens > 0
    # A verification step replays with a row per drafted position: more rows than requests.
    replayed_verifies = [c for c, nxt in itertools.pairwise(calls)
                         if c.startswith("graph") and nxt == "verify"]
    assert replayed_verifies and max(int(c.split()[1]) for c in replayed_verifies) > 3
    # Only the prefill steps (several tokens of one prompt) ran without the buffers.
    assert engine.num_steps - len(graphs.replays) <= 3


def test_plain_and_single_token_chunks_replay(model) -> None:
    """Without speculation: decode steps replay, and the tokens equal the eager engine's
    (padding rows, -1 slots, block 0 for the padded rows' tables do not leak into real rows)."""
    prompts = _prompts(3)
    plain = _run(_engine(model, None, graphs=False), prompts, 20)
    engine = _engine(model, None, graphs=True)
    assert _run(engine, prompts, 20) == plain
    graphs = engine.runner.graphs
    assert isinstance(graphs, ForwardGraphs) and set(graphs.replays) <= {1, 2, 3, 4}
    assert len(graphs.replays) >= 18
