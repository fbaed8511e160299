"""Tensor parallelism against TP = 1, served on the CPU over gloo and spoken to by gRPC.

- The default model (9 heads, 3 KV heads) at `-tp 3`, chunked prefill (64-token budget),
  n-gram speculation and LoRA on, a KV cache of 28 blocks: greedy tokens of the parity
  prompts, prompt logprobs (within 1e-3), a chunked long prompt and its prefix-cache hit,
  n = 2 seeded samples, a JSON-schema constraint, two LoRA adapters beside the base model
  (one loaded at run time), and swap and recompute preemption, each equal to an in-process
  TP = 1 engine's (the GGUF on its Q4_1/Q8_0 blocks on both: each rank holds its slices of
  the file's blocks, o_proj's 192 columns and down_proj's 512 whole blocks of 32).
- KV-head replication: tiny random models with 1 KV head at `-tp 2` (swap preemption; a
  GGUF of K-quant blocks, Q4_K and Q6_K, each rank's slices on them) and 2 KV heads at
  `-tp 4` (recompute preemption), a KV cache small enough to preempt, equal to TP = 1; a
  K-quant split off the blocks refused at start-up by its numbers.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from llmworker.v1 import worker_pb2 as pb

from benchmarks.lora import write_adapters
from scheduler.request import SamplingParams
from tests.conftest import CHAT_PROMPTS
from tests.gguf_tiny import write_tiny_llama
from tests.test_server import ROOT, run
from tests.tp_helpers import TPWorker, followers, gone, tiny_checkpoint
from worker import config as cfgmod
from worker.cli import build_parser
from worker.engine import Engine
from worker.lora.adapter import TARGETS
from worker.structured import Constraint, GrammarCompiler
from worker.weights.dummy import dummy_config

pytestmark = pytest.mark.slow
SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}'
# float32 activations on both sides: with int16's (auto on AVX-512 VNNI) the ranks' sums, in
# another order of float32 additions, move values across int16's rounding steps, and the
# prompt logprobs of -tp 3 and TP = 1 part by int16's own error (~3e-3 here; 1e-2 is its
# bound against float32), not by 1e-3 (float32: 2e-5).
ACTIVATIONS = ("--cpu-activations", "float32")
DEFAULT_FLAGS = ("--max-num-batched-tokens", "64", "--speculative-config", SPEC, *ACTIVATIONS)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
          "required": ["city"], "additionalProperties": False}
MAX_TOKENS = 8
# A rank's KV block at -tp 3: 16 tokens of 30 layers' K and V of one KV head (64 float32).
BLOCK_BYTES = 16 * 2 * 30 * 1 * 64 * 4
# 28 blocks: the parity batch (4 prompts, one of 254 tokens) fits; four 142-token prompts
# generating 24 tokens each do not, so the preemption test preempts (by swap: ample swap space).
TP3_BLOCKS, TP3_MAX_MODEL_LEN = 28, 320
TP3_KV = ("--kv-cache-memory-bytes", str(TP3_BLOCKS * BLOCK_BYTES), "--max-model-len", str(TP3_MAX_MODEL_LEN))


def _engine(*flags: str) -> Engine:
    return Engine(cfgmod.from_args(build_parser().parse_args(["serve", *flags])))


def _ids(complete_run) -> list[int]:
    chunks, _ = complete_run
    return [t for c in chunks for t in c.token_ids]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two random PEFT adapters on every projection of the default model (so on column- and
    row-parallel layers both): l0 served from start-up, l1 loaded by the tests at run time."""
    return write_adapters(tmp_path_factory.mktemp("tp_loras"), dummy_config("smollm2-135m"), 2, 8,
                          list(TARGETS), b_std=0.1)


def _lora_flags(adapters) -> tuple[str, ...]:
    return ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules",
            f"l0={adapters['adapter0']}")


