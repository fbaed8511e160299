"""Sampling from a batch of logits, on the logits' device, with no host sync per request.

Order (as vLLM): penalties -> temperature -> min-p -> top-k -> top-p -> draw.
A draw is argmax(probs / E) with E ~ Exp(1) (equivalent to a multinomial draw).
A seeded request draws E from its own generator seeded by (seed, output index),
so its tokens do not depend on which batch it ran in. Logprobs are of the raw
model distribution (before penalties and temperature), as OpenAI reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK = float("-inf")


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_p: torch.Tensor  # [B] float32; 1 = off
    top_k: torch.Tensor  # [B] int64; 0 = off
    min_p: torch.Tensor  # [B] float32; 0 = off
    repetition_penalty: torch.Tensor  # [B]; 1 = off
    presence_penalty: torch.Tensor  # [B]; 0 = off
    frequency_penalty: torch.Tensor  # [B]; 0 = off
    prompt_mask: torch.Tensor | None  # [B, V] bool: token occurs in the prompt (penalties only)
    output_counts: torch.Tensor | None  # [B, V] float32: occurrences in the output so far
    seeds: list[int | None]  # per row
    steps: list[int]  # per row: index of the token being drawn (for seeded rows)
    all_greedy: bool
    num_logprobs: int  # most top alternatives any row asked for; -1 = no row wants logprobs


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, of the chosen token
    top_ids: torch.Tensor | None  # [B, n]
    top_logprobs: torch.Tensor | None  # [B, n]


def apply_penalties(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    assert st.output_counts is not None and st.prompt_mask is not None
    seen = st.prompt_mask | (st.output_counts > 0)
    rep = st.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - st.frequency_penalty[:, None] * st.output_counts
    return logits - st.presence_penalty[:, None] * (st.output_counts > 0).to(logits.dtype)


def _top_k_top_p_min_p(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    vocab = logits.shape[-1]
    if bool((st.min_p > 0).any()):
        probs = logits.softmax(-1)
        limit = st.min_p[:, None] * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < limit, _MASK)
    need_k = bool((st.top_k > 0).any())
    need_p = bool((st.top_p < 1).any())
    if not (need_k or need_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if need_k:
        k = torch.where(st.top_k > 0, st.top_k, vocab).clamp(max=vocab)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], _MASK)
    if need_p:
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens strictly before it already reach top_p;
        # the first token is always kept. Rows with top_p = 1 are off: a float32 cumsum
        # can reach 1.0 before the tail, which would drop tail tokens of such rows.
        before = probs.cumsum(-1) - probs
        drop = (before >= st.top_p[:, None]) & (st.top_p < 1)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, _MASK)
    return torch.full_like(logits, _MASK).scatter(-1, order, sorted_logits)


def _exponential_noise(shape: tuple[int, int], st: SamplingTensors, device: torch.device) -> torch.Tensor:
    noise = torch.empty(shape, device=device).exponential_()
    for row, seed in enumerate(st.seeds):
        if seed is not None:
            gen = torch.Generator(device=device)
            # A fixed odd multiplier spreads (seed, step) pairs over the seed space.
            gen.manual_seed((seed * 1_000_003 + st.steps[row]) & 0x7FFF_FFFF_FFFF_FFFF)
            noise[row].exponential_(generator=gen)
    return noise


def sample_ref(logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
    """logits: [B, V] float32 -> one token per row."""
    raw = logits
    if st.prompt_mask is not None:
        logits = apply_penalties(logits, st)
    greedy_ids = logits.argmax(-1)
    if st.all_greedy:
        token_ids = greedy_ids
    else:
        greedy = st.temperature <= 0
        temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
        scaled = _top_k_top_p_min_p(logits / temp[:, None], st)
        probs = scaled.softmax(-1)
        drawn = (probs / _exponential_noise(tuple(probs.shape), st, probs.device)).argmax(-1)
        token_ids = torch.where(greedy, greedy_ids, drawn)
    if st.num_logprobs < 0:
        return SamplerOutput(token_ids, None, None, None)
    lp = raw.log_softmax(-1)
    chosen = lp.gather(-1, token_ids[:, None]).squeeze(-1)
    top_lp, top_ids = lp.topk(st.num_logprobs, dim=-1) if st.num_logprobs > 0 else (None, None)
    return SamplerOutput(token_ids, chosen, top_ids, top_lp)
