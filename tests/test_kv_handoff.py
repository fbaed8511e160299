"""The KV handoff's JSON (worker.kv_transfer.handoff) and the cache's blocks as bytes
(worker.kv_transfer.blocks), without a worker: what a prefill writes reads back whole; bad
input is refused naming its key; a handoff this worker cannot use says why; blocks survive
the trip in every cache dtype."""

from __future__ import annotations

import json

import pytest
import torch

from worker.config import BadValue, KVTransferConfig, KVTransferSpec, parse_kv_transfer_config
from worker.kv_transfer import blocks, handoff
from worker.kv_transfer.handoff import BadParams, Layout

LAYOUT = Layout(30, 3, 64, 16, "float32", "c9a2d7ca04770fdb")
PEER = "127.0.0.1:5000"


def built(**kw) -> str:
    args = dict(handle="h" * 43, request_id="r 1", blocks=[3, 4, 9], num_tokens=37,
                layout=LAYOUT, host="127.0.0.1", port=5000, engine_id="e1", lease_s=30.0)
    return handoff.build(**(args | kw))


def test_what_a_prefill_writes_reads_back() -> None:
    p = handoff.parse(built(), max_blocks=128)
    h = p.handoff
    assert not p.remote_decode and not p.foreign and h is not None
    assert (h.address, h.handle, h.num_tokens, h.block_size, h.kv_cache_dtype, h.model) == (
        PEER, "h" * 43, 37, 16, "float32", LAYOUT.model)
    assert handoff.usable(h, LAYOUT, 37, (PEER,)) is None
    d = json.loads(built())  # NIXL's keys, as SMG and vLLM name them
    assert d["do_remote_prefill"] is True and d["remote_block_ids"] == [[3, 4, 9]]
    assert d["tp_size"] == 1 and d["remote_num_tokens"] == 37


def test_the_prefill_tag_and_plain_json() -> None:
    assert handoff.parse('{"do_remote_decode":true,"do_remote_prefill":false}', 8).remote_decode
    assert handoff.parse("{}", 8) == handoff.KVParams()


@pytest.mark.parametrize(("why", "h", "tokens", "peers"), [
    ("untrusted_peer", built(host="10.0.0.9"), 37, (PEER,)),
    ("untrusted_peer", built(port=5001), 37, (PEER,)),
    ("model", built(layout=Layout(30, 3, 64, 16, "float32", "other")), 37, (PEER,)),
    ("block_size", built(layout=Layout(30, 3, 64, 32, "float32", LAYOUT.model)), 37, (PEER,)),
    ("dtype", built(layout=Layout(30, 3, 64, 16, "float16", LAYOUT.model)), 37, (PEER,)),
    ("num_tokens", built(), 38, (PEER,)),
])
def test_an_unusable_handoff_says_why(why, h, tokens, peers) -> None:
    assert handoff.usable(handoff.parse(h, 128).handoff, LAYOUT, tokens, peers) == why


def test_an_ipv6_peer_is_matched_in_brackets() -> None:
    h = handoff.parse(built(host="::1"), 128).handoff
    assert h.address == "[::1]:5000" and handoff.usable(h, LAYOUT, 37, ("[::1]:5000",)) is None


def test_foreign_handoffs_are_named_not_refused() -> None:
    d = json.loads(built())
    del d["llm_worker"]
    assert handoff.parse(json.dumps(d), 128).foreign == "foreign_handoff"
    d = json.loads(built())
    d["tp_size"] = 2
    assert handoff.parse(json.dumps(d), 128).foreign == "tp_size"
    d = json.loads(built())
    d["llm_worker"]["v"] = 2
    assert handoff.parse(json.dumps(d), 128).foreign == "version"


def _with(path: str, value) -> str:
    d = json.loads(built())
    *outer, key = path.split(".")
    target = d
    for k in outer:
        target = target[k]
    target[key] = value
    return json.dumps(d)


@pytest.mark.parametrize(("text", "says"), [
    ("x" * 70_000, "at most 65536"),
    ("[" * 60_000, "not JSON"),
    ("[1]", "must be a JSON object"),
    ('{"do_remote_decode": true, "do_remote_prefill": true}', "cannot both be true"),
    ('{"do_remote_decode": 1}', "do_remote_decode must be bool"),
    (_with("remote_port", "5000"), "remote_port must be int"),
    (_with("remote_port", True), "remote_port must be int"),
    (_with("remote_port", 0), "remote_port must be in"),
    (_with("remote_host", "a\nb"), "remote_host must be"),
    (_with("remote_host", "h" * 300), "remote_host must be"),
    (_with("remote_request_id", "r" * 2000), "remote_request_id is 2000"),
    (_with("remote_block_ids", [list(range(200))]), "remote_block_ids has 200"),
    (_with("remote_block_ids", [[1, -1]]), "block ids"),
    (_with("remote_block_ids", [[1, "2"]]), "block ids"),
    (_with("remote_num_tokens", 0), "remote_num_tokens must be in"),
    (_with("llm_worker", []), "llm_worker must be dict"),
    (_with("llm_worker.handle", "x"), "handle must be"),
    (_with("llm_worker.handle", "a/" * 20), "handle must be"),
    (_with("llm_worker.lease_s", -1), "lease_s must be in"),
    (_with("llm_worker.lease_s", float("nan")), "lease_s must be in"),
    (_with("llm_worker.block_size", None), "without llm_worker.block_size"),
])
def test_malformed_json_is_refused_naming_the_key(text: str, says: str) -> None:
    with pytest.raises(BadParams) as e:
        handoff.parse(text, max_blocks=128)
    assert says in str(e.value) and len(str(e.value)) < 300, str(e.value)


