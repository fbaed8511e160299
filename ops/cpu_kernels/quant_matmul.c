/* y[M, N] = x[M, K] @ W[N, K]^T for W kept in GGUF's block quantization (Q4_1, Q8_0),
 * computed in float32 (AVX2 + FMA + F16C code, in every ISA's build).
 *
 * Why: a decode step on the CPU reads every weight once; float32 weights are 6.4x the
 * bytes of Q4_1 ones. The quants are converted to float exactly; only the order of the
 * arithmetic differs from multiplying gguf-py's dequantized weights (d*q + m, d*q).
 *
 * Layout (repacked once at load by ops/quantized_linear.py): output rows in tiles of 32,
 * K in blocks of 32; one record per (tile t, block b), tiles outermost:
 *
 *   Q4_1 record (640 bytes):  d[32] fp16 | m[32] fp16 | for k in 0..31: 16 bytes,
 *                             byte j = q(n=j, k) | q(n=j+16, k) << 4
 *   Q8_0 record (1088 bytes): d[32] fp16 | for k in 0..31: 32 int8, byte j = q(n=j, k)
 *
 * so that the 32 quants q[n0..n0+31, k] of one k convert into four ymm.
 *
 * The arithmetic: the block's scale comes out of the sum over its 32 k (as the integer
 * kernels do, quant_matmul_int8.c). For each row, output n and block b, in order b = 0, 1, ...:
 *
 *   s = 0;  s = fma(x[k], float(q[n, k]), s)  for k = 32b .. 32b + 31 in order
 *   y = fma(d[n, b], s, y)                    (y = 0 before block 0)
 *   Q4_1: y = fma(m[n, b], sx[b], y)          sx[b] = block_sum32 of x's block (simd.h)
 *
 * One FMA per weight and row. Multiplying the dequantized weight instead (w = fma(d, q, m),
 * then fma(x, w, y)) took two: on Zen 3 the one-row loop was bound by them, not by memory.
 *
 * Batch invariance: every path (one row, a few rows, the buffered block) does exactly the
 * above for each row, whatever M is, so a row's bits never depend on its batch. The code is
 * AVX2 in every build (as qa_row is): the builds for other ISAs give the same bits.
 *
 * `qf_tiles` is an OpenMP "team" function (an orphaned `omp for`): called inside a parallel
 * region its tiles are shared among the team, outside one a single thread does them all.
 */
#ifndef LLMWORKER_QUANT_MATMUL_C
#define LLMWORKER_QUANT_MATMUL_C

#include "quant_types.h"

#define TILE 32
#define QBLOCK 32
#ifndef FEW_ROWS_MAX
#define FEW_ROWS_MAX 4  /* rows up to this many take few_rows (see there) */
#endif

/* ---- one k's 32 quants as floats in four ymm (lanes n = 0..7, ..., 24..31) ----
 * Q4_1: a k's quant bytes are broadcast to both 128-bit halves of a ymm as they load, and
 * vpshufb (which stays within each half) spreads bytes 8i..8i+3 to the low half's 32-bit
 * lanes and 8i+4..8i+7 to the high half's: outputs in lane order. vpmovzxbd/vpmovsxbd from a
 * register (and the vpsrldq they need) cross the halves, and on Zen 3 they, not the FMAs, set
 * the pace of the one-row loop (the batch-1 decode call ran 1.16-1.22x faster without them:
 * BENCHMARKS.md, session 12).
 * Q8_0: each group of 8 signed bytes is sign-extended straight from memory (vpmovsxbd ymm,
 * m64): one instruction where the spreading takes a shuffle and a shift, and the crossing is
 * done by the load (BENCHMARKS.md, session 13). */
#define SPREAD_CONSTS                                                                        \
    const __m256i sp_lo = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1, \
                                           4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1); \
    const __m256i sp_hi = _mm256_add_epi8(sp_lo, _mm256_set1_epi32(8));
#define BCAST16(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p)))
#define Q4_1_CONSTS                                                                          \
    const __m256i low = _mm256_set1_epi32(0x0F);                                            \
    SPREAD_CONSTS
#define Q4_1_QUANTS(rec, k)                                                                  \
    const __m256i v = BCAST16((rec) + 128 + 16 * (k));                                     \
    const __m256i u_lo = _mm256_shuffle_epi8(v, sp_lo), u_hi = _mm256_shuffle_epi8(v, sp_hi); \
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(u_lo, low)); /* n = 0..7 */      \
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(u_hi, low));                     \
    const __m256 w2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(u_lo, 4)); /* n = 16..23 */     \
    const __m256 w3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(u_hi, 4));
#define Q8_0_CONSTS
/* 8 signed quant bytes at p as 8 floats */
#define SIGNED8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define Q8_0_QUANTS(rec, k)                                                                  \
    const __m256 w0 = SIGNED8((rec) + 64 + 32 * (k)), w1 = SIGNED8((rec) + 72 + 32 * (k)); \
    const __m256 w2 = SIGNED8((rec) + 80 + 32 * (k)), w3 = SIGNED8((rec) + 88 + 32 * (k));

