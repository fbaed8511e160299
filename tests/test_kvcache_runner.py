"""`KVRunner`: the fake model runner for prefix caching and swap, and tests of the runner
itself (a checker that cannot fail proves nothing).

`tests.fake_runner.FakeRunner` checks that each slot holds what *this request* wrote
there, which rules out sharing. `KVRunner` checks contents instead: a slot holds
(position, fingerprint of the tokens up to and including it), as a real KV entry depends on
the whole prefix. It makes each step's KV moves exactly as the real runner must (swap-out,
then swap-in, then copies, each one batched gather-then-scatter, all before the forward),
then writes the scheduled positions and reads every request's context back through its
block table. A wrong block table, a shared block written by someone else, a lost swap or
copy, or moves in the wrong order show up as a wrong entry. Sampled tokens come from
`FakeRunner.token_for`, so outputs stay comparable across runs.
"""

import zlib

import pytest

from kvcache import KVCacheManager
from scheduler import Request, SamplingParams, Scheduler, SchedulerOutput
from tests.fake_runner import FakeRunner

Entry = tuple[int, int]  # (position, fingerprint of tokens[0..position])


def fingerprints(tokens: list[int], end: int) -> list[int]:
    fps, fp = [], 0
    for t in tokens[:end]:
        fp = zlib.crc32(t.to_bytes(8, "little"), fp)
        fps.append(fp)
    return fps


