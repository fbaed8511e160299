"""Sampling from a batch of logits, on the logits' device, with no host sync per request.

Order (as vLLM): penalties -> temperature -> min-p -> top-k -> top-p -> draw.
A draw is argmax(probs / E) with E ~ Exp(1) (equivalent to a multinomial draw).
A seeded request draws E from its own generator seeded by a 64-bit mix of (seed, output
index) (`seed_key`), so its tokens do not depend on which batch it ran in. Logprobs are of
the raw model distribution (before penalties and temperature), as OpenAI reports them.

Hostile values. Whatever the logits and SamplingTensors hold, no NaN (and no inf - inf)
reaches a draw, and the token drawn has a finite logit (a row with none cannot have one; it
gets its argmax, and -inf logprobs):
- a non-finite logit (NaN, +inf, -inf) is never drawn: it counts as -inf, logprobs too;
- penalized logits saturate at +-FLT_MAX instead of overflowing; the penalty values are
  clamped to finite ranges first (repetition penalty to [FLT_MIN, FLT_MAX], NaN = off);
- a temperature below SAMPLING_EPS (or NaN) is greedy, as in vLLM; a row whose logits /
  temperature overflow float32 is greedy over its penalized logits (at such a temperature
  the draw is the argmax anyway);
- min_p is clamped to at most 1 and the top token always survives the filters (top_p <= 0
  and top_p = 1e-45 included).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_MASK = float("-inf")
# Temperatures below this are greedy (vLLM's value): 1 / SAMPLING_EPS is a factor no
# logit range survives in float32 without a scale of its own.
SAMPLING_EPS = 1e-5
_FMAX = torch.finfo(torch.float32).max
_FMIN = torch.finfo(torch.float32).tiny  # the smallest normal float32
_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: every input bit flips about half the output bits."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def seed_key(seed: int, step: int) -> int:
    """The 64-bit key of a seeded row's draw for output index `step`: all 64 bits of the
    seed (two's complement for a negative one) and of the step count. The CPU generator
    (mt19937) keeps 32 bits of it, so two (seed, step) pairs share a stream with
    probability 2**-32 there; CUDA's Philox keeps all 64."""
    return _mix64(_mix64(seed & _M64) ^ (step & _M64))


@dataclass(frozen=True)
class PenaltyTokens:
    """The tokens each row's penalties count, flat and on the host. Row i owns
    ids[starts[i]:starts[i + 1]]: its prompt's first (prompt_lens[i] of them, repeats
    allowed), then its output so far with repeats (their number is the frequency penalty's
    count). A row without penalties may own none: with the penalties off, a seen token's
    logit is unchanged anyway.

    Sparse because a row's seen tokens are a few hundred of a 49k-128k vocabulary: the C
    sampler penalizes just those (ops/cpu_kernels/penalties.c), where the [B, V] mask and
    counts the reference reads (`dense`) cost ~0.6 ms at batch 1 and ~58 ms at 64 rows
    (benchmarks.sampler_ops).
    """

    ids: torch.Tensor  # [N] int32
    starts: torch.Tensor  # [B + 1] int64
    prompt_lens: torch.Tensor  # [B] int64

    def __post_init__(self) -> None:
        b = self.prompt_lens.numel()
        assert self.ids.dtype == torch.int32 and self.ids.dim() == 1
        assert self.starts.dtype == torch.int64 and self.starts.shape == (b + 1,)
        assert self.prompt_lens.dtype == torch.int64
        # (No element read here: indexing a tensor costs tens of microseconds a step.)

    @classmethod
    def from_lists(cls, rows: list[tuple[list[int], list[int]]]) -> PenaltyTokens:
        """rows[i] = (row i's prompt tokens, its output tokens)."""
        flat: list[int] = []
        bounds = [0]  # per row: where its prompt ends, then where its output ends
        for prompt, output in rows:
            flat += prompt
            bounds.append(len(flat))
            flat += output
            bounds.append(len(flat))
        # numpy converts a list of ints ~4x faster than torch.tensor.
        b = np.asarray(bounds, dtype=np.int64)
        return cls(torch.from_numpy(np.asarray(flat, dtype=np.int32).reshape(-1)),
                   torch.from_numpy(np.concatenate([b[:1], b[2::2]])), torch.from_numpy(b[1::2] - b[:-1:2]))

    @classmethod
    def from_dense(cls, prompt_mask: torch.Tensor, output_counts: torch.Tensor) -> PenaltyTokens:
        """From a [B, V] prompt mask and whole output counts (tests)."""
        counts = output_counts.long()
        assert bool((counts >= 0).all()) and bool((counts == output_counts).all())
        rows = []
        for mask, count in zip(prompt_mask.cpu(), counts.cpu(), strict=True):
            seen = count.nonzero().squeeze(-1)
            rows.append((mask.nonzero().squeeze(-1).tolist(), seen.repeat_interleave(count[seen]).tolist()))
        return cls.from_lists(rows)

    def dense(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, V] bool: in the prompt, [B, V] float32: occurrences in the output).

        The flat indices are made on the host and travel as one non-blocking copy, and the
        device writes are scatters, so a CUDA step never waits on the host here (a boolean
        index or `index_put_(accumulate=True)` on the device would: tests/
        test_sampling_triton.py::test_gpu_no_host_sync). Ids outside the vocabulary are
        skipped, as the C kernel skips them."""
        b = self.prompt_lens.numel()
        rows = torch.repeat_interleave(torch.arange(b), self.starts.diff())
        in_prompt = torch.arange(self.ids.numel()) - self.starts[rows] < self.prompt_lens[rows]
        ids = self.ids.long()
        valid = (ids >= 0) & (ids < vocab)
        flat = rows * vocab + ids
        prompt_at, output_at = flat[valid & in_prompt], flat[valid & ~in_prompt]
        both = torch.cat((prompt_at, output_at)).to(device, non_blocking=True)
        prompt_at, output_at = both[: prompt_at.numel()], both[prompt_at.numel():]
        prompt_mask = torch.zeros(b, vocab, dtype=torch.bool, device=device)
        prompt_mask.view(-1).scatter_(0, prompt_at, True)
        output_counts = torch.zeros(b, vocab, dtype=torch.float32, device=device)
        output_counts.view(-1).scatter_add_(0, output_at, torch.ones(output_at.numel(), device=device))
        return prompt_mask, output_counts


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_p: torch.Tensor  # [B] float32; 1 = off
    top_k: torch.Tensor  # [B] int64; 0 = off
    min_p: torch.Tensor  # [B] float32; 0 = off
    repetition_penalty: torch.Tensor  # [B]; 1 = off
    presence_penalty: torch.Tensor  # [B]; 0 = off
    frequency_penalty: torch.Tensor  # [B]; 0 = off
    penalty_tokens: PenaltyTokens | None  # the tokens the penalties count (None: no row has one)
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


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """NaN and +-inf -> -inf: tokens that are never drawn."""
    inf = float("inf")
    return logits.nan_to_num(nan=-inf, posinf=-inf, neginf=-inf)


def penalty_values(st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(repetition, presence, frequency) [B, 1], clamped so that the penalties' arithmetic
    can overflow but never give NaN: repetition in [FLT_MIN, FLT_MAX] (NaN: 1), presence
    and frequency finite (NaN: 0)."""
    rep = st.repetition_penalty.float().nan_to_num(1.0).clamp(_FMIN, _FMAX)
    pres = st.presence_penalty.float().nan_to_num(0.0).clamp(-_FMAX, _FMAX)
    freq = st.frequency_penalty.float().nan_to_num(0.0).clamp(-_FMAX, _FMAX)
    return rep[:, None], pres[:, None], freq[:, None]


