/* Logprobs on the CPU: `ops.sampling.with_logprobs`'s result for float32 logits [B, V].
 *
 * For each row x (NaN and +-inf count as -inf, as `finite_logits`):
 *   lse       = max + log(sum over finite x of exp(x - max)), max the largest finite x;
 *   chosen    = x[token] - lse (-inf where x[token] is not finite or no x is);
 *   top n     = the n largest x - lse, descending, with their token ids.
 *
 * Why: the reference (finite_logits, log_softmax, gather, topk) writes and re-reads a
 * [B, V] copy three times; on a 49k vocabulary with 5 logprobs it took ~0.25 ms at batch 1
 * and ~7 ms at 64 rows (benchmarks.sampler_ops: ~0.07 and ~1.6 ms here). A row is two
 * read-only passes:
 *   1. the max of the finite logits, and the top n by logit (an insertion-sorted buffer
 *      of n entries; a vector compare against its smallest value finds the few tokens
 *      that enter it, so a pass costs about what a max costs);
 *   2. sum of exp(x - max) over the finite logits.
 * Ranking by logit is ranking by logprob (x - lse is monotone in x).
 *
 * What differs from torch, within the tests' tolerance (tests/test_logprobs_c.py):
 * - exp is simd.h's exp8 (Cephes' polynomial, ~1-2 float ulp), not torch's vectorized
 *   expf; terms below e^-87.3 of the max count as 0 (they cannot move a sum that is >= 1).
 *   The sum is in one fixed order of its own: float partial sums of 16 terms a lane
 *   (relative error <= 1e-6, ~1e-7 typical), added in double. x - max - log(sum) is done
 *   in double and rounded once to float, where torch rounds x - max first. The values
 *   agree to ~1e-6 plus a few ulps of the logprob (the tests: atol 2e-5, rtol 1e-6).
 * - Ties: equal logits are ranked lower token id first. torch's topk leaves the order of
 *   tied values unspecified, so only the values and the set sizes of ties are comparable.
 * - A row with no finite logit: every logprob -inf; top ids are 0..n-1 (torch gives some
 *   n distinct ids too). Where fewer than n logits are finite, the rest of the top n are
 *   -inf with the lowest such ids.
 * - A difference that overflows float32 (x - lse below -FLT_MAX, e.g. x = -3e38 next to
 *   a max of 3e38) rounds to -inf, as torch's float x - max does (IEEE conversion, Annex F).
 *
 * Rows run in parallel (a lone row on the calling thread); a row's result never depends on
 * the thread count.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define MAX_TOP 64 /* largest n; ops/cpu_logprobs.py falls back to torch above it */

typedef struct {
    float v; /* the logit (-inf for a non-finite one) */
    int id;
} entry;

/* Inserts (v, id) into top[0..*cnt), kept descending, capacity n; when full the caller has
 * checked v > top[n - 1].v, which drops out. Equal values stay in scan order: lower id first. */
static inline void insert(entry *top, int *cnt, int n, float v, int id) {
    int j = *cnt < n ? (*cnt)++ : n - 1;
    while (j > 0 && top[j - 1].v < v) {
        top[j] = top[j - 1];
        j--;
    }
    top[j] = (entry){v, id};
}

static inline float clean(float v) { return isfinite(v) ? v : -INFINITY; }

/* Pass 1: returns the largest finite logit (-inf if none) and fills top[0..n) with the n
 * largest cleaned logits (n <= V). */
static float scan(const float *x, int V, int n, entry *top) {
    int cnt = 0, i = 0;
    float best = -INFINITY;
    /* The first n tokens fill the buffer, whatever their values: then its smallest value is a
     * threshold every later token is compared with (ids stay distinct, -inf ones included). */
    for (; i < n; i++) {
        const float c = clean(x[i]);
        best = c > best ? c : best;
        insert(top, &cnt, n, c, i);
    }
    float thr = n ? top[n - 1].v : INFINITY; /* n = 0: nothing ever enters */
    const __m256 ninf = _mm256_set1_ps(-INFINITY), zero = _mm256_setzero_ps();
    __m256 vbest0 = ninf, vbest1 = ninf, vthr = _mm256_set1_ps(thr);
    /* 16 tokens a step, two running maxima: one max's latency a step would bound the loop. */
    for (; i + 16 <= V; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        /* v - v is 0 only for finite v: NaN and +-inf become -inf. */
        const __m256 c0 = _mm256_blendv_ps(ninf, v0, _mm256_cmp_ps(_mm256_sub_ps(v0, v0), zero, _CMP_EQ_OQ));
        const __m256 c1 = _mm256_blendv_ps(ninf, v1, _mm256_cmp_ps(_mm256_sub_ps(v1, v1), zero, _CMP_EQ_OQ));
        vbest0 = _mm256_max_ps(vbest0, c0);
        vbest1 = _mm256_max_ps(vbest1, c1);
        int m = _mm256_movemask_ps(_mm256_cmp_ps(c0, vthr, _CMP_GT_OQ))
              | _mm256_movemask_ps(_mm256_cmp_ps(c1, vthr, _CMP_GT_OQ)) << 8;
        if (m) { /* rare after the first few thousand tokens of a random row */
            while (m) { /* a lane that beats the threshold holds a finite logit */
                const int l = __builtin_ctz(m);
                m &= m - 1;
                if (x[i + l] > thr) { /* the threshold may have risen since the compare */
                    insert(top, &cnt, n, x[i + l], i + l);
                    thr = top[n - 1].v;
                }
            }
            vthr = _mm256_set1_ps(thr);
        }
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(vbest0, vbest1));
    for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
    for (; i < V; i++) {
        const float c = clean(x[i]);
        best = c > best ? c : best;
        if (c > thr) {
            insert(top, &cnt, n, c, i);
            thr = top[n - 1].v;
        }
    }
    return best;
}

