/* Decode attention over a paged KV cache, float32, AVX2 + FMA: one query token per request,
 * read straight from the cache through the block table (no gather copy).
 *
 *   q, out   [T, Hq, D]                      rows[i]: request i's query row
 *   caches   [num_blocks, block_size, Hkv, D]  token p of request i: block
 *            tables[i, p / block_size], offset p % block_size
 *
 * One work item per request (or per (request, kv head) when there are few requests): the
 * Hq / Hkv query heads of a kv head share every key and value read. Scores for all lens[i]
 * keys, then an exact softmax (max first), then the weighted sum of values in key order.
 * Each query head's arithmetic is the same whichever way the work is split, so a request's
 * result does not depend on the rest of the batch.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADS 256 /* query heads */
#define MAX_D 256

/* e^x for x <= 0 to float rounding (Cephes' expf polynomial, 8 lanes). */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, int block_size,
                           int num_kv_heads, int num_heads, int head_dim, const int64_t *rows,
                           const int64_t *tables, int max_blocks, const int64_t *lens, int n,
                           float scale, float *out, int nthreads) {
    const int group = num_heads / num_kv_heads, D = head_dim;
    if (num_heads % num_kv_heads || num_heads > MAX_HEADS || D % 8 || D > MAX_D) return -1;
    int64_t max_len = 1;
    for (int i = 0; i < n; i++) {
        if (lens[i] < 1 || lens[i] > (int64_t)max_blocks * block_size) return -2;
        if (lens[i] > max_len) max_len = lens[i];
    }
    const size_t tok = (size_t)num_kv_heads * D; /* floats per cached token */
    const size_t stride = (size_t)(max_len + 8);
    /* With enough requests to share out, an item is a whole request and reads each cached
     * token's keys and values for all heads in one contiguous run; with few, an item is one
     * (request, kv head), so that every thread has work. */
    const int split = n >= 2 * nthreads ? 1 : num_kv_heads;
    const int heads_per_item = num_kv_heads / split;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *scores = malloc(sizeof(float) * (size_t)num_heads * stride);
        float *o = aligned_alloc(32, sizeof(float) * (size_t)num_heads * MAX_D);
        if (!scores || !o) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < n * split; item++) {
            if (!scores || !o) continue;
            const int i = item / split, h0 = (item % split) * heads_per_item;
            const int nh = heads_per_item * group; /* query heads of this item */
            const int64_t L = lens[i];
            const int64_t *table = tables + (size_t)i * max_blocks;
            const float *qi = q + ((size_t)rows[i] * num_heads + (size_t)h0 * group) * D;
            /* scores[a][j] = scale * q_a . k_j, a over the item's query heads */
            for (int64_t j = 0; j < L; j++) {
                const float *kt = k_cache + ((size_t)table[j / block_size] * block_size + j % block_size) * tok
                                  + (size_t)h0 * D;
                for (int a = 0; a < nh; a++) {
                    const float *qa = qi + (size_t)a * D, *kp = kt + (size_t)(a / group) * D;
                    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                    int d = 0;
                    for (; d + 16 <= D; d += 16) {
                        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d), _mm256_loadu_ps(kp + d), a0);
                        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d + 8), _mm256_loadu_ps(kp + d + 8), a1);
                    }
                    if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d), _mm256_loadu_ps(kp + d), a0);
                    scores[a * stride + j] = hsum(_mm256_add_ps(a0, a1)) * scale;
                }
            }
            /* softmax per query head: subtract the max, exponentiate, sum */
            float inv_sum[MAX_HEADS];
            for (int a = 0; a < nh; a++) {
                float *sc = scores + a * stride;
                float mx = sc[0];
                for (int64_t j = 1; j < L; j++) mx = sc[j] > mx ? sc[j] : mx;
                const __m256 vmx = _mm256_set1_ps(mx);
                __m256 acc = _mm256_setzero_ps();
                int64_t j = 0;
                for (; j + 8 <= L; j += 8) {
                    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vmx));
                    _mm256_storeu_ps(sc + j, e);
                    acc = _mm256_add_ps(acc, e);
                }
                float sum = hsum(acc);
                if (j < L) { /* the tail through a padded copy */
                    float tail[8] = {0};
                    memcpy(tail, sc + j, sizeof(float) * (size_t)(L - j));
                    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(tail), vmx));
                    _mm256_storeu_ps(tail, e);
                    for (int64_t t = 0; t < L - j; t++) { sc[j + t] = tail[t]; sum += tail[t]; }
                }
                inv_sum[a] = 1.0f / sum;
            }
            /* out_a = sum_j p_aj v_j / sum_a, in key order */
            memset(o, 0, sizeof(float) * (size_t)nh * D);
            for (int64_t j = 0; j < L; j++) {
                const float *vt = v_cache + ((size_t)table[j / block_size] * block_size + j % block_size) * tok
                                  + (size_t)h0 * D;
                for (int a = 0; a < nh; a++) {
                    const __m256 p = _mm256_set1_ps(scores[a * stride + j]);
                    const float *vp = vt + (size_t)(a / group) * D;
                    float *oa = o + (size_t)a * D;
                    for (int d = 0; d < D; d += 8)
                        _mm256_store_ps(oa + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(vp + d), _mm256_load_ps(oa + d)));
                }
            }
            for (int a = 0; a < nh; a++) {
                float *dst = out + ((size_t)rows[i] * num_heads + (size_t)h0 * group + a) * D;
                const __m256 inv = _mm256_set1_ps(inv_sum[a]);
                for (int d = 0; d < D; d += 8)
                    _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_load_ps(o + (size_t)a * D + d), inv));
            }
        }
        free(scores);
        free(o);
    }
    return failed ? -3 : 0;
}
