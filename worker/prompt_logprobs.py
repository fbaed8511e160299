"""Prompt logprobs: each prompt token's logprob under the model, with the top-k others.

The logits at position q give the distribution of token q + 1, so a prefill chunk over
positions ``start..end-1`` yields the logprobs of prompt tokens ``start+1..end`` (the first
prompt token has none; the last position's logits give the first output token, not a
prompt token's):

    prompt        t0    t1    t2    t3    t4          (P = 5)
    positions     0     1     2     3     4
    chunk         [ start=0 .... end=3 )[ 3 .. 5 )
    logprob of    t1    t2    t3  | t4    (first output token: sampled, not returned)

Only the rows of requests that asked are turned into logits, `ROWS_PER_PASS` rows at a time
(`ops.token_logprobs`: the C kernel on the CPU, log-softmax, gather and top-k elsewhere),
and only those small results are kept: never a whole prompt's logits. The values are of
the raw logits (no temperature, penalty or mask), as vLLM returns them. Entry i of
`Request.prompt_logprobs` is token i + 1's; a recomputed request (preempted) skips the
positions it has already.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import ops
from scheduler.output import ScheduledRequest

# Rows of logits alive at once (x vocabulary x 4 bytes: 32 MiB for a 32k vocabulary).
ROWS_PER_PASS = 256


@dataclass
class PromptLogprob:
    token_id: int  # the prompt token
    logprob: float  # its logprob
    top_logprobs: list[tuple[int, float]]  # the top-k (token id, logprob), best first


def positions_wanted(s: ScheduledRequest) -> range:
    """The chunk's positions q whose logits give a prompt token's logprob not taken yet."""
    req = s.request
    if req.sampling_params.prompt_logprobs is None:
        return range(0)
    done = len(req.prompt_logprobs)
    assert s.start <= done or s.start >= req.num_prompt_tokens - 1, (
        f"{req.request_id}: prompt logprobs of positions {done}..{s.start - 1} skipped")
    return range(max(s.start, done), min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1))


def passes(rows: list[int]) -> list[list[int]]:
    """The rows `compute` turns into logits, one list a call of `compute_logits`, in order
    (under tensor parallelism every rank makes the same calls: worker/parallel/vocab.py)."""
    return [rows[first : first + ROWS_PER_PASS] for first in range(0, len(rows), ROWS_PER_PASS)]


def compute(compute_logits, hidden: torch.Tensor, rows: list[int], targets: list[int],
            k: int) -> list[PromptLogprob]:
    """The logprob of `targets[i]` under the logits of `hidden[rows[i]]`, with the top `k`,
    for every i, `ROWS_PER_PASS` rows at a time (`passes`)."""
    out: list[PromptLogprob] = []
    first = 0
    for part in passes(rows):
        idx = torch.tensor(part, device=hidden.device)
        tgt = torch.tensor(targets[first : first + len(part)], device=hidden.device)
        logits = compute_logits(hidden.index_select(0, idx)).float()
        chosen, ids, values = ops.token_logprobs(logits, tgt, k)
        del logits
        own = chosen.tolist()
        top_ids, top_lp = (ids.tolist(), values.tolist()) if k else ([[]] * len(own), [[]] * len(own))
        out += [PromptLogprob(t, lp, list(zip(ti, tl, strict=True)))
                for t, lp, ti, tl in zip(targets[first:], own, top_ids, top_lp, strict=False)]
        first += len(part)
    return out
