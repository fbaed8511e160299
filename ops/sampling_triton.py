"""Sampling on the device with Triton: one program per row, no host sync.

Same contract as `ops.sampling.sample_ref` (penalties -> temperature -> min-p -> top-k ->
top-p -> draw; greedy rows take the argmax of the penalized logits; logprobs of the raw
distribution). Each program walks its row in tiles of BLOCK tokens:

1. One pass over the logits: penalties, the greedy argmax, the raw log-sum-exp (for
   logprobs) and, for a sampling row, y = z / T. A row with no filter draws in this same
   pass; a filtered row stores y in a float32 scratch row for the passes below.
2. Filters become one threshold on y, so the kept set is {y >= thr}. min-p gives it in
   closed form (y >= ymax + log(min_p)). top-k and top-p search for it: each step is a
   pass that measures the weight of {y >= c} (a count for top-k, the mass exp(y - ymax)
   for top-p) together with the smallest such y and the weight of the tokens equal to it.
   That tells at once whether that smallest value is the exact boundary, so the search
   stops as soon as a probe falls between the boundary token and the next one; the
   threshold is then an actual logit of the row and the kept set is exact. Probes halve
   the value range first and the float32 bit pattern later, which bounds the steps.
3. The draw: argmax over kept tokens of y - log(E), E ~ Exp(1) (the exponential race, so
   no normalisation is needed). E comes from Philox (tl.randint4x) keyed by a per-row
   64-bit key, with the token index as counter: a row with a request seed uses
   `seed_key(seed, step)` (all 64 bits of both), so its token does not depend on the batch
   or on the tile size. Other rows use one key drawn per call from the host's torch
   generator, plus the row index.

Hostile values are handled as the reference does (see ops/sampling.py): non-finite logits
are never drawn, penalties saturate at +-FLT_MAX, temperatures below SAMPLING_EPS are
greedy and so is a row whose y overflows, min_p <= 1, and top_p at least FLT_MIN (so
its mass target never flushes to zero); the top token always stays.

Host side, nothing waits on the device: the only decisions taken there (all greedy, any
penalties, logprobs wanted) are host flags already in SamplingTensors; per-row choices
(greedy or not, which filters) are branches inside the kernel.

Ties at a top-k / top-p boundary keep every tied token (the reference keeps an arbitrary
subset of them); for distinct logits the kept sets agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.sampling import (
    SAMPLING_EPS,
    SamplerOutput,
    SamplingTensors,
    finite_logits,
    sample_ref,
    seed_key,
)

_FMAX = tl.constexpr(3.4028234663852886e38)
_FMIN = tl.constexpr(1.1754943508222875e-38)  # the smallest normal float32
# Search steps: value halving first (fast for ordinary logit ranges), then bit-pattern
# halving, which needs at most 32 more steps to separate any two float32 values.
_VALUE_STEPS = 24
_MAX_STEPS = 64
# One program owns a row and runs alone on its SM, so it needs many warps in flight to keep
# loads outstanding. On an H100 at B=64, V=128256 this beat 2048 x 8 warps by 20-35% with
# filters on; 8192 x 32 warps spills registers.
_MAX_BLOCK = 4096
_NUM_WARPS = 16


@triton.jit
def _key_midpoint(lo, hi):
    """The float32 halfway between lo and hi in bit-pattern order (halves the floats between)."""
    lo_bits = lo.to(tl.int32, bitcast=True)
    hi_bits = hi.to(tl.int32, bitcast=True)
    # Sign-magnitude -> two's complement order, and back.
    lo_key = (lo_bits ^ ((lo_bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
    hi_key = (hi_bits ^ ((hi_bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
    mid = ((lo_key + hi_key) >> 1).to(tl.int32)
    return (mid ^ ((mid >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _log_exp_noise(key, start, ROWS: tl.constexpr):
    """log(E), E ~ Exp(1), for tokens start + 4 * i + j as a [ROWS, 4] tile.

    Philox yields four 32-bit words per counter, so counter idx // 4 serves four tokens
    (word idx % 4): a quarter of the arithmetic of one call per token, and still a function
    of the key and the token index alone.
    """
    ctr = start // 4 + tl.arange(0, ROWS)
    r0, r1, r2, r3 = tl.randint4x(key, ctr)
    j = tl.arange(0, 4)[None, :]
    r = tl.where(j < 2, tl.where(j == 0, r0[:, None], r1[:, None]),
                 tl.where(j == 2, r2[:, None], r3[:, None]))
    r = r.to(tl.uint32, bitcast=True)
    # Uniform in (0, 1) with fine resolution near 0, where E = -log(1 - w) is small and its
    # relative precision decides the race for unlikely tokens.
    w = (r.to(tl.float32) + 0.5) * 2.3283064365386963e-10
    w = tl.minimum(w, 0.99999994)
    # -log(1 - w): a series where 1 - w would round away w's low bits.
    small = w * (1.0 + w * (0.5 + w * 0.3333333333))
    e = tl.where(w < 0.0078125, small, -tl.log(1.0 - w))
    return tl.log(e)


@triton.jit
def _argmax_2d(score, index, V):
    """Full-tile argmax of per-lane bests: (first index holding the maximum, the maximum)."""
    top = tl.max(tl.max(score, axis=1), axis=0)
    return tl.min(tl.min(tl.where(score == top, index, V), axis=1), axis=0), top


@triton.jit
def _threshold(
    row_ptr, V, lo, target, ymax,
    MASS: tl.constexpr, BLOCK: tl.constexpr, VALUE_STEPS: tl.constexpr, MAX_STEPS: tl.constexpr,
):
    """The y threshold that cuts {y >= lo} down to weight `target` (times its weight for MASS).

    Weight is 1 per token (top-k) or exp(y - ymax) (top-p). Returns t, an element value, with
    weight(y > t) < target <= weight(y >= t): the exact boundary; lo when {y >= lo} does not
    exceed the target. Each step is one pass measuring, over {y >= c}: the weight, the
    smallest y and the weight of the tokens equal to it (per-lane state, one reduction at
    the end of the pass, so tiles cost no cross-warp traffic).
    """
    offs = tl.arange(0, BLOCK)
    # Invariant after the first pass: weight(y >= lo) >= target > weight(y >= hi).
    hi = ymax + tl.abs(ymax) * 1.2e-7 + 1e-38  # just above ymax: 1.2e-7 exceeds one ulp
    c = lo
    result = lo
    todo = lo == lo  # true
    step = 0
    while todo & (step < MAX_STEPS):
        total = tl.full([BLOCK], 0.0, tl.float32)
        lane_min = tl.full([BLOCK], float("inf"), tl.float32)
        lane_w = tl.full([BLOCK], 0.0, tl.float32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            in_row = idx < V
            y = tl.load(row_ptr + idx, mask=in_row, other=float("-inf"))
            sel = in_row & (y >= c)
            if MASS:
                w = tl.where(sel, tl.exp(y - ymax), 0.0)
            else:
                w = sel.to(tl.float32)
            total += w
            ys = tl.where(sel, y, float("inf"))
            lane_w = tl.where(ys < lane_min, w, tl.where(ys == lane_min, lane_w + w, lane_w))
            lane_min = tl.minimum(lane_min, ys)
        w = tl.sum(total, axis=0)
        m = tl.min(lane_min, axis=0)
        wm = tl.sum(tl.where(lane_min == m, lane_w, 0.0), axis=0)
        if MASS:
            if step == 0:
                target = target * w  # top_p of the mass kept so far
        # Done when the smallest kept value is the boundary, or when nothing needs cutting.
        exact = (w >= target) & (w - wm < target)
        result = tl.where(exact, m, result)
        todo = todo & (exact == 0) & ((step > 0) | (w > target))
        above = w >= target
        lo = tl.where(above, m, lo)  # {y >= m} == {y >= c}: lo is an element value
        hi = tl.where(above, hi, c)
        # Next probe: halve the value range; when that stalls (or takes too long), halve
        # the float32 bit patterns in between, which ends within 32 steps.
        c = lo * 0.5 + hi * 0.5  # no overflow; -inf when lo is -inf
        inside = (c > lo) & (c < hi)
        if (step >= VALUE_STEPS) | (inside == 0):
            c = _key_midpoint(lo, hi)
        step += 1
    # Out of steps (only for absurd logit ranges): lo keeps a superset of the target set.
    return tl.where(todo, lo, result)


@triton.jit
def _race(row_ptr, V, thr, key, BLOCK: tl.constexpr):
    """Exponential race over the kept tokens {y >= thr}: (winner, its score)."""
    offs = tl.arange(0, BLOCK // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]
    best = tl.full([BLOCK // 4, 4], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK // 4, 4], 0, tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        in_row = idx < V
        y = tl.load(row_ptr + idx, mask=in_row, other=float("-inf"))
        noise = _log_exp_noise(key, start, BLOCK // 4)
        s = tl.where(in_row & (y >= thr), y - noise, float("-inf"))
        upd = s > best  # strict: the earliest index wins a tie within a lane
        best = tl.where(upd, s, best)
        best_i = tl.where(upd, idx, best_i)
    return _argmax_2d(best, best_i, V)


@triton.jit
def _sample_kernel(
    logits_ptr, stride_logits, work_ptr, prompt_ptr, counts_ptr,
    temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, rep_ptr, pres_ptr, freq_ptr, key_ptr,
    token_ptr, chosen_ptr, kept_ptr, V,
    HAS_PENALTIES: tl.constexpr, DO_SAMPLE: tl.constexpr, WANT_LOGPROBS: tl.constexpr,
    WRITE_KEPT: tl.constexpr, BLOCK: tl.constexpr,
    VALUE_STEPS: tl.constexpr, MAX_STEPS: tl.constexpr, EPS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # Tiles are [BLOCK // 4, 4]: token start + 4 * i + j, so four tokens share a Philox call.
    offs = tl.arange(0, BLOCK // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]
    R: tl.constexpr = BLOCK // 4
    logits_row = logits_ptr + row * stride_logits
    work_row = work_ptr + row * V

    temp = tl.load(temp_ptr + row)
    sampling = temp >= EPS  # NaN: greedy
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    min_p = tl.minimum(tl.where(min_p == min_p, min_p, 0.0), 1.0)  # the top token stays
    use_k = (top_k > 0) & (top_k < V)
    use_p = top_p < 1.0  # NaN: off
    top_p = tl.maximum(top_p, _FMIN)
    use_min_p = min_p > 0.0
    filtered = sampling & (use_k | use_p | use_min_p)
    plain = sampling & (filtered == 0)  # draws during the first pass
    safe_temp = tl.where(sampling, tl.minimum(temp, _FMAX), 1.0)
    key = tl.load(key_ptr + row)
    if HAS_PENALTIES:
        # As penalty_values: finite, so that the arithmetic below can overflow but not NaN.
        rep = tl.load(rep_ptr + row)
        rep = tl.minimum(tl.maximum(tl.where(rep == rep, rep, 1.0), _FMIN), _FMAX)
        pres = tl.load(pres_ptr + row)
        pres = tl.minimum(tl.maximum(tl.where(pres == pres, pres, 0.0), -_FMAX), _FMAX)
        freq = tl.load(freq_ptr + row)
        freq = tl.minimum(tl.maximum(tl.where(freq == freq, freq, 0.0), -_FMAX), _FMAX)

    # ---- pass 1: penalties, greedy argmax, raw log-sum-exp, y (stored or raced)
    best = tl.full([R, 4], float("-inf"), tl.float32)
    best_i = tl.full([R, 4], 0, tl.int32)
    race = tl.full([R, 4], float("-inf"), tl.float32)
    race_i = tl.full([R, 4], 0, tl.int32)
    # A finite start keeps exp(old - new) well defined when a lane sees only -inf.
    lane_m = tl.full([R, 4], -3.0e38, tl.float32)
    lane_s = tl.full([R, 4], 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        in_row = idx < V
        x = tl.load(logits_row + idx, mask=in_row, other=float("-inf")).to(tl.float32)
        x = tl.where(x < float("inf"), x, float("-inf"))  # NaN and +inf are never drawn
        if WANT_LOGPROBS:
            new_m = tl.maximum(lane_m, x)
            lane_s = lane_s * tl.exp(lane_m - new_m) + tl.exp(x - new_m)
            lane_m = new_m
        z = x
        if HAS_PENALTIES:
            base = row * V + idx
            seen = tl.load(prompt_ptr + base, mask=in_row, other=0) != 0
            cnt = tl.load(counts_ptr + base, mask=in_row, other=0.0)
            occurred = cnt > 0
            alive = x > float("-inf")
            x0 = tl.where(alive, x, 0.0)
            # Same operations, in the same order, as apply_penalties (IEEE division too).
            pen = tl.where(x0 > 0, tl.math.div_rn(x0, rep), x0 * rep)
            pen = tl.minimum(tl.maximum(pen, -_FMAX), _FMAX)
            z = tl.where(seen | occurred, pen, x0)
            z = z - freq * cnt
            z = z - pres * occurred.to(tl.float32)
            z = tl.minimum(tl.maximum(tl.where(z == z, z, -_FMAX), -_FMAX), _FMAX)
            z = tl.where(in_row & alive, z, float("-inf"))
        upd = z > best  # strict: torch's argmax returns the first maximal index
        best = tl.where(upd, z, best)
        best_i = tl.where(upd, idx, best_i)
        if DO_SAMPLE:
            if filtered:
                tl.store(work_row + idx, tl.math.div_rn(z, safe_temp), mask=in_row)
            if plain:
                y = tl.math.div_rn(z, safe_temp)
                s = tl.where(in_row, y - _log_exp_noise(key, start, R), float("-inf"))
                r_upd = s > race
                race = tl.where(r_upd, s, race)
                race_i = tl.where(r_upd, idx, race_i)

    token, zmax = _argmax_2d(best, best_i, V)
    # Kept set {y >= thr}: everything, until the filters raise it. (The first search pass
    # measures the row's minimum, so pass 1 need not.)
    thr = tl.full([], float("-inf"), tl.float32)
    if DO_SAMPLE:
        # y's maximum, exactly (division by t > 0 keeps the order). Not finite: y overflowed
        # (or no logit is finite), and the row stays greedy.
        ymax = tl.math.div_rn(zmax, safe_temp)
        finite = tl.abs(ymax) < float("inf")
        if plain & finite:
            drawn, top = _argmax_2d(race, race_i, V)
            token = tl.where(top > float("-inf"), drawn, token)
        if filtered & finite:
            if use_min_p:
                # probs < min_p * max(probs)  <=>  y < ymax + log(min_p)
                thr = tl.maximum(thr, ymax + tl.log(min_p))
            if use_k:
                thr = _threshold(work_row, V, thr, top_k.to(tl.float32), ymax,
                                 False, BLOCK, VALUE_STEPS, MAX_STEPS)
            if use_p:
                thr = _threshold(work_row, V, thr, top_p, ymax,
                                 True, BLOCK, VALUE_STEPS, MAX_STEPS)
            drawn, top = _race(work_row, V, thr, key, BLOCK)
            token = tl.where(top > float("-inf"), drawn, token)
    tl.store(token_ptr + row, token.to(tl.int64))

    if WANT_LOGPROBS:
        big = tl.max(tl.max(lane_m, axis=1), axis=0)
        lse = big + tl.log(tl.sum(tl.sum(lane_s * tl.exp(lane_m - big), axis=1), axis=0))
        x_tok = tl.load(logits_row + token).to(tl.float32)
        chosen = tl.where(x_tok < float("inf"), x_tok, float("-inf")) - lse
        chosen = tl.where(chosen == chosen, chosen, float("-inf"))  # a row with no finite logit
        tl.store(chosen_ptr + row * 2, chosen)
        tl.store(chosen_ptr + row * 2 + 1, lse)

    if WRITE_KEPT:  # tests only: the set this row could have drawn from
        for start in range(0, V, BLOCK):
            idx = start + offs
            in_row = idx < V
            keep = idx == token
            if DO_SAMPLE:
                if plain & finite:
                    keep = in_row
                if filtered & finite:
                    y = tl.load(work_row + idx, mask=in_row, other=float("-inf"))
                    keep = in_row & (y >= thr)
            tl.store(kept_ptr + row * V + idx, keep.to(tl.int8), mask=in_row)


def _row_keys(st: SamplingTensors, device: torch.device) -> torch.Tensor:
    """Philox key per row (64 bits, as int64): seed_key(seed, step) for seeded rows, else one
    host draw per call + the row index."""
    base = int(torch.randint(0, 1 << 62, (1,)))  # host generator: no device work, no sync
    keys = [seed_key(seed, step) if seed is not None else base + i
            for i, (seed, step) in enumerate(zip(st.seeds, st.steps, strict=True))]
    signed = [k - (1 << 64) if k >= 1 << 63 else k for k in keys]  # the same 64 bits
    return torch.tensor(signed, dtype=torch.int64).to(device, non_blocking=True)


def _config(vocab: int) -> tuple[int, int]:
    """(tile size, warps)."""
    block = max(16, min(_MAX_BLOCK, triton.next_power_of_2(vocab)))
    return block, _NUM_WARPS if block >= 1024 else 4


def _launch(
    logits: torch.Tensor, st: SamplingTensors, debug: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Run the kernel: (token ids, [B, 2] (chosen logprob, raw lse) or None, kept, scratch).

    kept ([B, V] int8) and a NaN-filled scratch are only written when debug is set.
    """
    assert logits.dim() == 2
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    b, vocab = logits.shape
    dev = logits.device
    has_pen = st.penalty_tokens is not None
    do_sample = not st.all_greedy
    want_lp = st.num_logprobs >= 0
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    # Only filtered rows write their scratch row; torch.empty costs no device work.
    shape = (b, vocab) if do_sample else (1,)
    work = torch.empty(shape, dtype=torch.float32, device=dev)
    if debug:
        work.fill_(float("nan"))
    chosen = torch.empty((b, 2) if want_lp else (1,), dtype=torch.float32, device=dev)
    kept = torch.empty((b, vocab) if debug else (1,), dtype=torch.int8, device=dev)
    if has_pen:
        assert st.penalty_tokens is not None
        prompt_mask, counts = st.penalty_tokens.dense(vocab, dev)
        prompt = prompt_mask.view(torch.uint8)
    else:
        prompt, counts = tokens, work  # never read
    block, num_warps = _config(vocab)
    _sample_kernel[(b,)](
        logits, logits.stride(0), work, prompt, counts,
        st.temperature.float(), st.top_k.long(), st.top_p.float(), st.min_p.float(),
        st.repetition_penalty.float(), st.presence_penalty.float(), st.frequency_penalty.float(),
        _row_keys(st, dev) if do_sample else tokens, tokens, chosen, kept, vocab,
        HAS_PENALTIES=has_pen, DO_SAMPLE=do_sample, WANT_LOGPROBS=want_lp,
        WRITE_KEPT=debug, BLOCK=block, VALUE_STEPS=_VALUE_STEPS, MAX_STEPS=_MAX_STEPS,
        EPS=SAMPLING_EPS, num_warps=num_warps,
        # No mul+add contraction: the penalties must round exactly as apply_penalties does.
        enable_fp_fusion=False,
    )
    return tokens, chosen if want_lp else None, kept, work