/* The end of a block for 8 outputs of one row, their sums s: y = fma(d, s, y), then for Q4_1
 * y = fma(m, sx, y). */
static inline __attribute__((always_inline)) void block_end8(__m256 d, __m256 m, int has_m, __m256 s, float sx,
                                                             float *y, int first) {
    __m256 a = _mm256_fmadd_ps(d, s, first ? _mm256_setzero_ps() : _mm256_loadu_ps(y));
    if (has_m) a = _mm256_fmadd_ps(m, _mm256_set1_ps(sx), a);
    _mm256_storeu_ps(y, a);
}

/* A record's scales as floats, converted once for all the rows: d[32], then m[32] for Q4_1
 * (d at the record's start, m 64 bytes on). */
static inline void block_scales(const uint8_t *rec, int has_m, float *dm) {
    for (int j = 0; j < 4; j++) _mm256_store_ps(dm + 8 * j, load_half8(rec + 16 * j));
    for (int j = 0; has_m && j < 4; j++) _mm256_store_ps(dm + 32 + 8 * j, load_half8(rec + 64 + 16 * j));
}
#define DM_END8(dm, has_m, j, s, sx, y, first) \
    block_end8(_mm256_load_ps((dm) + 8 * (j)), has_m ? _mm256_load_ps((dm) + 32 + 8 * (j)) : _mm256_setzero_ps(), \
               has_m, s, sx, y, first)

/* One row's block sums for the 32 outputs of a tile: a0..a3, from 0 each block. */
#define ACC_DECL(a) __m256 a##0, a##1, a##2, a##3;
#define ACC_ZERO(a) a##0 = a##1 = a##2 = a##3 = _mm256_setzero_ps();
#define ACC_FMA_W(a, xb) a##0 = _mm256_fmadd_ps(xb, w0, a##0); a##1 = _mm256_fmadd_ps(xb, w1, a##1); \
                         a##2 = _mm256_fmadd_ps(xb, w2, a##2); a##3 = _mm256_fmadd_ps(xb, w3, a##3);
#define ACC_FMA_BUF(a, xb, wk)                                                               \
    a##0 = _mm256_fmadd_ps(xb, _mm256_load_ps(wk), a##0); a##1 = _mm256_fmadd_ps(xb, _mm256_load_ps((wk) + 8), a##1); \
    a##2 = _mm256_fmadd_ps(xb, _mm256_load_ps((wk) + 16), a##2); a##3 = _mm256_fmadd_ps(xb, _mm256_load_ps((wk) + 24), a##3);
#define ACC_END(a, dm, has_m, sx, y, first)                                                  \
    DM_END8(dm, has_m, 0, a##0, sx, (y), first); DM_END8(dm, has_m, 1, a##1, sx, (y) + 8, first); \
    DM_END8(dm, has_m, 2, a##2, sx, (y) + 16, first); DM_END8(dm, has_m, 3, a##3, sx, (y) + 24, first);
/* One row: the scales straight from the record. */
#define REC_END8(rec, has_m, j, s, sx, y, first) \
    block_end8(load_half8((rec) + 16 * (j)), has_m ? load_half8((rec) + 64 + 16 * (j)) : _mm256_setzero_ps(), \
               has_m, s, sx, y, first)

/* Convert one record's quants into w[k * TILE + n] (for the register-blocked rows), or
 * multiply them straight into one row's sums (for a single row: no store). */
#define QUANT_FNS(T, HAS_M)                                                                  \
    static inline void dequant_##T(const uint8_t *rec, float *w) {                          \
        T##_CONSTS                                                                           \
        for (int k = 0; k < QBLOCK; k++, w += TILE) {                                       \
            T##_QUANTS(rec, k)                                                               \
            _mm256_store_ps(w, w0); _mm256_store_ps(w + 8, w1);                             \
            _mm256_store_ps(w + 16, w2); _mm256_store_ps(w + 24, w3);                       \
        }                                                                                    \
    }                                                                                        \
    static inline void fused1_##T(const uint8_t *rec, const float *x, float sx, float *y, int first) { \
        T##_CONSTS                                                                           \
        ACC_DECL(a) ACC_ZERO(a)                                                              \
        _Pragma("GCC unroll 4")                                                              \
        for (int k = 0; k < QBLOCK; k++) {                                                   \
            T##_QUANTS(rec, k)                                                               \
            const __m256 xb = _mm256_broadcast_ss(x + k);                                    \
            ACC_FMA_W(a, xb)                                                                 \
        }                                                                                    \
        REC_END8(rec, HAS_M, 0, a0, sx, y, first); REC_END8(rec, HAS_M, 1, a1, sx, y + 8, first);       \
        REC_END8(rec, HAS_M, 2, a2, sx, y + 16, first); REC_END8(rec, HAS_M, 3, a3, sx, y + 24, first); \
    }
QUANT_FNS(Q4_1, 1)
QUANT_FNS(Q8_0, 0)