@pytest.fixture(scope="module")
def tp3(adapters):
    w = TPWorker("-tp", "3", *DEFAULT_FLAGS, *_lora_flags(adapters), kv=TP3_KV)
    try:
        yield w.wait_ready()
        procs = followers(w)
        assert len(procs) == 2
        w.proc.terminate()  # SIGTERM drains and stops every rank
        assert w.proc.wait(60) == 0
        assert gone(procs, 5)
    finally:
        w.close()


@pytest.fixture(scope="module")
def tp1(adapters):
    engine = _engine(*ACTIVATIONS, "--max-model-len", "2048", "--kv-cache-memory",
                     "0.25", "--max-num-batched-tokens", "64", *_lora_flags(adapters))
    yield engine
    engine.shutdown()


def _chat(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True))


def test_default_model_at_tp3_equals_tp1(tp3, tp1) -> None:
    tok = tp1.tokenizer
    prompts = [_chat(tok, p) for p in CHAT_PROMPTS[:3]]
    long = _chat(tok, " ".join(CHAT_PROMPTS * 2))  # > 64 tokens: chunked prefill
    assert len(long) > 150
    prompts.append(long)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ref = tp1.generate([tp1.make_request(p, greedy) for p in prompts])

    def served(ids: list[int], **extra):
        return run(tp3.stub, token_ids=pb.TokenIdsInput(ids=ids), sampling=pb.SamplingParams(temperature=0.0),
                   stopping=pb.StoppingCriteria(max_tokens=MAX_TOKENS), **extra)

    with ThreadPoolExecutor(len(prompts)) as pool:  # one batch, as the reference's
        got = list(pool.map(served, prompts))
    assert [_ids(g) for g in got] == [c.token_ids for c in ref]
    assert served(long)[1].usage.cached_tokens >= 128  # the prefix cache's hit, same tokens
    assert _ids(served(long)) == ref[-1].token_ids

    # prompt logprobs
    want = tp1.generate([tp1.make_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=1,
                                                                     prompt_logprobs=0))])[0]
    chunks, _ = run(tp3.stub, token_ids=pb.TokenIdsInput(ids=prompts[0]),
                    sampling=pb.SamplingParams(temperature=0.0), prompt_logprobs=0,
                    stopping=pb.StoppingCriteria(max_tokens=1))
    lp = [e.logprob for e in chunks[0].prompt_logprobs]
    assert len(lp) == len(prompts[0]) - 1 == len(want.prompt_logprobs)
    assert max(abs(a - b.logprob) for a, b in zip(lp, want.prompt_logprobs, strict=True)) < 1e-3

    # n = 2 seeded samples
    sampled = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=MAX_TOKENS)
    ref2 = tp1.generate([tp1.make_request(prompts[1], sampled)])
    stream = tp3.stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIdsInput(ids=prompts[1]), sampling=pb.SamplingParams(temperature=0.8, seed=7, n=2),
        stopping=pb.StoppingCriteria(max_tokens=MAX_TOKENS)), timeout=120)
    chunks = [r.chunk for r in stream if r.HasField("chunk")]
    for i in range(2):
        assert [t for c in chunks if c.index == i for t in c.token_ids] == ref2[i].token_ids

    # a JSON-schema constraint
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)
    req = tp1.make_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=40))
    req.grammar = compiler.compile(Constraint("json_schema", json.dumps(SCHEMA))).matcher()
    want_json = tp1.generate([req])[0]
    chunks, _ = run(tp3.stub, token_ids=pb.TokenIdsInput(ids=prompts[0]),
                    sampling=pb.SamplingParams(temperature=0.0), json_schema=json.dumps(SCHEMA),
                    stopping=pb.StoppingCriteria(max_tokens=40))
    assert [t for c in chunks for t in c.token_ids] == want_json.token_ids
    assert "city" in json.loads("".join(c.text for c in chunks))

    status = tp3.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)
    assert status.spec_draft_tokens > 0  # verification steps ran sharded too
    assert '"tensor_parallel_size": 3' in status.config_json


