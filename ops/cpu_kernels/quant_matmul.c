/* y[M, N] = x[M, K] @ W[N, K]^T for W kept in GGUF's block quantization (Q4_1, Q8_0),
 * computed in float32 (AVX2 + FMA + F16C; AVX-512 where the build has it).
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
 * so that the 32 weights W[n0..n0+31, k] of one k dequantize into four ymm (two zmm).
 *
 * Batch invariance: every y[r, n] is one float accumulator that starts at 0 and takes
 * fma(x[r, k], W[n, k], acc) for k = 0, 1, ..., K-1 in order, whatever M is and whichever
 * path (fused or buffered) runs, so a row's result never depends on its batch. The AVX-512
 * code does the same per lane, so both builds give the same bits.
 *
 * `qf_tiles` is an OpenMP "team" function (an orphaned `omp for`): called inside a parallel
 * region its tiles are shared among the team, outside one a single thread does them all.
 */
#ifndef LLMWORKER_QUANT_MATMUL_C
#define LLMWORKER_QUANT_MATMUL_C

#include "simd.h"

#define TILE 32
#define QBLOCK 32
#define Q4_1_RECORD 640
#define Q8_0_RECORD 1088
#ifndef FEW_ROWS_MAX
#define FEW_ROWS_MAX 4  /* AVX2: rows up to this many take few_rows (see there) */
#endif

enum { QT_Q4_1 = 0, QT_Q8_0 = 1 };

#ifdef __AVX512F__
/* ---- AVX-512: the 32 weights of one k in two zmm (lanes n = 0..15, 16..31) ---- */
#define Q4_1_SCALES(rec)                                                                     \
    const __m512 d0 = load_half16((rec) + 0), d1 = load_half16((rec) + 32);                \
    const __m512 m0 = load_half16((rec) + 64), m1 = load_half16((rec) + 96);               \
    const __m128i low = _mm_set1_epi8(0x0F);
#define Q4_1_WEIGHTS(rec, k)                                                                 \
    const __m128i v = _mm_loadu_si128((const __m128i *)((rec) + 128 + 16 * (k)));         \
    const __m512 w0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low))), m0); \
    const __m512 w1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low))), m1);
#define Q8_0_SCALES(rec) const __m512 d0 = load_half16((rec) + 0), d1 = load_half16((rec) + 32);
#define Q8_0_WEIGHTS(rec, k)                                                                 \
    const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                \
        _mm_loadu_si128((const __m128i *)((rec) + 64 + 32 * (k))))), d0);                  \
    const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                \
        _mm_loadu_si128((const __m128i *)((rec) + 80 + 32 * (k))))), d1);
#define VEC __m512
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VLOADA(p) _mm512_load_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSTOREA(p, v) _mm512_store_ps(p, v)
#define VBCAST(p) _mm512_set1_ps(*(p))
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VW 16
#define STORE_W(w)  VSTOREA((w), w0); VSTOREA((w) + 16, w1);
#define NACC 2
#else
/* ---- AVX2: the 32 weights of one k in four ymm (lanes n = 0..7, ..., 24..31) ----
 * Q4_1: a k's quant bytes are broadcast to both 128-bit halves of a ymm as they load, and
 * vpshufb (which stays within each half) spreads bytes 8i..8i+3 to the low half's 32-bit
 * lanes and 8i+4..8i+7 to the high half's: outputs in lane order. vpmovzxbd/vpmovsxbd from a
 * register (and the vpsrldq they need) cross the halves, and on Zen 3 they, not the FMAs, set
 * the pace of the one-row loop (the batch-1 decode call ran 1.16-1.22x faster without them:
 * BENCHMARKS.md, session 12).
 * Q8_0: each group of 8 signed bytes is sign-extended straight from memory (vpmovsxbd ymm,
 * m64): one instruction where the spreading takes a shuffle and a shift, and the crossing is
 * done by the load. On Zen 3 the 3-row decode call (a verification step's) ran 1.04x faster
 * than with the spreading; the one-row call, whose LM head waits on memory, the same
 * (BENCHMARKS.md, session 13).
 * The same integers reach the same cvt and FMAs: the same bits. */
