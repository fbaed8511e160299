"""Prefill/decode disaggregation between real worker processes, without a gateway: the
test plays SMG's part of vLLM's sequential protocol (the prefill leg with max_tokens 1 and
{"do_remote_decode": true}, its GenerateComplete's kv_transfer_params_json copied verbatim
into the decode leg), and hostile clients' parts.

Workers: a prefill P (kv_producer, 3 s leases), a decode D (kv_consumer trusting P and one
more address, with n-gram speculation), a decode D16 (kv_consumer with a float16 cache);
and, in one test, a second prefill that drains and is then killed. Every figure asserted
is a worker's own counter (GetServerStatus, /metrics); at the end each worker stops
gracefully and its block accounting must hold (`check_integrity`, every block free).
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from llmworker.v1 import kv_transfer_pb2 as kpb
from llmworker.v1 import kv_transfer_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from tests.pd_helpers import (
    CONSUMER,
    LEASE_S,
    PRODUCER,
    delta,
    figures,
    free_port,
    settled,
    status,
    stop_and_check,
)
from tests.test_server import Worker

pytestmark = pytest.mark.slow

TAG = '{"do_remote_decode":true,"do_remote_prefill":false}'
TIMEOUT = 120


LATE_PORT = free_port()  # where the drained-then-killed prefill listens (D trusts it)
METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[Worker, Worker, Worker]]:
    p = Worker(*PRODUCER)
    started = [p]
    try:
        m = p.wait_for(r"listening on (\S+):(\d+)")
        peers = (f"{m.group(1)}:{m.group(2)}", f"127.0.0.1:{LATE_PORT}")
        d = Worker(*CONSUMER, "--kv-transfer-peers", *peers, "--metrics-port", str(METRICS_PORT),
                   "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                   '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
        started.append(d)
        d16 = Worker(*CONSUMER, "--kv-transfer-peers", peers[0], "--kv-cache-dtype", "float16")
        started.append(d16)
        for w in started:
            w.wait_ready()
        yield p, d, d16
        stop_and_check(*started)
    finally:
        for w in started:
            w.close()


# ----- helpers ------------------------------------------------------------------------------


def ids_of(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 40000 + 100 for i in range(n)]


def vgen(w: Worker, ids: list[int], kv: str | None = None, *, max_tokens: int = 12,
         stream: bool = False, rid: str = "", timeout: float = TIMEOUT,
         **sampling) -> tuple[list[int], vpb.GenerateComplete]:
    """One vLLM-protocol Generate: (the streamed tokens, or the complete's), the complete."""
    sampling.setdefault("temperature", 0.0)
    sp = vpb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    req = vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids),
                              sampling_params=sp, stream=stream)
    if kv is not None:
        req.kv_transfer_params_json = kv
    streamed, complete = [], None
    for resp in w.vllm.Generate(req, timeout=timeout):
        if resp.HasField("chunk"):
            streamed += resp.chunk.token_ids
        else:
            complete = resp.complete
    assert complete is not None
    return (streamed if stream else list(complete.output_ids)), complete


def handoff(p: Worker, ids: list[int], rid: str = "") -> str:
    """The prefill leg as SMG sends it; the handoff its complete carries."""
    _, c = vgen(p, ids, TAG, max_tokens=1, rid=rid)
    assert c.HasField("kv_transfer_params_json"), "a tagged prefill gave no handoff"
    return c.kv_transfer_params_json


def forged(text: str, **changes) -> str:
    d = json.loads(text)
    for key, value in changes.items():
        if key in d["llm_worker"]:
            d["llm_worker"][key] = value
        else:
            d[key] = value
    return json.dumps(d)


def flush(w: Worker) -> None:
    """Empty `w`'s prefix cache (FlushCache), so that a prompt is pulled again."""
    assert w.vllm.FlushCache(common_pb2.FlushCacheRequest(timeout_s=5), timeout=10).success


# ----- the handoff works, and its output is one worker's --------------------------------


