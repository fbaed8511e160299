"""N-gram speculative decoding (worker/spec_decode): the proposer against a brute-force
reference; the scheduler's bookkeeping of drafts (KV of rejected drafts rolled back, blocks,
budgets, preemption) against a fake runner that fingerprints every KV slot; the engine on the
default model giving the same greedy (and seeded) tokens with and without speculation, with
drafts accepted on input-grounded prompts, stop strings inside accepted drafts, logprobs; the
sampled output distribution of a small-vocabulary model, chi-square against the exact one;
the flag, the metrics and the vLLM protocol's usage fields."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import socket
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import KVCacheManager
from scheduler import Request, RequestStatus, SamplingParams, Scheduler, SchedulerOutput
from tests.helpers import last_logits
from tests.test_kvcache_runner import KVRunner, fingerprints
from worker import config as cfgmod
from worker.cli import build_parser
from worker.config import (
    CacheConfig,
    ModelConfig,
    NgramSpeculation,
    SchedulerConfig,
    SpeculativeConfig,
    WorkerConfig,
)
from worker.engine import Completion, Engine
from worker.outputs import RequestOutput
from worker.spec_decode import NgramProposer, accepted
from worker.weights import LoadedModel, _build, dummy

# ----- the proposer ---------------------------------------------------------------------------


def reference_propose(tokens: Sequence[int], k: int, lo: int, hi: int) -> list[int]:
    """The definition, by brute force: the longest suffix of lo..hi tokens that occurred
    before (not as the suffix itself), its earliest occurrence, the k tokens after it."""
    total = len(tokens)
    for n in range(min(hi, total - 1), lo - 1, -1):
        suffix = list(tokens[total - n :])
        for s in range(total - n):
            if list(tokens[s : s + n]) == suffix:
                return list(tokens[s + n : s + n + k])
    return []


def test_longest_suffix_wins_then_the_earliest_occurrence() -> None:
    p = NgramProposer(3, 1, 3)
    # "9" alone occurred at 0 (followed by 5); "2 9" occurred at 3 (followed by 7 7 7).
    assert p.propose([9, 5, 1, 2, 9, 7, 7, 7, 2, 9]) == [7, 7, 7]
    # Two occurrences of the longest match: the earliest one's continuation.
    assert p.propose([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]) == [4, 1, 2]
    # The continuation may run into the suffix itself (a repeating pattern), never past it.
    assert p.propose([7, 7]) == [7]
    assert p.propose([1, 2, 1, 2]) == [1, 2]
    # The suffix itself is no earlier occurrence.
    assert p.propose([1, 2, 3]) == []


def test_bounds_and_caps() -> None:
    tokens = [5, 6, 7, 8, 0, 7, 8]  # "7 8" occurred before (n = 2), "8" too (n = 1)
    assert NgramProposer(2, 2, 4).propose(tokens) == [0, 7]
    assert NgramProposer(2, 3, 4).propose(tokens) == []  # no suffix of 3+ occurred before
    assert NgramProposer(5, 1, 1).propose(tokens) == [0, 7, 8]  # as many as follow
    assert NgramProposer(5, 2, 2).propose(tokens, max_drafts=1) == [0]
    assert NgramProposer(5, 2, 2).propose(tokens, max_drafts=0) == []
    assert NgramProposer(5, 1, 3).propose([4]) == []


def test_byte_matches_across_token_ids_are_not_matches() -> None:
    # As little-endian words, 256 is 00 01 00 00 and 1 is 01 00 00 00: the bytes of "1 1"
    # (01 00 00 00 01 00 00 00) sit inside "256 1 256" (00 01 00 00 | 01 00 00 00 | ...) one
    # byte off, where no token boundary is.
    tokens = [256, 65536, 256, 9, 1, 0]
    assert NgramProposer(2, 2, 2).propose(tokens) == reference_propose(tokens, 2, 2, 2) == []
    tokens = [0, 1, 0, 0, 0, 1, 0, 0, 9, 1, 0]
    assert NgramProposer(2, 2, 2).propose(tokens) == reference_propose(tokens, 2, 2, 2) == [0, 0]


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.sampled_from([0, 1, 2, 3, 256, 65536, 16777216, 2**32 - 1]), max_size=40),
    k=st.integers(1, 6), lo=st.integers(1, 4), extra=st.integers(0, 3),
)
def test_proposer_matches_the_brute_force_definition(tokens: list[int], k: int, lo: int,
                                                     extra: int) -> None:
    assert NgramProposer(k, lo, lo + extra).propose(tokens) == reference_propose(tokens, k, lo, lo + extra)


@settings(max_examples=300, deadline=None)
@given(
    # few symbols and repeated runs: long suffixes that occurred before, at every length
    unit=st.lists(st.integers(0, 2), min_size=1, max_size=6), repeats=st.integers(1, 12),
    tail=st.lists(st.integers(0, 2), max_size=8), k=st.integers(1, 4), lo=st.integers(1, 3),
    extra=st.sampled_from([0, 1, 5, 17, 40, 10**9]),
)
def test_the_longest_suffix_found_by_bisection_is_the_definitions(unit: list[int], repeats: int,
                                                                  tail: list[int], k: int, lo: int,
                                                                  extra: int) -> None:
    tokens = unit * repeats + tail
    hi = lo + extra
    assert NgramProposer(k, lo, hi).propose(tokens) == reference_propose(tokens, k, lo, min(hi, 200))


def test_a_huge_prompt_lookup_max_costs_a_logarithmic_number_of_searches(monkeypatch) -> None:
    """prompt_lookup_max is the operator's; 10**9 must not make a step search once per
    length (one `find` over the whole request each: 0.9 s a step at 16,000 tokens)."""
    from worker.spec_decode import ngram

    calls = []
    real = ngram._find_aligned
    monkeypatch.setattr(ngram, "_find_aligned", lambda *a: calls.append(1) or real(*a))
    tokens = [7, 8, 9] * 3000 + [1, 2] * 100 + [7, 8, 9] * 500  # the longest match: 1,500+ tokens
    got = NgramProposer(4, 2, 10**9).propose(tokens)
    assert got == [7, 8, 9, 7]  # the earliest occurrence of the longest suffix: at the start
    assert len(calls) <= 2 + (len(tokens) - 1).bit_length(), len(calls)
    calls.clear()
    random_tokens = [(i * 7919) % 49999 for i in range(16000)]  # no repeated pair
    assert NgramProposer(3, 2, 10**9).propose(random_tokens) == []
    assert len(calls) == 1  # the shortest allowed suffix did not occur: nothing longer did


def test_accepted_counts_the_matching_prefix() -> None:
    assert accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted([4, 5, 6], [1, 5, 6, 7]) == 0
    assert accepted([], [3]) == 0
    with pytest.raises(AssertionError):
        accepted([4], [4])


# ----- the scheduler's bookkeeping, with a fake runner ----------------------------------------


class SpecKVRunner(KVRunner):
    """`KVRunner` for steps with drafts: a chunk's inputs are the request's tokens and then
    its drafts (the KV fingerprints chain through them, as a real model's keys do), and the
    model's token at position p is `token_for(rid, p)` whatever came before, so a draft is
    accepted iff it equals that. A rejected draft left readable below a later step's start
    (no rollback) reads back as a wrong fingerprint."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.drafted = self.accepted = 0

    def execute(self, output: SchedulerOutput) -> dict[str, list[int]]:  # type: ignore[override]
        bs = self.block_size
        self._move(self.gpu, self.cpu, output.blocks_to_swap_out)
        self._move(self.cpu, self.gpu, output.blocks_to_swap_in)
        for c, _ in output.blocks_to_swap_in:
            for o in range(bs):
                self.cpu.pop(c * bs + o, None)
        self._move(self.gpu, self.gpu, output.blocks_to_copy)
        fps = {}
        for s in output.scheduled:
            end = s.start + s.num_new_tokens
            inputs = s.request.all_token_ids[: s.start] + s.token_ids
            assert len(inputs) == end and len(s.block_table) * bs >= end
            assert s.will_sample == (end - len(s.spec_token_ids) == s.request.num_tokens)
            fps[s.request_id] = fingerprints(inputs, end)
            for pos in range(s.start, end):
                self.gpu[s.block_table[pos // bs] * bs + pos % bs] = (pos, fps[s.request_id][pos])
        sampled = {}
        for s in output.scheduled:
            end = s.start + s.num_new_tokens
            for pos in range(end):
                got = self.gpu.get(s.block_table[pos // bs] * bs + pos % bs)
                assert got == (pos, fps[s.request_id][pos]), f"{s.request_id}@{pos}: {got}"
            if s.will_sample:
                n = s.request.num_tokens
                model = [self.token_for(s.request_id, n + j) for j in range(len(s.spec_token_ids) + 1)]
                a = accepted(s.spec_token_ids, model)
                self.drafted += len(s.spec_token_ids)
                self.accepted += a
                sampled[s.request_id] = model[: a + 1]
        return sampled


def propose_mixed(runner: SpecKVRunner, rng: random.Random, k: int, p_right: float
                  ) -> Callable[[Request], list[int]]:
    """Drafts each right (the fake model's token) with probability `p_right`, else wrong."""

    def propose(r: Request) -> list[int]:
        right = [runner.token_for(r.request_id, r.num_tokens + j) for j in range(k)]
        return [t if rng.random() < p_right else (t + 1) % runner.vocab_size for t in right]

    return propose


def spec_step(sched: Scheduler, runner: SpecKVRunner, propose: Callable[[Request], list[int]],
              now: float) -> SchedulerOutput:
    """One engine iteration as `Engine._run` makes it: drafts for the running decodes, then
    schedule, run, update; then the integrity checks."""
    for r in sched.running:
        r.spec_token_ids = propose(r) if r.num_computed_tokens == r.num_tokens - 1 else []
    out = sched.schedule(now=now)
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    for s in out.scheduled:
        r, k = s.request, len(s.spec_token_ids)
        assert s.start == r.num_computed_tokens
        # Room: all accepted plus the model's token stays within max_tokens and max_model_len.
        assert r.num_output_tokens + k + 1 <= r.sampling_params.max_tokens
        assert r.num_tokens + k + 1 <= sched.max_model_len
    sched.update_from_output(out, runner.execute(out), now=now)
    sched.kv.check_integrity()
    for r in sched.running:
        assert r.num_computed_tokens < r.num_tokens
        assert sched.kv.is_swapped(r.request_id) is False
    return out


def _expected(runner: SpecKVRunner, r: Request) -> list[int]:
    """A lone run without drafts: the fake model's token at each output position, up to the
    request's stop token if it has one."""
    out = []
    for i in range(r.sampling_params.max_tokens):
        t = runner.token_for(r.request_id, r.num_prompt_tokens + i)
        out.append(t)
        if t in r.sampling_params.stop_token_ids:
            break
    return out


@pytest.mark.parametrize("seed", range(6))
def test_drafts_under_pressure_give_the_same_tokens_and_free_every_block(seed: int) -> None:
    """Small caches (preemption by swap and recompute), small budgets (drafts cut), prefix
    caching, max_model_len close to prompts (drafts capped), stop tokens among the drafts:
    every request gets what it gets without speculation, every KV slot below a request's
    computed tokens holds its real tokens after each step, and every block is free at the
    end."""
    rng = random.Random(seed)
    bs = 4
    kv = KVCacheManager(num_blocks=18 + 2 * (seed % 3), block_size=bs, enable_prefix_caching=True,
                        num_cpu_blocks=(0, 64)[seed % 2])
    sched = Scheduler(kv, max_num_seqs=(4, 8)[seed % 2], max_num_batched_tokens=(6, 16, 64)[seed % 3],
                      max_model_len=64, preemption_mode="auto")
    runner = SpecKVRunner(bs)
    reqs = []
    shared = [rng.randrange(1000) for _ in range(8)]  # a prefix some prompts share
    for i in range(16):
        rid = f"r{seed}-{i}"
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
        max_tokens = min(rng.randint(1, 30), 64 - len(prompt))
        stop = (runner.token_for(rid, len(prompt) + rng.randrange(max_tokens)),) if i % 4 == 1 else ()
        r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop),
                    arrival_time=float(i))
        sched.add_request(r)
        reqs.append(r)
    propose = propose_mixed(runner, rng, k=(1, 3, 6)[seed % 3], p_right=0.7)
    steps = preempted = swapped_in = 0
    while sched.has_unfinished_requests():
        out = spec_step(sched, runner, propose, now=100.0 + steps)
        assert not out.is_empty
        preempted += len(out.preempted_ids)
        swapped_in += len(out.blocks_to_swap_in)
        steps += 1
        assert steps < 10_000
    assert preempted > 0 and (swapped_in > 0) == (kv.num_cpu_blocks > 0)
    for r in reqs:
        assert r.output_token_ids == _expected(runner, r), r.request_id
        assert r.num_accepted_tokens <= r.num_draft_tokens
    assert runner.accepted > 0 and runner.drafted > runner.accepted
    assert sum(r.num_draft_tokens for r in reqs) == runner.drafted
    assert not kv.block_tables and not kv.cpu_tables and kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


def test_drafts_are_cut_to_the_budget_and_the_room_left() -> None:
    runner = SpecKVRunner(4)
    sched = Scheduler(KVCacheManager(64, block_size=4), max_num_seqs=4, max_num_batched_tokens=4,
                      max_model_len=64)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add_request(a)
    spec_step(sched, runner, lambda r: [], now=0.0)  # prefill, first token
    a.spec_token_ids = [7, 7, 7, 7, 7]
    (s,) = sched.schedule().scheduled
    assert s.spec_token_ids == [7]  # max_tokens 3: one token out, one draft, one of the model's
    assert s.num_new_tokens == 2 and a.spec_token_ids == []  # taken off the request

    sched = Scheduler(KVCacheManager(64, block_size=4), max_num_seqs=4, max_num_batched_tokens=4,
                      max_model_len=64)
    b = Request("b", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add_request(b)
    spec_step(sched, runner, lambda r: [], now=0.0)
    b.spec_token_ids = [7] * 10
    (s,) = sched.schedule().scheduled
    assert s.num_new_tokens == 4 and s.spec_token_ids == [7] * 3  # the budget of 4

    sched = Scheduler(KVCacheManager(64, block_size=4), max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=8)
    c = Request("c", [1, 2, 3, 4, 5], SamplingParams(max_tokens=10, ignore_eos=True))
    sched.add_request(c)
    spec_step(sched, runner, lambda r: [], now=0.0)
    c.spec_token_ids = [7] * 10
    (s,) = sched.schedule().scheduled
    assert s.spec_token_ids == [7]  # max_model_len 8: 6 tokens, one draft, one of the model's


def test_drafts_preempt_nobody() -> None:
    """Blocks for the decodes but not for the drafts: both run, without drafts."""
    kv = KVCacheManager(2, block_size=4)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    runner = SpecKVRunner(4)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True), arrival_time=0.0)
    b = Request("b", [4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True), arrival_time=1.0)
    sched.add_request(a)
    sched.add_request(b)
    spec_step(sched, runner, lambda r: [], now=0.0)
    a.spec_token_ids = b.spec_token_ids = [9, 9, 9]
    out = sched.schedule()
    assert not out.preempted_ids and [s.spec_token_ids for s in out.scheduled] == [[], []]
    assert {s.request_id for s in out.scheduled} == {"a", "b"}


def test_a_stop_token_among_accepted_drafts_ends_the_request_there() -> None:
    kv = KVCacheManager(64, block_size=4)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    runner = SpecKVRunner(4)
    rid = "s"
    stop = runner.token_for(rid, 5 + 2)  # the third output token
    r = Request(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop,)))
    sched.add_request(r)
    spec_step(sched, runner, lambda r: [], now=0.0)
    right = [runner.token_for(rid, 6 + j) for j in range(5)]
    out = spec_step(sched, runner, lambda r: right, now=1.0)
    assert out.scheduled[0].spec_token_ids == right
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == stop
    assert r.output_token_ids == _expected(runner, r) and len(r.output_token_ids) == 3
    assert r.num_draft_tokens == 5 and r.num_accepted_tokens == 5
    assert kv.num_free_blocks == kv.num_blocks