/* Eight terms exp(v - max); a non-finite v, or one whose term is below e^-87.3 (where exp8
 * clamps), gives 0. max is finite and >= every finite v, so lo <= v - max <= 0 holds exactly
 * for the terms that count (+inf - max = +inf and NaN fail it). */
static inline __m256 terms(__m256 v, __m256 vmax) {
    const __m256 d = _mm256_sub_ps(v, vmax);
    const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-87.3f), _CMP_GE_OQ),
                                      _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_LE_OQ));
    return _mm256_and_ps(exp8(d), keep);
}

#define SPAN 256 /* tokens a float partial sum covers: 16 terms <= 1 a lane, error <= 1e-6 */

/* Pass 2: log(sum of exp(x - max)) over the finite logits, max finite. Float partial sums
 * (two chains, 16 tokens a step) over spans of SPAN tokens go into double: converting every
 * term to double cost a third more time (30 us a 49k row, 20 us so). */
static double log_sum(const float *x, int V, float max) {
    const __m256 vmax = _mm256_set1_ps(max);
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    for (int i = 0; i < V;) {
        const int end = V - i > SPAN ? i + SPAN : V;
        __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
        for (; i + 16 <= end; i += 16) {
            a = _mm256_add_ps(a, terms(_mm256_loadu_ps(x + i), vmax));
            b = _mm256_add_ps(b, terms(_mm256_loadu_ps(x + i + 8), vmax));
        }
        if (i < end) { /* the last < 16 tokens through the same arithmetic, padded with -inf */
            float pad[16];
            for (int l = 0; l < 16; l++) pad[l] = i + l < end ? x[i + l] : -INFINITY;
            a = _mm256_add_ps(a, terms(_mm256_loadu_ps(pad), vmax));
            b = _mm256_add_ps(b, terms(_mm256_loadu_ps(pad + 8), vmax));
            i = end;
        }
        a = _mm256_add_ps(a, b);
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
    }
    double s[4];
    _mm256_storeu_pd(s, _mm256_add_pd(s0, s1));
    return log((s[0] + s[2]) + (s[1] + s[3])); /* >= log 1: the max's own term is exp8(0) = 1 */
}

/* x - lse in double, rounded once; -inf for a non-finite x (or row). */
static inline float logprob(float v, float max, double ls) {
    if (!isfinite(v) || !isfinite(max)) return -INFINITY;
    return (float)(((double)v - (double)max) - ls);
}

/* One row: returns 0, or -1 where its token is not in [0, V). */
static int logprob_row(const float *x, int V, int64_t token, int n, float *chosen,
                       int64_t *top_ids, float *top_lp) {
    entry top[MAX_TOP];
    const float max = scan(x, V, n, top);
    const double ls = isfinite(max) ? log_sum(x, V, max) : 0.0;
    for (int j = 0; j < n; j++) {
        top_ids[j] = top[j].id;
        top_lp[j] = logprob(top[j].v, max, ls);
    }
    if (token < 0 || token >= V) {
        *chosen = NAN;
        return -1;
    }
    *chosen = logprob(x[token], max, ls);
    return 0;
}

/* Row r of logits + r * ld: chosen[r], and with n > 0 top_ids[r * n + j], top_lp[r * n + j]
 * (j < n, descending). Returns 0; -1 where a token is out of range (the caller raises torch's
 * error); -2 where n is not in [0, min(V, MAX_TOP)] (nothing written). */
int logprob_rows(const float *logits, int64_t ld, int B, int V, const int64_t *tokens, int n,
                 float *chosen, int64_t *top_ids, float *top_lp, int nthreads) {
    if (n < 0 || n > MAX_TOP || n > V) return -2;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (B > 1)
    for (int r = 0; r < B; r++) {
        if (logprob_row(logits + r * ld, V, tokens[r], n, chosen + r, n ? top_ids + (int64_t)r * n : NULL,
                        n ? top_lp + (int64_t)r * n : NULL)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}
