"""The vLLM engine protocol (`vllm.grpc.engine.VllmEngine`, what SMG speaks) against a real
worker process, through the generated stubs of `smg-grpc-proto`; plus the pure pieces
behind it (the KV-event listener in kvcache, the event hub's bounds, auth levels).

One default-model worker for the module, and a small dummy-weights one started with
--no-kv-events.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import queue
import signal
import threading
import time
import zipfile
from collections.abc import Iterator
from types import SimpleNamespace

import grpc
import pytest
from llmworker.v1 import worker_pb2 as pb
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from tokenizers import Tokenizer as HFTokenizer

from kvcache.block_hash import ROOT, hash_block
from kvcache.events import AllCleared, BlocksRemoved, BlocksStored
from kvcache.manager import KVCacheManager
from tests.test_server import MAX_MODEL_LEN, Worker, blocks_all_free, code_of, run, wait_until
from worker import auth
from worker.config import WorkerConfig
from worker.door import Door
from worker.engine import StepOutput
from worker.kv_events import KvEventHub, Overflowed, to_int64
from worker.load import Load
from worker.tokenizer import Tokenizer
from worker.vllm_service import VllmEngineServicer

PROMPT = ("The three primary colors are red, yellow and blue. Mixing two of them gives a "
          "secondary color: red and yellow make orange, and red and blue make purple, while "
          "yellow and blue make")
GREEDY = vpb.SamplingParams(temperature=0.0)
TIMEOUT = 120


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    try:
        yield w.wait_ready()
    finally:
        w.close()


@pytest.fixture(scope="module")
def prompt_ids(tok: Tokenizer) -> list[int]:
    ids = tok.encode(PROMPT)
    assert len(ids) > 32 and len(ids) % 16, len(ids)  # two full blocks and a partial one
    return ids


@pytest.fixture(scope="module")
def ours(worker: Worker, prompt_ids: list[int]) -> list[int]:
    """Our own WorkerService's greedy output for the prompt (24 tokens, EOS ignored)."""
    chunks, complete = run(worker.stub, token_ids=pb.TokenIdsInput(ids=prompt_ids),
                           sampling=pb.SamplingParams(temperature=0.0),
                           stopping=pb.StoppingCriteria(max_tokens=24, ignore_eos=True))
    assert complete.finish_reason == pb.FINISH_REASON_LENGTH
    return [t for c in chunks for t in c.token_ids]


def generate(w: Worker, ids: list[int] | None = None, *, stream: bool = True,
             text: str | None = None, **params) -> tuple[list[vpb.GenerateStreamChunk],
                                                          vpb.GenerateComplete]:
    sp = vpb.SamplingParams(**params)
    req = (vpb.GenerateRequest(text=text, sampling_params=sp, stream=stream) if text is not None
           else vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=ids),
                                    sampling_params=sp, stream=stream))
    chunks, complete = [], None
    for resp in w.vllm.Generate(req, timeout=TIMEOUT):
        assert complete is None, "a message after complete"
        if resp.HasField("chunk"):
            chunks.append(resp.chunk)
        else:
            complete = resp.complete
    assert complete is not None, "the stream ended without complete"
    return chunks, complete


# ----- Generate -------------------------------------------------------------------------------


def test_greedy_stream_matches_our_service(worker, prompt_ids, ours) -> None:
    chunks, complete = generate(worker, prompt_ids, temperature=0.0, max_tokens=24,
                                ignore_eos=True)
    streamed = [t for c in chunks for t in c.token_ids]
    assert streamed == ours
    assert list(complete.output_ids) == streamed
    assert complete.finish_reason == "length"
    assert (complete.prompt_tokens, complete.completion_tokens) == (len(prompt_ids), 24)
    # Running usage: each chunk counts every token so far, and the prompt.
    running = [c.completion_tokens for c in chunks]
    assert running == sorted(running) and running[-1] == 24
    assert all(c.prompt_tokens == len(prompt_ids) for c in chunks)
    # The same prompt again: its full blocks come from the prefix cache.
    _, again = generate(worker, prompt_ids, temperature=0.0, max_tokens=2, ignore_eos=True)
    assert again.cached_tokens == len(prompt_ids) // 16 * 16