#define SPREAD_CONSTS                                                                        \
    const __m256i sp_lo = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1, \
                                           4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1); \
    const __m256i sp_hi = _mm256_add_epi8(sp_lo, _mm256_set1_epi32(8));
#define BCAST16(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p)))
#define Q4_1_SCALES(rec)                                                                     \
    const __m256 d0 = load_half8((rec) + 0), d1 = load_half8((rec) + 16);                  \
    const __m256 d2 = load_half8((rec) + 32), d3 = load_half8((rec) + 48);                 \
    const __m256 m0 = load_half8((rec) + 64), m1 = load_half8((rec) + 80);                 \
    const __m256 m2 = load_half8((rec) + 96), m3 = load_half8((rec) + 112);                \
    const __m256i low = _mm256_set1_epi32(0x0F);                                            \
    SPREAD_CONSTS
#define Q4_1_WEIGHTS(rec, k)                                                                 \
    const __m256i v = BCAST16((rec) + 128 + 16 * (k));                                     \
    const __m256i u_lo = _mm256_shuffle_epi8(v, sp_lo), u_hi = _mm256_shuffle_epi8(v, sp_hi); \
    const __m256 w0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(_mm256_and_si256(u_lo, low)), m0); /* n = 0..7 */ \
    const __m256 w1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_and_si256(u_hi, low)), m1); \
    const __m256 w2 = _mm256_fmadd_ps(d2, _mm256_cvtepi32_ps(_mm256_srli_epi32(u_lo, 4)), m2); /* n = 16..23 */ \
    const __m256 w3 = _mm256_fmadd_ps(d3, _mm256_cvtepi32_ps(_mm256_srli_epi32(u_hi, 4)), m3);
#define Q8_0_SCALES(rec)                                                                     \
    const __m256 d0 = load_half8((rec) + 0), d1 = load_half8((rec) + 16);                  \
    const __m256 d2 = load_half8((rec) + 32), d3 = load_half8((rec) + 48);
/* 8 signed quant bytes at p as 8 floats */
#define SIGNED8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define Q8_0_WEIGHTS(rec, k)                                                                 \
    const __m256 w0 = _mm256_mul_ps(SIGNED8((rec) + 64 + 32 * (k)), d0);                   \
    const __m256 w1 = _mm256_mul_ps(SIGNED8((rec) + 72 + 32 * (k)), d1);                   \
    const __m256 w2 = _mm256_mul_ps(SIGNED8((rec) + 80 + 32 * (k)), d2);                   \
    const __m256 w3 = _mm256_mul_ps(SIGNED8((rec) + 88 + 32 * (k)), d3);
#define VEC __m256
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VLOADA(p) _mm256_load_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSTOREA(p, v) _mm256_store_ps(p, v)
#define VBCAST(p) _mm256_broadcast_ss(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VW 8
#define STORE_W(w)  VSTOREA((w), w0); VSTOREA((w) + 8, w1); VSTOREA((w) + 16, w2); VSTOREA((w) + 24, w3);
#define NACC 4
#endif

/* One row's accumulators for the 32 outputs of a tile: a0..a3 (a0, a1 under AVX-512). */
#if NACC == 2
#define ACC_DECL(a) VEC a##0, a##1;
#define ACC_ZERO(a) a##0 = a##1 = VZERO();
#define ACC_LOAD(a, p) a##0 = VLOAD(p); a##1 = VLOAD((p) + 16);
#define ACC_STORE(a, p) VSTORE(p, a##0); VSTORE((p) + 16, a##1);
#define ACC_FMA_W(a, xb) a##0 = VFMA(xb, w0, a##0); a##1 = VFMA(xb, w1, a##1);
#define ACC_FMA_BUF(a, xb, wk) a##0 = VFMA(xb, VLOADA(wk), a##0); a##1 = VFMA(xb, VLOADA((wk) + 16), a##1);
#else
#define ACC_DECL(a) VEC a##0, a##1, a##2, a##3;
#define ACC_ZERO(a) a##0 = a##1 = a##2 = a##3 = VZERO();
#define ACC_LOAD(a, p) a##0 = VLOAD(p); a##1 = VLOAD((p) + 8); a##2 = VLOAD((p) + 16); a##3 = VLOAD((p) + 24);
#define ACC_STORE(a, p) VSTORE(p, a##0); VSTORE((p) + 8, a##1); VSTORE((p) + 16, a##2); VSTORE((p) + 24, a##3);
#define ACC_FMA_W(a, xb) a##0 = VFMA(xb, w0, a##0); a##1 = VFMA(xb, w1, a##1); \
                         a##2 = VFMA(xb, w2, a##2); a##3 = VFMA(xb, w3, a##3);
