"""The engine end to end on the default model: continuous batching must not change
what any request gets."""

from __future__ import annotations

import argparse
import inspect
import json
import random
import textwrap
import threading
import time

import pytest

from kvcache.manager import cdiv
from scheduler.request import SamplingParams, SamplingParamsError
from tests.helpers import hf_greedy
from worker.config import CacheConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine


def _engine(loaded, *, budget: int = 512, seqs: int = 64, gib: float = 0.5, policy: str = "continuous") -> Engine:
    conf = WorkerConfig(
        cache=CacheConfig(kv_cache_memory=gib),
        scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, policy=policy),
    )
    return Engine(conf, loaded=loaded)


def _assert_clean(engine: Engine) -> None:
    assert not engine.scheduler.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.budget.num_blocks
    engine.kv.check_integrity()


@pytest.fixture(scope="module")
def corpus_ids(default_model) -> list[int]:
    """Real text (fixed for a Python version): stdlib sources, code and English docstrings."""
    text = "\n".join(inspect.getsource(m) for m in (argparse, json, textwrap, threading))
    return default_model.tokenizer.encode(text)


@pytest.fixture(scope="module")
def mixed_workload(corpus_ids) -> list[tuple[list[int], int]]:
    """64 prompts of 8 to 1,000 tokens (log-uniform) with 1 to 12 new tokens each."""
    rng = random.Random(1234)
    work = []
    for i in range(64):
        n = 1000 if i == 0 else 8 if i == 1 else round(8 * (1000 / 8) ** rng.random())
        start = rng.randrange(len(corpus_ids) - n)
        work.append((corpus_ids[start : start + n], rng.randint(1, 12)))
    return work


def test_batch_invariance_with_chunked_prefill(default_model, hf_model, mixed_workload) -> None:
    """64 concurrent requests under a 64-token budget (prefills chunked and mixed with
    decodes) give the same greedy tokens as each alone, and (17 of them) as transformers."""
    batched = _engine(default_model, budget=64)
    bs = batched.kv.block_size
    mixed_steps = 0
    waste: list[int] = []
    schedule = batched.scheduler.schedule

    def watch_schedule():
        nonlocal mixed_steps
        out = schedule()
        kinds = {s.num_new_tokens == 1 and s.start > 0 for s in out.scheduled}
        mixed_steps += kinds == {True, False}
        return out

    def watch_outputs(_outputs) -> None:
        # Blocks in use never exceed what the running requests' lengths need, rounded up.
        running = batched.scheduler.running
        need = sum(cdiv(r.num_computed_tokens, bs) for r in running)
        assert batched.kv.blocks_in_use() <= need
        tokens = sum(r.num_computed_tokens for r in running)
        waste.append(batched.kv.blocks_in_use() * bs - tokens)

    batched.scheduler.schedule = watch_schedule
    reqs = [batched.make_request(ids, SamplingParams(temperature=0, max_tokens=m)) for ids, m in mixed_workload]
    together = [c.token_ids for c in batched.generate(reqs, on_output=watch_outputs)]
    _assert_clean(batched)
    assert mixed_steps > 10, "prefill chunks never shared a step with decodes"
    assert max(waste) < bs * batched.scheduler.max_num_seqs
    print(f"\nKV waste per step: mean {sum(waste) / len(waste):.0f} tokens, max {max(waste)} "
          f"(< one block per running request); {mixed_steps} mixed steps")

    alone_engine = _engine(default_model)
    for i, (ids, m) in enumerate(mixed_workload):
        (alone,) = alone_engine.generate([alone_engine.make_request(ids, SamplingParams(temperature=0, max_tokens=m))])
        assert together[i] == alone.token_ids, f"request {i} ({len(ids)} prompt tokens): batched != alone"
        # transformers for a quarter of them, the longest (0) and shortest (1) prompts among
        # them: it took half the test's time for all 64, and every one was already the same.
        if i % 4 == 0 or i == 1:
            assert alone.token_ids == hf_greedy(hf_model, ids, m), f"request {i}: ours != transformers"
    _assert_clean(alone_engine)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(default_model, chat_prompt_ids) -> None:
    engine = _engine(default_model, budget=48)
    seeded = [
        SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7, max_tokens=16),
        SamplingParams(temperature=1.2, min_p=0.05, seed=11, max_tokens=16),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, seed=3, max_tokens=16),
    ]
    alone = [engine.generate([engine.make_request(chat_prompt_ids[i], p)])[0].token_ids
             for i, p in enumerate(seeded)]
    companions = [engine.make_request(ids, SamplingParams(temperature=1.0, max_tokens=12))
                  for ids in chat_prompt_ids[3:]]
    mine = [engine.make_request(chat_prompt_ids[i], p) for i, p in enumerate(seeded)]
    done = engine.generate(companions[:3] + mine + companions[3:])
    together = [c.token_ids for c in done[3 : 3 + len(mine)]]
    assert together == alone
    # and a different seed gives a different continuation
    other = engine.generate([engine.make_request(chat_prompt_ids[0], SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=8, max_tokens=16))])[0].token_ids
    assert other != alone[0]
    _assert_clean(engine)