/* Rows of x against one converted block w[32 k][TILE]: each row's sums live in registers
 * for the block's 32 k, then go into y (block_end8). Named variables, not arrays: gcc
 * spills arrays of vectors to the stack on every k. */
#define ROW_FMA(a, r) { const __m256 xb = _mm256_broadcast_ss(x + (size_t)(r) * ldx + k); ACC_FMA_BUF(a, xb, wk) }
#define ROW_END(a, r) ACC_END(a, dm, has_m, sx ? sx[(size_t)(r) * ldsx] : 0.0f, y + (size_t)(r) * ldy, first)
#define MICRO_ARGS const float *x, size_t ldx, const float *w, const float *dm, int has_m, const float *sx, \
                   size_t ldsx, float *y, size_t ldy, int first, int nk

static inline void micro_1(MICRO_ARGS) {
    ACC_DECL(a) ACC_ZERO(a)
    for (int k = 0; k < nk; k++) {
        const float *wk = w + k * TILE;
        ROW_FMA(a, 0)
    }
    ROW_END(a, 0)
}

static inline void micro_2(MICRO_ARGS) {
    ACC_DECL(a) ACC_DECL(b) ACC_ZERO(a) ACC_ZERO(b)
    for (int k = 0; k < nk; k++) {
        const float *wk = w + k * TILE;
        ROW_FMA(a, 0) ROW_FMA(b, 1)
    }
    ROW_END(a, 0) ROW_END(b, 1)
}

static inline void micro_3(MICRO_ARGS) {
    ACC_DECL(a) ACC_DECL(b) ACC_DECL(c) ACC_ZERO(a) ACC_ZERO(b) ACC_ZERO(c)
    for (int k = 0; k < nk; k++) {
        const float *wk = w + k * TILE;
        ROW_FMA(a, 0) ROW_FMA(b, 1) ROW_FMA(c, 2)
    }
    ROW_END(a, 0) ROW_END(b, 1) ROW_END(c, 2)
}

/* A few rows (2..4), straight from the record like the one-row path. Three or four rows take
 * each half of the tile (16 outputs) in turn: 2 ymm of quants a k, 2 sums a row, so four rows
 * fit the 16 registers. Two rows take the whole tile a k, as one row does: their 8 sums are
 * 8 independent FMA chains, enough to cover the FMA's latency, where a half's 4 were not (a
 * half at a time, two rows cost what four did; in a loop over L2-resident records on Zen 3,
 * 8.7 -> 7.3 cycles a k and tile for Q4_1, 8.2 -> 6.6 for Q8_0; three rows as a whole tile
 * spill). The buffered path instead stores the converted block and reloads it for every
 * group of rows: on Zen 3 its stores and reloads, not the FMAs, set the pace of a 4-row
 * verification step. Each quant is converted by the same instructions as in Q4_1_QUANTS /
 * Q8_0_QUANTS and each output takes the same FMAs in the same order: the same bits as any
 * other path. */
#define Q4_1_HALF_QUANTS(rec, h, k)                                                          \
    const __m256i v = BCAST16((rec) + 128 + 16 * (k));                                     \
    const __m256i u_lo = _mm256_shuffle_epi8(v, sp_lo), u_hi = _mm256_shuffle_epi8(v, sp_hi); \
    const __m256 wa = _mm256_cvtepi32_ps((h) ? _mm256_srli_epi32(u_lo, 4) : _mm256_and_si256(u_lo, low)); \
    const __m256 wb = _mm256_cvtepi32_ps((h) ? _mm256_srli_epi32(u_hi, 4) : _mm256_and_si256(u_hi, low));
#define Q8_0_HALF_QUANTS(rec, h, k)                                                          \
    const __m256 wa = SIGNED8((rec) + 64 + 32 * (k) + 16 * (h));                           \
    const __m256 wb = SIGNED8((rec) + 72 + 32 * (k) + 16 * (h));

#define HALF_DECL(a) __m256 a##0 = _mm256_setzero_ps(), a##1 = _mm256_setzero_ps();
#define HALF_FMA(a, r) {                                                                     \
    const __m256 xb = _mm256_broadcast_ss(x + (r) * ldx + k);                              \
    a##0 = _mm256_fmadd_ps(xb, wa, a##0); a##1 = _mm256_fmadd_ps(xb, wb, a##1); }