class KVRunner(FakeRunner):
    def __init__(self, block_size: int, vocab_size: int = 1000) -> None:
        super().__init__(block_size, vocab_size, verify_kv=False)
        self.gpu: dict[int, Entry] = {}  # slot -> entry
        self.cpu: dict[int, Entry] = {}  # CPU slot -> entry
        self.num_swapped_out = self.num_swapped_in = self.num_copied = 0

    def _move(
        self, src: dict[int, Entry], dst: dict[int, Entry], pairs: list[tuple[int, int]]
    ) -> None:
        """One batched block copy: gather every source, then scatter."""
        bs = self.block_size
        got = [[src.get(s * bs + o) for o in range(bs)] for s, _ in pairs]
        for (_, d), entries in zip(pairs, got, strict=True):
            for o, e in enumerate(entries):
                if e is None:
                    dst.pop(d * bs + o, None)
                else:
                    dst[d * bs + o] = e

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        self.num_steps += 1
        bs = self.block_size
        self._move(self.gpu, self.cpu, output.blocks_to_swap_out)
        self._move(self.cpu, self.gpu, output.blocks_to_swap_in)
        for c, _ in output.blocks_to_swap_in:  # freed after this step: forget the contents
            for o in range(bs):
                self.cpu.pop(c * bs + o, None)
        self._move(self.gpu, self.gpu, output.blocks_to_copy)
        self.num_swapped_out += len(output.blocks_to_swap_out)
        self.num_swapped_in += len(output.blocks_to_swap_in)
        self.num_copied += len(output.blocks_to_copy)

        # The forward: every request writes its new positions, then attention reads back
        # each request's whole context.
        fps = {}
        for s in output.scheduled:
            tokens, end = s.request.all_token_ids, s.start + s.num_new_tokens
            assert s.num_new_tokens >= 1 and end <= len(tokens)
            assert s.will_sample == (end == len(tokens))
            assert len(s.block_table) * bs >= end, f"{s.request_id}: block table too short"
            fps[s.request_id] = fingerprints(tokens, end)
            self.num_tokens_computed += s.num_new_tokens
            for pos in range(s.start, end):
                self.gpu[s.block_table[pos // bs] * bs + pos % bs] = (pos, fps[s.request_id][pos])
        sampled = {}
        for s in output.scheduled:
            fp, end = fps[s.request_id], s.start + s.num_new_tokens
            for pos in range(end):
                slot = s.block_table[pos // bs] * bs + pos % bs
                got = self.gpu.get(slot)
                assert got == (pos, fp[pos]), f"{s.request_id}@{pos}: KV slot {slot} has {got}"
            if s.will_sample:
                sampled[s.request_id] = self.token_for(s.request_id, end)
        return sampled


def run_step(sched: Scheduler, runner: KVRunner, now: float = 0.0) -> SchedulerOutput:
    """One engine iteration, then the integrity checks (GPU and CPU pools)."""
    out = sched.schedule(now=now)
    sched.update_from_output(out, runner.execute(out), now=now)
    sched.kv.check_integrity()
    return out


def drain(sched: Scheduler, runner: KVRunner, now: float = 0.0) -> list[SchedulerOutput]:
    """Step until every request ended; returns the steps' outputs."""
    outs = []
    while sched.has_unfinished_requests():
        outs.append(run_step(sched, runner, now=now + len(outs)))
        assert not outs[-1].is_empty and len(outs) < 100_000
    return outs


def expected_output(runner: FakeRunner, r: Request) -> list[int]:
    """What a lone, never-preempted run of `r` samples."""
    n = r.num_output_tokens
    return [runner.token_for(r.request_id, r.num_prompt_tokens + k) for k in range(n)]


# -- the checker catches what it should ------------------------------------------------------


def _one_step(kv: KVCacheManager, prompt: list[int], rid: str = "a"):
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    r = Request(rid, prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add_request(r)
    return sched, r


def test_runner_accepts_a_correct_run_and_sharing():
    kv = KVCacheManager(16, block_size=4)
    runner = KVRunner(4)
    sched, _ = _one_step(kv, list(range(10)))
    sched.update_from_output(out := sched.schedule(), runner.execute(out))
    b = Request("b", list(range(10)), SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add_request(b)
    out = sched.schedule()
    assert b.num_computed_tokens == 8 and out.scheduled[-1].num_new_tokens == 2
    sched.update_from_output(out, runner.execute(out))


def test_runner_catches_a_wrong_block_table():
    kv = KVCacheManager(16, block_size=4)
    runner = KVRunner(4)
    sched, _ = _one_step(kv, list(range(10)))
    sched.update_from_output(out := sched.schedule(), runner.execute(out))
    out = sched.schedule()
    out.scheduled[0].block_table[0] = 15  # never written
    with pytest.raises(AssertionError, match="a@0"):
        runner.execute(out)


def test_runner_catches_a_shared_prefix_of_other_tokens():
    # Same tokens in block 1, different block 0: the entries differ, as real keys and
    # values would. b overwrites a's block 1 with its own; a reads it back first.
    runner = KVRunner(4)
    kv = KVCacheManager(16, block_size=4)
    sched, _ = _one_step(kv, [9, 9, 9, 9, 4, 5, 6, 7, 1])
    sched.update_from_output(out := sched.schedule(), runner.execute(out))
    table = out.scheduled[0].block_table
    b = Request("b", [0, 0, 0, 0, 4, 5, 6, 7, 2], SamplingParams(max_tokens=2))
    sched.add_request(b)
    out = sched.schedule()
    s = next(s for s in out.scheduled if s.request_id == "b")
    s.block_table[1] = table[1]  # what a hash of the block's own tokens alone would do
    with pytest.raises(AssertionError, match="a@4"):
        runner.execute(out)


def test_runner_catches_a_lost_copy():
    kv = KVCacheManager(16, block_size=4)
    runner = KVRunner(4)
    sched, _ = _one_step(kv, list(range(8)))
    sched.update_from_output(out := sched.schedule(), runner.execute(out))
    b = Request("b", list(range(8)), SamplingParams(max_tokens=2))
    sched.add_request(b)
    out = sched.schedule()
    assert len(out.blocks_to_copy) == 1
    out.blocks_to_copy.clear()
    with pytest.raises(AssertionError, match="b@4"):
        runner.execute(out)