def apply_penalties(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Penalized logits: finite where the logit is (saturating at +-FLT_MAX), -inf elsewhere."""
    assert st.penalty_tokens is not None
    prompt_mask, output_counts = st.penalty_tokens.dense(logits.shape[-1], logits.device)
    alive = torch.isfinite(logits)
    all_alive = bool(alive.all())
    x = logits if all_alive else logits.masked_fill(~alive, 0.0)
    rep, pres, freq = penalty_values(st)
    seen = prompt_mask | (output_counts > 0)
    penalized = torch.where(x > 0, x / rep, x * rep).clamp_(-_FMAX, _FMAX)
    z = torch.where(seen, penalized, x)
    z = z - freq * output_counts
    z = z - pres * (output_counts > 0).to(z.dtype)
    z = z.nan_to_num_(nan=-_FMAX, posinf=_FMAX, neginf=-_FMAX)
    return z if all_alive else z.masked_fill_(~alive, _MASK)


def _top_k_top_p_min_p(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Filtered logits: -inf for the tokens the filters drop. The row's top token always
    stays (min_p is clamped to <= 1; top_p <= 0 keeps just it)."""
    vocab = logits.shape[-1]
    min_p = st.min_p.float().nan_to_num(0.0).clamp(0.0, 1.0)
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        limit = min_p[:, None] * probs.amax(-1, keepdim=True)
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
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, _MASK)
    return torch.full_like(logits, _MASK).scatter(-1, order, sorted_logits)


def _exponential_noise(shape: tuple[int, int], st: SamplingTensors, device: torch.device) -> torch.Tensor:
    """E ~ Exp(1), at least FLT_MIN: probs / E is never 0 / 0."""
    noise = torch.empty(shape, device=device).exponential_()
    for row, seed in enumerate(st.seeds):
        if seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed_key(seed, st.steps[row]))
            noise[row].exponential_(generator=gen)
    return noise.clamp_min_(_FMIN)