#define HALF_END(a, r, has_m)                                                                \
    DM_END8(dm, has_m, 2 * h, a##0, has_m ? sx[(r) * ldsx] : 0.0f, y + (r) * ldy + 16 * h, first); \
    DM_END8(dm, has_m, 2 * h + 1, a##1, has_m ? sx[(r) * ldsx] : 0.0f, y + (r) * ldy + 16 * h + 8, first);
#define FEW_ARGS const uint8_t *rec, const float *dm, const float *x, size_t ldx, const float *sx, size_t ldsx, \
                 float *y, size_t ldy, int first

#define FEW_FNS(T, HAS_M)                                                                    \
    static inline void few2_##T(FEW_ARGS) {                                                  \
        T##_CONSTS                                                                           \
        ACC_DECL(a) ACC_DECL(b) ACC_ZERO(a) ACC_ZERO(b)                                      \
        for (int k = 0; k < QBLOCK; k++) {                                                   \
            T##_QUANTS(rec, k)                                                               \
            const __m256 xa = _mm256_broadcast_ss(x + k), xb = _mm256_broadcast_ss(x + ldx + k); \
            ACC_FMA_W(a, xa) ACC_FMA_W(b, xb)                                                \
        }                                                                                    \
        ACC_END(a, dm, HAS_M, HAS_M ? sx[0] : 0.0f, y, first)                                \
        ACC_END(b, dm, HAS_M, HAS_M ? sx[ldsx] : 0.0f, y + ldy, first)                       \
    }                                                                                        \
    static inline void few3_##T(FEW_ARGS) {                                                  \
        T##_CONSTS                                                                           \
        for (int h = 0; h < 2; h++) {                                                        \
            HALF_DECL(a) HALF_DECL(b) HALF_DECL(c)                                           \
            for (int k = 0; k < QBLOCK; k++) {                                               \
                T##_HALF_QUANTS(rec, h, k) HALF_FMA(a, 0) HALF_FMA(b, 1) HALF_FMA(c, 2)     \
            }                                                                                \
            HALF_END(a, 0, HAS_M) HALF_END(b, 1, HAS_M) HALF_END(c, 2, HAS_M)                \
        }                                                                                    \
    }                                                                                        \
    static inline void few4_##T(FEW_ARGS) {                                                  \
        T##_CONSTS                                                                           \
        for (int h = 0; h < 2; h++) {                                                        \
            HALF_DECL(a) HALF_DECL(b) HALF_DECL(c) HALF_DECL(e)                              \
            for (int k = 0; k < QBLOCK; k++) {                                               \
                T##_HALF_QUANTS(rec, h, k) HALF_FMA(a, 0) HALF_FMA(b, 1) HALF_FMA(c, 2) HALF_FMA(e, 3) \
            }                                                                                \
            HALF_END(a, 0, HAS_M) HALF_END(b, 1, HAS_M) HALF_END(c, 2, HAS_M) HALF_END(e, 3, HAS_M) \
        }                                                                                    \
    }
FEW_FNS(Q4_1, 1)
FEW_FNS(Q8_0, 0)

/* Six rows against one half of the block (16 outputs) at a time, with the few-rows macros
 * above: 12 sums, the half's 2 quant vectors and a broadcast fill 15 of the 16 registers, and
 * each quant vector loaded serves six FMAs. In a scratch loop on Zen 3 (one thread, L1) it took
 * 0.78 ns a row and k against micro_3's 0.93, whose FMAs each load their quants: the many-rows
 * step is bound by these loops. */
static inline void micro_6(MICRO_ARGS) {
    for (int h = 0; h < 2; h++) {
        HALF_DECL(a) HALF_DECL(b) HALF_DECL(c) HALF_DECL(e) HALF_DECL(f) HALF_DECL(g)
        for (int k = 0; k < nk; k++) {
            const __m256 wa = _mm256_load_ps(w + k * TILE + 16 * h), wb = _mm256_load_ps(w + k * TILE + 16 * h + 8);
            HALF_FMA(a, 0) HALF_FMA(b, 1) HALF_FMA(c, 2) HALF_FMA(e, 3) HALF_FMA(f, 4) HALF_FMA(g, 5)
        }
        HALF_END(a, 0, has_m) HALF_END(b, 1, has_m) HALF_END(c, 2, has_m)
        HALF_END(e, 3, has_m) HALF_END(f, 4, has_m) HALF_END(g, 5, has_m)
    }
}

static inline void few_rows(const uint8_t *rec, const float *dm, int qtype, const float *x, size_t ldx,
                            const float *sx, size_t ldsx, int M, float *y, size_t ldy, int first) {
    if (qtype == QT_Q4_1) {
        if (M == 2) few2_Q4_1(rec, dm, x, ldx, sx, ldsx, y, ldy, first);
        else if (M == 3) few3_Q4_1(rec, dm, x, ldx, sx, ldsx, y, ldy, first);
        else few4_Q4_1(rec, dm, x, ldx, sx, ldsx, y, ldy, first);
    } else {
        if (M == 2) few2_Q8_0(rec, dm, x, ldx, sx, ldsx, y, ldy, first);
        else if (M == 3) few3_Q8_0(rec, dm, x, ldx, sx, ldsx, y, ldy, first);
        else few4_Q8_0(rec, dm, x, ldx, sx, ldsx, y, ldy, first);
    }
}

