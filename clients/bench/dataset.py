"""The requests of a benchmark: what each sends and how many tokens it must generate.

- ``random``: prompts of random token ids, lengths from an input distribution; outputs from
  an output distribution. Ids are drawn from [FIRST_ORDINARY_ID, vocab_size), above the low
  ids where vocabularies keep their special and byte tokens.
- ``chat``: the built-in questions (clients/bench/chat.py) as chat messages, long-tailed
  outputs by default. The worker renders them with the model's chat template.
- ``mixed``: the chat set with a fraction of its requests (seeded positions) replaced by long
  random prompts (2,000 tokens by default): what chunked prefill is for.

Every random choice comes from numpy generators seeded by (seed, purpose), so the same seed
gives the same requests whatever else changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from clients.bench.chat import pick_questions, user_turn
from clients.bench.lengths import LengthDist

FIRST_ORDINARY_ID = 1000
KINDS = ("random", "chat", "mixed")


@dataclass
class BenchRequest:
    """One request: exactly one of `token_ids`, `messages` or `text` is set."""

    index: int
    output_len: int
    kind: str  # random | chat | long
    token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    text: str | None = None

    @property
    def prompt_len(self) -> int | None:
        """Known for token-id prompts; chat prompts are counted by the server (usage)."""
        return len(self.token_ids) if self.token_ids is not None else None


def _rng(seed: int, purpose: int) -> np.random.Generator:
    return np.random.default_rng([seed, purpose])


def _random_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    low = min(FIRST_ORDINARY_ID, vocab_size // 2)
    return [int(t) for t in rng.integers(low, vocab_size, size=n)]


def random_dataset(
    n: int, input_dist: LengthDist, output_dist: LengthDist, vocab_size: int, seed: int
) -> list[BenchRequest]:
    in_lens = input_dist.sample(n, _rng(seed, 10))
    out_lens = output_dist.sample(n, _rng(seed, 11))
    ids_rng = _rng(seed, 12)
    return [
        BenchRequest(i, o, "random", token_ids=_random_ids(ids_rng, p, vocab_size))
        for i, (p, o) in enumerate(zip(in_lens, out_lens, strict=True))
    ]


def chat_dataset(n: int, output_dist: LengthDist, seed: int) -> list[BenchRequest]:
    # Output lengths from default_rng(seed), questions from (seed, 1): the same workload as
    # benchmarks.offline for the same seed and the default long tail.
    out_lens = output_dist.sample(n, np.random.default_rng(seed))
    return [
        BenchRequest(i, o, "chat", messages=user_turn(q))
        for i, (q, o) in enumerate(zip(pick_questions(n, seed), out_lens, strict=True))
    ]


def mixed_dataset(
    n: int,
    output_dist: LengthDist,
    seed: int,
    *,
    long_fraction: float,
    long_input_len: int,
    long_output_len: int,
    vocab_size: int,
) -> list[BenchRequest]:
    """Chats, with round(n * long_fraction) of them replaced by long random prompts."""
    reqs = chat_dataset(n, output_dist, seed)
    rng = _rng(seed, 20)
    n_long = round(n * long_fraction)
    for i in sorted(rng.choice(n, size=n_long, replace=False).tolist()):
        reqs[i] = BenchRequest(
            i, long_output_len, "long", token_ids=_random_ids(rng, long_input_len, vocab_size)
        )
    return reqs


def describe(reqs: list[BenchRequest]) -> dict[str, object]:
    """Counts for the result file: how many of each kind, output tokens asked for."""
    kinds: dict[str, int] = {}
    for r in reqs:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    outs = [r.output_len for r in reqs]
    known = [r.prompt_len for r in reqs if r.prompt_len is not None]
    return {
        "num_requests": len(reqs),
        "kinds": kinds,
        "output_tokens_requested": sum(outs),
        "output_len": {"min": min(outs), "median": float(np.median(outs)), "max": max(outs)},
        "token_id_prompt_tokens": sum(known),
    }
