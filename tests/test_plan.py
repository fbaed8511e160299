"""`llm-worker plan` against the worker itself: the KV blocks the engine allocates, the bytes
its model holds, parameter counts of the real module, and the planner's own arithmetic."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ops import huge_pages, quantized_linear
from worker import cli, memory, plan
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.models.llama import LlamaForCausalLM
from worker.weights import LoadedModel, load_model

ROOT = Path(__file__).resolve().parents[1]
# A CPU with fixed figures, so that no test depends on this machine's measured speed.
CPU = plan.Device("cpu", "cpu", 24 << 30, 10e9, {"float32": 50e9, "bfloat16": 10e9})


@pytest.fixture(scope="module")
def default_model() -> LoadedModel:
    return load_model("default")


@pytest.fixture(scope="module")
def default_info() -> plan.ModelInfo:
    return plan.read_model("default")  # a few seconds: the GGUF's metadata and tokenizer


def _engine_budget(loaded: LoadedModel, max_model_len: int, cache: CacheConfig) -> Engine:
    conf = WorkerConfig(model=ModelConfig(max_model_len=max_model_len), cache=cache,
                        scheduler=SchedulerConfig())
    return Engine(conf, loaded=loaded)


@pytest.mark.parametrize(("max_model_len", "cache"), [
    (0, CacheConfig()),  # the defaults: the model's 8192 tokens, 1 GiB, blocks of 16
    (2048, CacheConfig(block_size=32, kv_cache_memory=0.25)),
    (1000, CacheConfig(block_size=8, kv_cache_memory=0.1)),
    (2048, CacheConfig(kv_cache_memory=0.25, kv_cache_dtype="float16")),  # half the bytes a token
])
def test_predicted_kv_blocks_are_what_the_engine_allocates(
        default_model: LoadedModel, default_info: plan.ModelInfo, max_model_len: int,
        cache: CacheConfig) -> None:
    engine = _engine_budget(default_model, max_model_len, cache)
    p = plan.make_plan(default_info, CPU, plan.Workload(100, 24), "auto",
                       max_model_len, cache)
    kv, b = p.kv_cache, engine.budget
    assert (kv["num_blocks"], kv["bytes_per_token"], kv["budget_bytes"], kv["max_model_len"]) == (
        b.num_blocks, b.bytes_per_token, b.budget_bytes, engine.max_model_len)
    assert kv["max_concurrent_at_max_model_len"] == b.max_concurrent_requests
    assert engine.runner.kv_caches[0][0].shape[:2] == (kv["num_blocks"], kv["block_size"])
    assert engine.kv.num_blocks == kv["num_blocks"]


def test_too_small_a_cache_is_refused_alike(default_model: LoadedModel,
                                            default_info: plan.ModelInfo) -> None:
    cache = CacheConfig(kv_cache_memory=0.01)
    with pytest.raises(ValueError) as engine_error:
        _engine_budget(default_model, 0, cache)
    with pytest.raises(ValueError) as plan_error:
        plan.make_plan(default_info, CPU, plan.Workload(100, 24), cache=cache)
    assert str(plan_error.value) == str(engine_error.value)


def test_bfloat16_dummy_blocks_match_too() -> None:
    loaded = load_model("dummy:smollm2-135m", "cpu", torch.bfloat16)
    conf = WorkerConfig(model=ModelConfig(model="dummy:smollm2-135m", dtype="bfloat16",
                                          max_model_len=4096))
    engine = Engine(conf, loaded=loaded)
    p = plan.make_plan(plan.read_model("dummy:smollm2-135m"), CPU, plan.Workload(100, 24),
                       "bfloat16", 4096)
    assert p.kv_cache["num_blocks"] == engine.budget.num_blocks
    assert p.kv_cache["bytes_per_token"] == engine.budget.bytes_per_token


def _held_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model's modules hold, each storage once (buffers such as
    the rotary table left out)."""
    seen: dict[int, int] = {}
    for m in model.modules():
        tensors = list(m.parameters(recurse=False))
        tensors += [t for a in ("packed", "bias") if isinstance(t := getattr(m, a, None), torch.Tensor)]
        for t in tensors:
            if t.is_mkldnn:  # oneDNN's opaque packed weights
                seen[id(t)] = t.numel() * t.element_size()
            elif huge_pages.in_arena(t.data_ptr()):  # one storage holds them all: each its own bytes
                seen[t.data_ptr()] = t.numel() * t.element_size()
            else:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.skipif(not quantized_linear.available(), reason="the C kernel needs gcc and AVX2")