def test_non_streaming_sends_only_complete(worker, prompt_ids, ours) -> None:
    chunks, complete = generate(worker, prompt_ids, stream=False, temperature=0.0,
                                max_tokens=24, ignore_eos=True, logprobs=2)
    assert chunks == []
    assert list(complete.output_ids) == ours
    lp = complete.output_logprobs
    assert list(lp.token_ids) == ours and len(lp.token_logprobs) == 24
    assert all(len(t.token_ids) == 2 and t.token_ids[0] == tid
               for t, tid in zip(lp.top_logprobs, ours, strict=True))  # greedy: best first


def test_text_input_is_tokenized_like_the_ids(worker, prompt_ids, ours) -> None:
    _, complete = generate(worker, text=PROMPT, temperature=0.0, max_tokens=24, ignore_eos=True)
    assert complete.prompt_tokens == len(prompt_ids)
    assert list(complete.output_ids) == ours


def test_max_tokens_stop_ids_and_stop_strings(worker, tok, prompt_ids, ours) -> None:
    _, c = generate(worker, prompt_ids, temperature=0.0, max_tokens=3, ignore_eos=True)
    assert list(c.output_ids) == ours[:3] and c.finish_reason == "length"

    stop_id = ours[5]
    _, c = generate(worker, prompt_ids, temperature=0.0, max_tokens=24, ignore_eos=True,
                    stop_token_ids=[stop_id])
    k = ours.index(stop_id)
    assert list(c.output_ids) == ours[:k + 1]
    assert c.finish_reason == "stop" and c.matched_token_id == stop_id

    text = tok.decode(ours)
    stop = text[len(tok.decode(ours[:8])):][:4]  # a string that starts past token 8
    assert stop.strip(), text
    _, c = generate(worker, prompt_ids, temperature=0.0, max_tokens=24, ignore_eos=True,
                    stop=[stop], skip_special_tokens=True)
    out = list(c.output_ids)
    assert c.finish_reason == "stop" and c.matched_stop_str == stop
    assert out == ours[:len(out)] and 8 < len(out) < 24
    assert stop in tok.decode(out) and stop not in tok.decode(out[:-1])


def test_seed_makes_sampling_repeatable(worker, prompt_ids) -> None:
    def sample(seed: int) -> list[int]:
        _, c = generate(worker, prompt_ids, temperature=1.0, top_k=50, seed=seed,
                        max_tokens=12, ignore_eos=True)
        return list(c.output_ids)

    assert sample(1234) == sample(1234)
    assert sample(-5) == sample(-5)


def _set(field: str, value):
    def apply(req: vpb.GenerateRequest) -> None:
        target, name = req, field
        if field.startswith("sampling_params."):
            target, name = req.sampling_params, field.removeprefix("sampling_params.")
        if isinstance(value, dict):
            getattr(target, name).update(value)
        elif callable(value):
            value(getattr(target, name))
        else:
            setattr(target, name, value)
    return apply


REFUSED = [
    ("sampling_params.n", _set("sampling_params.n", 17)),  # n <= 16 is taken
    ("sampling_params.structural_tag", _set("sampling_params.structural_tag", "{}")),  # no format
    ("sampling_params.prompt_logprobs", _set("sampling_params.prompt_logprobs", -1)),
    ("sampling_params.prompt_logprobs", _set("sampling_params.prompt_logprobs", 21)),
    # Structured outputs and the bias are taken (tests/test_structured.py); bad ones are not.
    ("sampling_params.json_schema", _set("sampling_params.json_schema", '{"type": "foo"}')),
    ("sampling_params.regex", _set("sampling_params.regex", "[a-")),
    ("sampling_params.choice", _set("sampling_params.choice", lambda c: c.choices.append(""))),
    ("sampling_params.grammar", _set("sampling_params.grammar", "root ::= undefined")),
    ("sampling_params.logit_bias", _set("sampling_params.logit_bias", {5: 101.0})),
    ("sampling_params.min_tokens", _set("sampling_params.min_tokens", 3)),  # > max_tokens 2
    ("sampling_params.logprobs", _set("sampling_params.logprobs", -1)),
    ("sampling_params.logprobs", _set("sampling_params.logprobs", 21)),
    ("mm_inputs", _set("mm_inputs", lambda m: m.mm_hashes.append("h"))),
    ("extra_mm_inputs", _set("extra_mm_inputs", lambda m: m.add())),
    ("media_refs", _set("media_refs", lambda m: m.items.add(url="http://x"))),
    ("kv_transfer_params", _set("kv_transfer_params", lambda k: setattr(k, "remote_port", 1))),
    ("kv_transfer_params_json", _set("kv_transfer_params_json", "{}")),
    ("data_parallel_rank", _set("data_parallel_rank", 1)),
    # Bad values: the same limits as our own service.
    ("temperature", _set("sampling_params.temperature", -1.0)),
    ("top_p", _set("sampling_params.top_p", 1.5)),
    ("presence_penalty", _set("sampling_params.presence_penalty", 3.0)),
    ("sampling_params.stop", _set("sampling_params.stop", lambda s: s.extend(["x"] * 17))),
    ("sampling_params.stop[0]", _set("sampling_params.stop", lambda s: s.append(""))),
    ("sampling_params.max_tokens", _set("sampling_params.max_tokens", 0)),
    ("max_model_len", _set("sampling_params.max_tokens", MAX_MODEL_LEN)),
    ("truncate_prompt_tokens", _set("sampling_params.truncate_prompt_tokens", 0)),
    ("request_id", _set("request_id", "r" * 300)),
    ("request_id holds a control character (U+0000)", _set("request_id", "r\x001")),
    ("vocabulary", _set("tokenized", lambda t: t.input_ids.append(10**6))),
    # banned while min_tokens holds, such an id failed the whole model step (session 27)
    ("sampling_params.stop_token_ids", lambda r: (r.sampling_params.stop_token_ids.append(49152),
                                                  setattr(r.sampling_params, "min_tokens", 1))),
    ("sampling_params.logit_bias", _set("sampling_params.logit_bias", {49152: 1.0})),
]


