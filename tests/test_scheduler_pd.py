"""Prefill/decode disaggregation in the scheduler and the KV cache, with the fake runner:
the prefill side's pins (tagged prompts only, under a lease, released, expired, claimed
once, never outliving their blocks) and the decode side's admission of a request with a
handoff (blocks allocated, its local prefix taken, the pull's blocks named, a seat taken,
never preempted; after the pull only the last prompt token computed, after a failed pull
the whole prompt). Outputs are compared with the same request computed locally."""

from __future__ import annotations

import pytest

from kvcache import KVCacheManager
from kvcache.pins import PinRefused
from scheduler import Request, RequestStatus, SamplingParams, Scheduler
from scheduler.request import RemoteKV, RemoteKVState
from tests.fake_runner import FakeRunner

BS = 4
KEY = b"k" * 32


def make(num_blocks: int = 64, lease_s: float | None = 30.0, max_num_seqs: int = 8,
         budget: int = 64, max_pinned: int = 0) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(num_blocks, BS)
    sched = Scheduler(kv, max_num_seqs, budget, 512, handoff_lease_s=lease_s,
                      max_pinned_blocks=max_pinned)
    return sched, FakeRunner(BS)


def req(rid: str, prompt: list[int], max_tokens: int = 1, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_ids=(2,), **kw)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + i * 7) % 997 + 3 for i in range(n)]