/* M rows against one converted block buf[k][TILE] (its first nk k): sixes, threes, the rest. */
static inline void micro_rows(const float *xb, size_t ldx, const float *buf, const float *dm, int has_m,
                              const float *sxb, size_t ldsx, int M, float *yt, size_t ldy, int first, int nk) {
    int r = 0;
    for (; r + 6 <= M; r += 6)
        micro_6(xb + r * ldx, ldx, buf, dm, has_m, sxb ? sxb + r * ldsx : NULL, ldsx, yt + r * ldy, ldy, first, nk);
    for (; r + 3 <= M; r += 3)
        micro_3(xb + r * ldx, ldx, buf, dm, has_m, sxb ? sxb + r * ldsx : NULL, ldsx, yt + r * ldy, ldy, first, nk);
    if (M - r == 2)
        micro_2(xb + r * ldx, ldx, buf, dm, has_m, sxb ? sxb + r * ldsx : NULL, ldsx, yt + r * ldy, ldy, first, nk);
    else if (M - r == 1)
        micro_1(xb + r * ldx, ldx, buf, dm, has_m, sxb ? sxb + r * ldsx : NULL, ldsx, yt + r * ldy, ldy, first, nk);
}

static inline int qf_record(int qtype) { return qtype == QT_Q4_1 ? Q4_1_RECORD : Q8_0_RECORD; }

/* ---- the qn types (quant_types.h): one layout for both arithmetics ----
 *
 * The same arithmetic as above, per sub-block of 32 k (Q6_K: per half of 16, each with its
 * own D): s = 0; s = fma(x[k], float(v[n, k]), s) over its k in order; y = fma(D, s, y); then,
 * for Q5_1/Q4_K/Q5_K, y = fma(M, sx, y) (Q2_K: per half, its M times the half's sum of x). v is a small integer (q - zero, or IQ4's kv[q]),
 * exact as a float; D and M are formed exactly in float32 from the record's fp16 scales and
 * integer sub-scales (quant_types.h). The quants come as the 32-bit lanes of the records'
 * chunks, one output's four consecutive k a lane: each k's byte of the lane is shifted to the
 * top and back (sign-extending), all within each lane. */

/* The signed values of outputs 8e..8e+7 for k = 8p + 4s + j (j: the lanes' bytes). */
QN_INLINE __m256i qn_vals8(const uint8_t *body, int qt, int p, int s, int e) {
    __m256i lo, hi;
    qn_quants8(body, qt, p, e, &lo, &hi);
    return qn_values8(s ? hi : lo, qt);
}

/* Q2_K's half-block sum of x for its mins: in order, one rounding an add (the same bits for a
 * row alone or in a batch, whichever path sums it). */
static inline float half_sum16(const float *x) {
    float s = x[0];
    for (int k = 1; k < 16; k++) s += x[k];
    return s;
}

/* One row against sub-block b of a tile: 32 sums in registers, then the block's end. */
QN_INLINE void qn_fused1(const uint8_t *tile, int qt, int b, const float *x, float sx, float *y, int first) {
    const uint8_t *hdr = qn_hdr(tile, qt, b), *body = qn_sub(tile, qt, b);
    const int j = b % qn_group(qt), halves = 1 + qn_split(qt), has_m = qn_has_m(qt), half_m = qn_half_m(qt);
    _Pragma("GCC unroll 2")
    for (int kh = 0; kh < halves; kh++) {
        ACC_DECL(a) ACC_ZERO(a)
#define QN_STEP(p, s)                                                                        \
    {                                                                                        \
        const __m256i X0 = qn_vals8(body, qt, p, s, 0), X1 = qn_vals8(body, qt, p, s, 1);  \
        const __m256i X2 = qn_vals8(body, qt, p, s, 2), X3 = qn_vals8(body, qt, p, s, 3);  \
        _Pragma("GCC unroll 4")                                                              \
        for (int i = 0; i < 4; i++) {                                                        \
            const __m256 xb = _mm256_broadcast_ss(x + 8 * (p) + 4 * (s) + i);                \
            a0 = _mm256_fmadd_ps(xb, byte_f8(X0, i), a0);                                    \
            a1 = _mm256_fmadd_ps(xb, byte_f8(X1, i), a1);                                    \
            a2 = _mm256_fmadd_ps(xb, byte_f8(X2, i), a2);                                    \
            a3 = _mm256_fmadd_ps(xb, byte_f8(X3, i), a3);                                    \
        }                                                                                    \
    }
        if (qn_split(qt)) {
            _Pragma("GCC unroll 4")
            for (int p = kh * 2; p < kh * 2 + 2; p++) {
                QN_STEP(p, 0) QN_STEP(p, 1)
            }
        } else {
            /* A loop over p, not unrolled: unrolled over the whole sub-block GCC scheduled it
             * chain by chain, the x broadcasts spilled to the stack (Q4_K and Q5_K took 2.5x
             * this loop's time, Q4_0 1.5x, Q5_0 and IQ4_NL 1.25x: benchmarks.ab linear, one
             * thread, AMD EPYC AVX2 build, bench-results/issue49-kernels49/). The same FMAs in
             * the same order: the same bits. (Q6_K's halves keep the unrolled loop.) */
            _Pragma("GCC unroll 1")
            for (int p = 0; p < 4; p++) {
                QN_STEP(p, 0) QN_STEP(p, 1)
            }
        }
#undef QN_STEP
        const int f = first && kh == 0;
        const float hx = half_m ? half_sum16(x + 16 * kh) : sx;
#define QN_END8(e, acc)                                                                                        \
    block_end8(qn_d8(hdr, qt, j, kh, 8 * (e)),                                                                 \
               half_m ? qn_hm8(hdr, j, kh, 8 * (e)) : has_m ? qn_m8(hdr, qt, j, 8 * (e)) : _mm256_setzero_ps(), \
               has_m || half_m, acc, hx, y + 8 * (e), f);
        QN_END8(0, a0) QN_END8(1, a1) QN_END8(2, a2) QN_END8(3, a3)
#undef QN_END8
    }
}