@pytest.mark.parametrize(("field", "mutate"), REFUSED, ids=[f for f, _ in REFUSED])
def test_refused_fields_name_themselves(worker, prompt_ids, field, mutate) -> None:
    req = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=prompt_ids),
                              sampling_params=vpb.SamplingParams(max_tokens=2), stream=True)
    mutate(req)
    with pytest.raises(grpc.RpcError) as e:
        list(worker.vllm.Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in e.value.details()


def test_missing_input_and_malformed_bytes(worker) -> None:
    assert code_of(lambda: list(worker.vllm.Generate(vpb.GenerateRequest(), timeout=10))) == (
        grpc.StatusCode.INVALID_ARGUMENT)
    raw = worker.channel.unary_stream("/vllm.grpc.engine.VllmEngine/Generate")
    assert code_of(lambda: list(raw(b"\x0a\xff\xff", timeout=10))) == (
        grpc.StatusCode.INVALID_ARGUMENT)


def test_truncate_prompt_tokens_keeps_the_tail(worker, prompt_ids) -> None:
    _, c = generate(worker, prompt_ids, temperature=0.0, max_tokens=1, truncate_prompt_tokens=3)
    assert c.prompt_tokens == 3
    # -1: as many as leave room for max_tokens (it kept max_model_len, and was then refused)
    long = (prompt_ids * (MAX_MODEL_LEN // len(prompt_ids) + 2))[: MAX_MODEL_LEN + 50]
    _, c = generate(worker, long, temperature=0.0, max_tokens=4, truncate_prompt_tokens=-1)
    assert c.prompt_tokens == MAX_MODEL_LEN - 4


def _long_stream(w: Worker, prompt_ids: list[int], rid: str):
    return w.vllm.Generate(vpb.GenerateRequest(
        request_id=rid, tokenized=vpb.TokenizedInput(input_ids=prompt_ids),
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True),
        stream=True), timeout=TIMEOUT)


def test_abort_and_cancel_free_every_block(worker, prompt_ids) -> None:
    call = _long_stream(worker, prompt_ids, "vllm-abort-me")
    first = next(call)
    assert first.HasField("chunk")
    worker.vllm.Abort(vpb.AbortRequest(request_ids=["vllm-abort-me", "nope"]), timeout=10)
    rest = list(call)
    assert rest[-1].complete.finish_reason == "abort"
    wait_until(lambda: blocks_all_free(worker), what="blocks freed after Abort")

    call = _long_stream(worker, prompt_ids, "vllm-cancel-me")
    next(call), next(call)
    call.cancel()
    wait_until(lambda: blocks_all_free(worker), what="blocks freed after cancel")


# ----- management RPCs ------------------------------------------------------------------------


def test_health_model_and_server_info(worker) -> None:
    h = worker.vllm.HealthCheck(vpb.HealthCheckRequest(), timeout=5)
    assert h.healthy, h.message
    ours = worker.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    info = worker.vllm.GetModelInfo(vpb.GetModelInfoRequest(), timeout=5)
    assert info.served_model_name == ours.model_name
    assert info.max_context_length == MAX_MODEL_LEN == ours.max_model_len
    assert info.vocab_size == ours.vocab_size == 49152
    assert list(info.eos_token_ids) == list(ours.eos_token_ids)
    assert info.is_generation and not info.supports_vision
    assert info.model_path.endswith(".gguf") and info.architectures == [ours.architecture]

    server = worker.vllm.GetServerInfo(vpb.GetServerInfoRequest(), timeout=5)
    assert server.block_size == ours.kv_block_size == 16
    assert server.max_num_seqs == 64 and server.model_dtype == "torch.float32"
    assert server.active_requests == 0 and not server.is_paused
    assert 0 < server.uptime_seconds < 3600 and server.data_parallel_size == 1


def test_get_loads_matches_our_get_load_when_idle(worker) -> None:
    wait_until(lambda: blocks_all_free(worker), what="idle")
    ours = worker.stub.GetLoad(pb.GetLoadRequest(), timeout=5)
    resp = worker.vllm.GetLoads(vpb.GetLoadsRequest(include=["core"]), timeout=5)
    assert resp.dp_rank_count == 1 and len(resp.loads) == 1
    load = resp.loads[0]
    assert (load.num_running_reqs, load.num_waiting_reqs) == (ours.num_running, ours.num_waiting)
    assert load.max_total_num_tokens == ours.num_total_blocks * 16
    assert load.num_used_tokens == (ours.num_total_blocks - ours.num_free_blocks) * 16 == 0
    assert load.token_usage == pytest.approx(ours.kv_cache_usage) == 0.0
    assert load.gen_throughput == pytest.approx(ours.tokens_per_second, rel=0.5, abs=1.0)
    assert 0.0 < load.cache_hit_rate <= 1.0  # the repeated prompt above hit
    assert load.max_running_requests == 64


def test_flush_cache(worker, prompt_ids) -> None:
    wait_until(lambda: blocks_all_free(worker), what="idle")
    ok = worker.vllm.FlushCache(common_pb2.FlushCacheRequest(), timeout=10)
    assert ok.success, ok.message
    # Busy: refused (success false) while a request holds blocks, then fine once it is gone.
    call = _long_stream(worker, prompt_ids, "vllm-flush-busy")
    next(call)
    busy = worker.vllm.FlushCache(common_pb2.FlushCacheRequest(), timeout=10)
    assert not busy.success and "in flight" in busy.message
    call.cancel()
    waited = worker.vllm.FlushCache(common_pb2.FlushCacheRequest(timeout_s=20), timeout=30)
    assert waited.success, waited.message


def test_get_tokenizer_bundle(worker, tok) -> None:
    chunks = list(worker.vllm.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=60))
    assert len(chunks) > 1 and all(c.sha256 == "" for c in chunks[:-1])
    data = b"".join(c.data for c in chunks)
    assert hashlib.sha256(data).hexdigest() == chunks[-1].sha256
    files = zipfile.ZipFile(io.BytesIO(data))
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(files.namelist())
    hf = HFTokenizer.from_str(files.read("tokenizer.json").decode())
    for text in (PROMPT, "<|im_start|>user\nHi 12345, héllo 🙂<|im_end|>\n", "  a\n\n\tb  "):
        assert hf.encode(text).ids == tok.encode(text), text
    config = json.loads(files.read("tokenizer_config.json"))
    assert config["chat_template"] == tok.chat_template and "<|im_start|>" in config["chat_template"]
    assert config["eos_token"] == "<|im_end|>" and config["bos_token"] == "<|im_start|>"
    # Built once: the same bytes again.
    again = list(worker.vllm.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=60))
    assert again[-1].sha256 == chunks[-1].sha256


