"""Parallel sampling (n > 1): the prompt is computed once, its blocks shared by reference
and the half-full one copied on write (scheduler/sample_group.py); each sample has its own
seed stream, finish reason and blocks; an abort ends them all; nothing leaks.

Scheduler level with `KVRunner` (which checks every KV slot's contents through the block
tables, so a shared block written by two samples shows), then the engine on the default
model, then both gRPC protocols."""

from __future__ import annotations

import random
import zlib

import pytest

from kvcache import KVCacheManager
from scheduler import Request, SamplingParams, Scheduler, SchedulerOutput
from scheduler.sample_group import make_group
from tests.test_kvcache_runner import KVRunner

# -- scheduler level --------------------------------------------------------------------------


class ForkRunner(KVRunner):
    """`KVRunner` that also samples the followers a step forks (their own token stream)."""

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        sampled = super().execute(output)
        for s in output.scheduled:
            for f in s.forks:
                sampled[f.request_id] = self.token_for(f.request_id, s.start + s.num_new_tokens)
        return sampled


def _group(rid: str, prompt_len: int, n: int, max_tokens: int, arrival: float = 0.0) -> Request:
    prompt = [(zlib.crc32(rid.encode()) + 7 * i) % 1000 for i in range(prompt_len)]
    leader = Request(rid, prompt, SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True),
                     eos_token_ids=(2,), arrival_time=arrival)
    make_group(leader)
    return leader


def _drain(sched: Scheduler, runner: KVRunner) -> None:
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule(now=float(steps))
        sched.update_from_output(out, runner.execute(out), now=float(steps))
        sched.kv.check_integrity()
        steps += 1
        assert steps < 100_000


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("prompt_len", [37, 48])  # a half-full last block (copied), or none
def test_prompt_computed_once_and_blocks_shared(prefix_caching: bool, prompt_len: int) -> None:
    kv = KVCacheManager(256, 16, enable_prefix_caching=prefix_caching)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)
    runner = ForkRunner(16)
    n, max_tokens = 4, 20
    leader = _group("g", prompt_len, n, max_tokens)
    sched.add_request(leader)
    _drain(sched, runner)
    samples = leader.group.samples
    # The prompt once (in chunks of 64), then each sample's decodes: its tokens but the last.
    assert runner.num_tokens_computed == prompt_len + n * (max_tokens - 1)
    # The half-full block is copied by all but its last holder; full blocks never are.
    assert runner.num_copied == (n - 1 if prompt_len % 16 else 0)
    for r in samples:
        assert r.finish_reason == "length" and r.num_output_tokens == max_tokens
        assert r.output_token_ids == [runner.token_for(r.request_id, prompt_len + k)
                                      for k in range(max_tokens)]
    assert len({tuple(r.output_token_ids) for r in samples}) == n
    assert kv.num_free_blocks == kv.num_blocks


def test_leader_ending_at_its_first_token_leaves_the_blocks_to_the_followers() -> None:
    kv = KVCacheManager(64, 16, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)
    runner = ForkRunner(16)
    leader = _group("g", 21, 3, 6)
    sched.add_request(leader)
    out = sched.schedule(now=0.0)
    (s,) = out.scheduled
    assert [f.sample_index for f in s.forks] == [1, 2]
    sampled = runner.execute(out)
    sched.finish_requests(["g"], leader.status.FINISHED_STOPPED)  # e.g. a stop string
    sched.update_from_output(out, sampled, now=0.0)
    # The leader's stream ends; followers were not forked (the engine ends them with it).
    assert not leader.group.forked
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_seats_are_held_for_followers() -> None:
    kv = KVCacheManager(256, 16, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    runner = ForkRunner(16)
    sched.add_request(_group("g", 30, 3, 4))
    sched.add_request(Request("a", list(range(5)), SamplingParams(max_tokens=4, ignore_eos=True)))
    sched.add_request(Request("b", list(range(5)), SamplingParams(max_tokens=4, ignore_eos=True)))
    out = sched.schedule(now=0.0)
    # g takes 3 seats before its followers exist: a fits, b waits.
    assert [s.request_id for s in out.scheduled] == ["g", "a"]
    sched.update_from_output(out, runner.execute(out), now=0.0)
    assert sched.num_running == 4 and sched.num_waiting == 1
    with pytest.raises(ValueError, match="max_num_seqs is 4"):
        sched.check_request(_group("h", 10, 5, 4))
    _drain(sched, runner)
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("seed", range(6))
def test_random_groups_under_preemption_keep_tokens_and_blocks(seed: int) -> None:
    """Groups and single requests in a cache too small for them all (swap and recompute,
    prefix caching on and off): every sample gets its own token stream, as if alone, and
    no block leaks; KVRunner checks every slot through the tables each step."""
    rng = random.Random(seed)
    kv = KVCacheManager(rng.choice([16, 24]), 8, enable_prefix_caching=seed % 2 == 0,
                        num_cpu_blocks=rng.choice([0, 16]))
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=rng.choice([16, 48]),
                      max_model_len=256, preemption_mode="auto")
    runner = ForkRunner(8)
    reqs = []
    for i in range(10):
        n = rng.choice([1, 2, 3, 4])
        length, max_tokens = rng.randint(1, 40), rng.randint(8, 40)
        if n > 1:
            r = _group(f"r{i}", length, n, max_tokens, arrival=float(i))
        else:
            r = Request(f"r{i}", [rng.randrange(1000) for _ in range(length)],
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                        arrival_time=float(i))
        sched.add_request(r)
        reqs.append(r)
    _drain(sched, runner)
    for r in reqs:
        for s in (r.group.samples if r.group else [r]):
            assert s.num_output_tokens == s.sampling_params.max_tokens
            assert s.output_token_ids == [runner.token_for(s.request_id, s.num_prompt_tokens + k)
                                          for k in range(s.num_output_tokens)]
    assert kv.num_free_blocks == kv.num_blocks and not kv.cpu_tables
    # The scenario is what it claims: samples were forked, copied and preempted.
    samples = [s for r in reqs if r.group for s in r.group.samples]
    assert samples and runner.num_copied
    assert sum(s.num_preemptions for s in samples) > 0