def test_truncate_output_keeps_the_request_consistent() -> None:
    r = Request("t", list(range(6)), SamplingParams(max_tokens=20))
    r.start_block_hashes(4)
    for t in range(10):
        r.append_output_token(100 + t)
    r.num_computed_tokens = r.num_tokens - 1
    r.truncate_output(3)
    assert r.output_token_ids == [100, 101, 102]
    assert r.all_token_ids == [*range(6), 100, 101, 102] and r.num_computed_tokens == 8
    same = Request("t", r.all_token_ids, SamplingParams(max_tokens=20))
    same.start_block_hashes(4)
    assert r.block_hashes == same.block_hashes and len(r.block_hashes) == 2
    with pytest.raises(AssertionError):
        r.truncate_output(4)


# ----- the engine on the default model --------------------------------------------------------

GROUNDED = [
    "Rewrite the following paragraph, replacing every 'cat' with 'dog'. Keep everything else "
    "exactly the same.\n\nThe cat sat on the mat by the window. Every morning the cat watched "
    "the birds in the garden, and every evening the cat slept by the warm fire. The cat was "
    "happy in the old house.",
    "Extract the name, the email address and the phone number from this message and answer "
    "in JSON with the keys name, email and phone.\n\nHello, my name is Maria Lopez. You can "
    "reach me at maria.lopez@example.com or call me at 555-0142 during office hours.",
    "Rename the variable `total` to `running_sum` in this Python function and show the whole "
    "function:\n\ndef add_all(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total\n",
]
SPEC = NgramSpeculation(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2,
                        disable_by_batch_size=64)