def test_unimplemented_rpcs(worker) -> None:
    for call in (lambda: worker.vllm.Embed(vpb.EmbedRequest(), timeout=5),
                 lambda: worker.vllm.StartProfile(common_pb2.StartProfileRequest(), timeout=5),
                 lambda: worker.vllm.StopProfile(common_pb2.StopProfileRequest(), timeout=5)):
        assert code_of(call) == grpc.StatusCode.UNIMPLEMENTED


# ----- KV events ------------------------------------------------------------------------------


class Subscriber:
    """SubscribeKvEvents read by a thread into a queue."""

    def __init__(self, w: Worker, **fields) -> None:
        self.call = w.vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(**fields),
                                             timeout=TIMEOUT)
        self.batches: queue.Queue[common_pb2.KvEventBatch] = queue.Queue()
        self.error: grpc.RpcError | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.batches.put(batch)
        except grpc.RpcError as e:
            self.error = e

    def until(self, pred, timeout: float = 20.0) -> list[common_pb2.KvEventBatch]:
        seen, end = [], time.monotonic() + timeout
        while True:
            try:
                batch = self.batches.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no batch matched; stream error: {self.error}") from None
            seen.append(batch)
            if pred(batch):
                return seen


def test_kv_events_stored_and_cleared(worker, tok) -> None:
    wait_until(lambda: blocks_all_free(worker), what="idle")
    sub = Subscriber(worker, load_records_before_first_batch=True)
    try:
        # A load-only record comes first, numbered 0, with the heartbeat's extra figures.
        (hello,) = sub.until(lambda b: True, timeout=5)
        assert hello.load.load_only and hello.sequence_number == 0 and not hello.events
        assert hello.load.max_total_num_tokens > 0 and hello.load.max_running_requests == 64

        ids = tok.encode("Once upon a time, in a kingdom far away, " * 5)[:40]
        assert len(ids) > 32
        generate(worker, ids, temperature=0.0, max_tokens=2)
        seen = sub.until(lambda b: any(e.HasField("stored") for e in b.events))
        batch = seen[-1]
        stored = next(e.stored for e in batch.events if e.HasField("stored"))
        assert batch.sequence_number >= 1 and batch.HasField("load")
        assert not stored.HasField("parent_block_hash")  # the sequence's first block
        blocks = list(stored.blocks)[:2]
        h0 = hash_block(ROOT, ids[:16])
        h1 = hash_block(h0, ids[16:32])
        assert [list(b.token_ids) for b in blocks] == [ids[:16], ids[16:32]]
        assert [b.block_hash for b in blocks] == [to_int64(h0), to_int64(h1)]
        assert all(b.block_size == 16 for b in blocks)

        wait_until(lambda: blocks_all_free(worker), what="idle")
        assert worker.vllm.FlushCache(common_pb2.FlushCacheRequest(), timeout=10).success
        seen += sub.until(lambda b: any(e.HasField("cleared") for e in b.events))
        numbers = [b.sequence_number for b in seen if not b.load.load_only]
        assert numbers == sorted(set(numbers)), numbers
    finally:
        sub.call.cancel()