#define ACC_FMA_BUF(a, xb, wk) a##0 = VFMA(xb, VLOADA(wk), a##0); a##1 = VFMA(xb, VLOADA((wk) + 8), a##1); \
                               a##2 = VFMA(xb, VLOADA((wk) + 16), a##2); a##3 = VFMA(xb, VLOADA((wk) + 24), a##3);
#endif

/* Dequantize one record into w[k * TILE + n] (for the register-blocked rows), or
 * multiply it straight into one row's accumulators (for a single row: no store). */
#define DEQUANT_FNS(T)                                                                       \
    static inline void dequant_##T(const uint8_t *rec, float *w) {                          \
        T##_SCALES(rec)                                                                      \
        for (int k = 0; k < QBLOCK; k++, w += TILE) {                                       \
            T##_WEIGHTS(rec, k)                                                              \
            STORE_W(w)                                                                       \
        }                                                                                    \
    }                                                                                        \
    static inline void fused1_##T(const uint8_t *rec, const float *x, float *y, int first) { \
        T##_SCALES(rec)                                                                      \
        ACC_DECL(a)                                                                          \
        if (first) { ACC_ZERO(a) } else { ACC_LOAD(a, y) }                                  \
        for (int k = 0; k < QBLOCK; k++) {                                                   \
            T##_WEIGHTS(rec, k)                                                              \
            const VEC xb = VBCAST(x + k);                                                    \
            ACC_FMA_W(a, xb)                                                                 \
        }                                                                                    \
        ACC_STORE(a, y)                                                                      \
    }
DEQUANT_FNS(Q4_1)
DEQUANT_FNS(Q8_0)

/* Rows of x against one dequantized block w[32 k][TILE], accumulating into y: the
 * accumulators live in registers for the block's 32 k and in y between blocks (a float
 * store and load change nothing, so the sum's order is k = 0..K-1 whatever the blocking).
 * Named variables, not arrays: gcc spills arrays of vectors to the stack on every k. */
#define ROW_LOAD(a, r) if (first) { ACC_ZERO(a) } else { ACC_LOAD(a, y + (size_t)(r) * ldy) }
#define ROW_FMA(a, r) { const VEC xb = VBCAST(x + (size_t)(r) * ldx + k); ACC_FMA_BUF(a, xb, wk) }

static inline void micro_1(const float *x, size_t ldx, const float *w, float *y, size_t ldy, int first) {
    ACC_DECL(a)
    ROW_LOAD(a, 0)
    for (int k = 0; k < QBLOCK; k++) {
        const float *wk = w + k * TILE;
        ROW_FMA(a, 0)
    }
    ACC_STORE(a, y)
}

static inline void micro_2(const float *x, size_t ldx, const float *w, float *y, size_t ldy, int first) {
    ACC_DECL(a) ACC_DECL(b)
    ROW_LOAD(a, 0) ROW_LOAD(b, 1)
    for (int k = 0; k < QBLOCK; k++) {
        const float *wk = w + k * TILE;
        ROW_FMA(a, 0) ROW_FMA(b, 1)
    }
    ACC_STORE(a, y) ACC_STORE(b, y + ldy)
}

