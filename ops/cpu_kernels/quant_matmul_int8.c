/* y[M, N] = x[M, K] @ W[N, K]^T with integer dot products, as llama.cpp computes it: x is
 * quantized per row and block of 32 to int8 (`qa_rows`: scale dx = max|x| / 127,
 * xq = round(x / dx), and the block's float sum sx), and each block's dot product of int8
 * x with the weights' small integers is exact in int32:
 *
 *   Q4_1 (w = d q + m, q in 0..15):  y += float(sum xq q) * (d dx), then y += m sx
 *   Q8_0 (w = d q, q in -127..127):  y += float(sum xq q) * (d dx)
 *
 * (one fma each, over blocks b = 0, 1, ... in order). This is not the float32 product: x
 * loses about 1/254 of its block's largest value per element, so it is a flag, off by
 * default (ops/quantized_linear.py). A row's result depends only on the row: the int8
 * sums are exact, whatever instruction makes them, so every build (AVX-512 VNNI vpdpbusd,
 * AVX-VNNI, AVX2 vpmaddubsw) gives the same bits.
 *
 * Layout (ops/quantized_linear.py `repack_int8`): tiles of 32 outputs, blocks of 32 k, one
 * record per (tile, block), tiles outermost; the quants in chunks of 64 bytes, each holding
 * 16 outputs x 4 consecutive k so that one 32-bit lane is one output's 4 products:
 *
 *   Q4_1 record (640 bytes):  d[32] fp16 | m[32] fp16 | chunks c = 4h + p (h 0..1, p 0..3):
 *       byte 4n + j = q(16h + n, 8p + j) | q(16h + n, 8p + 4 + j) << 4     (n 0..15, j 0..3)
 *   Q8_0 record (1152 bytes): d[32] fp16 | s[32] int16 = sum_k q(n, k) | chunks c = 8h + p
 *       (h 0..1, p 0..7): byte 4n + j = q(16h + n, 4p + j)
 *
 * vpdpbusd takes unsigned x signed bytes: Q4_1's quants are the unsigned side; for Q8_0 the
 * activations go unsigned as xq + 128, and 128 s takes the offset back out.
 */
#ifndef LLMWORKER_QUANT_MATMUL_INT8_C
#define LLMWORKER_QUANT_MATMUL_INT8_C

#include "simd.h"

#define I8_TILE 32
#define I8_QBLOCK 32
#define Q4_1_I8_RECORD 640
#define Q8_0_I8_RECORD 1152

enum { QT_Q4_1_I8 = 2, QT_Q8_0_I8 = 3 };

/* One row's activations quantized: xq[K] int8, dx[K / 32] scales, sx[K / 32] block sums. */
typedef struct {
    int8_t *q;
    float *d;
    float *s;
} qact;

/* Quantize row x[K] (K a multiple of 32) into a: AVX2 code in every build, so one rounding. */
static void qa_row(const float *x, int K, qact a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < K / I8_QBLOCK; b++) {
        const float *xb = x + (size_t)b * I8_QBLOCK;
        const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        const __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        a.d[b] = amax / 127.0f;
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        /* round to nearest even (the default MXCSR mode); |x| id <= 127 up to rounding */
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id));
        const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
        /* pack 32 int32 -> 32 int8 in order (packs interleave 128-bit lanes; permute back) */
        const __m256i p16 = _mm256_packs_epi32(i0, i1), q16 = _mm256_packs_epi32(i2, i3);
        __m256i p8 = _mm256_packs_epi16(p16, q16);
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(a.q + (size_t)b * I8_QBLOCK), p8);
        a.s[b] = hsum8(_mm256_add_ps(_mm256_add_ps(v0, v2), _mm256_add_ps(v1, v3)));
    }
}

/* Rows 0..M-1 of x (stride ldx) into a[r] = (q + r K, d + r K/32, s + r K/32), shared
 * among the team. */
