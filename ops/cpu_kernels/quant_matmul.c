/* y[M, N] = x[M, K] @ W[N, K]^T for W kept in GGUF's block quantization (Q4_1, Q8_0),
 * computed in float32 on AVX2 + FMA + F16C CPUs.
 *
 * Why: a decode step on the CPU reads every weight once; float32 weights are 6.4x the
 * bytes of Q4_1 ones. The weights are dequantized exactly as gguf-py does it (d*q + m,
 * d*q, in float32: d*q is exact, so an FMA rounds the same as numpy's multiply-then-add),
 * so the model is the same model: only the order of the sums differs from a BLAS.
 *
 * Layout (repacked once at load by ops/quantized_linear.py): output rows in tiles of 32,
 * K in blocks of 32; one record per (tile t, block b), tiles outermost:
 *
 *   Q4_1 record (640 bytes):  d[32] fp16 | m[32] fp16 | for k in 0..31: 16 bytes,
 *                             byte j = q(n=j, k) | q(n=j+16, k) << 4
 *   Q8_0 record (1088 bytes): d[32] fp16 | for k in 0..31: 32 int8, byte j = q(n=j, k)
 *
 * so that the 32 weights W[n0..n0+31, k] of one k dequantize into four ymm registers.
 *
 * Batch invariance: every y[r, n] is one float accumulator that starts at 0 and takes
 * fma(x[r, k], W[n, k], acc) for k = 0, 1, ..., K-1 in order, whatever M is and whichever
 * path (fused or buffered) runs, so a row's result never depends on its batch.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE 32
#define QBLOCK 32
#define Q4_1_RECORD 640
#define Q8_0_RECORD 1088

/* One record's scales, and its 32 weights W[n0..n0+31, k] for one k, in four registers. */
#define Q4_1_SCALES(rec)                                                                     \
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((rec) + 0)));      \
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((rec) + 16)));     \
    const __m256 d2 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((rec) + 32)));     \
    const __m256 d3 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((rec) + 48)));     \
    const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((rec) + 64)));     \
    const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((rec) + 80)));     \
    const __m256 m2 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((rec) + 96)));     \
    const __m256 m3 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((rec) + 112)));    \
    const __m128i low = _mm_set1_epi8(0x0F);
#define Q4_1_WEIGHTS(rec, k)                                                                 \
    const __m128i v = _mm_loadu_si128((const __m128i *)((rec) + 128 + 16 * (k)));         \
    const __m128i lo = _mm_and_si128(v, low);                    /* n = 0..15 */          \
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low); /* n = 16..31 */         \
    const __m256 w0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m0); \
    const __m256 w1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m1); \
    const __m256 w2 = _mm256_fmadd_ps(d2, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m2); \
    const __m256 w3 = _mm256_fmadd_ps(d3, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m3);

#define Q8_0_SCALES(rec)                                                                     \
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((rec) + 0)));      \
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((rec) + 16)));     \
    const __m256 d2 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((rec) + 32)));     \
    const __m256 d3 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((rec) + 48)));
#define Q8_0_WEIGHTS(rec, k)                                                                 \
    const __m128i a = _mm_loadu_si128((const __m128i *)((rec) + 64 + 32 * (k)));          \
    const __m128i b = _mm_loadu_si128((const __m128i *)((rec) + 80 + 32 * (k)));          \
    const __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)), d0);     \
    const __m256 w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))), d1); \
    const __m256 w2 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d2);     \
    const __m256 w3 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), d3);

/* Dequantize one record into w[k * TILE + n] (for the register-blocked rows), or
 * multiply it straight into one row's accumulators (for a single row: no store). */
#define DEQUANT_FNS(T)                                                                       \
    static inline void dequant_##T(const uint8_t *rec, float *w) {                          \
        T##_SCALES(rec)                                                                      \
        for (int k = 0; k < QBLOCK; k++, w += TILE) {                                       \
            T##_WEIGHTS(rec, k)                                                              \
            _mm256_store_ps(w + 0, w0); _mm256_store_ps(w + 8, w1);                         \
            _mm256_store_ps(w + 16, w2); _mm256_store_ps(w + 24, w3);                       \
        }                                                                                    \
    }                                                                                        \
    static inline void fused1_##T(const uint8_t *rec, const float *x, float *y, int first) { \
        T##_SCALES(rec)                                                                      \
        __m256 a0, a1, a2, a3;                                                               \
        if (first) { a0 = a1 = a2 = a3 = _mm256_setzero_ps(); }                             \
        else { a0 = _mm256_loadu_ps(y); a1 = _mm256_loadu_ps(y + 8);                        \
               a2 = _mm256_loadu_ps(y + 16); a3 = _mm256_loadu_ps(y + 24); }                \
        for (int k = 0; k < QBLOCK; k++) {                                                   \
            T##_WEIGHTS(rec, k)                                                              \
            const __m256 xb = _mm256_broadcast_ss(x + k);                                    \
            a0 = _mm256_fmadd_ps(xb, w0, a0); a1 = _mm256_fmadd_ps(xb, w1, a1);             \
            a2 = _mm256_fmadd_ps(xb, w2, a2); a3 = _mm256_fmadd_ps(xb, w3, a3);             \
        }                                                                                    \
        _mm256_storeu_ps(y, a0); _mm256_storeu_ps(y + 8, a1);                               \
        _mm256_storeu_ps(y + 16, a2); _mm256_storeu_ps(y + 24, a3);                         \
    }
DEQUANT_FNS(Q4_1)
DEQUANT_FNS(Q8_0)