@pytest.mark.parametrize("n", [5, 16, 17, 300])  # under a block, one block, one more, many
def test_a_handed_off_prompt_decodes_as_one_worker_alone(workers, n: int) -> None:
    p, d, _ = workers
    ids = ids_of(n, seed=n)
    alone, _ = vgen(p, ids)
    before_d, before_p = figures(d), figures(p)
    out, c = vgen(d, ids, handoff(p, ids))
    assert out == alone
    assert c.prompt_tokens == n and c.cached_tokens == n - 1  # as vLLM: external counts
    got = delta(figures(d), before_d)
    # Computed here: the last prompt token only; the rest came over the wire.
    assert got == {"pulls": 1, "pulled_blocks": -(-(n - 1) // 16),
                   "source:local_compute": 1, "source:external_kv_transfer": n - 1}, got
    got = delta(figures(p), before_p)
    assert (got["handoffs"], got["pins_pulled"]) == (1, 1), got
    # Streamed, a second time: the prefix cache here has the prompt's full blocks now; only
    # what they do not hold is pulled, or nothing (the handoff released unpulled).
    before_d, before_p = figures(d), figures(p)
    streamed, _ = vgen(d, ids, handoff(p, ids), stream=True)
    assert streamed == alone
    got = delta(figures(d), before_d)
    local = n - 1 if n % 16 == 0 else n // 16 * 16
    if local >= n - 1:
        assert got == {"skipped": 1, "source:local_cache_hit": n - 1,
                       "source:local_compute": 1}, got
    else:
        want = {"pulls": 1, "pulled_blocks": -(-(n - 1) // 16) - local // 16,
                "source:local_compute": 1, "source:external_kv_transfer": n - 1 - local}
        assert got == want | ({"source:local_cache_hit": local} if local else {}), got
    settled(p, d)
    got = delta(figures(p), before_p)
    assert got.get("pins_released" if local >= n - 1 else "pins_pulled") == 1, got


def test_a_prefix_cached_on_the_decode_pulls_only_the_rest(workers) -> None:
    p, d, _ = workers
    shared = ids_of(64, seed=11)
    vgen(d, [*shared, 5, 6, 7], max_tokens=2)  # the first 4 blocks now cached on D
    ids = [*shared, *ids_of(40, seed=12)]
    alone, _ = vgen(p, ids)
    before = figures(d)
    out, _ = vgen(d, ids, handoff(p, ids))
    assert out == alone
    got = delta(figures(d), before)
    assert got["pulled_blocks"] == -(-103 // 16) - 4, got
    assert got["source:local_cache_hit"] == 64 and got["source:external_kv_transfer"] == 39
    assert got["source:local_compute"] == 1
    settled(p, d)


def test_untagged_and_parallel_prefills_pin_nothing(workers) -> None:
    p, _, _ = workers
    before = figures(p)
    _, c = vgen(p, ids_of(40, 3), max_tokens=1)
    assert not c.HasField("kv_transfer_params_json")
    resps = list(p.vllm.Generate(vpb.GenerateRequest(
        tokenized=vpb.TokenizedInput(input_ids=ids_of(40, 4)), kv_transfer_params_json=TAG,
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=3, n=2, ignore_eos=True)),
        timeout=TIMEOUT))
    completes = [r.complete for r in resps if r.HasField("complete")]
    assert len(completes) == 2 and not any(c.HasField("kv_transfer_params_json")
                                           for c in completes)
    assert completes[0].output_ids == completes[1].output_ids  # greedy samples agree
    got = delta(figures(p), before)
    assert "handoffs" not in got and "handoffs_refused" not in got, got
    settled(p)


def test_n_gram_speculation_and_structured_output_on_the_decode(workers) -> None:
    p, d, _ = workers
    text_ids = ids_of(24, 5) * 3  # repeats: the n-gram proposer finds drafts
    alone, _ = vgen(p, text_ids, max_tokens=24)
    out, c = vgen(d, text_ids, handoff(p, text_ids), max_tokens=24)
    assert out == alone and c.spec_draft_tokens > 0
    regex = "(yes|no)[0-9]{3}"
    alone, ca = vgen(p, ids_of(30, 6), max_tokens=8, regex=regex)
    out, cd = vgen(d, ids_of(30, 6), handoff(p, ids_of(30, 6)), max_tokens=8, regex=regex)
    assert out == alone and ca.finish_reason == cd.finish_reason
    settled(p, d)


def test_a_hundred_requests_in_rounds_leave_no_pin(workers) -> None:
    p, d, _ = workers
    prompts = [ids_of(20 + i % 37, seed=100 + i) for i in range(100)]
    alone = {i: vgen(p, prompts[i], max_tokens=3)[0] for i in range(0, 100, 10)}
    before = figures(d)

    def one(i: int) -> list[int]:
        ids = prompts[i]
        return vgen(d, ids, handoff(p, ids, rid=f"c{i}"), max_tokens=3, rid=f"c{i}")[0]

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        outs = list(pool.map(one, range(100)))
    assert {i: outs[i] for i in alone} == alone
    got = delta(figures(d), before)
    assert got["pulls"] == 100 and not any(k.startswith("fallback") for k in got), got
    settled(p, d)


# ----- handoffs that cannot be used: computed here, counted by reason ----------------------


def test_expired_reused_unknown_and_foreign_handles_fall_back(workers) -> None:
    p, d, _ = workers
    ids = ids_of(50, 21)
    alone, _ = vgen(p, ids)
    before = figures(d)
    h = handoff(p, ids)
    time.sleep(LEASE_S + 1.5)  # P frees it at its lease's end
    assert vgen(d, ids, h)[0] == alone
    flush(d)
    h = handoff(p, ids)
    assert vgen(d, ids, h)[0] == alone  # pulled
    flush(d)
    assert vgen(d, ids, h)[0] == alone  # the same handle again: single use
    flush(d)
    assert vgen(d, ids, forged(h, handle="A" * 43))[0] == alone
    flush(d)
    nixl = json.loads(h)
    del nixl["llm_worker"]  # a real NIXL prefill's handoff
    assert vgen(d, ids, json.dumps(nixl))[0] == alone
    got = delta(figures(d), before)
    assert {k: v for k, v in got.items() if k.startswith("fallback")} == {
        "fallback:expired": 1, "fallback:used": 1, "fallback:unknown": 1,
        "fallback:foreign_handoff": 1}, got
    assert got["pulls"] == 1
    assert figures(p)["pins_expired"] >= 1
    settled(p, d)


def test_another_prompts_handle_reads_nothing(workers) -> None:
    p, d, _ = workers
    mine, theirs = ids_of(40, 31), ids_of(40, 32)  # the same length: the counts agree
    h = handoff(p, theirs)
    alone, _ = vgen(p, mine)
    before = figures(d)
    assert vgen(d, mine, h)[0] == alone  # refused by P (key): computed here
    assert delta(figures(d), before) == {"fallback:key": 1, "source:local_compute": 40}
    # The rightful prompt still pulls it: a wrong key does not use the handle up.
    assert vgen(d, theirs, h)[0] == vgen(p, theirs)[0]
    settled(p, d)


def test_mismatched_dtype_and_block_size_fall_back(workers) -> None:
    p, d, d16 = workers
    ids = ids_of(60, 41)
    local16, _ = vgen(d16, ids)
    before = figures(d16)
    assert vgen(d16, ids, handoff(p, ids))[0] == local16  # the handoff says float32
    flush(d16)
    # A handoff that lies about its dtype: P refuses to send float32 blocks to float16.
    assert vgen(d16, ids, forged(handoff(p, ids), kv_cache_dtype="float16"))[0] == local16
    got = delta(figures(d16), before)
    assert got["fallback:dtype"] == 2 and "pulls" not in got, got
    before = figures(d)
    alone, _ = vgen(p, ids)
    assert vgen(d, ids, forged(handoff(p, ids), block_size=32))[0] == alone
    assert delta(figures(d), before)["fallback:block_size"] == 1
    settled(p, d, d16)


def test_an_abort_during_the_pull_frees_both_sides(workers) -> None:
    p, d, _ = workers
    for i in range(2):
        ids = ids_of(1000, 50 + i)  # ~45 MB of keys and values: the pull takes a while
        h = handoff(p, ids)
        req = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=ids),
                                  kv_transfer_params_json=h, stream=True,
                                  sampling_params=vpb.SamplingParams(temperature=0.0,
                                                                     max_tokens=100))
        call = d.vllm.Generate(req, timeout=TIMEOUT)
        time.sleep(0.005 * i)
        call.cancel()
        settled(p, d)
    assert figures(d).get("fallback:error", 0) == 0


