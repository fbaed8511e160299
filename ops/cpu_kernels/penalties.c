/* Repetition, presence and frequency penalties on the CPU, at the tokens a row has seen only.
 *
 * `ops.sampling.apply_penalties` (the reference) builds a [B, V] prompt mask and output
 * counts and makes ~15 passes over the row: ~0.6 ms at batch 1 (a decode step is ~3.5 ms)
 * and ~58 ms at 64 rows on a 49k vocabulary (benchmarks.sampler_ops: ~0.04 and ~2.3 ms
 * here). A penalty changes only the logits of the tokens in the row's prompt or output, a
 * few hundred, so this visits just those:
 *
 *   ids[starts[r] .. starts[r] + prompt_lens[r])   row r's prompt tokens (repeats allowed)
 *   ids[starts[r] + prompt_lens[r] .. starts[r+1]) its output tokens, with repeats
 *
 * 1. count each output token's occurrences into cnt[] (per thread, kept zeroed);
 * 2. for each distinct seen token t (done[] marks the first visit) with a finite logit x:
 *        p = x > 0 ? x / rep : x * rep, clamped to +-FLT_MAX
 *        z = p - freq * cnt[t] - pres * (cnt[t] > 0), NaN -> -FLT_MAX, +-inf -> +-FLT_MAX
 *    with the reference's operations in its order (no FMA contraction: -ffp-contract=off),
 *    so every penalized logit has the reference's bits;
 * 3. clear cnt[] and done[] at the same tokens.
 *
 * Every other logit is left as it is: the reference gives x - freq * 0 - pres * 0 = x there
 * (up to the sign of a zero), and maps non-finite logits to -inf, which the sampler reading
 * z treats them as already (never drawn). Token ids outside [0, V) are skipped (the door
 * admits none). Rows run in parallel, one a thread.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    float *cnt;    /* [V] output occurrences, zero between rows */
    uint8_t *done; /* [V] visited in this row, zero between rows */
    size_t cap;
} scratch;

static _Thread_local scratch tls;

static int grow(int V) {
    if ((size_t)V <= tls.cap) return 0;
    free(tls.cnt);
    free(tls.done);
    tls.cnt = calloc((size_t)V, sizeof(float));
    tls.done = calloc((size_t)V, 1);
    tls.cap = (tls.cnt && tls.done) ? (size_t)V : 0;
    return tls.cap ? 0 : -1;
}

static inline float clampf(float x) { return x > FLT_MAX ? FLT_MAX : (x < -FLT_MAX ? -FLT_MAX : x); }

static void penalize_row(float *z, int V, const int32_t *ids, int64_t n_prompt, int64_t n, float rep,
                         float pres, float freq) {
    float *cnt = tls.cnt;
    uint8_t *done = tls.done;
    for (int64_t j = n_prompt; j < n; j++)
        if (ids[j] >= 0 && ids[j] < V) cnt[ids[j]] += 1.0f;
    for (int64_t j = 0; j < n; j++) {
        const int32_t t = ids[j];
        if (t < 0 || t >= V || done[t]) continue;
        done[t] = 1;
        const float x = z[t];
        if (!isfinite(x)) continue;
        const float c = cnt[t];
        float v = clampf(x > 0.0f ? x / rep : x * rep);
        const float f = freq * c;
        v = v - f;
        const float g = pres * (c > 0.0f ? 1.0f : 0.0f);
        v = v - g;
        z[t] = isnan(v) ? -FLT_MAX : clampf(v);
    }
    for (int64_t j = 0; j < n; j++) {
        const int32_t t = ids[j];
        if (t >= 0 && t < V) {
            cnt[t] = 0.0f;
            done[t] = 0;
        }
    }
}

/* `ops.sampling.penalty_values`: repetition in [FLT_MIN, FLT_MAX] (NaN: 1, off), presence
 * and frequency finite (NaN: 0, off), so that the arithmetic above can overflow but never
 * make a NaN. */
static inline float clamp_between(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

/* z: [B, V] float32 (row stride ld), penalized in place. rep / pres / freq: [B], as the
 * request gave them (clamped here). Returns 0, or -1 where scratch could not be allocated
 * (z may then be partly penalized). */
int penalize_rows(float *z, int64_t ld, int B, int V, const int32_t *ids, const int64_t *starts,
                  const int64_t *prompt_lens, const float *rep, const float *pres, const float *freq,
                  int nthreads) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (B > 1)
    for (int r = 0; r < B; r++) {
        if (starts[r + 1] == starts[r]) continue;
        if (grow(V)) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        const float rp = isnan(rep[r]) ? 1.0f : clamp_between(rep[r], FLT_MIN, FLT_MAX);
        const float pr = isnan(pres[r]) ? 0.0f : clampf(pres[r]);
        const float fr = isnan(freq[r]) ? 0.0f : clampf(freq[r]);
        penalize_row(z + r * ld, V, ids + starts[r], prompt_lens[r], starts[r + 1] - starts[r], rp, pr, fr);
    }
    return failed ? -1 : 0;
}