/* Sub-block b's values as floats w[k * TILE + n], and its scales: dm[0..31] D (of the first
 * half for Q6_K), dm[32..63] Q6_K's second half's D or M; Q2_K's D, M of the first half, then
 * of the second (dm[0..127]). */
QN_INLINE void qn_dequant(const uint8_t *tile, int qt, int b, float *w, float *dm) {
    const uint8_t *hdr = qn_hdr(tile, qt, b), *body = qn_sub(tile, qt, b);
    const int j = b % qn_group(qt);
    for (int e = 0; e < 4; e++) {
        if (qn_half_m(qt)) {
            for (int kh = 0; kh < 2; kh++) {
                _mm256_store_ps(dm + 64 * kh + 8 * e, qn_d8(hdr, qt, j, kh, 8 * e));
                _mm256_store_ps(dm + 64 * kh + 32 + 8 * e, qn_hm8(hdr, j, kh, 8 * e));
            }
            continue;
        }
        _mm256_store_ps(dm + 8 * e, qn_d8(hdr, qt, j, 0, 8 * e));
        if (qn_split(qt)) _mm256_store_ps(dm + 32 + 8 * e, qn_d8(hdr, qt, j, 1, 8 * e));
        if (qn_has_m(qt)) _mm256_store_ps(dm + 32 + 8 * e, qn_m8(hdr, qt, j, 8 * e));
    }
    _Pragma("GCC unroll 4")
    for (int p = 0; p < 4; p++)
        for (int s = 0; s < 2; s++)
            for (int e = 0; e < 4; e++) {
                const __m256i X = qn_vals8(body, qt, p, s, e);
                _Pragma("GCC unroll 4")
                for (int i = 0; i < 4; i++) _mm256_store_ps(w + (8 * p + 4 * s + i) * TILE + 8 * e, byte_f8(X, i));
            }
}