@pytest.mark.parametrize("seed", range(12))
def test_urgent_arrivals_preempt_samples_in_the_step_they_copy(seed: int) -> None:
    """Groups arriving over time with mixed priorities in a small cache with swap space: a
    more urgent arrival displaces running samples, among them samples that copied their
    shared half-full block in the same step (the copy is then undone). Before, that swap
    (or a recompute whose freed copy went to a swap-in) failed an assertion and killed the
    engine thread (session 27's second probe). Tokens as if alone, no block leaked."""
    rng = random.Random(1000 + seed)
    kv = KVCacheManager(rng.choice([14, 18, 24]), 8, enable_prefix_caching=seed % 2 == 0,
                        num_cpu_blocks=rng.choice([4, 16]))
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=rng.choice([24, 64]),
                      max_model_len=256, preemption_mode=rng.choice(["auto", "swap"]))
    runner = ForkRunner(8)
    pending = []
    for i in range(14):
        n = rng.choice([1, 2, 2, 3])
        length = rng.choice([5, 12, 20, 29, rng.randint(1, 40)])  # mostly a half-full last block
        max_tokens = rng.randint(4, 24)
        r = (_group(f"r{i}", length, n, max_tokens) if n > 1 else
             Request(f"r{i}", [rng.randrange(1000) for _ in range(length)],
                     SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        r.priority = rng.choice([0, 0, -1, -5])
        pending.append((rng.randint(0, 12), r))
    reqs = [r for _, r in pending]
    steps = 0
    while pending or sched.has_unfinished_requests():
        for at, r in [x for x in pending if x[0] <= steps]:
            r.arrival_time = float(steps)
            sched.add_request(r)
            pending.remove((at, r))
        out = sched.schedule(now=float(steps))
        sched.update_from_output(out, runner.execute(out), now=float(steps))
        kv.check_integrity()
        steps += 1
        assert steps < 100_000
    for r in reqs:
        for smp in (r.group.samples if r.group else [r]):
            assert smp.output_token_ids == [runner.token_for(smp.request_id, smp.num_prompt_tokens + k)
                                            for k in range(smp.sampling_params.max_tokens)]
    assert kv.num_free_blocks == kv.num_blocks and not kv.cpu_tables


# -- the engine on the default model -----------------------------------------------------------

PROMPT = "The three most surprising facts about octopuses are"


def _engine(loaded, prefix_caching: bool, seqs: int = 16):
    from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
    from worker.engine import Engine

    conf = WorkerConfig(
        model=ModelConfig(max_model_len=1024),
        cache=CacheConfig(kv_cache_memory=0.0625, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=256))
    return Engine(conf, loaded=loaded)


def _clean(engine) -> None:
    assert not engine.scheduler.has_unfinished_requests() and not engine._groups
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_integrity()


def _count_steps(engine) -> list:
    """Record every step the runner executes (its batched tokens and copies)."""
    steps = []
    execute = engine.runner.execute

    def spy(step):
        steps.append((step.num_batched_tokens, len(step.blocks_to_copy)))
        return execute(step)

    engine.runner.execute = spy
    return steps


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_engine_samples_share_the_prefill(default_model, prefix_caching: bool) -> None:
    engine = _engine(default_model, prefix_caching)
    ids = default_model.tokenizer.encode(PROMPT)
    assert len(ids) % engine.kv.block_size, "the prompt should end in a half-full block"
    steps = _count_steps(engine)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    outs = engine.generate([engine.make_request(ids, params, request_id="g")])
    _clean(engine)
    assert [o.index for o in outs] == [0, 1, 2, 3] and {o.request_id for o in outs} == {"g"}
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) == 4, "the samples should differ"
    # The prompt computed once: one prefill, then 4 x 11 decodes; 3 copies of the tail.
    assert sum(t for t, _ in steps) == len(ids) + 4 * 11
    assert sum(c for _, c in steps) == 3
    # Sample i is what a lone request seeded seed + i draws: reproducible, per-sample seeds.
    for o in outs:
        alone = engine.generate([engine.make_request(
            ids, SamplingParams(temperature=1.0, seed=7 + o.index, max_tokens=12,
                                ignore_eos=True))])[0]
        assert alone.token_ids == o.token_ids, f"sample {o.index}"
    _clean(engine)


def test_engine_finish_reasons_per_sample_and_greedy(default_model) -> None:
    engine = _engine(default_model, prefix_caching=False)
    ids = default_model.tokenizer.encode(PROMPT)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    first = engine.generate([engine.make_request(ids, params)])
    # A stop token that only sample 0 has (at its 4th token): it alone stops there.
    others = {t for o in first[1:] for t in o.token_ids}
    k, stop = next((k, t) for k, t in enumerate(first[0].token_ids) if t not in others and k >= 2)
    again = engine.generate([engine.make_request(
        ids, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True,
                            stop_token_ids=[stop]))])
    assert again[0].finish_reason == "stop" and again[0].token_ids == first[0].token_ids[: k + 1]
    for a, f in zip(again[1:], first[1:], strict=True):
        assert a.finish_reason == "length" and a.token_ids == f.token_ids
    greedy = engine.generate([engine.make_request(ids, SamplingParams(n=2, temperature=0.0,
                                                                      max_tokens=8))])
    assert greedy[0].token_ids == greedy[1].token_ids
    _clean(engine)