def test_the_prompt_digest_binds_tokens_and_adapter() -> None:
    a = handoff.prompt_digest([1, 2, 3], None)
    assert a == handoff.prompt_digest([1, 2, 3], "")
    assert len({a, handoff.prompt_digest([1, 2, 4], None), handoff.prompt_digest([1, 2], None),
                handoff.prompt_digest([1, 2, 3], "lora")}) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_blocks_survive_the_trip_in_their_dtype(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    src = [(torch.randn(8, 4, 2, 16, generator=g).to(dtype),
            torch.randn(8, 4, 2, 16, generator=g).to(dtype)) for _ in range(2)]
    dst = [(torch.zeros(8, 4, 2, 16, dtype=dtype), torch.zeros(8, 4, 2, 16, dtype=dtype))
           for _ in range(2)]
    for layer in range(2):
        keys, values = blocks.read(src, layer, [5, 1, 6])
        assert len(keys) == 3 * blocks.block_nbytes(src)
        blocks.write(dst, layer, [0, 7, 2], keys, values)
        for s, d in ((5, 0), (1, 7), (6, 2)):
            assert torch.equal(src[layer][0][s], dst[layer][0][d])
            assert torch.equal(src[layer][1][s], dst[layer][1][d])
    assert not dst[0][0][3].any()  # blocks not written stay as they were
    with pytest.raises(ValueError, match="bytes for 2 blocks"):
        blocks.write(dst, 0, [0, 1], keys, values)
    assert list(blocks.runs(7, 3)) == [(0, 3), (3, 3), (6, 1)]


def test_the_kv_transfer_config_reads_vllms_json() -> None:
    spec = parse_kv_transfer_config('{"kv_connector": "GrpcConnector", "kv_role": "kv_both"}')
    assert spec == KVTransferSpec("GrpcConnector", "kv_both") and spec.is_producer
    assert parse_kv_transfer_config("  ") is None
    for text, says in [('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}',
                        "reports itself to SMG as NixlConnector"),
                       ('{"kv_connector": "GrpcConnector", "kv_role": "both"}', "kv_role"),
                       ('{"kv_connector": "GrpcConnector"}', "give kv_connector and kv_role"),
                       ('{"kv_connector": "GrpcConnector", "kv_role": "kv_both", "kv_ip": 1}',
                        "unsupported keys kv_ip"),
                       ('{"kv_connector": "GrpcConnector", "kv_role": "kv_both", '
                        '"kv_load_failure_policy": "fail"}', "recompute"),
                       ("[]", "JSON object")]:
        with pytest.raises(BadValue, match=says):
            parse_kv_transfer_config(text)
    with pytest.raises(ValueError, match="--kv-transfer-peers needs"):
        KVTransferConfig(kv_transfer_peers=("a:1",))
    with pytest.raises(ValueError, match="lease"):
        KVTransferConfig(kv_transfer_lease_s=0)


def test_the_kv_transfer_flags_and_their_variables(monkeypatch) -> None:
    import argparse

    from worker import config as cfgmod

    monkeypatch.setenv("LLMWORKER_KV_TRANSFER_CONFIG",
                       '{"kv_connector": "GrpcConnector", "kv_role": "kv_consumer"}')
    monkeypatch.setenv("LLMWORKER_KV_TRANSFER_PEERS", "10.0.0.1:50051 [::1]:7")
    ap = argparse.ArgumentParser()
    cfgmod.add_arguments(ap)
    kc = cfgmod.from_args(ap.parse_args(["--kv-transfer-lease-s", "5"])).kv_transfer
    assert kc.kv_transfer_config == KVTransferSpec("GrpcConnector", "kv_consumer")
    assert kc.kv_transfer_peers == ("10.0.0.1:50051", "[::1]:7") and kc.kv_transfer_lease_s == 5
    with pytest.raises(SystemExit):
        ap.parse_args(["--kv-transfer-peers", "no-port"])


def test_the_span_shows_the_pull_or_why_there_was_none() -> None:
    from scheduler.request import RemoteKV, RemoteKVState
    from worker.door import _pull_events
    from worker.kv_transfer.client import RemotePull

    class Span:
        def __init__(self) -> None:
            self.events: list[tuple[str, float | None, dict]] = []

        def event(self, name: str, timestamp_s: float | None = None, **attrs) -> None:
            self.events.append((name, timestamp_s, attrs))

    h = handoff.parse(built(), 128).handoff
    pull = RemotePull(h, b"d" * 32, started_at=100.0, ended_at=100.25, num_bytes=4096)
    remote = RemoteKV(37, pull, RemoteKVState.DONE, block_ids=[1, 2, 3], num_pulled_tokens=36)
    span = Span()
    _pull_events(span, remote)
    (start, t0, a0), (end, t1, a1) = span.events
    assert (start, a0) == ("kv_pull_started", {"peer": PEER, "blocks": 3,
                                                "local_prefix_tokens": 0})
    assert (end, a1) == ("kv_pull_ended", {"outcome": "done", "tokens": 36, "bytes": 4096})
    assert abs((t1 - t0) - 0.25) < 1e-6  # back-dated to when the pull ran
    span = Span()
    _pull_events(span, RemoteKV(37, None, RemoteKVState.FAILED, reason="untrusted_peer"))
    assert span.events == [("kv_pull_ended", None, {"outcome": "failed", "tokens": 0,
                                                     "reason": "untrusted_peer"})]
