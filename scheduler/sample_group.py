"""Parallel samples of one prompt (``n > 1``): the prompt is computed once.

Sample 0 (the leader) is queued, admitted and prefilled like any request. The others (the
followers) wait on the group, holding no blocks, but each holds a seat from the leader's
admission on (`Scheduler` counts `num_unforked` as taken seats). In the step that samples
the leader's first token, the runner samples every follower from the same row of logits
(each with its own parameters: seed + index), and after it the scheduler forks them:

    leader's table     [A  B  C']             C' half full (the prompt's tail)
    fork               every sample holds A, B, C' (one reference each, `KVCacheManager.fork`)
    next write         a sample writing into C' while others still hold it gets a fresh
                       block and a copy of C' first (copy-on-write, a `blocks_to_copy`
                       move); the last holder writes in place

From then on each sample is a request of its own (its own id, blocks, preemption, finish
reason); only the engine's outputs name them by the leader's id and their `index`. A
leader preempted before its first token takes its followers' seats along (they never held
anything). This holds with prefix caching off: the sharing is by reference counts alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from scheduler.request import Request


@dataclass(eq=False)
class SampleGroup:
    samples: list[Request]  # by index; samples[0] is the leader
    forked: bool = False  # the followers were forked (they run on their own since)

    @property
    def leader(self) -> Request:
        return self.samples[0]

    @property
    def followers(self) -> list[Request]:
        return self.samples[1:]

    @property
    def num_unforked(self) -> int:
        """Followers still waiting for the leader's first token (each holds a seat)."""
        return 0 if self.forked else len(self.samples) - 1

    def all_finished(self) -> bool:
        return all(r.is_finished for r in self.samples)


def follower_id(leader_id: str, index: int) -> str:
    """A follower's own request id (the engine's, never on a wire): the leader's id, a NUL
    and the index. No other request's id can be one: `Engine.make_request` refuses a NUL
    (and the door every control character)."""
    return f"{leader_id}\x00{index}"


def make_group(leader: Request) -> SampleGroup:
    """The group of `leader` (n = its `sampling_params.n` > 1): followers are copies of
    it, sample i seeded `seed + i` (vLLM's rule: reproducible, and the samples differ)."""
    p = leader.sampling_params
    assert p.n > 1 and leader.group is None and not leader.output_token_ids
    group = SampleGroup([leader])
    for i in range(1, p.n):
        f = Request(
            request_id=follower_id(leader.request_id, i),
            prompt_token_ids=leader.prompt_token_ids,
            sampling_params=replace(p, seed=None if p.seed is None else p.seed + i),
            eos_token_ids=leader.eos_token_ids,
            arrival_time=leader.arrival_time,
            priority=leader.priority,
            cache_salt=leader.cache_salt,
            lora_name=leader.lora_name,
            lora_key=leader.lora_key,
        )
        f.sample_index = i
        f.group = group
        group.samples.append(f)
    leader.group = group
    return group