def sample_triton(logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
    """logits: [B, V] -> one token per row; drop-in for sample_ref, all on the logits' device."""
    if logits.shape[0] == 0:
        return sample_ref(logits, st)  # nothing to launch; the reference handles empty shapes
    if st.all_greedy and st.penalty_tokens is None and st.num_logprobs < 0:
        # Plain argmax: torch spreads a row over many blocks, faster than one program per row.
        return SamplerOutput(finite_logits(logits).argmax(-1), None, None, None)
    tokens, chosen, _, _ = _launch(logits, st)
    if chosen is None:
        return SamplerOutput(tokens, None, None, None)
    top_ids = top_lp = None
    if st.num_logprobs > 0:
        # log_softmax is monotone: the top raw logits are the top logprobs.
        values, top_ids = finite_logits(logits).topk(st.num_logprobs, dim=-1)
        top_lp = values.float() - chosen[:, 1:2]
        top_lp = top_lp.masked_fill_(top_lp.isnan(), float("-inf"))  # a row with no finite logit
    return SamplerOutput(tokens, chosen[:, 0].contiguous(), top_ids, top_lp)


def inspect_triton(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """For tests: (kept, scaled). kept [B, V] bool is the set each row's draw picks from
    (a greedy row: its argmax). scaled [B, V] is the kernel's penalized logits / temperature
    for rows with a top-k / top-p / min-p filter, NaN elsewhere (or [1] when all greedy)."""
    _, _, kept, work = _launch(logits, st, debug=True)
    return kept.bool(), work