def test_held_weights_are_what_the_cpu_runner_holds(default_model: LoadedModel,
                                                    default_info: plan.ModelInfo) -> None:
    engine = _engine_budget(default_model, 1024, CacheConfig(kv_cache_memory=0.05))
    w = plan.weights(default_info, CPU, "float32")
    assert sum(w.held.values()) == _held_bytes(engine.runner.model)
    assert set(w.held) == {"Q4_1", "Q8_0", "float32"}  # the GGUF's linears stay quantized
    assert w.held["Q4_1"] + w.held["Q8_0"] == sum(
        m.packed.nbytes for m in engine.runner.model.modules()
        if isinstance(m, quantized_linear.QuantLinear))


def test_float32_dummy_holds_a_packed_head_copy() -> None:
    loaded = load_model("dummy:smollm2-135m", "cpu", torch.float32)
    engine = Engine(WorkerConfig(model=ModelConfig(model="dummy:smollm2-135m", max_model_len=512),
                                 cache=CacheConfig(kv_cache_memory=0.05)), loaded=loaded)
    w = plan.weights(plan.read_model("dummy:smollm2-135m"), CPU, "float32")
    assert sum(w.held.values()) == _held_bytes(engine.runner.model)


@pytest.mark.parametrize("shape", ["llama-3-8b", "llama-3.2-1b", "smollm2-135m"])
def test_weights_on_a_gpu_are_the_real_modules_parameters(shape: str) -> None:
    info = plan.read_model(f"dummy:{shape}")
    with torch.device("meta"):
        model = LlamaForCausalLM(info.config)
    params = sum(p.numel() for p in model.parameters())
    w = plan.weights(info, plan.DEVICES["h100"], "bfloat16")
    assert w.held == {"bfloat16": 2 * params}
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    head = info.config.vocab_size * info.config.hidden_size
    assert w.matmul_params == linears + (head if info.config.tie_word_embeddings else 0)
    # A step reads every weight but the embedding rows (unless the table is the head).
    untied_table = 0 if info.config.tie_word_embeddings else head
    assert w.read_per_step == 2 * (params - untied_table)


def test_llama_3_8b_on_h100_arithmetic() -> None:
    p = plan.make_plan(plan.read_model("dummy:llama-3-8b"), plan.DEVICES["h100"],
                       plan.Workload(1024, 256, qps=10, ttft_slo=1.0, tpot_slo=0.05))
    kv, dev = p.kv_cache, plan.DEVICES["h100"]
    assert kv["bytes_per_token"] == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, bf16
    # vLLM's --gpu-memory-utilization: a share of the device's total memory, less the
    # weights and the activation reserve (as the engine computes it, worker/memory.py).
    cfg = plan.read_model("dummy:llama-3-8b").config
    reserve = memory.activation_reserve(cfg, SchedulerConfig(), p.kv_cache["max_model_len"], 2)
    assert kv["budget_bytes"] == (int(dev.memory_bytes * CacheConfig().gpu_memory_utilization)
                                  - p.weights["held_total_bytes"] - reserve)
    assert kv["num_blocks"] == kv["budget_bytes"] // kv["bytes_per_block"]
    assert kv["max_concurrent_sequences"] == kv["num_blocks"] // math.ceil(1280 / 16)
    b1 = p.decode["batch_1"]
    assert b1["bound"] == "memory"  # one row: the weight read is the step
    assert b1["step_s"] == pytest.approx(
        (p.weights["read_per_step_bytes"] + p.decode["mean_context"] * kv["bytes_per_token"]) / dev.bandwidth)