static inline void micro_3(const float *x, size_t ldx, const float *w, float *y, size_t ldy, int first) {
    ACC_DECL(a) ACC_DECL(b) ACC_DECL(c)
    ROW_LOAD(a, 0) ROW_LOAD(b, 1) ROW_LOAD(c, 2)
    for (int k = 0; k < QBLOCK; k++) {
        const float *wk = w + k * TILE;
        ROW_FMA(a, 0) ROW_FMA(b, 1) ROW_FMA(c, 2)
    }
    ACC_STORE(a, y) ACC_STORE(b, y + ldy) ACC_STORE(c, y + 2 * ldy)
}

#ifdef __AVX512F__
/* Twice the registers: six rows at a time. */
static inline void micro_6(const float *x, size_t ldx, const float *w, float *y, size_t ldy, int first) {
    ACC_DECL(a) ACC_DECL(b) ACC_DECL(c) ACC_DECL(e) ACC_DECL(f) ACC_DECL(g)
    ROW_LOAD(a, 0) ROW_LOAD(b, 1) ROW_LOAD(c, 2) ROW_LOAD(e, 3) ROW_LOAD(f, 4) ROW_LOAD(g, 5)
    for (int k = 0; k < QBLOCK; k++) {
        const float *wk = w + k * TILE;
        ROW_FMA(a, 0) ROW_FMA(b, 1) ROW_FMA(c, 2) ROW_FMA(e, 3) ROW_FMA(f, 4) ROW_FMA(g, 5)
    }
    ACC_STORE(a, y) ACC_STORE(b, y + ldy) ACC_STORE(c, y + 2 * ldy)
    ACC_STORE(e, y + 3 * ldy) ACC_STORE(f, y + 4 * ldy) ACC_STORE(g, y + 5 * ldy)
}
#endif

#ifndef __AVX512F__
/* A few rows (2..4) on AVX2, straight from the record like the one-row path: each half of
 * the tile (16 outputs) is 2 ymm of weights a k, and each row keeps 2 accumulators, so four
 * rows fit the 16 registers. The buffered path instead stores the dequantized block and
 * reloads it for every group of rows: on Zen 3 (no AVX-512) its stores and reloads, not the
 * FMAs, set the pace of a 4-row verification step. Each weight is computed by the same
 * instructions as in Q4_1_WEIGHTS / Q8_0_WEIGHTS and each output takes the same FMAs in the
 * same order: the same bits as any other path. */
#define Q4_1_HALF_SCALES(rec, h)                                                             \
    const __m256 da = load_half8((rec) + 32 * (h)), db = load_half8((rec) + 32 * (h) + 16); \
    const __m256 ma = load_half8((rec) + 64 + 32 * (h)), mb = load_half8((rec) + 80 + 32 * (h)); \
    const __m256i low = _mm256_set1_epi32(0x0F);                                            \
    SPREAD_CONSTS
#define Q4_1_HALF_WEIGHTS(rec, h, k)                                                         \
    const __m256i v = BCAST16((rec) + 128 + 16 * (k));                                     \
    const __m256i u_lo = _mm256_shuffle_epi8(v, sp_lo), u_hi = _mm256_shuffle_epi8(v, sp_hi); \
    const __m256i qa = (h) ? _mm256_srli_epi32(u_lo, 4) : _mm256_and_si256(u_lo, low);        \
    const __m256i qb = (h) ? _mm256_srli_epi32(u_hi, 4) : _mm256_and_si256(u_hi, low);        \
    const __m256 wa = _mm256_fmadd_ps(da, _mm256_cvtepi32_ps(qa), ma);                     \
    const __m256 wb = _mm256_fmadd_ps(db, _mm256_cvtepi32_ps(qb), mb);
#define Q8_0_HALF_SCALES(rec, h)                                                             \
    const __m256 da = load_half8((rec) + 32 * (h)), db = load_half8((rec) + 32 * (h) + 16);
#define Q8_0_HALF_WEIGHTS(rec, h, k)                                                         \
    const __m256 wa = _mm256_mul_ps(SIGNED8((rec) + 64 + 32 * (k) + 16 * (h)), da);        \
    const __m256 wb = _mm256_mul_ps(SIGNED8((rec) + 72 + 32 * (k) + 16 * (h)), db);