def _engine(loaded: LoadedModel, spec: NgramSpeculation | None) -> Engine:
    conf = WorkerConfig(model=ModelConfig(max_model_len=2048), cache=CacheConfig(kv_cache_memory=0.25),
                        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
                        speculative=SpeculativeConfig(spec))
    return Engine(conf, loaded=loaded)


def _generate(engine: Engine, prompts: list[list[int]], params: SamplingParams,
              on_output: Callable[[list[RequestOutput]], None] | None = None) -> list[Completion]:
    done = engine.generate([engine.make_request(p, params) for p in prompts], on_output)
    assert not engine.scheduler.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_integrity()
    return done


@pytest.fixture(scope="module")
def grounded_ids(default_model: LoadedModel) -> list[list[int]]:
    tok = default_model.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
            for p in GROUNDED]


@pytest.fixture(scope="module")
def engines(default_model: LoadedModel) -> tuple[Engine, Engine]:
    return _engine(default_model, None), _engine(default_model, SPEC)


def test_greedy_tokens_are_the_same_with_and_without_speculation(engines, grounded_ids,
                                                                 chat_prompt_ids) -> None:
    """Every test prompt, all at once (drafted decodes, plain decodes and prefill chunks in
    one step) and the input-grounded ones alone (one stream, as speculation is meant for):
    the same tokens and finish as without speculation, with drafts accepted."""
    plain, spec = engines
    prompts = grounded_ids + chat_prompt_ids
    params = SamplingParams(temperature=0.0, max_tokens=48)
    want = _generate(plain, prompts, params)
    got = _generate(spec, prompts, params)
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert spec.num_accepted_tokens > 0
    for i, p in enumerate(grounded_ids):
        drafted, accepted_before = spec.num_draft_tokens, spec.num_accepted_tokens
        (alone,) = _generate(spec, [p], params)
        assert alone.token_ids == want[i].token_ids
        assert spec.num_accepted_tokens > accepted_before, f"no draft accepted on {GROUNDED[i][:40]!r}"
        assert spec.num_draft_tokens > drafted