static void qa_rows(const float *x, size_t ldx, int M, int K, qact a) {
    const int nb = K / I8_QBLOCK;
#pragma omp for schedule(static)
    for (int r = 0; r < M; r++) {
        qact ar = {a.q + (size_t)r * K, a.d + (size_t)r * nb, a.s + (size_t)r * nb};
        qa_row(x + (size_t)r * ldx, K, ar);
    }
}

static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(__AVX512VNNI__)
/* ---- AVX-512 VNNI: 16 outputs per zmm, R rows at once sharing each unpacked chunk ---- */
#define I8_R 4

static inline __attribute__((always_inline)) void q4_1_i8_rows(const uint8_t *rec0, int nb, const qact *a, int R, float *y, size_t ldy) {
    __m512 acc[I8_R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = rec0 + (size_t)b * Q4_1_I8_RECORD;
        for (int h = 0; h < 2; h++) {
            __m512i s[I8_R];
            for (int r = 0; r < R; r++) s[r] = _mm512_setzero_si512();
            for (int p = 0; p < 4; p++) {
                const __m512i v = _mm512_loadu_si512(rec + 128 + (h * 4 + p) * 64);
                const __m512i lo = _mm512_and_si512(v, low);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int r = 0; r < R; r++) {
                    const int8_t *xq = a[r].q + b * I8_QBLOCK + 8 * p;
                    s[r] = _mm512_dpbusd_epi32(s[r], lo, _mm512_set1_epi32(load_i32(xq)));
                    s[r] = _mm512_dpbusd_epi32(s[r], hi, _mm512_set1_epi32(load_i32(xq + 4)));
                }
            }
            const __m512 d = load_half16(rec + 32 * h), m = load_half16(rec + 64 + 32 * h);
            for (int r = 0; r < R; r++) {
                const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(a[r].d[b]));
                acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), dd, acc[r][h]);
                acc[r][h] = _mm512_fmadd_ps(m, _mm512_set1_ps(a[r].s[b]), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(y + r * ldy, acc[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
}

/* xu: the rows' xq + 128 (as unsigned bytes), for vpdpbusd's unsigned side. */
static inline __attribute__((always_inline)) void q8_0_i8_rows(const uint8_t *rec0, int nb, const qact *a, const uint8_t *const *xu, int R,
                                float *y, size_t ldy) {
    __m512 acc[I8_R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = rec0 + (size_t)b * Q8_0_I8_RECORD;
        for (int h = 0; h < 2; h++) {
            __m512i s[I8_R];
            for (int r = 0; r < R; r++) s[r] = _mm512_setzero_si512();
            for (int p = 0; p < 8; p++) {
                const __m512i q = _mm512_loadu_si512(rec + 128 + (h * 8 + p) * 64);
                for (int r = 0; r < R; r++)
                    s[r] = _mm512_dpbusd_epi32(s[r], _mm512_set1_epi32(load_i32((const int8_t *)xu[r] + b * I8_QBLOCK + 4 * p)), q);
            }
            const __m512i off = _mm512_slli_epi32(
                _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(rec + 64 + 32 * h))), 7);
            const __m512 d = load_half16(rec + 32 * h);
            for (int r = 0; r < R; r++) {
                const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(a[r].d[b]));
                acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s[r], off)), dd, acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(y + r * ldy, acc[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
}
#else
/* ---- AVX2 (with or without AVX-VNNI): 8 outputs per ymm, one row at a time ---- */
#define I8_R 1

#if defined(__AVXVNNI__)
#define DOT_INIT() _mm256_setzero_si256()
#define DOT_ADD(s, u, x) s = _mm256_dpbusd_avx_epi32(s, u, x)
#define DOT_DONE(s) (s)
#else
/* int16 partial sums: 8 products of at most 15 x 127 per pair stay below 2^15 */
#define DOT_INIT() _mm256_setzero_si256()
#define DOT_ADD(s, u, x) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u, x))
#define DOT_DONE(s) _mm256_madd_epi16(s, _mm256_set1_epi16(1))
#endif

static inline __attribute__((always_inline)) void q4_1_i8_rows(const uint8_t *rec0, int nb, const qact *a, int R, float *y, size_t ldy) {
    (void)R;
    (void)ldy;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = rec0 + (size_t)b * Q4_1_I8_RECORD;
        const int8_t *xq = a[0].q + b * I8_QBLOCK;
        const __m256 dx = _mm256_set1_ps(a[0].d[b]), sx = _mm256_set1_ps(a[0].s[b]);
        for (int e = 0; e < 4; e++) { /* outputs 8e..8e+7: half h = e / 2, bytes 32 (e % 2) */
            __m256i s = DOT_INIT();
            for (int p = 0; p < 4; p++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 128 + ((e / 2) * 4 + p) * 64 + 32 * (e % 2)));
                DOT_ADD(s, _mm256_and_si256(v, low), _mm256_set1_epi32(load_i32(xq + 8 * p)));
                DOT_ADD(s, _mm256_and_si256(_mm256_srli_epi16(v, 4), low), _mm256_set1_epi32(load_i32(xq + 8 * p + 4)));
            }
            const __m256 dd = _mm256_mul_ps(load_half8(rec + 16 * e), dx);
            acc[e] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT_DONE(s)), dd, acc[e]);
            acc[e] = _mm256_fmadd_ps(load_half8(rec + 64 + 16 * e), sx, acc[e]);
        }
    }
    for (int e = 0; e < 4; e++) _mm256_storeu_ps(y + 8 * e, acc[e]);
}