# ----- a prefill that drains, then dies -----------------------------------------------------


def test_a_draining_prefill_serves_its_pins_and_a_killed_one_falls_back(workers) -> None:
    _, d, _ = workers
    late = Worker(*PRODUCER[:2], "--kv-transfer-lease-s", "60", "--port", str(LATE_PORT))
    try:
        late.wait_ready()
        a, b = ids_of(45, 61), ids_of(45, 62)
        alone_a, alone_b = vgen(late, a)[0], vgen(late, b)[0]
        ha, hb = handoff(late, a), handoff(late, b)
        late.proc.send_signal(signal.SIGTERM)  # drains: waits for its pins
        late.wait_for(r"waiting for 2 KV handoffs")
        before = figures(d)
        assert vgen(d, a, ha)[0] == alone_a
        assert delta(figures(d), before).get("pulls") == 1
        late.proc.kill()  # between its answer and the pull of b
        late.proc.wait(30)
        t0 = time.monotonic()
        assert vgen(d, b, hb)[0] == alone_b
        assert time.monotonic() - t0 < 30
        assert delta(figures(d), before).get("fallback:peer_unavailable") == 1
        settled(d)
    finally:
        late.close()


# ----- hostile handoffs --------------------------------------------------------------------


def test_a_host_outside_the_trusted_peers_is_never_connected_to(workers) -> None:
    p, d, _ = workers
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.settimeout(1.0)
    connected = []

    def watch() -> None:
        try:
            connected.append(trap.accept())
        except OSError:
            pass

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    ids = ids_of(33, 71)
    before = figures(d)
    h = forged(handoff(p, ids), remote_port=trap.getsockname()[1])
    assert vgen(d, ids, h)[0] == vgen(p, ids)[0]
    assert vgen(d, ids, forged(h, remote_host="169.254.169.254", remote_port=80))[0]
    t.join(3)
    trap.close()
    assert connected == [], "the decode connected to an address it does not trust"
    assert delta(figures(d), before)["fallback:untrusted_peer"] == 2
    settled(p, d)