/* F16/BF16: w[k][n] two bytes each; a block's sums end as y = fma(1, s, y), y + s rounded once. */
QN_INLINE __m256 f16_w8(const uint8_t *rec, int qt, int k, int e) {
    const __m128i h = _mm_loadu_si128((const __m128i *)(rec + 64 * k + 16 * e));
    if (qt == QT_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

QN_INLINE void f16_fused1(const uint8_t *rec, int qt, const float *x, float *y, int first) {
    ACC_DECL(a) ACC_ZERO(a)
    _Pragma("GCC unroll 4")
    for (int k = 0; k < QBLOCK; k++) {
        const __m256 xb = _mm256_broadcast_ss(x + k);
        a0 = _mm256_fmadd_ps(xb, f16_w8(rec, qt, k, 0), a0);
        a1 = _mm256_fmadd_ps(xb, f16_w8(rec, qt, k, 1), a1);
        a2 = _mm256_fmadd_ps(xb, f16_w8(rec, qt, k, 2), a2);
        a3 = _mm256_fmadd_ps(xb, f16_w8(rec, qt, k, 3), a3);
    }
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    block_end8(one, zero, 0, a0, 0.0f, y, first);
    block_end8(one, zero, 0, a1, 0.0f, y + 8, first);
    block_end8(one, zero, 0, a2, 0.0f, y + 16, first);
    block_end8(one, zero, 0, a3, 0.0f, y + 24, first);
}

/* qf_tile for a qn or F16/BF16 code qt (a constant: one copy per type). */
QN_INLINE void qn_tile_f(const uint8_t *w, int qt, int K, const float *x, size_t ldx, const float *sx, size_t ldsx,
                         int M, float *yt, size_t ldy, int t) {
    const int nb = K / QBLOCK, f16 = is_f16(qt), has_m = !f16 && qn_has_m(qt), halves = f16 ? 1 : 1 + qn_split(qt);
    const uint8_t *tile = w + (size_t)t * tile_bytes(qt, K);
    const size_t stride = f16 ? F16_RECORD : qn_stride(qt), ahead = f16 ? F16_AHEAD_L2 : qn_ahead(qt);
    float buf[QBLOCK * TILE] __attribute__((aligned(64)));
    float dm[4 * TILE] __attribute__((aligned(32)));
    if (f16)
        for (int i = 0; i < TILE; i++) dm[i] = 1.0f;
    for (int b = 0; b < nb; b++) {
        const float *xb = x + (size_t)b * QBLOCK, *sxb = has_m ? sx + b : NULL;
        const int first = b == 0;
        prefetch_bytes_l2(tile + (size_t)b * stride + ahead, stride);
        if (M == 1) {
            if (f16) f16_fused1(tile + (size_t)b * F16_RECORD, qt, xb, yt, first);
            else qn_fused1(tile, qt, b, xb, has_m ? *sxb : 0.0f, yt, first);
            continue;
        }
        if (f16) {
            const uint8_t *rec = tile + (size_t)b * F16_RECORD;
            for (int k = 0; k < QBLOCK; k++)
                for (int e = 0; e < 4; e++) _mm256_store_ps(buf + k * TILE + 8 * e, f16_w8(rec, qt, k, e));
        } else {
            qn_dequant(tile, qt, b, buf, dm);
        }
        const int nk = QBLOCK / halves;
        if (!f16 && qn_half_m(qt)) { /* each half with its D and M, its sums of x 64 rows at a time */
            for (int r0 = 0; r0 < M; r0 += 64) {
                const int m = M - r0 < 64 ? M - r0 : 64;
                float hs[64];
                for (int kh = 0; kh < 2; kh++) {
                    for (int r = 0; r < m; r++) hs[r] = half_sum16(xb + (size_t)(r0 + r) * ldx + 16 * kh);
                    micro_rows(xb + (size_t)r0 * ldx + 16 * kh, ldx, buf + 16 * kh * TILE, dm + 64 * kh, 1, hs, 1, m,
                               yt + (size_t)r0 * ldy, ldy, first && kh == 0, 16);
                }
            }
            continue;
        }
        for (int kh = 0; kh < halves; kh++)
            micro_rows(xb + kh * nk, ldx, buf + kh * nk * TILE, dm + kh * TILE, has_m, sxb, ldsx, M, yt, ldy,
                       first && kh == 0, nk);
    }
}

static void qn_tile_f_any(const uint8_t *w, int qt, int K, const float *x, size_t ldx, const float *sx, size_t ldsx,
                          int M, float *yt, size_t ldy, int t) {
    switch (qt) {
#define QN_CASE(T) case T: qn_tile_f(w, T, K, x, ldx, sx, ldsx, M, yt, ldy, t); break;
    QN_CASE(QT_Q4_0) QN_CASE(QT_Q5_0) QN_CASE(QT_Q5_1) QN_CASE(QT_IQ4_NL) QN_CASE(QT_Q4_K) QN_CASE(QT_Q5_K)
    QN_CASE(QT_Q6_K) QN_CASE(QT_IQ4_XS) QN_CASE(QT_F16) QN_CASE(QT_BF16)
    QN_CASE(QT_Q4_G128) QN_CASE(QT_Q4_G32) QN_CASE(QT_Q8_CH) QN_CASE(QT_Q3_K) QN_CASE(QT_Q2_K)
    QN_CASE(QT_IQ2_XXS) QN_CASE(QT_IQ2_XS) QN_CASE(QT_IQ2_S) QN_CASE(QT_IQ3_XXS) QN_CASE(QT_IQ3_S) QN_CASE(QT_IQ1_S)
    QN_CASE(QT_IQ1_M)
#undef QN_CASE
    default: break;
    }
}

/* Tile t (outputs 32t..32t+31) for rows 0..M-1 into yt[r * ldy + n], from x[r * ldx + k]
 * and, for the types with an M, the rows' block sums sx[r * ldsx + b] (block_sum32; NULL
 * for the others). */
static void qf_tile(const uint8_t *w, int qtype, int K, const float *x, size_t ldx, const float *sx, size_t ldsx,
                    int M, float *yt, size_t ldy, int t) {
    if (qtype > QT_Q8_0_I8) {
        qn_tile_f_any(w, qtype, K, x, ldx, sx, ldsx, M, yt, ldy, t);
        return;
    }
    const int nb = K / QBLOCK, record = qf_record(qtype), has_m = qtype == QT_Q4_1;
    const uint8_t *rec = w + (size_t)t * nb * record;
    /* One converted block, 32 x 32 floats: 4 KB, stays in L1. */
    float buf[QBLOCK * TILE] __attribute__((aligned(64)));
    float dm[2 * TILE] __attribute__((aligned(32)));
    for (int b = 0; b < nb; b++, rec += record) {
        const float *xb = x + (size_t)b * QBLOCK, *sxb = has_m ? sx + b : NULL;
        const int first = b == 0;
        /* Records are fetched ahead into L2 (simd.h), for any number of rows. 8 rows, the fused
         * decoder's float32 call, one process: 16.88 -> 15.48 ms (AVX-512 build), 17.28 ->
         * 15.87 (AVX2 build, same Zen 4; session 7). One row: on a real AVX2-only Zen 3 the
         * batch-1 call ran 9.98 -> 9.42 ms with it (session 8). */
        prefetch_bytes_l2(rec + (qtype == QT_Q4_1 ? Q4_1_AHEAD_L2 : Q8_0_AHEAD_L2), (size_t)record);
        if (M == 1) {
            if (has_m) fused1_Q4_1(rec, xb, *sxb, yt, first);
            else fused1_Q8_0(rec, xb, 0.0f, yt, first);
            continue;
        }
        block_scales(rec, has_m, dm);
        if (M <= FEW_ROWS_MAX) {
            few_rows(rec, dm, qtype, xb, ldx, sxb, ldsx, M, yt, ldy, first);
            continue;
        }
        if (has_m) dequant_Q4_1(rec, buf);
        else dequant_Q8_0(rec, buf);
        micro_rows(xb, ldx, buf, dm, has_m, sxb, ldsx, M, yt, ldy, first, QBLOCK);
    }
}

/* One row's block sums: sx[b] = block_sum32 of x's block b (K floats). */
static inline void block_sums(const float *x, int K, float *sx) {
    for (int b = 0; b < K / QBLOCK; b++) sx[b] = block_sum32(x + (size_t)b * QBLOCK);
}

static int qf_matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads, int qtype) {
    if (qtype < 0 || qtype >= QT_COUNT || qtype == QT_Q4_1_I8 || qtype == QT_Q8_0_I8) return -1;
    if (K % record_k(qtype) || N % TILE || M < 1) return -1;
    const int nb = K / QBLOCK, has_m = has_block_min(qtype);
    float *sx = has_m ? malloc(sizeof(float) * (size_t)M * nb) : NULL;
    if (has_m && !sx) return -3;
#pragma omp parallel num_threads(nthreads)
    {
        if (has_m) {
#pragma omp for schedule(static)
            for (int r = 0; r < M; r++) block_sums(x + (size_t)r * K, K, sx + (size_t)r * nb);
        }
#pragma omp for schedule(static)
        for (int t = 0; t < N / TILE; t++)
            qf_tile(w, qtype, K, x, (size_t)K, sx, (size_t)nb, M, y + (size_t)t * TILE, (size_t)N, t);
    }
    free(sx);
    return 0;
}

int q4_1_matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads) {
    return qf_matmul(x, M, K, w, N, y, nthreads, QT_Q4_1);
}

