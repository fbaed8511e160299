/* Sampling on the CPU: one token per row of logits, `ops.sampling.sample_ref`'s contract.
 *
 * The reference spends ~1.3 ms on one row of a 49k vocabulary at temperature 1 (a
 * softmax, 49k exponential variates from mt19937, a division, an argmax) and ~4.7 ms with
 * top-p or top-k (a sort of the whole row); a batch-1 decode step is ~3.5 ms. Here a row
 * costs one pass that finds the argmax, one that computes the weights, and a walk:
 *
 * 1. z: the row's (penalized) logits; a non-finite z is never drawn (weight 0). The greedy
 *    token is the first maximum of the finite z (token 0 where none is finite). A row is
 *    greedy when its temperature is below SAMPLING_EPS (or NaN), when top_k is 1, or when
 *    max(z) / T is not finite (as the reference).
 * 2. y = z / T, w = exp(y - max y) in (0, 1] (min-p: w below min_p is 0, which is the
 *    reference's probs < min_p * max(probs)). The weights' float sums per block of BLK
 *    tokens are kept for the walk.
 * 3. top-k / top-p keep a prefix of the tokens in descending order of w. Only tokens with
 *    w >= FLOOR can be in it unless the prefix reaches below FLOOR, so those are gathered
 *    as candidates in the weight pass (if the prefix does reach below, every token with
 *    w > 0 is). A histogram of their weights (bins a factor <= 1.07 wide) finds the bin
 *    where the count reaches k, or the mass reaches top_p; only the candidates from that
 *    bin up are sorted (about the kept tokens, where a flat row has thousands of
 *    candidates). Top-k keeps k
 *    tokens, top-p (over the top-k and min-p survivors, renormalized) keeps tokens while
 *    the mass before them is below top_p. Ties at either boundary keep every tied token,
 *    as the Triton kernel does (the reference keeps an arbitrary subset of them).
 * 4. The draw is by inverse CDF: one uniform u from the row's 64-bit key, the first kept
 *    token whose running sum of weights passes u * (their total). Exactly the kept tokens'
 *    renormalized distribution, as the reference's exponential race gives, with one random
 *    number a row instead of one a token. A seeded row's key is `seed_key(seed, step)`
 *    (ops/sampling.py), so its token depends on its logits and key alone, never on the
 *    batch; other rows' keys come from one base a call drawn from torch's generator.
 *
 * Rows run in parallel (one row a thread; a lone row on the calling thread alone).
 * Scratch is per thread and kept between calls.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define SAMPLING_EPS 1e-5f
#define BLK 512            /* tokens a block sum covers in the walk */
#define FLOOR 9.5367431640625e-07f /* 2^-20: candidates' weight at least this, first */

typedef struct {
    float w;
    int idx;
} cand;

typedef struct {
    float *w;     /* [V] weights */
    double *sums; /* [V / BLK + 1] block sums of w */
    cand *c;      /* [V] candidates */
    size_t cap;
    int cnt[2048];   /* a histogram of the candidates' weights: counts (NBIN) */
    double ms[2048]; /* and masses */
} scratch;

static _Thread_local scratch tls;

static int grow(int V) {
    if ((size_t)V <= tls.cap) return 0;
    free(tls.w);
    free(tls.sums);
    free(tls.c);
    tls.w = aligned_alloc(64, ((size_t)V * sizeof(float) + 63) / 64 * 64);
    tls.sums = malloc(((size_t)V / BLK + 1) * sizeof(double));
    tls.c = malloc((size_t)V * sizeof(cand));
    tls.cap = (tls.w && tls.sums && tls.c) ? (size_t)V : 0;
    return tls.cap ? 0 : -1;
}

/* splitmix64's finaliser, as ops/sampling.py's _mix64. */
static inline uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Descending weight, then ascending index: one order whatever qsort's algorithm. */
static int by_weight(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->w != y->w) return x->w < y->w ? 1 : -1;
    return (x->idx > y->idx) - (x->idx < y->idx);
}

/* The first maximum of the finite values of z (0 when none is finite). */
static int greedy_index(const float *z, int V, float *best_out) {
    float best = -INFINITY;
    int gi = 0;
    int i = 0;
    __m256 vbest = _mm256_set1_ps(-INFINITY);
    /* Vector max over finite values first (z - z is 0 only for finite z), then the first
     * index holding it. */
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(z + i);
        const __m256 fin = _mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(), _CMP_EQ_OQ);
        vbest = _mm256_max_ps(vbest, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, fin));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vbest);
    for (int l = 0; l < 8; l++)
        if (lanes[l] > best) best = lanes[l];
    for (; i < V; i++)
        if (isfinite(z[i]) && z[i] > best) best = z[i];
    if (best > -INFINITY) {
        const __m256 target = _mm256_set1_ps(best);
        for (i = 0; i + 8 <= V; i += 8) {
            const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(z + i), target, _CMP_EQ_OQ));
            if (m) break;
        }
        for (; i < V && z[i] != best; i++) {
        }
        gi = i;
    }
    *best_out = best;
    return gi;
}

