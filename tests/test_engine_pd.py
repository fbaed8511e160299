"""The engine's part of prefill/decode disaggregation, in process, with two tiny engines:
the prefill's pin holds the prompt's real keys and values, which copied block for block
into the decode's cache (`worker.kv_transfer.blocks`, what the transport streams) give the
same greedy tokens as the prompt computed there; an abort during a pull waits for the pull
thread to let go of the blocks; an engine with only pulls under way sleeps instead of
spinning; pins expire while the engine idles."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from scheduler.request import RemoteKV, RemoteKVState, Request, RequestStatus, SamplingParams
from worker.config import (
    CacheConfig,
    KVTransferConfig,
    KVTransferSpec,
    ModelConfig,
    SchedulerConfig,
    WorkerConfig,
)
from worker.engine import Engine
from worker.kv_transfer import blocks, handoff
from worker.kv_transfer.client import RemotePull
from worker.weights import LoadedModel, _build, dummy


def _tiny_loaded() -> LoadedModel:
    cfg = dataclasses.replace(dummy.SHAPES["smollm2-135m"], vocab_size=512, hidden_size=64,
                              intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=16, max_position_embeddings=512)
    torch.manual_seed(0)
    model = _build(cfg, torch.device("cpu"), torch.float32)
    dummy.init_dummy(model)
    return LoadedModel(model, cfg, None, "tiny", "dummy", model.embed_tokens.weight.device,
                       model.embed_tokens.weight.dtype)


LOADED = None


def engine(role: str, lease_s: float = 30.0) -> Engine:
    global LOADED
    if LOADED is None:
        LOADED = _tiny_loaded()
    conf = WorkerConfig(model=ModelConfig(device="cpu", max_model_len=256, cuda_graphs=False),
                        cache=CacheConfig(kv_cache_memory=0.002),
                        scheduler=SchedulerConfig(max_num_seqs=8),
                        kv_transfer=KVTransferConfig(KVTransferSpec("GrpcConnector", role),
                                                     kv_transfer_lease_s=lease_s))
    return Engine(conf, loaded=LOADED)


class FakePuller:
    """Stands for `KVPuller`: `copy_from` set, a pull copies the prefill's pinned blocks
    into the decode's (what the transport does over the wire) and reports at once; unset,
    it reports only when the test calls `finish`."""

    def __init__(self, eng: Engine, copy_from: Engine | None = None) -> None:
        self.engine, self.source = eng, copy_from
        self.started: list[Request] = []
        self.released: list[RemotePull] = []

    def watch(self, pull: RemotePull) -> None:
        pass

    def start(self, req: Request) -> None:
        self.started.append(req)
        if self.source is not None:
            remote = req.remote_kv
            pin = self.source.kv.handoff_pins.claim(remote.handoff.handoff.handle,
                                                    remote.handoff.digest, time.monotonic())
            src = pin.blocks[remote.first_block:remote.first_block + len(remote.block_ids)]
            for layer in range(len(self.source.runner.kv_caches)):
                keys, values = blocks.read(self.source.runner.kv_caches, layer, src)
                blocks.write(self.engine.runner.kv_caches, layer, remote.block_ids, keys, values)
            self.source.release_pin(pin.handle, pulled=True)
            self.finish(req, True)

    def finish(self, req: Request, ok: bool, reason: str = "") -> None:
        self.engine._pulled(req, ok, reason)

    def release(self, pull: RemotePull) -> None:
        self.released.append(pull)

    def close(self) -> None:
        pass


def fake_puller(eng: Engine, copy_from: Engine | None = None) -> FakePuller:
    assert eng.puller is not None
    eng.puller.close()
    eng.puller = FakePuller(eng, copy_from)
    return eng.puller


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 13 + i * 7) % 500 + 3 for i in range(n)]


def prefill(p: Engine, ids: list[int], rid: str) -> RemotePull:
    req = p.make_request(ids, dataclasses.replace(GREEDY, max_tokens=1), request_id=rid)
    req.kv_pin_key = handoff.prompt_digest(ids, None)
    p.generate([req])
    pin = req.kv_handoff
    assert pin is not None
    h = handoff.Handoff("127.0.0.1", 1, pin.handle, pin.num_tokens, p.kv_layout.block_size,
                        p.kv_layout.dtype, p.kv_layout.model, 30.0)
    return RemotePull(h, req.kv_pin_key)


@pytest.mark.parametrize("n", [7, 16, 40, 130])
def test_pulled_blocks_decode_as_the_prompt_computed_here(n: int) -> None:
    p, d = engine("kv_producer"), engine("kv_consumer")
    puller = fake_puller(d, copy_from=p)
    ids = prompt(n, n)
    alone = d.generate([d.make_request(ids, GREEDY, request_id="alone")])[0].token_ids
    d.reset_prefix_cache()  # the next one must pull, not hit
    d.step()
    req = d.make_request(ids, GREEDY, request_id="pd")
    req.remote_kv = RemoteKV(n, prefill(p, ids, "pf"))
    before = dict(d.prompt_tokens_by_source)
    out = d.generate([req])[0]
    assert out.token_ids == alone
    assert puller.started == [req] and req.remote_kv.state is RemoteKVState.DONE
    assert d.prompt_tokens_by_source["local_compute"] - before["local_compute"] == 1
    assert d.prompt_tokens_by_source["external_kv_transfer"] - before[
        "external_kv_transfer"] == n - 1
    p.step()  # frees the pulled pin
    for e in (p, d):
        e.kv.check_integrity()
        assert e.kv.blocks_in_use() == 0


def test_an_abort_during_a_pull_waits_for_the_pull_thread() -> None:
    p, d = engine("kv_producer"), engine("kv_consumer")
    puller = fake_puller(d)
    ids = prompt(50, 1)
    req = d.make_request(ids, GREEDY, request_id="r")
    req.remote_kv = RemoteKV(50, prefill(p, ids, "pf"))
    d.submit(req)
    d.step()
    assert puller.started == [req] and req.status is RequestStatus.WAITING_FOR_REMOTE_KV
    held = d.kv.blocks_in_use()
    assert held == 4
    d.abort(["r"])
    outs = d.step().outputs
    assert outs == [] and req.remote_kv.handoff.cancelled  # cancelled, not ended yet
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV and d.kv.blocks_in_use() == held
    puller.finish(req, False, "aborted")  # the pull thread lets go
    outs = d.step().outputs
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r", "abort")]
    assert d.kv.blocks_in_use() == 0
    d.kv.check_integrity()


def test_a_failed_pull_computes_the_prompt_and_a_queued_abort_releases_the_handoff() -> None:
    p, d = engine("kv_producer"), engine("kv_consumer")
    puller = fake_puller(d)
    ids = prompt(40, 2)
    alone = d.generate([d.make_request(ids, GREEDY, request_id="alone")])[0].token_ids
    d.reset_prefix_cache()
    d.step()
    req = d.make_request(ids, GREEDY, request_id="r")
    req.remote_kv = RemoteKV(40, prefill(p, ids, "pf"))
    d.submit(req)
    d.step()
    puller.finish(req, False, "peer_unavailable")
    while not req.is_finished:
        d.step()
    assert req.output_token_ids == alone and req.remote_kv.state is RemoteKVState.FAILED
    # A request aborted while still queued (every seat taken) lets the prefill free its
    # handoff at once, not at its lease's end.
    seated = [d.make_request(prompt(10, 3 + i), GREEDY, request_id=f"b{i}") for i in range(8)]
    for b in seated:
        d.submit(b)
    queued = d.make_request(prompt(40, 4), GREEDY, request_id="q")
    queued.remote_kv = RemoteKV(40, prefill(p, prompt(40, 4), "pq"))
    d.submit(queued)
    d.step()
    assert queued.status is RequestStatus.WAITING and puller.started == [req]
    d.abort(["q"])
    d.step()
    assert puller.released == [queued.remote_kv.handoff]
    d.abort([b.request_id for b in seated])
    d.step()
    assert d.kv.blocks_in_use() == 0
    d.kv.check_integrity()


def test_an_engine_with_only_pulls_under_way_sleeps() -> None:
    p, d = engine("kv_producer"), engine("kv_consumer")
    puller = fake_puller(d)
    steps = 0
    real_step = d.step

    def counted():
        nonlocal steps
        steps += 1
        return real_step()

    d.step = counted
    done = threading.Event()
    d.start(lambda s: done.set() if any(o.finished for o in s.outputs) else None)
    try:
        ids = prompt(30, 5)
        req = d.make_request(ids, GREEDY, request_id="r")
        req.remote_kv = RemoteKV(30, prefill(p, ids, "pf"))
        d.submit(req)
        time.sleep(0.6)
        assert puller.started == [req]
        assert steps <= 8, f"{steps} steps while only a pull ran"
        puller.finish(req, False, "timeout")
        assert done.wait(30)
    finally:
        d.shutdown()
    d.kv.check_integrity()


def test_pins_expire_while_the_engine_idles() -> None:
    p = engine("kv_producer", lease_s=0.3)
    p.start(lambda s: None)
    try:
        ids = prompt(40, 6)
        req = p.make_request(ids, dataclasses.replace(GREEDY, max_tokens=1), request_id="t")
        req.kv_pin_key = handoff.prompt_digest(ids, None)
        p.submit(req)
        deadline = time.monotonic() + 30
        while req.kv_handoff is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert req.kv_handoff is not None
        assert p.kv.handoff_pins.num_live == 1
        deadline = time.monotonic() + 5
        while p.kv.handoff_pins.num_blocks() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert p.kv.handoff_pins.num_expired == 1 and p.kv.handoff_pins.num_blocks() == 0
    finally:
        p.shutdown()
    assert p.kv.blocks_in_use() == 0
    p.kv.check_integrity()