/* Rows of x against one dequantized block w[32 k][TILE], accumulating into y: the
 * accumulators live in registers for the block's 32 k and in y between blocks (a float
 * store and load change nothing, so the sum's order is k = 0..K-1 whatever the blocking).
 * Named variables, not arrays: gcc spills arrays of __m256 to the stack on every k. */
#define LOAD_ACC(r, a0, a1, a2, a3)                                                          \
    if (first) { a0 = a1 = a2 = a3 = _mm256_setzero_ps(); }                                \
    else { a0 = _mm256_loadu_ps(y + (size_t)(r) * N); a1 = _mm256_loadu_ps(y + (size_t)(r) * N + 8); \
           a2 = _mm256_loadu_ps(y + (size_t)(r) * N + 16); a3 = _mm256_loadu_ps(y + (size_t)(r) * N + 24); }
#define STORE_ACC(r, a0, a1, a2, a3)                                                         \
    _mm256_storeu_ps(y + (size_t)(r) * N, a0); _mm256_storeu_ps(y + (size_t)(r) * N + 8, a1); \
    _mm256_storeu_ps(y + (size_t)(r) * N + 16, a2); _mm256_storeu_ps(y + (size_t)(r) * N + 24, a3);
#define FMA_ROW(r, a0, a1, a2, a3)                                                           \
    { const __m256 xb = _mm256_broadcast_ss(x + (size_t)(r) * K + k);                     \
      a0 = _mm256_fmadd_ps(xb, _mm256_load_ps(wk), a0);                                   \
      a1 = _mm256_fmadd_ps(xb, _mm256_load_ps(wk + 8), a1);                               \
      a2 = _mm256_fmadd_ps(xb, _mm256_load_ps(wk + 16), a2);                              \
      a3 = _mm256_fmadd_ps(xb, _mm256_load_ps(wk + 24), a3); }

static inline void micro_1(const float *x, int K, const float *w, float *y, int N, int first) {
    __m256 a0, a1, a2, a3;
    LOAD_ACC(0, a0, a1, a2, a3)
    for (int k = 0; k < QBLOCK; k++) {
        const float *wk = w + k * TILE;
        FMA_ROW(0, a0, a1, a2, a3)
    }
    STORE_ACC(0, a0, a1, a2, a3)
}

static inline void micro_2(const float *x, int K, const float *w, float *y, int N, int first) {
    __m256 a0, a1, a2, a3, b0, b1, b2, b3;
    LOAD_ACC(0, a0, a1, a2, a3)
    LOAD_ACC(1, b0, b1, b2, b3)
    for (int k = 0; k < QBLOCK; k++) {
        const float *wk = w + k * TILE;
        FMA_ROW(0, a0, a1, a2, a3)
        FMA_ROW(1, b0, b1, b2, b3)
    }
    STORE_ACC(0, a0, a1, a2, a3)
    STORE_ACC(1, b0, b1, b2, b3)
}

static inline void micro_3(const float *x, int K, const float *w, float *y, int N, int first) {
    __m256 a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3;
    LOAD_ACC(0, a0, a1, a2, a3)
    LOAD_ACC(1, b0, b1, b2, b3)
    LOAD_ACC(2, c0, c1, c2, c3)
    for (int k = 0; k < QBLOCK; k++) {
        const float *wk = w + k * TILE;
        FMA_ROW(0, a0, a1, a2, a3)
        FMA_ROW(1, b0, b1, b2, b3)
        FMA_ROW(2, c0, c1, c2, c3)
    }
    STORE_ACC(0, a0, a1, a2, a3)
    STORE_ACC(1, b0, b1, b2, b3)
    STORE_ACC(2, c0, c1, c2, c3)
}

typedef void (*dequant_fn)(const uint8_t *, float *);
typedef void (*fused_fn)(const uint8_t *, const float *, float *, int);

static int matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads,
                  dequant_fn dequant, fused_fn fused, int record) {
    if (K % QBLOCK || N % TILE || M < 1) return -1;
    const int nb = K / QBLOCK, ntiles = N / TILE;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int t = 0; t < ntiles; t++) {
        /* One dequantized block, 32 x 32 floats: 4 KB, stays in L1. */
        float buf[QBLOCK * TILE] __attribute__((aligned(64)));
        const uint8_t *rec = w + (size_t)t * nb * record;
        float *yt = y + (size_t)t * TILE;
        for (int b = 0; b < nb; b++) {
            if (M == 1) {
                fused(rec + (size_t)b * record, x + (size_t)b * QBLOCK, yt, b == 0);
                continue;
            }
            dequant(rec + (size_t)b * record, buf);
            const float *xb = x + (size_t)b * QBLOCK;
            const int first = b == 0;
            int r = 0;
            for (; r + 3 <= M; r += 3) micro_3(xb + (size_t)r * K, K, buf, yt + (size_t)r * N, N, first);
            if (M - r == 2) micro_2(xb + (size_t)r * K, K, buf, yt + (size_t)r * N, N, first);
            else if (M - r == 1) micro_1(xb + (size_t)r * K, K, buf, yt + (size_t)r * N, N, first);
        }
    }
    return 0;
}

int q4_1_matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads) {
    return matmul(x, M, K, w, N, y, nthreads, dequant_Q4_1, fused1_Q4_1, Q4_1_RECORD);
}

int q8_0_matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads) {
    return matmul(x, M, K, w, N, y, nthreads, dequant_Q8_0, fused1_Q8_0, Q8_0_RECORD);
}