class ContentRunner(FakeRunner):
    """The fake runner whose KV check compares positions and tokens, not the writer's id
    (for blocks shared through the prefix cache)."""

    def execute(self, output):
        for s in output.scheduled:
            for pos in range(s.start, s.start + s.num_new_tokens):
                slot = s.block_table[pos // BS] * BS + pos % BS
                self.slots[slot] = (s.request_id, pos, s.request.all_token_ids[pos])
            if s.will_sample:
                for pos in range(s.start + s.num_new_tokens):
                    slot = s.block_table[pos // BS] * BS + pos % BS
                    assert self.slots[slot][1:] == (pos, s.request.all_token_ids[pos])
        self.verify_kv = False
        return super().execute(output)


def run(sched: Scheduler, runner: FakeRunner, now: float = 0.0, steps: int = 1000) -> None:
    for _ in range(steps):
        if not (sched.running or sched.waiting or sched.swapped):
            return
        out = sched.schedule(now=now)
        sched.update_from_output(out, runner.execute(out), now=now)
        sched.kv.check_integrity()
    raise AssertionError("did not finish")


# ----- prefill side: pins -------------------------------------------------------------------


@pytest.mark.parametrize("n", [3, 4, 9])  # shorter than a block, one block, a partial third
def test_a_tagged_prompt_pins_its_blocks_until_released(n: int) -> None:
    sched, runner = make()
    tagged = req("t", prompt_of(n), kv_pin_key=KEY)
    plain = req("p", prompt_of(n, 1))
    for r in (tagged, plain):
        sched.add_request(r)
    run(sched, runner)
    assert plain.kv_handoff is None
    pin = tagged.kv_handoff
    assert pin is not None and pin.num_tokens == n and len(pin.blocks) == -(-n // BS)
    kv = sched.kv
    assert kv.blocks_in_use() == len(pin.blocks)  # the plain request's blocks are free
    kv.check_integrity()
    assert kv.handoff_pins.claim(pin.handle, KEY, now=1.0) is pin
    with pytest.raises(PinRefused) as e:  # single use
        kv.handoff_pins.claim(pin.handle, KEY, now=1.0)
    assert e.value.reason == "used"
    assert kv.handoff_pins.release(pin.handle, pulled=True)
    assert kv.blocks_in_use() == len(pin.blocks)  # freed by the engine thread, next
    assert kv.free_pins(now=1.0) == len(pin.blocks)
    assert kv.blocks_in_use() == 0
    kv.check_integrity()
    with pytest.raises(PinRefused) as e:
        kv.handoff_pins.claim(pin.handle, KEY, now=1.0)
    assert e.value.reason == "used"


def test_pins_expire_unless_renewed_and_a_claimed_pin_never_expires() -> None:
    sched, runner = make(lease_s=10.0)
    rs = [req(f"r{i}", prompt_of(6, i), kv_pin_key=KEY) for i in range(3)]
    for r in rs:
        sched.add_request(r)
    run(sched, runner, now=100.0)
    pins = sched.kv.handoff_pins
    a, b, c = (r.kv_handoff for r in rs)
    assert all(p.expires_at == 110.0 for p in (a, b, c))
    assert pins.renew(b.handle, 130.0) is b
    pins.claim(c.handle, KEY, now=105.0)
    assert pins.next_expiry() == 110.0
    sched.kv.free_pins(now=111.0)
    assert pins.num_expired == 1 and pins.num_live == 2
    with pytest.raises(PinRefused) as e:
        pins.claim(a.handle, KEY, now=111.0)
    assert e.value.reason == "expired"
    sched.kv.free_pins(now=1000.0)  # b expires; c is being pulled
    assert pins.num_live == 1 and sched.kv.blocks_in_use() == len(c.blocks)
    pins.release(c.handle, pulled=True)
    sched.kv.free_pins(now=1000.0)
    assert sched.kv.blocks_in_use() == 0
    sched.kv.check_integrity()


def test_a_wrong_key_or_an_unknown_handle_reads_nothing_and_leaves_the_pin() -> None:
    sched, runner = make()
    r = req("r", prompt_of(8), kv_pin_key=KEY)
    sched.add_request(r)
    run(sched, runner)
    pins = sched.kv.handoff_pins
    with pytest.raises(PinRefused) as e:
        pins.claim(r.kv_handoff.handle, b"x" * 32, now=0.0)
    assert e.value.reason == "key"
    with pytest.raises(PinRefused) as e:
        pins.claim(pins.new_handle(), KEY, now=0.0)
    assert e.value.reason == "unknown"
    assert pins.claim(r.kv_handoff.handle, KEY, now=0.0) is r.kv_handoff  # still there


def test_aborted_failed_and_parallel_tagged_requests_pin_nothing() -> None:
    sched, runner = make()
    aborted = req("a", prompt_of(8), max_tokens=4, kv_pin_key=KEY)
    sched.add_request(aborted)
    out = sched.schedule(now=0.0)
    sched.update_from_output(out, runner.execute(out), now=0.0)
    sched.abort_requests(["a"])
    failed = req("f", prompt_of(8, 2), max_tokens=4, kv_pin_key=KEY)
    sched.add_request(failed)
    out = sched.schedule(now=0.0)
    sched.update_from_output(out, runner.execute(out), now=0.0)
    sched.finish_requests(["f"], RequestStatus.FINISHED_ERROR)
    assert aborted.kv_handoff is None and failed.kv_handoff is None
    assert sched.kv.blocks_in_use() == 0
    sched.kv.check_integrity()


def test_pins_stop_at_the_limit_and_without_a_lease_nothing_pins() -> None:
    sched, runner = make(max_pinned=5)
    rs = [req(f"r{i}", prompt_of(8, i), kv_pin_key=KEY) for i in range(4)]  # 2 blocks each
    for r in rs:
        sched.add_request(r)
    run(sched, runner)
    assert [r.kv_handoff is not None for r in rs] == [True, True, False, False]
    sched, runner = make(lease_s=None)
    r = req("r", prompt_of(8), kv_pin_key=KEY)
    sched.add_request(r)
    run(sched, runner)
    assert r.kv_handoff is None and sched.kv.blocks_in_use() == 0


# ----- decode side: admission of a request with a handoff ----------------------------------


def remote_req(rid: str, prompt: list[int], max_tokens: int = 6) -> Request:
    return req(rid, prompt, max_tokens, remote_kv=RemoteKV(len(prompt)))


def pull(runner: FakeRunner, r: Request) -> None:
    """What a successful pull leaves: the wanted positions' keys and values in the named
    blocks (the fake cache's entries)."""
    remote = r.remote_kv
    for pos in range(remote.num_local_tokens, remote.num_tokens_wanted):
        block = remote.block_ids[pos // BS - remote.first_block]
        runner.slots[block * BS + pos % BS] = (r.request_id, pos, r.all_token_ids[pos])


def local_output(prompt: list[int], rid: str, max_tokens: int = 6) -> list[int]:
    sched, runner = make()
    r = req(rid, prompt, max_tokens)
    sched.add_request(r)
    run(sched, runner)
    return r.output_token_ids


@pytest.mark.parametrize("n", [3, 4, 5, 17])
def test_a_pulled_prompt_computes_only_its_last_token(n: int) -> None:
    sched, runner = make()
    prompt = prompt_of(n)
    r = remote_req("d", prompt)
    sched.add_request(r)
    out = sched.schedule(now=0.0)
    assert out.scheduled == [] and out.remote_kv == [r]
    remote = r.remote_kv
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV and remote.state is RemoteKVState.PULLING
    assert remote.num_tokens_wanted == n - 1 and remote.first_block == 0
    assert len(remote.block_ids) == -(-(n - 1) // BS)
    assert sched.kv.block_table("d")[: len(remote.block_ids)] == remote.block_ids
    assert sched._num_seats() == 1
    out = sched.schedule(now=0.0)  # nothing runs while it pulls
    assert out.scheduled == [] and out.remote_kv == []
    pull(runner, r)
    sched.remote_kv_done(r, ok=True)
    assert r.num_computed_tokens == n - 1 and r.num_cached_tokens == n - 1
    before = runner.num_tokens_computed
    run(sched, runner)
    assert runner.num_tokens_computed - before == 1 + 5  # the last prompt token, 5 decodes
    assert r.output_token_ids == local_output(prompt, "d")
    assert remote.num_pulled_tokens == n - 1
    sched.kv.check_integrity()
    # Its full blocks were entered in the prefix cache as if computed here.
    assert sched.kv.num_cached_blocks >= (n - 1) // BS


def test_a_failed_pull_computes_the_whole_prompt_locally() -> None:
    sched, runner = make()
    prompt = prompt_of(13)
    r = remote_req("d", prompt)
    sched.add_request(r)
    sched.schedule(now=0.0)
    # A partial write is left in the blocks: it is computed over before anything reads it.
    runner.slots[r.remote_kv.block_ids[0] * BS] = ("garbage", 0, 0)
    sched.remote_kv_done(r, ok=False, reason="expired")
    assert r.remote_kv.state is RemoteKVState.FAILED and r.num_computed_tokens == 0
    before = runner.num_tokens_computed
    run(sched, runner)
    assert runner.num_tokens_computed - before == 13 + 5
    assert r.output_token_ids == local_output(prompt, "d")


def test_a_prefix_cached_here_is_not_pulled_again() -> None:
    sched, _ = make()
    runner = ContentRunner(BS)  # the prefix is shared: its entries name the first writer
    shared = prompt_of(8, 5)
    first = req("first", [*shared, 7, 8, 9])
    sched.add_request(first)
    run(sched, runner)
    prompt = shared + prompt_of(10, 6)  # 18 tokens: blocks 0, 1 cached here
    r = remote_req("d", prompt)
    sched.add_request(r)
    out = sched.schedule(now=0.0)
    remote = r.remote_kv
    assert out.remote_kv == [r] and remote.num_local_tokens == 8 and remote.first_block == 2
    assert r.num_computed_tokens == 8
    assert remote.block_ids == sched.kv.block_table("d")[2:5]  # positions 8..16
    pull(runner, r)
    table = sched.kv.block_table("d")
    for pos in range(17):  # the context it will read: the cached prefix, then the pull's
        slot = table[pos // BS] * BS + pos % BS
        assert runner.slots[slot][1:] == (pos, prompt[pos])
    sched.remote_kv_done(r, ok=True)
    run(sched, runner)
    assert remote.num_pulled_tokens == 17 - 8
    assert r.output_token_ids == local_output(prompt, "d")


def test_a_prompt_cached_here_whole_skips_its_handoff() -> None:
    sched, _ = make()
    runner = ContentRunner(BS)
    prompt = prompt_of(13, 3)  # its three full blocks cached: all the handoff would bring
    first = req("first", prompt)
    sched.add_request(first)
    run(sched, runner)
    r = remote_req("d", prompt)
    sched.add_request(r)
    out = sched.schedule(now=0.0)
    assert out.remote_kv == [r] and r.remote_kv.state is RemoteKVState.SKIPPED
    assert r.status is RequestStatus.RUNNING and [s.request for s in out.scheduled] == [r]
    sched.update_from_output(out, runner.execute(out), now=0.0)
    run(sched, runner)
    assert r.output_token_ids == local_output(prompt, "d")


def test_an_aborted_pull_frees_its_blocks() -> None:
    sched, _ = make()
    r = remote_req("d", prompt_of(20))
    sched.add_request(r)
    sched.schedule(now=0.0)
    assert sched.kv.blocks_in_use() == 5
    assert sched.abort_requests(["d"]) == [r]
    assert r.status is RequestStatus.FINISHED_ABORTED and not sched.pulling
    assert sched.kv.blocks_in_use() == 0 and not sched.has_unfinished_requests()
    sched.kv.check_integrity()


def test_a_pulling_request_is_never_preempted_and_waits_for_blocks_in_turn() -> None:
    # 12 blocks of 4: a running request grows into the last free blocks; the pulling one's
    # blocks are not taken from it (the runner preempts itself instead).
    sched, runner = make(num_blocks=12, budget=64)
    runner_req = req("run", prompt_of(4, 1), max_tokens=30)
    sched.add_request(runner_req)
    out = sched.schedule(now=0.0)
    sched.update_from_output(out, runner.execute(out), now=0.0)
    r = remote_req("d", prompt_of(20, 2))  # 5 blocks
    sched.add_request(r)
    out = sched.schedule(now=0.0)
    sched.update_from_output(out, runner.execute(out), now=0.0)
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV
    for _ in range(40):
        out = sched.schedule(now=0.0)
        sched.update_from_output(out, runner.execute(out), now=0.0)
        assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV
        assert "d" not in out.preempted_ids
        sched.kv.check_integrity()
    assert runner_req.num_preemptions >= 1  # it gave way, not the pull
    # A second handoff waits for blocks: nobody skips ahead of it.
    later = remote_req("later", prompt_of(20, 3))
    sched.add_request(later)
    out = sched.schedule(now=0.0)
    assert later.status is RequestStatus.WAITING and later.remote_kv.state is RemoteKVState.PENDING
    pull(runner, r)
    sched.remote_kv_done(r, ok=True)
    run(sched, runner)
    assert later.remote_kv.state is not RemoteKVState.PENDING
    sched.kv.check_integrity()


def test_a_received_request_recomputes_after_preemption_with_the_same_output() -> None:
    sched, runner = make(num_blocks=12, budget=64)
    prompt = prompt_of(17, 4)
    r = remote_req("d", prompt, max_tokens=12)
    sched.add_request(r)
    sched.schedule(now=0.0)
    pull(runner, r)
    sched.remote_kv_done(r, ok=True)
    out = sched.schedule(now=0.0)
    sched.update_from_output(out, runner.execute(out), now=0.0)
    # A more urgent request displaces it: it recomputes its whole prompt, correctly.
    urgent = req("u", prompt_of(30, 9), max_tokens=4, priority=-1)
    sched.add_request(urgent)
    run(sched, runner)
    assert r.num_preemptions >= 1
    assert r.output_token_ids == local_output(prompt, "d", 12)
    sched.kv.check_integrity()
