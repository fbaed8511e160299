"""A fake model runner: deterministic tokens, and a fake KV cache that catches bookkeeping bugs.

The next token depends only on (request_id, position), so a request's output is the same
alone, in any batch and after any preemption, just like greedy decoding of a real model.

With `verify_kv`, the runner also "writes" each computed position into a slot dict through
the step's block table, and before sampling reads the request's whole context back through
it: a block shared by two live requests, a stale block table or a lost chunk shows up as a
wrong entry.
"""

import zlib

from scheduler.output import SchedulerOutput


class FakeRunner:
    def __init__(self, block_size: int, vocab_size: int = 1000, verify_kv: bool = True) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.verify_kv = verify_kv
        self.slots: dict[int, tuple[str, int, int]] = {}  # slot -> (request_id, pos, token)
        self.num_steps = 0
        self.num_tokens_computed = 0

    def token_for(self, request_id: str, position: int) -> int:
        """The token this runner samples for position `position` of `request_id`."""
        return zlib.crc32(f"{request_id}@{position}".encode()) % self.vocab_size

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        """Run one step: returns request_id -> next token for every sampling request."""
        self.num_steps += 1
        bs = self.block_size
        sampled = {}
        for s in output.scheduled:
            rid, tokens = s.request_id, s.request.all_token_ids
            end = s.start + s.num_new_tokens
            assert s.num_new_tokens >= 1 and end <= len(tokens)
            assert s.will_sample == (end == len(tokens))
            assert len(s.block_table) * bs >= end, f"{rid}: block table too short"
            self.num_tokens_computed += s.num_new_tokens
            if self.verify_kv:
                for pos in range(s.start, end):
                    slot = s.block_table[pos // bs] * bs + pos % bs
                    self.slots[slot] = (rid, pos, tokens[pos])
            if not s.will_sample:
                continue
            if self.verify_kv:
                for pos in range(end):
                    slot = s.block_table[pos // bs] * bs + pos % bs
                    got = self.slots.get(slot)
                    assert got == (rid, pos, tokens[pos]), f"{rid}@{pos}: KV slot {slot} has {got}"
            sampled[rid] = self.token_for(rid, end)
        return sampled
