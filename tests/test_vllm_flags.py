"""The flags an operator's fingers bring from `vllm serve`: each is accepted and means what
vLLM's means (checked where it acts: the engine, the scheduler, the wire, the gateway), or
is refused with a message that says what to do instead. The README's table of them is
checked against the parser."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from llmworker.v1 import worker_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from kvcache import KVCacheManager
from scheduler import SamplingParams, Scheduler
from tests.test_limits import _tiny_loaded
from tests.test_scheduler import KVRunner, drive, expected_output, req, step
from tests.test_server import Worker
from worker import config as cfgmod
from worker import memory
from worker.cli import build_parser, main
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine, resolve_dtype

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def parse(*argv: str) -> WorkerConfig:
    return cfgmod.from_args(build_parser().parse_args(["serve", *argv]))


def serve_help() -> str:
    sub = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return sub.format_help()


def tiny_engine(**sections: object) -> Engine:
    conf = WorkerConfig(**{"model": ModelConfig(device="cpu", max_model_len=256), **sections})
    return Engine(conf, loaded=_tiny_loaded())


def kv_bytes_per_token(loaded) -> int:  # K and V, every layer, every KV head
    m = loaded.config
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * loaded.dtype.itemsize


# ----- every flag: in --help, with its variable ---------------------------------------------

VLLM_FLAGS = {  # the flag -> its LLMWORKER_* variable
    "--served-model-name": "LLMWORKER_SERVED_MODEL_NAME",
    "--enforce-eager": "LLMWORKER_ENFORCE_EAGER",
    "--enable-chunked-prefill": "LLMWORKER_ENABLE_CHUNKED_PREFILL",
    "--no-enable-chunked-prefill": "LLMWORKER_ENABLE_CHUNKED_PREFILL",
    "--kv-cache-memory-bytes": "LLMWORKER_KV_CACHE_MEMORY_BYTES",
    "--dtype": "LLMWORKER_DTYPE",
    "--max-model-len": "LLMWORKER_MAX_MODEL_LEN",
    "--gpu-memory-utilization": "LLMWORKER_GPU_MEMORY_UTILIZATION",
    "--kv-cache-free-memory-fraction": "LLMWORKER_KV_CACHE_FREE_MEMORY_FRACTION",
    "--tensor-parallel-size": "LLMWORKER_TENSOR_PARALLEL_SIZE",
    "--kv-transfer-config": "LLMWORKER_KV_TRANSFER_CONFIG",
    "--long-prefill-token-threshold": "LLMWORKER_LONG_PREFILL_TOKEN_THRESHOLD",
    "--max-num-partial-prefills": "LLMWORKER_MAX_NUM_PARTIAL_PREFILLS",
    "--max-long-partial-prefills": "LLMWORKER_MAX_LONG_PARTIAL_PREFILLS",
}


def test_each_flag_shows_in_help_with_its_variable() -> None:
    text = serve_help()
    for flag, env in VLLM_FLAGS.items():
        assert re.search(rf"(^|\s|\[){re.escape(flag)}\b", text), flag
        assert env in text, env
    assert "-tp INT" in text  # vLLM's short form


# ----- --max-model-len 32k (and the other sizes): vLLM's human_readable_int ---------------


@pytest.mark.parametrize(("text", "value"), [
    # vLLM's own examples (vllm/utils/argparse_utils.py, human_readable_int's docstring) and
    # its rule: lowercase = powers of 1000, uppercase = powers of 1024.
    ("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("32k", 32_000), ("32K", 32 * 1024),
    ("2m", 2 * 10**6), ("2M", 2 << 20), ("1g", 10**9), ("1G", 1 << 30), ("1t", 10**12),
    ("1T", 1 << 40), (" 4096 ", 4096),
])
def test_sizes_read_as_vllm_reads_them(text: str, value: int) -> None:
    assert cfgmod.human_readable_int(text) == value
    assert parse("--max-model-len", text).model.max_model_len == value
    assert parse("--max-num-batched-tokens", text).scheduler.max_num_batched_tokens == value
    assert parse("--kv-cache-memory-bytes", text).cache.kv_cache_memory_bytes == value


def test_bad_sizes_are_refused_with_the_reason(capsys, monkeypatch) -> None:
    with pytest.raises(SystemExit):
        parse("--max-model-len", "1.5K")
    assert "decimals are not allowed with binary suffixes like K; did you mean 1.5k?" in (
        capsys.readouterr().err)
    with pytest.raises(SystemExit):
        parse("--max-model-len", "auto")
    assert "'auto' (vLLM: the longest length whose KV cache fits) is not supported" in (
        capsys.readouterr().err)
    with pytest.raises(SystemExit):
        parse("--max-model-len", "lots")
    assert "'lots' is not an integer" in capsys.readouterr().err
    monkeypatch.setenv("LLMWORKER_MAX_MODEL_LEN", "2k")
    assert parse().model.max_model_len == 2000
    monkeypatch.setenv("LLMWORKER_MAX_MODEL_LEN", "2.5K")
    with pytest.raises(SystemExit):
        parse()
    assert "LLMWORKER_MAX_MODEL_LEN='2.5K'" in capsys.readouterr().err


def test_max_model_len_with_a_suffix_is_the_engines_limit() -> None:
    engine = tiny_engine(model=ModelConfig(device="cpu", max_model_len=parse(
        "--max-model-len", "0.3k").model.max_model_len))
    assert engine.max_model_len == 300
    ids = list(range(1, 251))
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(300\)"):
        engine.make_request(ids, SamplingParams(max_tokens=51))
    engine.make_request(ids, SamplingParams(max_tokens=50))  # 300: fits exactly


# ----- --dtype -----------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "torch_dtype"), [
    ("half", torch.float16), ("float16", torch.float16), ("bfloat16", torch.bfloat16),
    ("float", torch.float32), ("float32", torch.float32),
])
def test_dtype_names_of_vllm(given: str, torch_dtype: torch.dtype, monkeypatch) -> None:
    conf = parse("--dtype", given)
    assert resolve_dtype(conf.model.dtype, torch.device("cpu")) is torch_dtype
    monkeypatch.setenv("LLMWORKER_DTYPE", given)
    assert resolve_dtype(parse().model.dtype, torch.device("cpu")) is torch_dtype


def test_dtype_auto_and_unknown(capsys) -> None:
    assert resolve_dtype(parse().model.dtype, torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16  # vLLM: the model's
    with pytest.raises(SystemExit):
        parse("--dtype", "fp8")
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--dtype must be one of auto, float32, bfloat16, float16"):
        ModelConfig(dtype="double")


def test_half_loads_half_weights() -> None:
    from worker.weights import load_model

    loaded = load_model("dummy:smollm2-135m", torch.device("cpu"), resolve_dtype(
        parse("--dtype", "half").model.dtype, torch.device("cpu")))
    assert loaded.dtype is torch.float16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float16}


# ----- --enforce-eager ---------------------------------------------------------------------


def test_enforce_eager_is_no_cuda_graphs(monkeypatch, capsys) -> None:
    assert parse().model.cuda_graphs is True
    assert parse("--enforce-eager").model.cuda_graphs is False
    assert parse("--enforce-eager", "true").model.cuda_graphs is False
    assert parse("--enforce-eager", "false").model.cuda_graphs is True
    assert parse("--enforce-eager", "--no-enforce-eager").model.cuda_graphs is True
    assert parse("--no-cuda-graphs").model.cuda_graphs is False
    monkeypatch.setenv("LLMWORKER_ENFORCE_EAGER", "1")
    assert parse().model.cuda_graphs is False
    assert parse("--cuda-graphs").model.cuda_graphs is True  # a flag beats a variable
    monkeypatch.setenv("LLMWORKER_CUDA_GRAPHS", "1")
    with pytest.raises(SystemExit):
        parse()
    assert "LLMWORKER_CUDA_GRAPHS='1' and LLMWORKER_ENFORCE_EAGER='1' contradict" in (
        capsys.readouterr().err)


# ----- --tensor-parallel-size ---------------------------------------------------------------


def test_tensor_parallel_size_one_is_accepted() -> None:
    assert parse("--tensor-parallel-size", "1").parallel.tensor_parallel_size == 1
    assert parse("-tp", "1").parallel.tensor_parallel_size == 1


@pytest.mark.parametrize("argv", [["--tensor-parallel-size", "3"], ["-tp", "3"]])
def test_tensor_parallel_size_above_one_is_taken(argv: list[str]) -> None:
    # What it does is tested in tests/test_tp_*.py; here the spellings and the bounds.
    assert parse(*argv).parallel.tensor_parallel_size == 3
    with pytest.raises(ValueError, match=r"--tensor-parallel-size must be in \[1, 64\], got 0"):
        parse("-tp", "0")


def test_tensor_parallel_size_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("LLMWORKER_TENSOR_PARALLEL_SIZE", "4")
    monkeypatch.setenv("LLMWORKER_DISTRIBUTED_TIMEOUT_SECONDS", "5")
    conf = parse()
    assert conf.parallel.tensor_parallel_size == 4
    assert conf.parallel.distributed_timeout_seconds == 5.0
    assert parse("--distributed-timeout-seconds", "7").parallel.distributed_timeout_seconds == 7.0


# ----- --enable-chunked-prefill / --no-enable-chunked-prefill -------------------------------


def test_chunked_prefill_flags(monkeypatch) -> None:
    assert parse().scheduler.enable_chunked_prefill is True
    assert parse("--no-enable-chunked-prefill").scheduler.enable_chunked_prefill is False
    assert parse("--enable-chunked-prefill", "false").scheduler.enable_chunked_prefill is False
    monkeypatch.setenv("LLMWORKER_ENABLE_CHUNKED_PREFILL", "false")
    assert parse().scheduler.enable_chunked_prefill is False


def test_partial_prefill_flags(monkeypatch, capsys) -> None:
    sc = parse().scheduler  # ours: 2 partial prefills (vLLM: 1), measured; the rest vLLM's
    assert (sc.long_prefill_token_threshold, sc.max_num_partial_prefills,
            sc.max_long_partial_prefills) == (0, 2, 1)
    sc = parse("--long-prefill-token-threshold", "1k", "--max-num-partial-prefills", "4",
               "--max-long-partial-prefills", "2").scheduler
    assert (sc.long_prefill_token_threshold, sc.max_num_partial_prefills,
            sc.max_long_partial_prefills) == (1000, 4, 2)
    monkeypatch.setenv("LLMWORKER_MAX_NUM_PARTIAL_PREFILLS", "1")
    assert parse().scheduler.max_num_partial_prefills == 1
    with pytest.raises(ValueError, match=r"--max-long-partial-prefills \(2\) <= --max-num-partial"):
        parse("--max-long-partial-prefills", "2")
    with pytest.raises(ValueError, match="--long-prefill-token-threshold must be >= 0"):
        parse("--long-prefill-token-threshold", "-1")
    # Past max_model_len: refused when the engine knows it (vLLM's rule).
    with pytest.raises(ValueError, match=r"long_prefill_token_threshold \(600\) must be < max_model_len"):
        tiny_engine(model=ModelConfig(device="cpu", max_model_len=512),
                    scheduler=SchedulerConfig(long_prefill_token_threshold=600))


def _scheduler(chunked: bool, budget: int, max_model_len: int) -> tuple[Scheduler, KVRunner]:
    return (Scheduler(KVCacheManager(256, 16), 8, budget, max_model_len, chunked_prefill=chunked),
            KVRunner(16))


def test_unchunked_prefill_takes_a_long_prompt_in_one_step() -> None:
    outputs = {}
    for chunked in (True, False):
        sched, runner = _scheduler(chunked, budget=32, max_model_len=256)
        r = req("long", prompt_len=200, max_tokens=3)
        sched.add_request(r)
        first = step(sched, runner)
        (s,) = first.scheduled
        # vLLM: off, the budget is at least max_model_len and the prompt is one step.
        assert sched.max_num_batched_tokens == (32 if chunked else 256)
        assert (s.num_new_tokens, s.will_sample) == ((32, False) if chunked else (200, True))
        steps = 1 + drive(sched, runner)
        assert steps == (math.ceil(200 / 32) + 2 if chunked else 3)
        outputs[chunked] = r.output_token_ids
        assert r.output_token_ids == expected_output(runner, r, 3)
    assert outputs[True] == outputs[False]


def test_unchunked_prompt_waits_for_room_instead_of_being_split() -> None:
    for chunked in (True, False):
        sched, runner = _scheduler(chunked, budget=64, max_model_len=64)
        a, b = req("a", prompt_len=60, max_tokens=4), req("b", prompt_len=10, max_tokens=2)
        sched.add_request(a)
        sched.add_request(b)
        out = step(sched, runner)
        got = {s.request_id: s.num_new_tokens for s in out.scheduled}
        if chunked:
            assert got == {"a": 60, "b": 4}  # b's prompt split: 4 now, 6 later
        else:
            assert got == {"a": 60} and b in sched.waiting  # b waits, whole
            out = step(sched, runner)
            assert {s.request_id: s.num_new_tokens for s in out.scheduled} == {"a": 1, "b": 10}
        drive(sched, runner)
        assert a.output_token_ids == expected_output(runner, a, 4)
        assert b.output_token_ids == expected_output(runner, b, 2)


def test_unchunked_engine_gives_the_same_greedy_tokens(default_model) -> None:
    tok = default_model.tokenizer
    ids = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Explain in detail why the sky is blue, please. " * 4}],
        add_generation_prompt=True))
    assert len(ids) > 64
    results = {}
    for chunked in (True, False):
        conf = WorkerConfig(model=ModelConfig(max_model_len=512),
                            cache=CacheConfig(kv_cache_memory_bytes=cfgmod.human_readable_int("64M")),
                            scheduler=SchedulerConfig(max_num_batched_tokens=32,
                                                      enable_chunked_prefill=chunked))
        engine = Engine(conf, loaded=default_model)
        (done,) = engine.generate([engine.make_request(ids, SamplingParams(max_tokens=6))])
        results[chunked] = (done.token_ids, engine.num_steps)
    assert results[True][0] == results[False][0]
    assert results[False][1] == 6  # the prompt in one step that samples, then 5 decodes
    assert results[True][1] == math.ceil(len(ids) / 32) + 5


# ----- --kv-cache-memory-bytes (and --kv-cache-memory GiB) -----------------------------------


def test_kv_cache_memory_bytes_sizes_the_cache() -> None:
    for argv in (["--kv-cache-memory-bytes", "1M"], ["--kv-cache-memory-bytes", "1048576"],
                 ["--kv-cache-memory", str(1 / 1024)]):
        conf = parse(*argv)
        assert conf.cache.kv_cache_bytes == 1 << 20, argv
        engine = tiny_engine(cache=conf.cache)
        per_block = kv_bytes_per_token(engine.loaded) * 16
        assert engine.kv.num_blocks == (1 << 20) // per_block, argv
    engine = tiny_engine(cache=parse("--kv-cache-memory-bytes", "1m").cache)  # 10**6 bytes
    assert engine.kv.num_blocks == 10**6 // per_block


def test_both_kv_sizes_is_refused(capsys) -> None:
    assert main(["serve", "--kv-cache-memory", "1", "--kv-cache-memory-bytes", "1G"]) == 2
    assert "--kv-cache-memory (GiB) and --kv-cache-memory-bytes set the same size: give one" in (
        capsys.readouterr().err)


# ----- --gpu-memory-utilization: vLLM's share of TOTAL memory (fake devices) ----------------


def test_gpu_memory_utilization_is_a_share_of_total_memory() -> None:
    # An 80 GiB device: 16 GiB of weights loaded, 4 GiB held by others (context included).
    mem = memory.DeviceMemory(total=80 * GiB, free=60 * GiB, held=16 * GiB)
    act = 3 * GiB
    for util in (0.5, 0.9, 0.95):
        kv = memory.kv_cache_bytes(CacheConfig(gpu_memory_utilization=util), mem, act)
        # vLLM (v1 gpu_worker): requested = util * total; KV = requested - non-KV memory.
        assert kv == int(80 * GiB * util) - 16 * GiB - act
        assert kv + mem.held + act <= util * mem.total  # the worker stays inside its share
    # The same device with twice the weights: the KV cache shrinks by what they took.
    mem2 = dataclasses.replace(mem, free=44 * GiB, held=32 * GiB)
    assert (memory.kv_cache_bytes(CacheConfig(), mem, act)
            - memory.kv_cache_bytes(CacheConfig(), mem2, act)) == 16 * GiB


def test_gpu_memory_utilization_refusals_name_the_flag() -> None:
    mem = memory.DeviceMemory(total=80 * GiB, free=60 * GiB, held=16 * GiB)  # 76 free at start
    with pytest.raises(ValueError, match=r"free memory on the device at start \(76.00 GiB of "
                       r"80.00 GiB\) is less than --gpu-memory-utilization 0.99 asks for "
                       r"\(79.20 GiB\); other processes hold 4.00 GiB"):
        memory.kv_cache_bytes(CacheConfig(gpu_memory_utilization=0.99), mem, GiB)
    with pytest.raises(ValueError, match=r"no memory is left for the KV cache: weights "
                       r"\(16.00 GiB\) and the activation reserve \(5.00 GiB\) take all that "
                       r"--gpu-memory-utilization 0.2 allows"):
        memory.kv_cache_bytes(CacheConfig(gpu_memory_utilization=0.2), mem, 5 * GiB)
    with pytest.raises(ValueError, match=r"more than the device has free \(60.00 GiB"):
        memory.kv_cache_bytes(CacheConfig(kv_cache_memory_bytes=61 * GiB), mem, GiB)


def test_other_rules_take_precedence_as_documented() -> None:
    mem = memory.DeviceMemory(total=80 * GiB, free=60 * GiB, held=16 * GiB)
    # A size given wins over any share, as vLLM's kv_cache_memory_bytes does.
    assert memory.kv_cache_bytes(CacheConfig(kv_cache_memory_bytes=7 * GiB,
                                             gpu_memory_utilization=0.5), mem, GiB) == 7 * GiB
    # Our old rule, under its own name: a fraction of what is free after the weights.
    assert memory.kv_cache_bytes(CacheConfig(kv_cache_free_memory_fraction=0.5), mem,
                                 GiB) == 30 * GiB


def test_gpu_memory_utilization_reaches_the_engine(monkeypatch) -> None:
    fake = memory.DeviceMemory(total=8 << 20, free=6 << 20, held=1 << 20)  # an 8 MiB device
    monkeypatch.setattr(memory, "device_memory", lambda device: fake)
    conf = WorkerConfig(model=ModelConfig(device="cpu", max_model_len=256),
                        cache=CacheConfig(gpu_memory_utilization=0.75),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    engine = Engine(conf, loaded=_tiny_loaded())
    m = engine.loaded.config
    act = memory.activation_reserve(m, conf.scheduler, 256, 4)
    assert 0 < act < 1 << 20
    assert engine.budget.budget_bytes == (6 << 20) - (1 << 20) - act
    per_block = kv_bytes_per_token(engine.loaded) * 16
    assert engine.kv.num_blocks == engine.budget.budget_bytes // per_block


def test_activation_reserve_grows_with_the_step() -> None:
    m = _tiny_loaded().config
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    small = memory.activation_reserve(m, sc, 256, 4)
    big = memory.activation_reserve(m, dataclasses.replace(sc, max_num_batched_tokens=128), 256, 4)
    unchunked = memory.activation_reserve(
        m, dataclasses.replace(sc, enable_chunked_prefill=False), 256, 4)
    assert small < big < unchunked  # unchunked: the step may hold max_model_len tokens
    per_token = (big - small) // (2 * 64)
    assert per_token == (4 * m.hidden_size + (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
                         + 3 * m.intermediate_size) * 4


def test_gpu_memory_utilization_is_ignored_on_cpu_with_a_log_line(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="worker.memory"):
        engine = tiny_engine(cache=CacheConfig(gpu_memory_utilization=0.3))
    assert engine.budget.budget_bytes == memory.CPU_DEFAULT_BYTES
    assert "--gpu-memory-utilization 0.3 is ignored on the CPU" in caplog.text


# ----- --served-model-name: every place the model id shows ----------------------------------

SERVED = "acme/smol-chat-v2"


def test_served_model_name_list_form_is_refused(capsys) -> None:
    assert parse("--served-model-name", SERVED).model.served_model_name == SERVED
    assert main(["serve", "--served-model-name", "a", "b"]) == 2
    assert "--served-model-name takes one value here, got 2 (a b)" in capsys.readouterr().err


def test_engine_model_name_defaults_to_the_models_own() -> None:
    assert tiny_engine().model_name == "tiny"
    assert tiny_engine(model=ModelConfig(device="cpu", max_model_len=256,
                                         served_model_name=SERVED)).model_name == SERVED


@pytest.fixture(scope="module")
def named_worker() -> Iterator[tuple[Worker, int]]:
    from tests.test_metrics import free_port

    port = free_port()
    w = Worker("--served-model-name", SERVED, "--metrics-port", str(port))
    try:
        yield w.wait_ready(), port
    finally:
        w.close()


def test_served_model_name_on_both_protocols_and_the_metrics(
        named_worker: tuple[Worker, int]) -> None:
    w, port = named_worker
    assert w.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model_name == SERVED
    vllm = w.vllm
    info = vllm.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10)
    assert info.served_model_name == SERVED
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    labels = set(re.findall(r'model_name="([^"]*)"', text))
    assert labels == {SERVED}


def test_served_model_name_in_spans(default_model) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tests.test_observability import _run
    from worker import telemetry

    exporter = InMemorySpanExporter()
    assert telemetry.configure_tracing(exporter=exporter)
    try:
        conf = WorkerConfig(model=ModelConfig(served_model_name=SERVED, max_model_len=512),
                            cache=CacheConfig(kv_cache_memory=0.25))
        req_ = pb.GenerateRequest(request_id="named", text="Hello",
                                  sampling=pb.SamplingParams(temperature=0.0),
                                  stopping=pb.StoppingCriteria(max_tokens=2, ignore_eos=True))
        asyncio.run(_run(default_model, [(req_, ())], conf=conf))
    finally:
        spans = exporter.get_finished_spans()
        telemetry.shutdown_tracing()
    gen = [s for s in spans if s.attributes.get("gen_ai.request.model") is not None]
    assert gen, [s.name for s in spans]
    for s in gen:
        assert s.attributes["gen_ai.request.model"] == SERVED
        assert s.name.endswith(SERVED) and default_model.name not in s.name


def test_smg_lists_and_routes_the_served_model_name(named_worker: tuple[Worker, int]) -> None:
    from tests.test_smg import WARMUP_OFF, Gateway, _smg_runs

    if why := _smg_runs():
        pytest.skip(why)
    w, _ = named_worker
    gw = Gateway([w], *WARMUP_OFF)
    try:
        gw.wait_ready()
        assert [m["id"] for m in gw.get("/v1/models")["data"]] == [SERVED]
        answer = gw.chat(max_tokens=4, temperature=0,
                         messages=[{"role": "user", "content": "Say hi"}])
        assert answer["model"] == SERVED and answer["choices"][0]["message"]["content"]
    finally:
        gw.close()


# ----- the README's table -------------------------------------------------------------------


def test_readme_table_names_real_flags_of_both() -> None:
    text = (ROOT / "README.md").read_text()
    start = text.index("| `vllm serve` flag |")
    lines = text[start:].splitlines()
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines))[2:]
    assert len(rows) >= len(VLLM_FLAGS)
    help_text = serve_help()
    ours_seen = set()
    for row in rows:
        vllm_cell, ours_cell = re.split(r"(?<!\\)\|", row)[1:3]  # \| is a pipe inside a cell
        assert re.search(r"`-{1,2}[a-z]", vllm_cell) or vllm_cell.strip() == "—", row
        for flag in re.findall(r"`(--?[a-z][a-z-]*)", ours_cell):
            assert re.search(rf"(^|\s|\[|,\s){re.escape(flag)}\b", help_text), (flag, row)
            ours_seen.add(flag)
    for flag in VLLM_FLAGS:  # every flag this file tests is in the table
        assert flag in ours_seen or flag.replace("--no-", "--") in ours_seen, flag