def test_plain_greedy_verification_skips_the_sampler(engines, grounded_ids, monkeypatch) -> None:
    """Drafted steps of plain greedy requests on the CPU verify by each row's argmax (the
    runner's shortcut, no ops.sample) and accept drafts; with logprobs wanted they go through
    ops.sample, with the same tokens."""
    import ops

    _, spec = engines
    calls = []
    real = ops.sample
    monkeypatch.setattr(ops, "sample", lambda *a, **k: calls.append(1) or real(*a, **k))
    accepted_before = spec.num_accepted_tokens
    (fast,) = _generate(spec, grounded_ids[:1], SamplingParams(temperature=0.0, max_tokens=32))
    assert calls == [] and spec.num_accepted_tokens > accepted_before
    (full,) = _generate(spec, grounded_ids[:1], SamplingParams(temperature=0.0, max_tokens=32, logprobs=0))
    assert calls and full.token_ids == fast.token_ids


def test_penalties_and_seeds_see_the_drafts_as_output(engines, grounded_ids) -> None:
    """Each sampled position counts the drafts before it as output (penalties) and draws with
    its own output index's seeded generator: seeded sampling with penalties gives the same
    tokens with and without speculation, and greedy with a repetition penalty too."""
    plain, spec = engines
    for params in (
        SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=32),
        SamplingParams(temperature=0.7, top_p=0.95, top_k=50, min_p=0.01, repetition_penalty=1.05,
                       frequency_penalty=0.1, presence_penalty=0.1, seed=1234, max_tokens=32),
    ):
        accepted_before = spec.num_accepted_tokens
        want = _generate(plain, grounded_ids, params)
        got = [_generate(spec, [p], params)[0] for p in grounded_ids]
        assert [g.token_ids for g in got] == [w.token_ids for w in want], params
        assert spec.num_accepted_tokens > accepted_before, params