int q8_0_matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads) {
    return qf_matmul(x, M, K, w, N, y, nthreads, QT_Q8_0);
}

/* Every other type's: <type>_matmul (ops/quantized_linear.py, benchmarks/linear_ab.py). */
#define QF_EXPORT(name, T)                                                                  \
    int name##_matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads) { \
        return qf_matmul(x, M, K, w, N, y, nthreads, T);                                     \
    }
QF_EXPORT(q4_0, QT_Q4_0) QF_EXPORT(q5_0, QT_Q5_0) QF_EXPORT(q5_1, QT_Q5_1) QF_EXPORT(iq4_nl, QT_IQ4_NL)
QF_EXPORT(q4_k, QT_Q4_K) QF_EXPORT(q5_k, QT_Q5_K) QF_EXPORT(q6_k, QT_Q6_K) QF_EXPORT(iq4_xs, QT_IQ4_XS)
QF_EXPORT(f16, QT_F16) QF_EXPORT(bf16, QT_BF16)
QF_EXPORT(q4_g128, QT_Q4_G128) QF_EXPORT(q4_g32, QT_Q4_G32) QF_EXPORT(q8_ch, QT_Q8_CH) QF_EXPORT(q3_k, QT_Q3_K) QF_EXPORT(q2_k, QT_Q2_K)
QF_EXPORT(iq2_xxs, QT_IQ2_XXS) QF_EXPORT(iq2_xs, QT_IQ2_XS) QF_EXPORT(iq2_s, QT_IQ2_S) QF_EXPORT(iq3_xxs, QT_IQ3_XXS)
QF_EXPORT(iq3_s, QT_IQ3_S) QF_EXPORT(iq1_s, QT_IQ1_S) QF_EXPORT(iq1_m, QT_IQ1_M)
#undef QF_EXPORT

/* Bytes of one tile of K columns (the tests check the repacker's against it). */
int quant_tile_bytes(int qtype, int K) {
    return qtype < 0 || qtype >= QT_COUNT || K % record_k(qtype) ? -1 : (int)tile_bytes(qtype, K);
}

/* Rows ids[0..n-1] of a weight's records (K columns, rows < 32 * tiles) into y[n][K], as gguf-py
 * dequantizes them (the embedding lookup, ops/quantized_linear.py QuantEmbedding). */
int quant_rows(const uint8_t *w, int qtype, int K, const int64_t *ids, int n, float *y) {
    if (qtype < 0 || qtype >= QT_COUNT || K % record_k(qtype)) return -1;
    for (int i = 0; i < n; i++) quant_row(w, qtype, K, ids[i], y + (size_t)i * K);
    return 0;
}

#endif