def test_lora_adapters_and_preemption_at_tp3_equal_tp1(tp3, tp1, adapters) -> None:
    """In one batch: two short requests of LoRA adapters, l0 from start-up and l1 loaded at
    run time by the admin RPC (rank 0 alone reads it; its slot write reaches the followers),
    beside four 142-token base requests generating 24 tokens each, which outgrow the 28
    blocks: preempted by swap (mode auto, 4 GiB of swap space: KV moves on every rank); and
    a ResetPrefixCache(requeue) as the first token streams preempts every running request
    by recompute. Each equals TP = 1's tokens."""
    tok = tp1.tokenizer
    loaded = tp3.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(
        lora_name="l1", lora_path=str(adapters["adapter1"])), timeout=60)
    assert loaded.adapter.name == "l1"
    tp1.loras.load("l1", str(adapters["adapter1"]))
    short = [_chat(tok, p) for p in CHAT_PROMPTS[3:5]]
    long = [_chat(tok, " ".join(CHAT_PROMPTS[i:] + CHAT_PROMPTS[:i])) for i in range(4)]
    batch = [(short[0], "l0", MAX_TOKENS), (short[1], "l1", MAX_TOKENS), *((p, "", 24) for p in long)]

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    ref = [c.token_ids for c in tp1.generate([tp1.make_request(p, params(n), lora_name=name or None)
                                              for p, name, n in batch])]
    base = [c.token_ids for c in tp1.generate([tp1.make_request(p, params(MAX_TOKENS)) for p in short])]
    assert ref[0] != base[0] and ref[1] != base[1], "the adapters were meant to change the tokens"
    before = tp3.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10).num_preemptions
    streams = [tp3.stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIdsInput(ids=p), sampling=pb.SamplingParams(temperature=0.0), lora_name=name,
        stopping=pb.StoppingCriteria(max_tokens=n, ignore_eos=True)), timeout=120) for p, name, n in batch]
    requeued: list[int] = []

    def read(i: int) -> list[int]:
        got = []
        for r in streams[i]:
            if r.HasField("chunk"):
                got += r.chunk.token_ids
                if i == 0 and not requeued:  # mid-stream: recompute the running ones
                    requeued.append(tp3.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(requeue=True),
                                                              timeout=30).num_requeued)
        return got

    with ThreadPoolExecutor(len(batch)) as pool:
        got = list(pool.map(read, range(len(batch))))
    assert got == ref
    assert requeued[0] > 0, "the reset was meant to requeue running requests (recompute)"
    # Each request counts its preemptions: the reset's, and the cache's (swaps) beyond them.
    after = tp3.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10).num_preemptions
    assert after - before > requeued[0], "the cache was meant to be too small for all four (swap)"


def test_the_planners_kv_blocks_at_tp3_are_the_workers(tp3) -> None:
    from worker import plan

    blocks = int(tp3.wait_for(r"KV cache: .* = (\d+) blocks x").group(1))
    load = tp3.stub.GetLoad(pb.GetLoadRequest(), timeout=10)
    assert load.num_total_blocks == blocks
    cpu = plan.Device("cpu", "cpu", 64 << 30, 1e10, {"float32": 1e11})  # KV: not its figures
    p = plan.make_plan(plan.read_model("default"), cpu, plan.Workload(100, 28), "float32", TP3_MAX_MODEL_LEN,
                       plan.CacheConfig(kv_cache_memory_bytes=TP3_BLOCKS * BLOCK_BYTES),
                       plan.SchedulerConfig(), tp=3)
    assert p.kv_cache["num_blocks"] == blocks == TP3_BLOCKS
    assert p.parallel["kv_heads_per_rank"] == 1
    assert p.kv_cache["bytes_per_token"] == 2 * 30 * 1 * 64 * 4  # K and V, 30 layers, a rank's head