def test_engine_abort_ends_every_sample(default_model) -> None:
    engine = _engine(default_model, prefix_caching=False)
    ids = default_model.tokenizer.encode(PROMPT)
    req = engine.make_request(ids, SamplingParams(n=4, max_tokens=200, ignore_eos=True),
                              request_id="x")
    engine.submit(req)
    finished: dict[int, str] = {}
    for step in range(400):
        if step == 3:
            engine.abort(["x"])
        for o in engine.step().outputs:
            assert o.request_id == "x"
            if o.finished:
                finished[o.index] = o.finish_reason
        if len(finished) == 4:
            break
    assert finished == {i: "abort" for i in range(4)}
    _clean(engine)
    # Aborted before the leader's first token: the followers end with it.
    engine.submit(engine.make_request(ids, SamplingParams(n=3, max_tokens=5), request_id="y"))
    engine.abort(["y"])
    outs = engine.step().outputs
    assert sorted((o.index, o.finish_reason) for o in outs) == [(0, "abort"), (1, "abort"),
                                                                 (2, "abort")]
    _clean(engine)


def test_engine_samples_under_a_grammar_each_have_their_own_matcher(default_model) -> None:
    import re

    from worker.structured import Constraint, GrammarCompiler

    tok = default_model.tokenizer
    compiler = GrammarCompiler(tok, default_model.config.vocab_size, default_model.eos_token_ids)
    engine = _engine(default_model, prefix_caching=False)
    req = engine.make_request(tok.encode("A product code:"), SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=16))
    req.grammar = compiler.compile(Constraint("regex", r"[A-Z]{3}-[0-9]{4}")).matcher()
    outs = engine.generate([req])
    assert len({o.text for o in outs}) > 1
    for o in outs:
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", o.text) and o.finish_reason == "stop", o.text
    _clean(engine)


# -- both gRPC protocols, one worker process --------------------------------------------------


@pytest.fixture(scope="module")
def worker():

    from tests.test_server import Worker

    w = Worker("--max-num-seqs", "8")
    try:
        yield w.wait_ready()
    finally:
        w.close()