static inline __attribute__((always_inline)) void q8_0_i8_rows(const uint8_t *rec0, int nb, const qact *a, const uint8_t *const *xu, int R,
                                float *y, size_t ldy) {
    (void)R;
    (void)xu;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = rec0 + (size_t)b * Q8_0_I8_RECORD;
        const int8_t *xq = a[0].q + b * I8_QBLOCK;
        const __m256 dx = _mm256_set1_ps(a[0].d[b]);
        for (int e = 0; e < 4; e++) {
            __m256i s = _mm256_setzero_si256();
            for (int p = 0; p < 8; p++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(rec + 128 + ((e / 2) * 8 + p) * 64 + 32 * (e % 2)));
                const __m256i x4 = _mm256_set1_epi32(load_i32(xq + 4 * p));
#if defined(__AVXVNNI__)
                s = _mm256_dpbusd_avx_epi32(s, _mm256_xor_si256(x4, _mm256_set1_epi8((char)0x80)), q);
#else
                /* |x| (unsigned) times q with x's sign: products below 2^15 in pairs, as
                 * long as no q is -128 (repack_int8 refuses those) */
                s = _mm256_add_epi32(s, _mm256_madd_epi16(
                    _mm256_maddubs_epi16(_mm256_sign_epi8(x4, x4), _mm256_sign_epi8(q, x4)), _mm256_set1_epi16(1)));
#endif
            }
#if defined(__AVXVNNI__)
            s = _mm256_sub_epi32(s, _mm256_slli_epi32(
                _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(rec + 64 + 16 * e))), 7));
#endif
            const __m256 dd = _mm256_mul_ps(load_half8(rec + 16 * e), dx);
            acc[e] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), dd, acc[e]);
        }
    }
    for (int e = 0; e < 4; e++) _mm256_storeu_ps(y + 8 * e, acc[e]);
    (void)ldy;
}
#endif

/* Tile t for rows 0..M-1 into yt[r * ldy + n] from their quantized activations a (and xu:
 * xq + 128 per row, for Q8_0 where the build needs it; NULL otherwise). */