# A GGUF of K-quant blocks (Q4_K, attn_v, ffn_down and the embedding Q6_K), hidden 512:
# 16 heads of 32, 1 KV head, intermediate 1024; at -tp 2 a rank's o_proj is 256 columns
# (one Q4_K block of 256) and its down_proj 512 (two Q6_K blocks).
KQUANT_TYPES = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}


@pytest.mark.parametrize(("kv_heads", "tp", "mode"), [(1, 2, "swap"), (2, 4, "recompute")])
def test_kv_head_replication_with_preemption_equals_tp1(tmp_path, kv_heads, tp, mode) -> None:
    """1 KV head at -tp 2 on a K-quant GGUF (each rank its slices of the file's blocks, on
    the CPU kernels as TP = 1 on the same file), 2 KV heads at -tp 4 on a transformers
    checkpoint."""
    if kv_heads == 1:
        model = str(write_tiny_llama(tmp_path / "kquant.gguf", "Q4_K", hidden=512, layers=2,
                                     types=KQUANT_TYPES))
        head_dim = 32
    else:
        model, head_dim = tiny_checkpoint(tmp_path, kv_heads=kv_heads), 16
    # 12 blocks a rank: 16 tokens of 2 layers' K and V, one KV head a rank (float32)
    per_block = 16 * 2 * 2 * head_dim * 4
    kv = ("--kv-cache-memory-bytes", str(12 * per_block), "--max-model-len", "128")
    flags = ("--model", model, "--preemption-mode", mode, "--max-num-seqs", "4")
    prompts = [[1 + i, *range(10 + 7 * i, 30 + 7 * i)] for i in range(4)]  # 21 tokens each
    tp1 = _engine(*flags)
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    ref = [c.token_ids for c in tp1.generate([tp1.make_request(p, greedy) for p in prompts])]
    w = TPWorker(*flags, "-tp", str(tp), kv=kv)
    try:
        w.wait_ready()
        assert any(f"{tp} ranks over gloo" in line for line in w.lines)
        if kv_heads == 1:  # each rank holds its slices as records of the file's K-quant blocks
            assert any("Q4_K x10" in line and "as Q4_K records" in line and "Q6_K x4" in line
                       for line in w.lines if "tensor parallel rank" not in line)  # rank 0's
            follower = next(line for line in w.lines if line.startswith("tensor parallel rank 1: GGUF"))
            assert "Q4_K records" in follower and "Q6_K records" in follower, follower
            file_mib, held_mib = map(float, re.search(r"in all ([\d.]+) MiB in the file, ([\d.]+) MiB "
                                                      r"held", follower).groups())
            assert held_mib < 0.75 * file_mib, follower  # half the layers' linears (k, v whole)

        def served(ids: list[int]) -> list[int]:
            return _ids(run(w.stub, token_ids=pb.TokenIdsInput(ids=ids),
                            sampling=pb.SamplingParams(temperature=0.0),
                            stopping=pb.StoppingCriteria(max_tokens=60, ignore_eos=True)))

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(served, prompts))
        assert got == ref
        status = w.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)
        assert status.num_preemptions > 0, "the cache was meant to be too small for all four"
    finally:
        w.close()


def test_a_k_quant_split_off_the_blocks_is_refused_at_start_up(tmp_path) -> None:
    """hidden 256 (8 heads of 32) at -tp 2: o_proj's 128 columns a rank are half a Q4_K
    block; serve exits non-zero naming them before any follower starts."""
    model = write_tiny_llama(tmp_path / "k256.gguf", "Q4_K", hidden=256, layers=1, types=KQUANT_TYPES)
    done = subprocess.run([sys.executable, "-m", "worker.cli", "serve", "--port", "0", "--model", str(model),
                           "-tp", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert ("layer 0 o_proj: 128 columns a rank is not a whole number of Q4_K blocks of 256; "
            "sizes that work: 1") in done.stderr, done.stderr[-2000:]