def _ours(worker, n: int, seed: int, max_tokens: int = 10):
    """Our Generate with n samples: {index: tokens}, {index: complete}."""
    from llmworker.v1 import worker_pb2 as pb

    tokens: dict[int, list[int]] = {}
    completes: dict = {}
    for resp in worker.stub.Generate(pb.GenerateRequest(
            text=PROMPT, sampling=pb.SamplingParams(temperature=1.0, seed=seed, n=n),
            stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True)), timeout=120):
        if resp.HasField("chunk"):
            assert resp.chunk.index not in completes, "a chunk after its sample's complete"
            tokens.setdefault(resp.chunk.index, []).extend(resp.chunk.token_ids)
        else:
            assert resp.complete.index not in completes
            completes[resp.complete.index] = resp.complete
    return tokens, completes


def test_our_protocol_n_samples(worker) -> None:
    import grpc
    from llmworker.v1 import worker_pb2 as pb

    from tests.test_server import blocks_all_free, wait_until

    tokens, completes = _ours(worker, 3, seed=42)
    assert sorted(completes) == [0, 1, 2] and sorted(tokens) == [0, 1, 2]
    assert len({tuple(t) for t in tokens.values()}) == 3
    for c in completes.values():
        assert c.finish_reason == pb.FINISH_REASON_LENGTH and c.usage.completion_tokens == 10
    # The prompt counted once: on sample 0's usage.
    prompt = completes[0].usage.prompt_tokens
    assert prompt > 0 and [completes[i].usage.prompt_tokens for i in (1, 2)] == [0, 0]
    # Reproducible, and sample i is the lone request seeded 42 + i.
    assert _ours(worker, 3, seed=42)[0] == tokens
    for i in range(3):
        assert _ours(worker, 1, seed=42 + i)[0] == {0: tokens[i]}
    wait_until(lambda: blocks_all_free(worker), timeout=5, what="blocks freed")
    # Cancelling the stream aborts every sample.
    before = worker.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=5)
    call = worker.stub.Generate(pb.GenerateRequest(
        text=PROMPT, sampling=pb.SamplingParams(n=4),
        stopping=pb.StoppingCriteria(max_tokens=1000, ignore_eos=True)), timeout=120)
    seen = set()
    while len(seen) < 4:
        seen.add(next(call).chunk.index)
    load = worker.stub.GetLoad(pb.GetLoadRequest(), timeout=5)
    assert load.num_running == 4
    call.cancel()
    wait_until(lambda: blocks_all_free(worker), timeout=5, what="blocks freed after a cancel")
    after = worker.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=5)
    assert after.requests_by_finish_reason["abort"] == before.requests_by_finish_reason["abort"] + 1
    # Bounds: 16 at most, and no more than the seats (--max-num-seqs 8).
    for n, says in ((17, "sampling.n must be in [1, 16]"), (9, "sampling.n is 9; at most 8 are allowed (--max-num-seqs)")):
        with pytest.raises(grpc.RpcError) as e:
            _ours(worker, n, seed=1)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in e.value.details(), e.value.details()


def test_vllm_protocol_n_samples(worker) -> None:
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

    from tests.test_server import blocks_all_free, wait_until

    ours, _ = _ours(worker, 3, seed=42)  # the same seeds on our protocol

    def generate(stream: bool) -> tuple[list, list]:
        req = vpb.GenerateRequest(text=PROMPT, stream=stream, sampling_params=vpb.SamplingParams(
            temperature=1.0, seed=42, n=3, max_tokens=10, ignore_eos=True))
        chunks, completes = [], []
        for resp in worker.vllm.Generate(req, timeout=120):
            if resp.HasField("chunk"):
                assert not completes, "as vLLM: the completes come last, together"
                chunks.append(resp.chunk)
            else:
                completes.append(resp.complete)
        return chunks, completes

    chunks, completes = generate(stream=True)
    assert [c.index for c in completes] == [0, 1, 2]
    for c in completes:
        streamed = [t for ch in chunks if ch.index == c.index for t in ch.token_ids]
        assert list(c.output_ids) == streamed == ours[c.index]
        assert c.finish_reason == "length" and c.completion_tokens == 10
    # Every complete reports the prompt, as vLLM's do; SMG counts it once (usage.prompt_tokens).
    assert len({c.prompt_tokens for c in completes}) == 1 and completes[0].prompt_tokens > 0
    chunks, unstreamed = generate(stream=False)
    assert not chunks and [list(c.output_ids) for c in unstreamed] == [ours[i] for i in range(3)]
    wait_until(lambda: blocks_all_free(worker), timeout=5, what="blocks freed")
    with pytest.raises(grpc.RpcError) as e:
        list(worker.vllm.Generate(vpb.GenerateRequest(
            text=PROMPT, sampling_params=vpb.SamplingParams(n=17)), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.n must be in [1, 16]" in e.value.details()