@pytest.mark.parametrize(("mutate", "says"), [
    # Past --max-message-bytes: gRPC itself refuses it (RESOURCE_EXHAUSTED), before us.
    (lambda d: d.update(remote_block_ids=[list(range(10**6))]), None),
    (lambda d: d.update(padding="x" * (1 << 20)), "at most 65536"),
    (lambda d: d.update(remote_block_ids=[list(range(400))]), "remote_block_ids has 400"),
    (lambda d: d.update(remote_port="50051"), "remote_port must be int"),
    (lambda d: d.update(remote_port=70000), "remote_port must be in"),
    (lambda d: d.update(remote_num_tokens=True), "remote_num_tokens must be int"),
    (lambda d: d.update(do_remote_decode=True), "cannot both be true"),
    (lambda d: d["llm_worker"].update(handle="../../etc"), "handle must be"),
    (lambda d: d["llm_worker"].update(lease_s=float("inf")), "lease_s must be in"),
    (lambda d: d.update(remote_host="a b"), "remote_host must be"),
], ids=["1e6 block ids", "a megabyte", "more ids than blocks", "port type", "port range",
        "bool count", "both legs", "handle", "infinite lease", "host"])
def test_malformed_handoffs_are_refused_naming_the_key(workers, mutate, says) -> None:
    p, d, _ = workers
    ids = ids_of(20, 81)
    h = json.loads(handoff(p, ids))
    mutate(h)
    with pytest.raises(grpc.RpcError) as e:
        vgen(d, ids, json.dumps(h))
    if says is None:
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    else:
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert says in e.value.details(), e.value.details()
    settled(d)


