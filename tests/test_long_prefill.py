"""Long prompts sharing the step on the default model: greedy tokens are those of the
schedule without limits, and benchmarks/long_prefill.py's command runs (a small case)."""

from __future__ import annotations

import json

import pytest

from benchmarks import long_prefill
from scheduler.request import SamplingParams
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine


def _tokens(loaded, prompts: list[list[int]], **flags: int) -> tuple[list[list[int]], int]:
    conf = WorkerConfig(model=ModelConfig(max_model_len=1024), cache=CacheConfig(kv_cache_memory=0.1),
                        scheduler=SchedulerConfig(max_num_batched_tokens=64, **flags))
    engine = Engine(conf, loaded=loaded)
    reqs = [engine.make_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            for p in prompts]
    done = engine.generate(reqs)
    assert engine.kv.blocks_in_use() == 0
    return [c.token_ids for c in done], engine.num_steps


def test_greedy_tokens_unchanged_when_long_prompts_share_the_step(default_model) -> None:
    tok = default_model.tokenizer
    long = tok.encode(" ".join(f"Item {i} weighs {i * 7 % 50} grams." for i in range(60)))[:300]
    shorts = [tok.encode(f"Question {i}: what is {i} plus {i}?") for i in range(2)]
    prompts = [long, *shorts, long[:150]]
    reference, steps_off = _tokens(default_model, prompts, max_num_partial_prefills=1)
    # v0's split (a long prompt: 4% of 1024 = 40 tokens) and v1's 32-token chunks.
    split, _ = _tokens(default_model, prompts)  # the default: 2
    capped, steps_capped = _tokens(default_model, prompts, long_prefill_token_threshold=32)
    assert split == reference and capped == reference
    assert steps_capped > steps_off  # the cap did cut the chunks


def test_the_benchmark_command_runs(default_model, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(long_prefill, "load_model", lambda name: default_model)
    out = tmp_path / "lp.json"
    long_prefill.main(["--rounds", "1", "--long-tokens", "200", "--budget", "64",
                       "--max-model-len", "512", "--kv-gib", "0.05", "--short-after-s", "0.1",
                       "--max-tokens", "2", "--settings", "off", "partial-2", "--no-alone",
                       "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert {"date", "cpu", "git_commit", "command"} <= set(report["info"])
    summary = report["summary"]
    assert set(summary) == {"off", "partial-2"}
    assert all(s["greedy_tokens_as_off"] for s in summary.values())
    assert {r["setting"] for r in report["runs"]} == {"off", "partial-2"}
    assert pytest.approx(summary["off"]["long_ttft_vs_off"]) == 1.0