def test_plain_sampled_rows_skip_the_sampling_tensors(engines, grounded_ids, monkeypatch) -> None:
    """Sampled requests with no penalties, logprobs or masks take the runner's plain path
    (ops.cpu_sampling.sample_plain: the C sampler called from lists, no ops.sample) on plain
    and drafted steps, and give the tokens ops.sample gives: seeded, so the same with and
    without speculation, and with the plain path turned off."""
    import ops
    from worker.model_runner import ModelRunner

    plain, spec = engines
    calls = []
    real = ops.sample
    monkeypatch.setattr(ops, "sample", lambda *a, **k: calls.append(1) or real(*a, **k))
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=77, max_tokens=32)
    accepted_before = spec.num_accepted_tokens
    fast = _generate(plain, grounded_ids, params)
    fast_spec = [_generate(spec, [p], params)[0] for p in grounded_ids]
    assert calls == [] and spec.num_accepted_tokens > accepted_before
    monkeypatch.setattr(ModelRunner, "_plain_rows", staticmethod(lambda *a, **k: None))
    full = _generate(plain, grounded_ids, params)
    full_spec = [_generate(spec, [p], params)[0] for p in grounded_ids]
    assert calls
    want = [c.token_ids for c in full]
    assert [c.token_ids for c in fast] == want
    assert [c.token_ids for c in fast_spec] == [c.token_ids for c in full_spec] == want