@pytest.mark.parametrize("text", ['[1, 2]', '"x"', "[" * 100_000, "{", '{"do_remote_decode": "yes"}'])
def test_json_that_is_no_handoff_is_refused(workers, text) -> None:
    _, d, _ = workers
    with pytest.raises(grpc.RpcError) as e:
        vgen(d, ids_of(8), text)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "kv_transfer_params_json" in e.value.details()


def test_each_leg_only_where_its_role_is(workers) -> None:
    p, d, _ = workers
    with pytest.raises(grpc.RpcError) as e:
        vgen(d, ids_of(8), TAG, max_tokens=1)
    assert "makes no KV handoffs" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        vgen(p, ids_of(8), handoff(p, ids_of(8)))
    assert "pulls no KV" in e.value.details()
    settled(p)  # the pin of that handoff expires


def test_the_transport_refuses_forged_pulls(workers) -> None:
    p, _, _ = workers
    stub = kv_transfer_pb2_grpc.KVTransferStub(p.channel)

    def code(request) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.PullBlocks(request, timeout=10))
        return e.value.code(), dict(e.value.trailing_metadata()).get("llm-worker-kv-reason")

    h = json.loads(handoff(p, ids_of(40, 91)))["llm_worker"]
    layout = kpb.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16,
                          dtype="float32", model=h["model"])
    base = dict(handle=h["handle"], prompt_digest=b"\0" * 32, layout=layout, num_blocks=3)
    assert code(kpb.PullBlocksRequest(**base)) == (grpc.StatusCode.PERMISSION_DENIED, "key")
    assert code(kpb.PullBlocksRequest(**{**base, "handle": "B" * 43})) == (
        grpc.StatusCode.NOT_FOUND, "unknown")
    assert code(kpb.PullBlocksRequest(**{**base, "prompt_digest": b"x"})) == (
        grpc.StatusCode.INVALID_ARGUMENT, "request")
    odd = kpb.KVLayout(**{**{f.name: getattr(layout, f.name) for f in
                             kpb.KVLayout.DESCRIPTOR.fields}, "block_size": 32})
    assert code(kpb.PullBlocksRequest(**{**base, "layout": odd})) == (
        grpc.StatusCode.FAILED_PRECONDITION, "block_size")
    assert stub.ReleaseBlocks(kpb.ReleaseBlocksRequest(handle=h["handle"]), timeout=10).released
    assert not stub.ReleaseBlocks(kpb.ReleaseBlocksRequest(handle=h["handle"]),
                                  timeout=10).released
    settled(p)


# ----- what the operator sees -------------------------------------------------------------


def test_server_info_and_prometheus(workers) -> None:
    p, d, _ = workers
    info = p.vllm.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10)
    assert (info.kv_connector, info.kv_role) == ("NixlConnector", "kv_producer")
    assert info.kv_engine_id and info.attention_backend == "LLM_WORKER_PAGED"
    assert (info.kv_cache_dtype, info.block_size, info.model_dtype) == ("float32", 16,
                                                                        "torch.float32")
    assert d.vllm.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10).kv_role == "kv_consumer"
    ids = ids_of(70, 99)
    vgen(d, ids, handoff(p, ids))
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read()
    samples = {(smp.name, smp.labels.get("source", smp.labels.get("reason", ""))): smp.value
               for fam in text_string_to_metric_families(text.decode()) for smp in fam.samples}
    st = status(d)
    assert samples[("vllm:prompt_tokens_by_source_total", "external_kv_transfer")] == (
        st.prompt_tokens_by_source["external_kv_transfer"])
    assert samples[("llm_worker:kv_transfer_pulls_total", "")] == st.kv_transfer.pulls >= 1
    assert samples[("llm_worker:kv_transfer_bytes_total", "")] == st.kv_transfer.pulled_bytes
    assert samples[("llm_worker:kv_transfer_seconds_count", "")] == st.kv_transfer.pulls
    for reason, n in st.kv_transfer.fallbacks.items():
        assert samples[("llm_worker:kv_transfer_fallbacks_total", reason)] == n
    assert ("llm_worker:kv_transfer_pinned_blocks", "") in samples
    settled(p, d)


