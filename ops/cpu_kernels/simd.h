/* Vector helpers shared by the kernels (AVX2 + FMA at least; see __init__.py for the ISAs).
 *
 * Reductions here have one fixed order whatever the ISA a kernel is built for, so the
 * AVX2 and AVX-512 builds of a kernel give the same bits: hsum8 adds the halves, then
 * the pairs, then the two last lanes.
 */
#ifndef LLMWORKER_SIMD_H
#define LLMWORKER_SIMD_H

#include <immintrin.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* hsum8 of eight vectors at once, in lane u: v[u]'s sum with hsum8's additions in its order,
 * ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)), so the same bits; a transpose as it
 * goes, where eight hsum8s spend three shuffles and three dependent adds each. */
static inline __m256 hsum8x8(const __m256 v[8]) {
    __m256 t[4]; /* t[p]: v[2p]'s x_i + x_(i+4) in the low half, v[2p + 1]'s in the high */
    for (int p = 0; p < 4; p++)
        t[p] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x31));
    /* + the pair two lanes on: [v0 v0 v2 v2 | v1 v1 v3 v3] and [v4 v4 v6 v6 | v5 v5 v7 v7] */
    const __m256 u0 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 u1 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm256_shuffle_ps(t[2], t[3], _MM_SHUFFLE(3, 2, 3, 2)));
    /* + the next lane: [v0 v2 v4 v6 | v1 v3 v5 v7], then in order */
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* The float sum of 32 floats at x in one fixed order (a quantized block's activations: the
 * float and integer matmuls' sx, quant_matmul.c and quant_matmul_int8.c). */
static inline float block_sum32(const float *x) {
    const __m256 a = _mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 16));
    const __m256 b = _mm256_add_ps(_mm256_loadu_ps(x + 8), _mm256_loadu_ps(x + 24));
    return hsum8(_mm256_add_ps(a, b));
}

/* e^x to float rounding (Cephes' expf polynomial, 8 lanes), x clamped to [-87.3, 88.3]. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
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

/* x[0..n) = c tanh(x / c) in place (Gemma 2's soft-capping of attention scores and logits),
 * tanh|y| = (1 - e^-2|y|) / (1 + e^-2|y|) with exp8, the sign put back: within ~3e-8 of
 * tanhf absolutely (c times that on the result), where a scalar tanhf a value cost the
 * Gemma 2 step a fifth of its time. The tail goes through a padded copy, so every value
 * takes the same arithmetic whatever n is. */
static inline void softcap_inplace(float *x, int64_t n, float c) {
    const __m256 vc = _mm256_set1_ps(c), inv = _mm256_set1_ps(1.0f / c), one = _mm256_set1_ps(1.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f), m2 = _mm256_set1_ps(-2.0f);
    for (int64_t j = 0; j < n; j += 8) {
        float pad[8] = {0};
        const int64_t k = n - j < 8 ? n - j : 8;
        float *p = k == 8 ? x + j : pad;
        if (k < 8) memcpy(pad, x + j, sizeof(float) * (size_t)k);
        const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(p), inv);
        const __m256 s = _mm256_and_ps(y, sign);
        const __m256 t = exp8(_mm256_mul_ps(_mm256_andnot_ps(sign, y), m2));
        const __m256 th = _mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
        _mm256_storeu_ps(p, _mm256_mul_ps(vc, _mm256_or_ps(th, s)));
        if (k < 8) memcpy(x + j, pad, sizeof(float) * (size_t)k);
    }
}

/* Asks for the cache lines of bytes [p, p + bytes) into L2 (the T1 hint; never faults): the
 * kernels' streams are read a few KB ahead, more lines in flight than L1's miss buffers hold.
 * always_inline: GCC (12) counts a prefetch as no side effect, so a call it does not inline
 * (a large kernel's inlining budget spent) is a call to a pure function whose result nobody
 * uses, and it deletes it: the integer kernels' weight prefetches had been compiled away that
 * way since they were written (tests/test_cpu_isa.py counts them in each build). */
static inline __attribute__((always_inline)) void prefetch_bytes_l2(const void *p, size_t bytes) {
    for (size_t l = 0; l < bytes; l += 64) _mm_prefetch((const char *)p + l, _MM_HINT_T1);
}

/* How far ahead the weight kernels fetch a quantized block's record into L2, by the block's
 * GGUF type (quant_matmul.c, quant_matmul_int8.c; their figures are there). */
#define Q4_1_AHEAD_L2 6144
#define Q8_0_AHEAD_L2 12288

/* Eight fp16 scales at p, as floats. */
static inline __m256 load_half8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

#ifdef __AVX512F__
static inline __m512 load_half16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#endif

#endif