def test_stop_string_ends_the_request_and_is_not_returned(default_model, chat_prompt_ids) -> None:
    engine = _engine(default_model)
    ids = chat_prompt_ids[2]
    (full,) = engine.generate([engine.make_request(ids, SamplingParams(temperature=0, max_tokens=40))])
    words = full.text.split()
    assert len(words) > 6
    stop = " ".join(words[3:5])
    deltas: list[str] = []
    req = engine.make_request(ids, SamplingParams(temperature=0, max_tokens=40, stop=("zzzz-never", stop)))
    (cut,) = engine.generate([req], on_output=lambda outs: deltas.extend(o.new_text for o in outs))
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    assert "".join(deltas) == cut.text and stop not in "".join(deltas)
    assert len(cut.token_ids) < len(full.token_ids)
    _assert_clean(engine)


def test_finish_reasons_for_length_eos_and_stop_token_ids(default_model, chat_prompt_ids) -> None:
    engine = _engine(default_model)
    ids = chat_prompt_ids[0]
    (free,) = engine.generate([engine.make_request(ids, SamplingParams(temperature=0, max_tokens=64))])
    assert free.finish_reason == "stop" and free.token_ids[-1] in engine.loaded.eos_token_ids
    (special,) = engine.generate([engine.make_request(
        ids, SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False))])
    eos_text = engine.tokenizer.decode([free.token_ids[-1]], skip_special_tokens=False)
    assert eos_text and eos_text not in free.text and special.text == free.text + eos_text
    (capped,) = engine.generate([engine.make_request(ids, SamplingParams(temperature=0, max_tokens=3))])
    assert capped.finish_reason == "length" and capped.token_ids == free.token_ids[:3]
    (ignored,) = engine.generate([engine.make_request(
        ids, SamplingParams(temperature=0, max_tokens=len(free.token_ids) + 5, ignore_eos=True))])
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == len(free.token_ids) + 5
    stop_tok = free.token_ids[2]
    (by_id,) = engine.generate([engine.make_request(
        ids, SamplingParams(temperature=0, max_tokens=64, stop_token_ids=(stop_tok,)))])
    first = free.token_ids.index(stop_tok)
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_tok
    assert by_id.token_ids == free.token_ids[: first + 1]
    _assert_clean(engine)


def test_logprobs_are_consistent_with_greedy_choice(default_model, chat_prompt_ids) -> None:
    engine = _engine(default_model)
    (c,) = engine.generate([engine.make_request(
        chat_prompt_ids[1], SamplingParams(temperature=0, max_tokens=8, logprobs=5))])
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert lp.token_id == tok and len(lp.top_logprobs) == 5
        assert lp.top_logprobs[0][0] == tok and lp.logprob == pytest.approx(lp.top_logprobs[0][1])
        values = [v for _, v in lp.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)


def test_plain_greedy_steps_skip_the_sampler_and_give_its_tokens(default_model, chat_prompt_ids,
                                                                 monkeypatch) -> None:
    """A CPU step whose rows are all plain greedy (no logprobs, penalties or masks) takes the
    runner's argmax shortcut, not ops.sample; a row that wants more goes through ops.sample,
    and the tokens are the same either way."""
    import ops
    from worker import model_runner

    calls = []
    real = ops.sample
    monkeypatch.setattr(model_runner.ops, "sample", lambda *a, **k: calls.append(1) or real(*a, **k))
    engine = _engine(default_model)
    plain = SamplingParams(temperature=0, max_tokens=8)
    (fast,) = engine.generate([engine.make_request(chat_prompt_ids[2], plain)])
    assert calls == []
    (full,) = engine.generate([engine.make_request(chat_prompt_ids[2], SamplingParams(
        temperature=0, max_tokens=8, logprobs=0))])
    assert len(calls) == 8 and full.token_ids == fast.token_ids