def test_slo_search_and_replicas_are_consistent(default_info: plan.ModelInfo) -> None:
    for tpot in (0.05, 0.2, 0.5):
        p = plan.make_plan(default_info, CPU, plan.Workload(200, 100, qps=3, tpot_slo=tpot, ttft_slo=2.0))
        s, r = p.slo, p.replicas
        roof = plan.Roofline(default_info.config, plan.weights(default_info, CPU, "float32"),
                             p.kv_cache["bytes_per_token"], CPU, "float32",
                             plan.Workload(200, 100), SchedulerConfig().max_num_batched_tokens)
        if not s["holds"]:
            assert roof.tpot(1) > tpot or roof.ttft(1) > 2.0
            assert r["replicas"] is None
            continue
        op = s["operating_batch"]
        assert roof.tpot(op) <= tpot and roof.ttft(op) <= 2.0
        assert op == p.kv_cache["max_batch"] or roof.tpot(op + 1) > tpot or roof.ttft(op + 1) > 2.0
        # Little's law: the replicas seat the concurrency at the operating batch.
        assert r["replicas"] * op >= 3 * roof.latency(op) - 1e-9
        assert (r["replicas"] - 1) * op < 3 * roof.latency(op) or r["replicas"] == r["by_work"]
    # A tighter TPOT never allows a larger batch.
    ops = [plan.make_plan(default_info, CPU, plan.Workload(200, 100, tpot_slo=t)).slo["operating_batch"]
           for t in (0.05, 0.1, 0.2, 0.5)]
    assert ops == sorted(ops)


def test_cli_json_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "dummy:llama-3-8b", "--device", "custom:24,1008,165",
            "--prompt-len", "512", "--output-len", "128", "--max-model-len", "4096", "--json"]
    assert cli.main(args) == 0
    out = json.loads(capsys.readouterr().out)  # one JSON object
    assert out["device"]["memory_bytes"] == 24 * 10**9 and out["kv_cache"]["max_model_len"] == 4096
    assert out["how"].startswith("roofline")
    for bad, says in ((["--device", "tpu"], "--device 'tpu'"),
                      (["--device", "custom:1,2"], "custom:MEM_GB,BW_GBps,TFLOPS"),
                      (["--max-model-len", "500"], "exceeds --max-model-len 500"),
                      (["--model", "/nonexistent.gguf"], "does not exist")):
        assert cli.main([*args[:-1], *bad]) == 2
        assert says in capsys.readouterr().err


def test_compare_step_reads_a_bench_step_report(tmp_path: Path, default_info: plan.ModelInfo) -> None:
    report = {"info": {"args": {"model": "default", "context": 100, "steps": 10}},
              "rows": [{"variant": "quantized", "batch": 1, "step_ms": 20.0},
                       {"variant": "quantized", "batch": 64, "step_ms": 200.0},
                       {"variant": "float32", "batch": 1, "step_ms": 40.0}]}
    path = tmp_path / "step.json"
    path.write_text(json.dumps(report))
    rows = plan.compare_step(str(path), default_info, CPU, "float32", "default")
    assert [r["batch"] for r in rows] == [1, 64]
    for r in rows:
        assert r["measured_over_predicted"] == pytest.approx(r["measured_ms"] / r["predicted_ms"])
        assert r["predicted_ms"] == pytest.approx(max(r["memory_ms"], r["compute_ms"]))
    with pytest.raises(ValueError, match="not 'dummy:llama-3-8b'"):
        plan.compare_step(str(path), default_info, CPU, "float32", "dummy:llama-3-8b")


def test_serve_allocates_the_planned_blocks() -> None:
    """End to end: `llm-worker serve` logs the blocks it allocated; `llm-worker plan` with the
    same flags predicts them."""
    flags = ["--max-model-len", "2048", "--block-size", "32", "--kv-cache-memory", "0.3"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "serve", "--port", "0", "--log-format", "console", *flags],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    line, deadline = "", time.monotonic() + 240
    try:
        assert proc.stderr is not None
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line or re.search(r"KV cache: .* blocks x", line):
                break
        match = re.search(r"= (\d+) blocks x (\d+) tokens", line)
        assert match, line
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    out = subprocess.run([sys.executable, "-m", "worker.cli", "plan", "--prompt-len", "100",
                          "--output-len", "24", "--json", *flags], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=240, check=True)
    kv = json.loads(out.stdout)["kv_cache"]
    assert (kv["num_blocks"], kv["block_size"]) == (int(match[1]), int(match[2]))


def test_hf_folder_sizes_come_from_the_safetensors_headers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    info = plan.read_model(str(tmp_path))
    assert info.source == "safetensors" and info.config.num_layers == 2
    assert info.stored == {"BF16": sum(2 * t.numel() for t in hf.parameters())}
    p = plan.make_plan(info, plan.DEVICES["l40s"], plan.Workload(100, 20), max_model_len=512)
    assert p.kv_cache["bytes_per_token"] == 2 * 2 * 2 * 16 * 2  # K+V, 2 layers, 2 KV heads x 16, bf16
    assert p.weights["held_bytes"] == {"bfloat16": sum(2 * t.numel() for t in hf.parameters())}