/* Weights w[i] = exp(z[i] / t - ymax), 0 for non-finite z, underflow, or below min_p; the
 * block sums; and the candidates with w >= floor (returned count). */
static int weigh(const float *z, int V, float t, float ymax, float min_p, float floor, float *w,
                 double *sums, cand *c) {
    const __m256 vt = _mm256_set1_ps(t), vmax = _mm256_set1_ps(ymax), zero = _mm256_setzero_ps();
    const __m256 lo = _mm256_set1_ps(-87.3f), vmin = _mm256_set1_ps(min_p), vfloor = _mm256_set1_ps(floor);
    int n = 0;
    for (int b = 0; b * BLK < V; b++) {
        const int end = (b + 1) * BLK < V ? (b + 1) * BLK : V;
        double s = 0.0;
        int i = b * BLK;
        __m256 acc = zero;
        for (; i + 8 <= end; i += 8) {
            const __m256 v = _mm256_loadu_ps(z + i);
            const __m256 fin = _mm256_cmp_ps(_mm256_sub_ps(v, v), zero, _CMP_EQ_OQ);
            const __m256 x = _mm256_sub_ps(_mm256_div_ps(v, vt), vmax);
            const __m256 ex = exp8(x);
            const __m256 keep = _mm256_and_ps(_mm256_and_ps(fin, _mm256_cmp_ps(x, lo, _CMP_GE_OQ)),
                                              _mm256_cmp_ps(ex, vmin, _CMP_GE_OQ));
            const __m256 e = _mm256_and_ps(ex, keep);
            _mm256_storeu_ps(w + i, e);
            acc = _mm256_add_ps(acc, e);
            int m = _mm256_movemask_ps(_mm256_cmp_ps(e, vfloor, _CMP_GE_OQ));
            while (m) {
                const int l = __builtin_ctz(m);
                m &= m - 1;
                c[n].w = w[i + l];
                c[n++].idx = i + l;
            }
        }
        s = hsum8(acc);
        for (; i < end; i++) {
            float e = 0.0f;
            if (isfinite(z[i])) {
                const float x = z[i] / t - ymax;
                if (x >= -87.3f) {
                    float lanes[8];
                    _mm256_storeu_ps(lanes, exp8(_mm256_set1_ps(x)));
                    e = lanes[0] >= min_p ? lanes[0] : 0.0f;
                }
            }
            w[i] = e;
            s += e;
            if (e >= floor) {
                c[n].w = e;
                c[n++].idx = i;
            }
        }
        sums[b] = s;
    }
    return n;
}

/* Candidates with w > 0 (every token that can be drawn), after a floor that was too high. */
static int gather_all(const float *w, int V, cand *c) {
    int n = 0;
    for (int i = 0; i < V; i++)
        if (w[i] > 0.0f) {
            c[n].w = w[i];
            c[n++].idx = i;
        }
    return n;
}

/* A weight's bin: its float's top 13 bits (exponent and 4 mantissa bits), in the order of
 * the weights (positive floats order as their bits do); a bin spans a factor of <= 1.07. */
#define NBIN 2048 /* bins of weights in (0, 1]: 1.0f's bits >> 19 is 2032 */
static inline int bin_of(float w) {
    union {
        float f;
        uint32_t u;
    } b = {w};
    return (int)(b.u >> 19);
}

/* Keeps (moved to the front, returned count) only the candidates in the bins the kept
 * prefix can reach: for top-k the bins down to the one where the count reaches k, for
 * top-p (alone) down to the one where the mass reaches top_p of `total`. -1 where the
 * candidates do not reach it (tokens below them are needed). Sorting then costs about
 * the kept tokens, not every candidate (a flat row has thousands above FLOOR). */
static int restrict_to_boundary(cand *c, int n, int k, float top_p, double total) {
    int *cnt = tls.cnt;
    double *ms = tls.ms;
    memset(cnt, 0, NBIN * sizeof(int));
    memset(ms, 0, NBIN * sizeof(double));
    for (int j = 0; j < n; j++) {
        const int b = bin_of(c[j].w);
        cnt[b]++;
        ms[b] += c[j].w;
    }
    int boundary = -1;
    if (k > 0) {
        int acc = 0;
        for (int b = NBIN - 1; b >= 0 && boundary < 0; b--)
            if ((acc += cnt[b]) >= k) boundary = b;
    } else {
        const double target = (double)top_p * total;
        double acc = 0.0;
        for (int b = NBIN - 1; b >= 0 && boundary < 0; b--)
            if ((acc += ms[b]) >= target) boundary = b;
    }
    if (boundary < 0) return -1;
    int m = 0;
    for (int j = 0; j < n; j++)
        if (bin_of(c[j].w) >= boundary) c[m++] = c[j];
    return m;
}

/* How many of the sorted candidates top-k and then top-p keep, ties at either boundary
 * kept. The candidates hold the whole kept prefix (restrict_to_boundary). `total`: the weight
 * of every token with w > 0, top-p's whole where top-k is off. */