def test_logprobs_of_accepted_drafts(engines, grounded_ids) -> None:
    """A drafted position's logits are those of a plain decode to the bit (it attends as a
    decode row, and each row's arithmetic is its own), so its logprobs are too."""
    plain, spec = engines
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
    (want,) = _generate(plain, grounded_ids[:1], params)
    accepted_before = spec.num_accepted_tokens
    (got,) = _generate(spec, grounded_ids[:1], params)
    assert spec.num_accepted_tokens > accepted_before
    assert got.token_ids == want.token_ids and len(got.logprobs) == len(got.token_ids)
    for g, w in zip(got.logprobs, want.logprobs, strict=True):
        assert (g.token_id, g.logprob, g.top_logprobs) == (w.token_id, w.logprob, w.top_logprobs)


def test_a_stop_string_inside_accepted_drafts_ends_the_request_there(engines, grounded_ids,
                                                                     default_model, monkeypatch) -> None:
    """A stop string completed by an accepted draft with more tokens after it in the same
    step: the request ends at that token, the later ones are dropped, and the result is
    what it is without speculation."""
    plain, spec = engines
    tok = default_model.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=48)
    groups: list[list[int]] = []
    (free,) = _generate(spec, grounded_ids[:1], params,
                        lambda outs: groups.extend(o.new_token_ids for o in outs if o.new_token_ids))
    # The first token that starts a step's group of several, whose text's first occurrence
    # in the output is where that token put it.
    ids, text = free.token_ids, tok.decode(free.token_ids)
    stop = None
    first = 0
    for g in groups:
        if len(g) > 1:
            a, b = len(tok.decode(ids[:first])), len(tok.decode(ids[: first + 1]))
            piece = text[a:b]
            if piece.strip() and text.find(piece) == a:
                stop = piece
                break
        first += len(g)
    assert stop is not None, f"no stop string candidate in {groups}"
    truncated: list[int] = []
    real = Request.truncate_output

    def watch(self: Request, n: int) -> None:
        truncated.append(self.num_output_tokens - n)
        real(self, n)

    monkeypatch.setattr(Request, "truncate_output", watch)
    with_stop = dataclasses.replace(params, stop=(stop,))
    (want,) = _generate(plain, grounded_ids[:1], with_stop)
    (got,) = _generate(spec, grounded_ids[:1], with_stop)
    assert truncated and truncated[-1] > 0  # tokens after the stop were dropped
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
        want.token_ids, want.text, "stop", stop)
    assert len(got.token_ids) == first + 1


def test_large_batches_do_not_speculate(default_model, chat_prompt_ids) -> None:
    """More running requests than disable_by_batch_size: no drafts in any step (and the same
    requests under a larger bound do draft)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    small = _engine(default_model, dataclasses.replace(SPEC, disable_by_batch_size=7))
    _generate(small, chat_prompt_ids[:8], params)
    assert small.num_draft_tokens == 0
    large = _engine(default_model, dataclasses.replace(SPEC, disable_by_batch_size=8))
    _generate(large, chat_prompt_ids[:8], params)
    assert large.num_draft_tokens > 0


# ----- the distribution of sampled outputs ----------------------------------------------------

TINY_PROMPT = [2] * 17  # the model's favourite: drafts of 2s; its first 16 tokens a cached block
TINY_VOCAB = 8


def _tiny_model() -> LoadedModel:
    """A one-layer model over 8 tokens whose next-token distributions are neither flat nor
    one-hot (weights of std 0.35: logits spread over a few units)."""
    cfg = dataclasses.replace(dummy.SHAPES["smollm2-135m"], vocab_size=TINY_VOCAB, hidden_size=32,
                              intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                              head_dim=16, max_position_embeddings=64)
    model = _build(cfg, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm") or name.endswith("layernorm"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.35, generator=gen)
    return LoadedModel(model, cfg, None, "tiny", "dummy", torch.device("cpu"), torch.float32)


def _tiny_outputs(loaded: LoadedModel, spec: NgramSpeculation | None, params: SamplingParams,
                  n: int) -> tuple[Counter[tuple[int, ...]], Engine]:
    conf = WorkerConfig(model=ModelConfig(device="cpu", cuda_graphs=False, seed=11),
                        cache=CacheConfig(kv_cache_memory=0.02),
                        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096),
                        speculative=SpeculativeConfig(spec))
    engine = Engine(conf, loaded=loaded)
    done = engine.generate([engine.make_request(TINY_PROMPT, params) for _ in range(n)])
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return Counter(tuple(c.token_ids[:3]) for c in done), engine


def _chi2_sf(x: float, dof: int) -> float:
    """P(chi-square with `dof` degrees of freedom > x)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def _goodness_of_fit(observed: Counter, expected: dict[tuple[int, ...], float], n: int) -> float:
    """p-value of Pearson's chi-square, cells expecting fewer than 5 pooled into one."""
    stat, dof, pool_o, pool_e = 0.0, -1, 0.0, 0.0
    for cell, p in expected.items():
        e = p * n
        if e < 5:
            pool_o, pool_e = pool_o + observed.get(cell, 0), pool_e + e
            continue
        stat += (observed.get(cell, 0) - e) ** 2 / e
        dof += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        dof += 1
    assert sum(observed.values()) == n and set(observed) <= set(expected)
    return _chi2_sf(stat, dof)