def test_static_policy_gives_the_same_tokens(default_model, chat_prompt_ids) -> None:
    params = SamplingParams(temperature=0, max_tokens=10)
    runs = []
    for policy in ("continuous", "static"):
        engine = _engine(default_model, seqs=3, policy=policy)
        runs.append([c.token_ids for c in engine.generate([engine.make_request(ids, params) for ids in chat_prompt_ids])])
        _assert_clean(engine)
    assert runs[0] == runs[1]


def test_background_thread_serves_submit_and_abort_from_other_threads(default_model, chat_prompt_ids) -> None:
    engine = _engine(default_model)
    done: dict[str, list] = {}
    finished = threading.Event()
    lock = threading.Lock()

    def sink(step) -> None:
        with lock:
            for o in step.outputs:
                done.setdefault(o.request_id, []).append(o)
            if sum(1 for v in done.values() if v[-1].finished) == 4:
                finished.set()

    engine.start(sink)
    try:
        reqs = [engine.make_request(ids, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
                for ids in chat_prompt_ids[:4]]
        threads = [threading.Thread(target=engine.submit, args=(r,)) for r in reqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deadline = time.monotonic() + 60
        while len(done.get(reqs[0].request_id, [])) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.abort([reqs[0].request_id])
        assert finished.wait(240)
    finally:
        engine.shutdown()
    first = done[reqs[0].request_id]
    assert first[-1].finish_reason == "abort" and len(first) < 200
    for r in reqs[1:]:
        outs = done[r.request_id]
        assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 200
        # at most one message per request per step
        assert all(len(o.new_token_ids) <= 1 for o in outs)
    _assert_clean(engine)


def test_bad_requests_are_refused_at_the_door(default_model) -> None:
    engine = _engine(default_model)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.make_request([], SamplingParams())
    with pytest.raises(ValueError, match="out of the vocabulary"):
        engine.make_request([1, 49152], SamplingParams())
    with pytest.raises(ValueError, match="holds a NUL"):  # sample 1 of "x" is "x\x001"
        engine.make_request([1, 2], SamplingParams(), request_id="x\x001")
    for params in (SamplingParams(stop_token_ids=(2, 49152), min_tokens=1), SamplingParams(logit_bias={49152: 1.0})):
        with pytest.raises(SamplingParamsError, match="out of the vocabulary") as e:
            engine.make_request([1, 2], params)
        assert e.value.field in ("stop_token_ids", "logit_bias")
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        engine.make_request([1, 2, 3], SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_budget_report_names_blocks_tokens_and_concurrency(default_model) -> None:
    engine = _engine(default_model, gib=0.75)
    text = engine.budget.describe()
    per_token = 2 * 30 * 3 * 64 * 4  # 2 · layers · kv_heads · head_dim · fp32 bytes
    assert engine.budget.bytes_per_token == per_token
    assert engine.budget.num_blocks == (int(0.75 * (1 << 30)) // per_token) // 16
    assert engine.budget.max_concurrent_requests == engine.budget.num_blocks * 16 // 8192
    assert f"{engine.budget.num_blocks} blocks" in text and "8192 tokens" in text
    json.dumps(engine.config.to_dict())  # the config prints as JSON
    with pytest.raises(ValueError, match=r"cannot hold one request of --max-model-len 8192"):
        _engine(default_model, gib=0.25)


def test_a_request_the_scheduler_refuses_fails_alone(default_model, chat_prompt_ids) -> None:
    """A duplicate id reaching the engine (bypassing the servicer's check) ends that
    request with an error; the engine thread does not die and the other request finishes."""
    engine = _engine(default_model)
    params = SamplingParams(temperature=0, max_tokens=4)
    first = engine.make_request(chat_prompt_ids[0], params, request_id="same")
    twin = engine.make_request(chat_prompt_ids[1], params, request_id="same")
    outputs = []
    engine.submit(first)
    engine.submit(twin)
    while engine.has_work():
        outputs += engine.step().outputs
    finals = [o for o in outputs if o.finished]
    assert sorted(o.finish_reason for o in finals) == ["error", "length"]
    assert "already in use" in next(o.error for o in finals if o.finish_reason == "error")
    _assert_clean(engine)