#define HALF_DECL(a) __m256 a##0, a##1;
#define HALF_LOAD(a, r)                                                                      \
    if (first) { a##0 = a##1 = _mm256_setzero_ps(); }                                       \
    else { a##0 = _mm256_loadu_ps(y + (r) * ldy + 16 * h); a##1 = _mm256_loadu_ps(y + (r) * ldy + 16 * h + 8); }
#define HALF_FMA(a, r) {                                                                     \
    const __m256 xb = _mm256_broadcast_ss(x + (r) * ldx + k);                              \
    a##0 = _mm256_fmadd_ps(xb, wa, a##0); a##1 = _mm256_fmadd_ps(xb, wb, a##1); }
#define HALF_STORE(a, r)                                                                     \
    _mm256_storeu_ps(y + (r) * ldy + 16 * h, a##0); _mm256_storeu_ps(y + (r) * ldy + 16 * h + 8, a##1);

#define FEW_FNS(T)                                                                           \
    static inline void few2_##T(const uint8_t *rec, const float *x, size_t ldx, float *y, size_t ldy, int first) { \
        for (int h = 0; h < 2; h++) {                                                        \
            T##_HALF_SCALES(rec, h)                                                          \
            HALF_DECL(a) HALF_DECL(b) HALF_LOAD(a, 0) HALF_LOAD(b, 1)                       \
            for (int k = 0; k < QBLOCK; k++) { T##_HALF_WEIGHTS(rec, h, k) HALF_FMA(a, 0) HALF_FMA(b, 1) } \
            HALF_STORE(a, 0) HALF_STORE(b, 1)                                                \
        }                                                                                    \
    }                                                                                        \
    static inline void few3_##T(const uint8_t *rec, const float *x, size_t ldx, float *y, size_t ldy, int first) { \
        for (int h = 0; h < 2; h++) {                                                        \
            T##_HALF_SCALES(rec, h)                                                          \
            HALF_DECL(a) HALF_DECL(b) HALF_DECL(c) HALF_LOAD(a, 0) HALF_LOAD(b, 1) HALF_LOAD(c, 2) \
            for (int k = 0; k < QBLOCK; k++) {                                               \
                T##_HALF_WEIGHTS(rec, h, k) HALF_FMA(a, 0) HALF_FMA(b, 1) HALF_FMA(c, 2)    \
            }                                                                                \
            HALF_STORE(a, 0) HALF_STORE(b, 1) HALF_STORE(c, 2)                               \
        }                                                                                    \
    }                                                                                        \
    static inline void few4_##T(const uint8_t *rec, const float *x, size_t ldx, float *y, size_t ldy, int first) { \
        for (int h = 0; h < 2; h++) {                                                        \
            T##_HALF_SCALES(rec, h)                                                          \
            HALF_DECL(a) HALF_DECL(b) HALF_DECL(c) HALF_DECL(e)                              \
            HALF_LOAD(a, 0) HALF_LOAD(b, 1) HALF_LOAD(c, 2) HALF_LOAD(e, 3)                 \
            for (int k = 0; k < QBLOCK; k++) {                                               \
                T##_HALF_WEIGHTS(rec, h, k) HALF_FMA(a, 0) HALF_FMA(b, 1) HALF_FMA(c, 2) HALF_FMA(e, 3) \
            }                                                                                \
            HALF_STORE(a, 0) HALF_STORE(b, 1) HALF_STORE(c, 2) HALF_STORE(e, 3)              \
        }                                                                                    \
    }
FEW_FNS(Q4_1)
FEW_FNS(Q8_0)

static inline void few_rows(const uint8_t *rec, int qtype, const float *x, size_t ldx, int M,
                            float *y, size_t ldy, int first) {
    if (qtype == QT_Q4_1) {
        if (M == 2) few2_Q4_1(rec, x, ldx, y, ldy, first);
        else if (M == 3) few3_Q4_1(rec, x, ldx, y, ldy, first);
        else few4_Q4_1(rec, x, ldx, y, ldy, first);
    } else {
        if (M == 2) few2_Q8_0(rec, x, ldx, y, ldy, first);
        else if (M == 3) few3_Q8_0(rec, x, ldx, y, ldy, first);
        else few4_Q8_0(rec, x, ldx, y, ldy, first);
    }
}
#endif

static inline int qf_record(int qtype) { return qtype == QT_Q4_1 ? Q4_1_RECORD : Q8_0_RECORD; }

/* Tile t (outputs 32t..32t+31) for rows 0..M-1 into yt[r * ldy + n], from x[r * ldx + k]. */
static void qf_tile(const uint8_t *w, int qtype, int K, const float *x, size_t ldx, int M,
                    float *yt, size_t ldy, int t) {
    const int nb = K / QBLOCK, record = qf_record(qtype);
    const uint8_t *rec = w + (size_t)t * nb * record;
    /* One dequantized block, 32 x 32 floats: 4 KB, stays in L1. */
    float buf[QBLOCK * TILE] __attribute__((aligned(64)));
    for (int b = 0; b < nb; b++, rec += record) {
        const float *xb = x + (size_t)b * QBLOCK;
        const int first = b == 0;
        /* Records are fetched ahead into L2 (simd.h), for any number of rows. 8 rows, the fused
         * decoder's float32 call, one process: 16.88 -> 15.48 ms (AVX-512 build), 17.28 ->
         * 15.87 (AVX2 build, same Zen 4; session 7). One row: on a real AVX2-only Zen 3 the
         * batch-1 call ran 9.98 -> 9.42 ms with it (session 8; the AVX2 build forced on Zen 4
         * had lost 8%, but float32 is not that machine's default). */
        prefetch_bytes_l2(rec + (qtype == QT_Q4_1 ? Q4_1_AHEAD_L2 : Q8_0_AHEAD_L2), (size_t)record);
        if (M == 1) {
            if (qtype == QT_Q4_1) fused1_Q4_1(rec, xb, yt, first);
            else fused1_Q8_0(rec, xb, yt, first);
            continue;
        }
#ifndef __AVX512F__
        if (M <= FEW_ROWS_MAX) {
            few_rows(rec, qtype, xb, ldx, M, yt, ldy, first);
            continue;
        }
#endif
        if (qtype == QT_Q4_1) dequant_Q4_1(rec, buf);
        else dequant_Q8_0(rec, buf);
        int r = 0;
#ifdef __AVX512F__
        for (; r + 6 <= M; r += 6) micro_6(xb + r * ldx, ldx, buf, yt + r * ldy, ldy, first);
#endif
        for (; r + 3 <= M; r += 3) micro_3(xb + r * ldx, ldx, buf, yt + r * ldy, ldy, first);
        if (M - r == 2) micro_2(xb + r * ldx, ldx, buf, yt + r * ldy, ldy, first);
        else if (M - r == 1) micro_1(xb + r * ldx, ldx, buf, yt + r * ldy, ldy, first);
    }
}

/* Every tile of y = x @ W^T, shared among the team (see the top). */
static void qf_tiles(const uint8_t *w, int qtype, int N, int K, const float *x, size_t ldx, int M,
                     float *y, size_t ldy) {
#pragma omp for schedule(static)
    for (int t = 0; t < N / TILE; t++) qf_tile(w, qtype, K, x, ldx, M, y + (size_t)t * TILE, ldy, t);
}

static int qf_matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads, int qtype) {
    if (K % QBLOCK || N % TILE || M < 1) return -1;
#pragma omp parallel num_threads(nthreads)
    qf_tiles(w, qtype, N, K, x, (size_t)K, M, y, (size_t)N);
    return 0;
}

int q4_1_matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads) {
    return qf_matmul(x, M, K, w, N, y, nthreads, QT_Q4_1);
}

int q8_0_matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads) {
    return qf_matmul(x, M, K, w, N, y, nthreads, QT_Q8_0);
}

#endif