static void qi_tile(const uint8_t *w, int qtype, int K, const qact *a, const uint8_t *const *xu, int M,
                    float *yt, size_t ldy, int t) {
    const int nb = K / I8_QBLOCK;
    const int record = qtype == QT_Q4_1_I8 ? Q4_1_I8_RECORD : Q8_0_I8_RECORD;
    const uint8_t *rec = w + (size_t)t * nb * record;
    /* I8_R rows at a time, then one at a time (constant counts: the loops over rows unroll) */
    int r = 0;
    for (; r + I8_R <= M; r += I8_R) {
        float *yr = yt + (size_t)r * ldy;
        if (qtype == QT_Q4_1_I8) q4_1_i8_rows(rec, nb, a + r, I8_R, yr, ldy);
        else q8_0_i8_rows(rec, nb, a + r, xu ? xu + r : NULL, I8_R, yr, ldy);
    }
    for (; r < M; r++) {
        float *yr = yt + (size_t)r * ldy;
        if (qtype == QT_Q4_1_I8) q4_1_i8_rows(rec, nb, a + r, 1, yr, ldy);
        else q8_0_i8_rows(rec, nb, a + r, xu ? xu + r : NULL, 1, yr, ldy);
    }
}

/* Per-row views of quantized activations laid out as qa_rows writes them. */
static void qa_views(qact a, int M, int K, qact *rows) {
    const int nb = K / I8_QBLOCK;
    for (int r = 0; r < M; r++) rows[r] = (qact){a.q + (size_t)r * K, a.d + (size_t)r * nb, a.s + (size_t)r * nb};
}

/* xu[r] = xq[r] + 128 for rows 0..M-1 (unsigned bytes), shared among the team. */
static void qa_unsigned(const int8_t *xq, int M, int K, uint8_t *xu) {
#pragma omp for schedule(static)
    for (int r = 0; r < M; r++)
        for (int k = 0; k < K; k++) xu[(size_t)r * K + k] = (uint8_t)(xq[(size_t)r * K + k] ^ 0x80);
}

/* Whether this build's Q8_0 kernel reads xq + 128. */
static inline int qi_needs_unsigned(void) {
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
    return 1;
#else
    return 0;
#endif
}

/* Every tile, shared among the team; `views` are qa_views of the activations. */
static void qi_tiles(const uint8_t *w, int qtype, int N, int K, const qact *views, const uint8_t *const *xu,
                     int M, float *y, size_t ldy) {
#pragma omp for schedule(static)
    for (int t = 0; t < N / I8_TILE; t++) qi_tile(w, qtype, K, views, xu, M, y + (size_t)t * I8_TILE, ldy, t);
}

static int qi_matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads, int qtype) {
    if (K % I8_QBLOCK || N % I8_TILE || M < 1) return -1;
    const int nb = K / I8_QBLOCK;
    const int unsigned_x = qtype == QT_Q8_0_I8 && qi_needs_unsigned();
    int8_t *q = malloc((size_t)M * K);
    float *ds = malloc(sizeof(float) * 2 * (size_t)M * nb);
    qact *views = malloc(sizeof(qact) * (size_t)M);
    uint8_t *xu = unsigned_x ? malloc((size_t)M * K) : NULL;
    const uint8_t **xus = unsigned_x ? malloc(sizeof(uint8_t *) * (size_t)M) : NULL;
    int rc = 0;
    if (!q || !ds || !views || (unsigned_x && (!xu || !xus))) {
        rc = -3;
    } else {
        const qact a = {q, ds, ds + (size_t)M * nb};
        qa_views(a, M, K, views);
        if (unsigned_x)
            for (int r = 0; r < M; r++) xus[r] = xu + (size_t)r * K;
#pragma omp parallel num_threads(nthreads)
        {
            qa_rows(x, (size_t)K, M, K, a);
            if (unsigned_x) qa_unsigned(q, M, K, xu);
            qi_tiles(w, qtype, N, K, views, xus, M, y, (size_t)N);
        }
    }
    free(q);
    free(ds);
    free(views);
    free(xu);
    free(xus);
    return rc;
}

int q4_1_i8_matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads) {
    return qi_matmul(x, M, K, w, N, y, nthreads, QT_Q4_1_I8);
}

int q8_0_i8_matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads) {
    return qi_matmul(x, M, K, w, N, y, nthreads, QT_Q8_0_I8);
}

#endif