static int kept_prefix(const cand *c, int n, int k, float top_p, double total) {
    int L = n;
    double mass = total;
    if (k > 0) {
        if (k < n) {
            L = k;
            while (L < n && c[L].w == c[L - 1].w) L++;
        }
        mass = 0.0; /* top-p renormalizes over the top-k survivors */
        for (int j = 0; j < L; j++) mass += c[j].w;
    }
    if (top_p < 1.0f) { /* keep a token while the mass before it is below top_p */
        const double target = (double)top_p * mass;
        double before = 0.0;
        int j = 0;
        for (; j < L && (j == 0 || before < target); j++) before += c[j].w;
        while (j < L && c[j].w == c[j - 1].w) j++;
        L = j;
    }
    return L;
}

/* One uniform in [0, 1) from a 64-bit key. */
static inline double uniform(uint64_t key) { return (double)(mix64(key) >> 11) * 0x1.0p-53; }

static int sample_row(const float *z, int V, float temp, float top_p, int64_t top_k, float min_p,
                      uint64_t key, uint8_t *kept) {
    float best;
    const int gi = greedy_index(z, V, &best);
    const int greedy = !(temp >= SAMPLING_EPS) || top_k == 1;
    const float t = temp > FLT_MAX ? FLT_MAX : temp;
    const float ymax = greedy ? 0.0f : best / t; /* division by t > 0 is monotone: max y */
    if (greedy || !isfinite(ymax)) {
        if (kept) kept[gi] = 1;
        return gi;
    }
    float mp = min_p != min_p ? 0.0f : min_p; /* NaN: off */
    mp = mp < 0.0f ? 0.0f : mp > 1.0f ? 1.0f : mp;
    const int need_k = top_k > 0 && top_k < V;
    const int need_p = top_p < 1.0f; /* NaN: off */
    const float p = top_p < FLT_MIN ? FLT_MIN : top_p;
    float *w = tls.w;
    double *sums = tls.sums;
    cand *c = tls.c;
    const int nb = (V + BLK - 1) / BLK;
    int n = weigh(z, V, t, ymax, mp, need_k || need_p ? FLOOR : INFINITY, w, sums, c);
    double total = 0.0;
    for (int b = 0; b < nb; b++) total += sums[b];
    const double u = uniform(key);
    if (!(need_k || need_p)) {
        /* Walk the blocks, then the block: the first token whose running sum passes u S. */
        const double target = u * total;
        double acc = 0.0;
        int b = 0;
        for (; b < nb - 1 && acc + sums[b] <= target; b++) acc += sums[b];
        /* Past block b only where its float sum rounded above the walk's double one. */
        int last = gi, i = b * BLK;
        const int end = V;
        for (; i < end; i++) {
            if (w[i] > 0.0f) {
                last = i;
                acc += w[i];
                if (acc > target) break;
            }
        }
        if (kept)
            for (int j = 0; j < V; j++) kept[j] = w[j] > 0.0f;
        return i < end ? i : last; /* rounding ran past the end: the last positive one */
    }
    int m = restrict_to_boundary(c, n, need_k ? (int)top_k : 0, need_p ? p : 1.0f, total);
    if (m < 0) { /* the kept prefix reaches below FLOOR: every token with w > 0 */
        n = gather_all(w, V, c);
        m = restrict_to_boundary(c, n, need_k ? (int)top_k : 0, need_p ? p : 1.0f, total);
        if (m < 0) m = n;
    }
    qsort(c, (size_t)m, sizeof(cand), by_weight);
    int L = kept_prefix(c, m, need_k ? (int)top_k : 0, need_p ? p : 1.0f, total);
    if (L <= 0) { /* no token with w > 0: cannot happen with a finite max, but never draw one */
        if (kept) kept[gi] = 1;
        return gi;
    }
    double mass = 0.0;
    for (int j = 0; j < L; j++) mass += c[j].w;
    const double target = u * mass;
    double acc = 0.0;
    int j = 0;
    for (; j < L - 1; j++) {
        acc += c[j].w;
        if (acc > target) break;
    }
    if (kept)
        for (int q = 0; q < L; q++) kept[c[q].idx] = 1;
    return c[j].idx;
}

/* out[r] = the token of row r (of logits + r ld). keys: per-row 64-bit keys where seeded[r],
 * else mix64(base + r). kept: NULL, or [B, V] bytes zeroed, set where a row's draw could
 * pick (tests). Returns 0, or -1 where scratch could not be allocated. */
int sample_rows(const float *logits, int64_t ld, int B, int V, const float *temperature,
                const float *top_p, const int64_t *top_k, const float *min_p,
                const uint64_t *keys, const uint8_t *seeded, uint64_t base, int64_t *out,
                uint8_t *kept, int nthreads) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (B > 1)
    for (int r = 0; r < B; r++) {
        if (grow(V)) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        const uint64_t key = seeded[r] ? keys[r] : mix64(base + (uint64_t)r);
        out[r] = sample_row(logits + r * ld, V, temperature[r], top_p[r], top_k[r], min_p[r], key,
                            kept ? kept + (int64_t)r * V : NULL);
    }
    return failed ? -1 : 0;
}