# ----- --no-kv-events, queue full, draining (dummy weights) ----------------------------------------------------------


def test_small_worker_no_kv_events_queue_full_and_draining() -> None:
    """Dummy weights (no tokenizer), --no-kv-events, one running and one waiting slot."""
    w = Worker("--model", "dummy:smollm2-135m", "--no-kv-events", "--no-reflection",
               "--max-num-seqs", "1", "--max-waiting", "1", "--drain-grace-s", "60")
    try:
        w.wait_ready()
        stub = w.vllm
        sub = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=10)
        assert code_of(lambda: next(sub)) == grpc.StatusCode.UNIMPLEMENTED
        tok_call = stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=10)
        assert code_of(lambda: next(tok_call)) == grpc.StatusCode.FAILED_PRECONDITION
        text = vpb.GenerateRequest(text="hi", sampling_params=vpb.SamplingParams(max_tokens=2))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(text, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tokenizer" in e.value.details()

        def long(rid: str):
            return stub.Generate(vpb.GenerateRequest(
                request_id=rid, tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3, 4]),
                sampling_params=vpb.SamplingParams(max_tokens=1000, ignore_eos=True),
                stream=True), timeout=TIMEOUT)

        running = long("small-running")
        next(running)
        waiting = long("small-waiting")
        wait_until(lambda: w.stub.GetLoad(pb.GetLoadRequest(), timeout=5).num_waiting == 1,
                   what="one waiting request")
        with pytest.raises(grpc.RpcError) as e:
            list(long("small-refused"))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(e.value.trailing_metadata())["retry-after-ms"] == "1000"
        waiting.cancel()

        # Draining (SIGTERM with a request in flight): not healthy, no new work.
        w.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: not stub.HealthCheck(vpb.HealthCheckRequest(), timeout=5).healthy,
                   what="HealthCheck unhealthy while draining")
        with pytest.raises(grpc.RpcError) as e:
            list(long("small-late"))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        running.cancel()
        assert w.proc.wait(60) == 0
    finally:
        w.close()