def _numpy_view(x: torch.Tensor) -> np.ndarray | None:
    """x as a numpy array where it can be one (on the CPU, in a float type numpy has)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64, torch.float16):
        return None
    return x.detach().numpy()


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1): the first maximum of each row (NaN ranking first), as torch gives it.
    On the CPU through numpy: torch's CPU argmax over a vocabulary took 130 us for one row
    and 2.9 ms for 64 (numpy: 13 us and 0.27 ms), the largest part of a greedy batch-1
    step's sampling. Same indices (the first maximum either way)."""
    a = _numpy_view(x)
    return x.argmax(-1) if a is None else torch.from_numpy(np.asarray(a.argmax(-1)))


def _finite_argmax_np(a: np.ndarray) -> np.ndarray | None:
    ids = a.argmax(-1)
    return ids if np.isfinite(a[np.arange(a.shape[0]), ids]).all() else None


def finite_argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """Each row's argmax (`argmax_rows`), or None when one lands on a non-finite logit (NaN
    ranks first; +inf): `sample_ref`'s greedy decode. On the CPU all in numpy: torch's
    gather and isfinite took ~0.1 ms there, on the caches a step's weights have evicted."""
    a = _numpy_view(logits)
    if a is not None:
        ids = _finite_argmax_np(a)
        return None if ids is None else torch.from_numpy(ids)
    ids = logits.argmax(-1)
    return ids if bool(torch.isfinite(logits.gather(-1, ids[:, None])).all()) else None


def greedy_ids_cpu(logits: torch.Tensor) -> list[int] | None:
    """`finite_argmax` as ints, for CPU logits, with no tensor in between; None where it
    gives None or numpy cannot view the logits. The runner takes it for steps whose rows are
    all plain greedy, skipping the SamplingTensors and `sample_ref` (together ~0.2 ms of a
    5 ms batch-1 step; a tensor made and read back here cost another 30-40 us)."""
    a = _numpy_view(logits)
    ids = None if a is None else _finite_argmax_np(a)
    return None if ids is None else ids.tolist()


def _draw(z: torch.Tensor, greedy_ids: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """One token per row from the penalized logits z (finite, or -inf where never drawn)."""
    temp = st.temperature.float()
    greedy = ~(temp >= SAMPLING_EPS)  # NaN too
    t = torch.where(greedy, torch.ones_like(temp), temp.clamp(max=_FMAX))
    y = z / t[:, None]
    # A row whose scaled logits overflow (or that has no finite logit) is greedy.
    overflow = ~torch.isfinite(y.amax(-1))
    if bool(overflow.any()):
        greedy = greedy | overflow
        y = torch.where(greedy[:, None], 0.0, y)  # filled, so that no NaN is computed below
    probs = _top_k_top_p_min_p(y, st).softmax(-1)
    drawn = argmax_rows(probs / _exponential_noise(tuple(probs.shape), st, probs.device))
    return torch.where(greedy, greedy_ids, drawn)


def sample_ref(logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
    """logits: [B, V] float32 -> one token per row."""
    if st.all_greedy and st.penalty_tokens is None and st.num_logprobs < 0:
        # Greedy decode: the raw argmax, unless it landed on a NaN or +inf; spares the copy
        # below, a pass as costly as the argmax itself.
        ids = finite_argmax(logits)
        if ids is not None:
            return SamplerOutput(ids, None, None, None)
    z = apply_penalties(logits, st) if st.penalty_tokens is not None else finite_logits(logits)
    greedy_ids = argmax_rows(z)
    token_ids = greedy_ids if st.all_greedy else _draw(z, greedy_ids, st)
    return with_logprobs(logits, token_ids, st, None if st.penalty_tokens is not None else z)


def with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, st: SamplingTensors,
                  clean: torch.Tensor | None = None) -> SamplerOutput:
    """The drawn tokens with the logprobs `st` asks for (none: num_logprobs < 0), of the raw
    logits; `clean`: `finite_logits(logits)` where the caller has it already."""
    if st.num_logprobs < 0:
        return SamplerOutput(token_ids, None, None, None)
    return SamplerOutput(token_ids, *token_logprobs_ref(logits, token_ids, st.num_logprobs, clean))


def token_logprobs_ref(logits: torch.Tensor, token_ids: torch.Tensor, n: int, clean: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Of the log-softmax of logits [B, V] (a non-finite logit counts as -inf): each row's
    logprob of token_ids[row] [B], and with n > 0 its n best token ids and logprobs [B, n],
    best first (else None, None). `clean`: `finite_logits(logits)` where the caller has it."""
    clean = finite_logits(logits) if clean is None else clean
    lp = clean.log_softmax(-1)
    lp = lp.masked_fill_(lp.isnan(), _MASK)  # a row with no finite logit
    chosen = lp.gather(-1, token_ids[:, None]).squeeze(-1)
    top_lp, top_ids = lp.topk(n, dim=-1) if n > 0 else (None, None)
    return chosen, top_ids, top_lp