def _homogeneity(a: Counter, b: Counter) -> float:
    """p-value of the two-sample chi-square test that `a` and `b` come from one distribution
    (cells with fewer than 10 draws in both pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    stat, dof, pa, pb = 0.0, -1, 0, 0
    for cell in set(a) | set(b):
        x, y = a.get(cell, 0), b.get(cell, 0)
        if x + y < 10:
            pa, pb = pa + x, pb + y
            continue
        stat += (math.sqrt(nb / na) * x - math.sqrt(na / nb) * y) ** 2 / (x + y)
        dof += 1
    if pa + pb:
        stat += (math.sqrt(nb / na) * pa - math.sqrt(na / nb) * pb) ** 2 / (pa + pb)
        dof += 1
    return _chi2_sf(stat, dof)


@torch.inference_mode()
def _exact(loaded: LoadedModel, temperature: float = 1.0) -> dict[tuple[int, ...], float]:
    """P(first three output tokens) of the model itself: a product of softmaxes of its
    logits, each from a whole forward pass over its context (no cache reuse, no drafts)."""
    model = loaded.model

    def probs(ctx: list[int]) -> list[float]:
        return (last_logits(model, ctx) / temperature).softmax(-1).tolist()

    exact = {}
    p1 = probs(TINY_PROMPT)
    for a in range(TINY_VOCAB):
        p2 = probs([*TINY_PROMPT, a])
        for b in range(TINY_VOCAB):
            p3 = probs([*TINY_PROMPT, a, b])
            for c in range(TINY_VOCAB):
                exact[a, b, c] = p1[a] * p2[b] * p3[c]
    return exact


N_DRAWS = 6000
TINY_SPEC = NgramSpeculation(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1,
                             disable_by_batch_size=256)


def test_sampled_outputs_keep_the_models_distribution() -> None:
    """6,000 sampled continuations with drafts (the prompt repeats, so drafts come from it
    and are accepted and rejected at both positions a draft can have here): the
    distribution of the first three tokens against the model's exact one, and the test's
    power against a slightly wrong distribution (temperature 0.7 instead of 0.6)."""
    loaded = _tiny_model()
    params = SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True)
    observed, engine = _tiny_outputs(loaded, TINY_SPEC, params, N_DRAWS)
    first, second = engine.accepted_per_position[:2]
    rejected = engine.num_draft_tokens - engine.num_accepted_tokens
    assert first > 1000 and second > 300 and rejected > 1000, (engine.accepted_per_position, rejected)
    p = _goodness_of_fit(observed, _exact(loaded, temperature=0.6), N_DRAWS)
    assert p > 1e-3, p
    assert _goodness_of_fit(observed, _exact(loaded, temperature=0.7), N_DRAWS) < 1e-6


def test_sampling_controls_keep_the_same_distribution_with_drafts() -> None:
    """Temperature, top-k, top-p, min-p and the three penalties, each position with the drafts
    before it counted as output: the same distribution as the sampler without speculation
    (two-sample chi-square), and the test's power against other controls. (A runner that
    forgot to count the drafts in the penalties fails it with p ~ 1e-18.)"""
    loaded = _tiny_model()
    params = SamplingParams(temperature=0.6, top_k=6, top_p=0.95, min_p=0.02, repetition_penalty=1.1,
                            presence_penalty=-0.5, frequency_penalty=0.8, max_tokens=4, ignore_eos=True)
    with_spec, engine = _tiny_outputs(loaded, TINY_SPEC, params, N_DRAWS)
    without, _ = _tiny_outputs(loaded, None, params, N_DRAWS)
    first, second = engine.accepted_per_position[:2]
    rejected = engine.num_draft_tokens - engine.num_accepted_tokens
    assert first > 1000 and second > 40 and rejected > 1000, (engine.accepted_per_position, rejected)
    assert _homogeneity(with_spec, without) > 1e-3
    no_penalties = dataclasses.replace(params, repetition_penalty=1.0, presence_penalty=0.0,
                                       frequency_penalty=0.0)
    other, _ = _tiny_outputs(loaded, None, no_penalties, N_DRAWS)
    assert _homogeneity(with_spec, other) < 1e-6


# ----- the flag, the metrics, the vLLM protocol -----------------------------------------------


def parse(*argv: str) -> WorkerConfig:
    return cfgmod.from_args(build_parser().parse_args(["serve", *argv]))


def test_the_flag_reads_vllms_json_and_refuses_other_methods(monkeypatch, capsys) -> None:
    conf = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, '
                                         '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    assert conf.speculative.speculative_config == NgramSpeculation(5, 4, 2)
    assert parse().speculative.speculative_config is None
    # vLLM's defaults: a missing bound takes the other's value, 5 when both are missing.
    spec = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                         '"prompt_lookup_max": 7}').speculative.speculative_config
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (7, 7)
    spec = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'
                 ).speculative.speculative_config
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    monkeypatch.setenv("LLMWORKER_SPECULATIVE_CONFIG", '{"method": "ngram", "num_speculative_tokens": 2}')
    assert parse().speculative.speculative_config.num_speculative_tokens == 2
    monkeypatch.delenv("LLMWORKER_SPECULATIVE_CONFIG")
    assert json.loads(conf.to_json())["speculative"]["speculative_config"]["prompt_lookup_min"] == 2
    for bad, says in [
        ('{"method": "eagle", "model": "x", "num_speculative_tokens": 3}', "method 'eagle' is not supported"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
         "prompt_lookup_min (3) must be <= prompt_lookup_max (2)"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}',
         "unsupported keys draft_tensor_parallel_size"),
        ("ngram", "--speculative-config is not JSON"),
    ]:
        with pytest.raises(SystemExit):
            parse("--speculative-config", bad)
        assert says in capsys.readouterr().err, bad


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_served_counts_reach_the_metrics_and_the_vllm_protocol(grounded_ids) -> None:
    """One request on each protocol: each complete carries its own counts, and the server's
    totals (GetServerStatus, Prometheus) are their sums, the warm-up's left out."""
    from llmworker.v1 import worker_pb2 as pb
    from prometheus_client.parser import text_string_to_metric_families
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

    from tests.test_server import Worker

    port = _free_port()
    w = Worker("--metrics-port", str(port), "--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
               '"prompt_lookup_min": 2}')
    try:
        w.wait_ready()
        stub = w.vllm
        req = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=grounded_ids[0]),
                                  sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=40),
                                  stream=False)
        (resp,) = list(stub.Generate(req, timeout=120))
        complete = resp.complete
        assert 0 < complete.spec_accepted_tokens <= complete.spec_draft_tokens
        ours = pb.GenerateRequest(token_ids=pb.TokenIdsInput(ids=grounded_ids[1]),
                                  sampling=pb.SamplingParams(temperature=0.0),
                                  stopping=pb.StoppingCriteria(max_tokens=40))
        (mine,) = [r.complete for r in w.stub.Generate(ours, timeout=120) if r.HasField("complete")]
        assert 0 < mine.spec_accepted_tokens <= mine.spec_draft_tokens
        drafted = complete.spec_draft_tokens + mine.spec_draft_tokens
        accepted = complete.spec_accepted_tokens + mine.spec_accepted_tokens
        status = w.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)
        assert (status.spec_draft_tokens, status.spec_accepted_tokens) == (drafted, accepted)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert values["vllm:spec_decode_num_draft_tokens_total"] == drafted
        assert values["vllm:spec_decode_num_accepted_tokens_total"] == accepted
        assert 0 < values["vllm:spec_decode_num_drafts_total"] <= drafted
        per_pos = {s.labels["position"]: s.value for f in text_string_to_metric_families(text)
                   for s in f.samples if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
        assert sorted(per_pos) == ["0", "1", "2", "3"]
        assert sum(per_pos.values()) == accepted
        assert per_pos["0"] >= per_pos["1"] >= per_pos["2"] >= per_pos["3"]
    finally:
        w.close()