# ----- pure pieces: the kvcache listener, the hub, health before attach, auth levels ----------


def test_kvcache_records_store_evict_and_clear_until_taken() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    toks = list(range(10))
    h0 = hash_block(ROOT, toks[:4], "salt")
    h1 = hash_block(h0, toks[4:8], "salt")
    assert kv.allocate_slots("a", 10)
    kv.cache_full_blocks("a", [h0, h1], 0, 10, toks, "salt")
    assert kv.take_events() == []  # not recorded until someone will take them
    kv.free("a")
    kv.pool.drop_all_hashes()
    kv.pool.record_events()
    assert kv.allocate_slots("a2", 10)
    kv.cache_full_blocks("a2", [h0, h1], 0, 10, toks, "salt")
    assert kv.take_events() == [BlocksStored((h0, h1), None, tuple(toks[:8]), "salt")]
    assert kv.take_events() == []  # taken once
    kv.free("a2")
    assert kv.allocate_slots("b", 12)  # needs all 3 blocks: both cached ones are evicted
    events = kv.take_events()
    assert all(isinstance(e, BlocksRemoved) for e in events) and len(events) == 2
    assert {e.hashes[0] for e in events} == {h0, h1}
    kv.free("b")
    assert kv.reset_prefix_cache()
    assert kv.take_events() == [AllCleared()]
    kv.check_integrity()


def _load() -> Load:
    return Load(num_running=1, num_waiting=2, num_swapped=0, num_total_blocks=10,
                num_free_blocks=5, block_size=16, kv_cache_usage=0.5, tokens_per_second=3.0,
                prefix_cache_queries=1, prefix_cache_queried_tokens=10,
                prefix_cache_hit_tokens=5, num_preemptions=0, num_steps=1)


def test_hub_drops_a_subscriber_that_falls_behind_and_resumes_from_history() -> None:
    async def scenario() -> None:
        hub = KvEventHub(4, _load, 8, queue_size=2, history_size=8)
        slow = hub.subscribe()
        for i in range(3):  # three engine steps, one batch each
            hub.step(StepOutput(kv_events=[BlocksRemoved((bytes([i]) * 32,))]), 0.0)
            hub.step(StepOutput(), 0.0)  # a step without events sends no batch
        assert hub.sequence == 3
        got = [(await slow.next(1.0)).sequence_number for _ in range(2)]
        assert got == [1, 2]
        with pytest.raises(Overflowed, match="start_sequence_number 3"):
            await slow.next(1.0)
        again = hub.subscribe(start_sequence_number=3)
        batch = await again.next(1.0)
        assert batch.sequence_number == 3 and batch.load.waiting_requests == 2
        assert list(batch.events[0].removed.block_hashes) == [to_int64(bytes([2]) * 32)]
        assert await again.next(0.05) is None  # live from here, nothing more yet

    asyncio.run(scenario())


def test_hash_mapping_is_the_digest_prefix_as_int64() -> None:
    assert to_int64(bytes(32)) == 0
    assert to_int64(b"\xff" * 8 + bytes(24)) == -1
    assert to_int64(b"\x7f" + b"\xff" * 7 + bytes(24)) == 2**63 - 1


def test_health_check_says_loading_and_draining() -> None:
    front = Door(WorkerConfig())
    vllm = VllmEngineServicer(front)

    async def check() -> vpb.HealthCheckResponse:
        return await vllm.HealthCheck(vpb.HealthCheckRequest(), None)

    assert not asyncio.run(check()).healthy
    front.bridge = SimpleNamespace(dead=False, closed=False)
    assert asyncio.run(check()).healthy
    front.draining = True
    assert "draining" in asyncio.run(check()).message


def test_auth_levels_of_the_vllm_methods() -> None:
    base = "/vllm.grpc.engine.VllmEngine/"
    # Abort too: SMG sends it when its client disconnects, holding only the generate token.
    for m in ("Generate", "Abort", "HealthCheck", "GetModelInfo", "GetServerInfo", "GetLoads",
              "GetTokenizer", "SubscribeKvEvents"):
        assert auth.required_level(base + m) == auth.GENERATE, m
    for m in ("FlushCache", "StartProfile", "StopProfile", "Embed"):
        assert auth.required_level(base + m) == auth.ADMIN, m
