"""How much of one step the prompts being prefilled get (vLLM's partial prefills).

Without limits, the running requests are served first and a long prompt's chunks take
the whole step's budget until it is prefilled: an 8-token request arriving meanwhile waits
for all of it (~10 s for 5,000 tokens on 2 CPU cores). vLLM's three flags share the step:

- `long_prefill_token_threshold` T: a prefill with more than T tokens left to compute is
  *long*. Given (> 0), it also caps every prefill chunk at T tokens (vLLM v1's meaning),
  leaving the rest of the budget to others. 0 with `max_num_partial_prefills` > 1: T is
  4% of max_model_len, for telling long from short only (vLLM's default).
- `max_num_partial_prefills` P (> 1 turns this on, vLLM v0's meaning): the prefills that
  can run this step (running ones, then waiting ones up to P) split the budget: each
  chunk at most ``(max_num_batched_tokens - running decodes) // min(P, their number)``. A
  long prompt alone keeps the whole budget but a token for each running decode; a short
  arrival halves it for one step and gets its first token, then its next ones each step.
- `max_long_partial_prefills` L (with P > 1): at most L long prefills run at once; a long
  waiting request beyond them is passed over this step by the shorter ones behind it
  (nobody passes a request for any other reason: blocks, seats, LoRA stop admission).

What counts as a prefill: a request with more than one token to compute (a decode has one;
drafts are not counted), after its prefix-cache hit when it is admitted. A request whose
prompt will be pulled from a prefill worker (a pending `RemoteKV`) is not a prefill: its
pull takes no budget; a failed pull makes it one in running. `PrefillLimits.off()` when
chunked prefill is off or the policy is static: they move whole prompts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from scheduler.request import RemoteKVState, Request

# vLLM's SchedulerConfig: with concurrent partial prefills and no threshold given, a prompt
# longer than this fraction of max_model_len is long.
AUTO_THRESHOLD_FRACTION = 0.04
# Waiting requests looked at to count this step's prefills (a queue of long prompts passed
# over could be long; each look may take a prefix-cache lookup).
MAX_PEEK = 32


@dataclass(frozen=True)
class PrefillLimits:
    threshold: int = 0  # tokens left above which a prefill is long; 0 = none is long
    chunk_cap: int = 0  # most tokens of one prefill chunk; 0 = the budget
    max_partial: int = 1  # P; 1 = the budget is not split
    max_long: int = 1  # L, counted only when max_partial > 1

    @classmethod
    def from_flags(cls, long_prefill_token_threshold: int, max_num_partial_prefills: int,
                   max_long_partial_prefills: int, max_model_len: int) -> PrefillLimits:
        t, p, m = long_prefill_token_threshold, max_num_partial_prefills, max_long_partial_prefills
        if t < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {t}")
        if p < 1 or m < 1:
            raise ValueError(f"max_num_partial_prefills ({p}) and max_long_partial_prefills "
                             f"({m}) must be >= 1")
        if m > p:
            raise ValueError(f"max_long_partial_prefills ({m}) must be <= "
                             f"max_num_partial_prefills ({p})")
        if t >= max_model_len:
            raise ValueError(f"long_prefill_token_threshold ({t}) must be < max_model_len "
                             f"({max_model_len})")
        threshold = t or (int(max_model_len * AUTO_THRESHOLD_FRACTION) if p > 1 else 0)
        return cls(threshold=threshold, chunk_cap=t, max_partial=p, max_long=m)

    @classmethod
    def off(cls) -> PrefillLimits:
        return cls()

    @property
    def splits(self) -> bool:
        return self.max_partial > 1

    def is_long(self, num_left: int) -> bool:
        return self.threshold > 0 and num_left > self.threshold


def num_to_prefill(req: Request) -> int:
    """Tokens `req` has left to compute if it is a prefill, else 0 (see the docstring)."""
    remote = req.remote_kv
    if remote is not None and remote.state in (RemoteKVState.PENDING, RemoteKVState.PULLING):
        return 0
    left = req.num_tokens - req.num_computed_tokens
    return left if left > 1 else 0


class StepPrefills:
    """One step's partial prefills: the chunk each prefill may take, and whether a waiting
    one may start (vLLM v0's PartialPrefillMetadata)."""

    def __init__(self, limits: PrefillLimits, budget: int, running: Iterable[Request],
                 queued: Iterable[Request], num_left: Callable[[Request], int] = num_to_prefill,
                 ) -> None:
        """`queued`: the waiting and swapped requests, most urgent first; `num_left`: what
        one has left to prefill (after its prefix-cache hit: the scheduler's)."""
        self.limits = limits
        self.num_long = 0  # long prefills this step: running ones, then those admitted
        prefills = decodes = 0
        for r in running:
            if left := num_to_prefill(r):
                prefills += 1
                self.num_long += limits.is_long(left)
            else:
                decodes += 1
        slots = prefills
        if limits.splits:
            waiting_long = 0
            for r in itertools.islice(queued, MAX_PEEK):  # those this step may admit
                if slots >= limits.max_partial:
                    break
                if not (left := num_left(r)):
                    continue
                if limits.is_long(left):
                    if self.num_long + waiting_long >= limits.max_long:
                        continue  # it will be passed over: its share goes to the others
                    waiting_long += 1
                slots += 1
        share = budget
        if limits.splits and slots:
            # After a token for each running decode (or a long prefill ranked ahead of them
            # would starve them after their first token, as a prompt did before).
            share = max(1, (budget - decodes) // min(slots, limits.max_partial))
        self.chunk = min(share, limits.chunk_cap or budget)

    def share(self, num_left: int) -> int:
        """The tokens this step for a request with `num_left` to compute: a prefill's share
        of the step (the budget left may cut it further), or its one token."""
        return min(num_left, self.chunk) if num_left > 1 else num_left

    def passes_over(self, num_left: int) -> bool:
        """Whether a waiting prefill with `num_left` tokens to compute (after its cached
        prefix) must let shorter ones pass this step: it is long and L long ones run."""
        lim = self.limits
        return lim.splits and lim.is_long(num_left) and self.num_long >= lim.max_long

    def admitted(self, num_left: int) -> None:
        self.num_long += self.limits.is_long(num_left)
