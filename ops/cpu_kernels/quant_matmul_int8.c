/* y[M, N] = x[M, K] @ W[N, K]^T with integer dot products. Each row of x is written per block
 * of 32 as integers m = round(x / dx) in P signed bytes ("planes": m = sum_p digit_p 256^(P-1-p),
 * digits in -128..127; `qa_row`), dx = max|x| / (127 * 256^(P-1)), and each block's dot product
 * of those bytes with the weights' small integers is exact in int32:
 *
 *   Q4_1 (w = d q + m, q in 0..15):  y += float(sum m q) * (d dx), then y += m sx
 *   Q8_0 (w = d q, q in -127..127):  y += float(sum m q) * (d dx)
 *
 * (one fma each, over blocks b = 0, 1, ... in order; sx is the block's float sum of x).
 * P = 1 is llama.cpp's arithmetic (int8 activations: each x loses up to 1/254 of its block's
 * largest); P = 3 keeps 23 bits of the block's largest, about float32's precision, at three
 * times the integer work. A row's result depends only on the row: the sums are exact,
 * whatever instruction makes them, so every build (AVX-512 VNNI vpdpbusd, AVX-VNNI, AVX2
 * vpmaddubsw) gives the same bits.
 *
 * Layout (ops/quantized_linear.py `repack_int8`): tiles of 32 outputs, blocks of 32 k, one
 * record per (tile, block), tiles outermost; the quants in chunks of 64 bytes, each holding
 * 16 outputs x 4 consecutive k so that one 32-bit lane is one output's 4 products:
 *
 *   Q4_1 record (640 bytes):  d[32] fp16 | m[32] fp16 | chunks c = 4h + p (h 0..1, p 0..3):
 *       byte 4n + j = q(16h + n, 8p + j) | q(16h + n, 8p + 4 + j) << 4     (n 0..15, j 0..3)
 *   Q8_0 record (1088 bytes): d[32] fp16 | chunks c = 8h + p (h 0..1, p 0..7):
 *       byte 4n + j = q(16h + n, 4p + j) + 128
 *
 * vpdpbusd takes unsigned x signed bytes: the weights are the unsigned side, Q4_1's quants as
 * they are, Q8_0's as q + 128, and 128 times the block's sum of digits (qact.t, one int per
 * row, plane and block, shared by every output) takes that offset back out. (Until session 25
 * the digits were the unsigned side, digit + 128, and each record carried its 32 outputs'
 * sums of q: 64 of its 1152 bytes, 5.6% of the bytes a tied LM head reads a step.) AVX2's
 * vpmaddubsw would saturate on (q + 128) x digit, so it takes q back (xor 0x80) and the
 * digits' signs (`_mm256_sign_epi8`).
 */
#ifndef LLMWORKER_QUANT_MATMUL_INT8_C
#define LLMWORKER_QUANT_MATMUL_INT8_C

#include "quant_types.h"

#define I8_TILE 32
#define I8_QBLOCK 32
#define Q4_1_I8_RECORD 640
#define Q8_0_I8_RECORD 1088

/* Bytes of one (tile, block) record of an integer-kernel weight. */
static inline size_t qi_record_bytes(int qtype) { return qtype == QT_Q4_1_I8 ? Q4_1_I8_RECORD : Q8_0_I8_RECORD; }

/* One row's activations as integers: planes q[P][K] (most significant first), per block
 * the scale d and float sum s, and per plane and block the digits' sum t[P][K / 32] (the Q8_0
 * kernels' offset, see the top) and th, that of the block's first 16 (Q6_K's halves). */
typedef struct {
    int8_t *q;
    float *d;
    float *s;
    int32_t *t;
    int32_t *th;
} qact;

/* Bytes of one row's planes (q). */
static inline size_t qa_bytes(int K, int P) { return (size_t)K * (size_t)P; }

static inline __m256i low_digit(__m256i m) { return _mm256_srai_epi32(_mm256_slli_epi32(m, 24), 24); }

/* 32 int32 (four vectors) -> 32 int8 in order, stored at p (values already in range). */
static inline void store_bytes(int8_t *p, __m256i i0, __m256i i1, __m256i i2, __m256i i3) {
    const __m256i p16 = _mm256_packs_epi32(i0, i1), q16 = _mm256_packs_epi32(i2, i3);
    const __m256i p8 = _mm256_packs_epi16(p16, q16); /* packs interleave 128-bit lanes */
    _mm256_storeu_si256((__m256i *)p, _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* The sum of 32 int32 (four vectors). */
static inline int32_t hsum_i32x32(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    return _mm_cvtsi128_si32(h);
}

/* Row x[K] (K a multiple of 32) into a, in P planes: AVX2 code in every build, one rounding. */
static void qa_row(const float *x, int K, int P, qact a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const float lim = P == 1 ? 127.0f : P == 2 ? 127.0f * 256.0f : 127.0f * 65536.0f;
    for (int b = 0; b < K / I8_QBLOCK; b++) {
        const float *xb = x + (size_t)b * I8_QBLOCK;
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        a.d[b] = amax / lim;
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? lim / amax : 0.0f);
        /* round to nearest even (the default MXCSR mode); |m| <= lim up to rounding */
        __m256i m[4];
        for (int i = 0; i < 4; i++) m[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
        /* balanced base-256 digits, least significant first: digit = m's low byte as signed,
         * m = (m - digit) / 256 (exact) */
        for (int p = P - 1; p >= 0; p--) {
            __m256i dgt[4];
            for (int i = 0; i < 4; i++) {
                dgt[i] = p ? low_digit(m[i]) : m[i];
                m[i] = _mm256_srai_epi32(_mm256_sub_epi32(m[i], dgt[i]), 8);
            }
            int8_t *dst = a.q + (size_t)p * K + (size_t)b * I8_QBLOCK;
            store_bytes(dst, dgt[0], dgt[1], dgt[2], dgt[3]);
            a.t[(size_t)p * (K / I8_QBLOCK) + b] = hsum_i32x32(dgt[0], dgt[1], dgt[2], dgt[3]);
            a.th[(size_t)p * (K / I8_QBLOCK) + b] = hsum_i32x32(dgt[0], dgt[1], _mm256_setzero_si256(),
                                                                _mm256_setzero_si256());
        }
        a.s[b] = block_sum32(xb);
    }
}

/* Records are fetched Q4_1_AHEAD_L2 / Q8_0_AHEAD_L2 bytes ahead (simd.h) of the one being
 * multiplied, into L2. A decode step reads each weight once, from memory, and the hardware's
 * prefetchers (which stop at every 4 KB page) leave the integer work and the memory's latency
 * in turn rather than together. A fetch past a tile's end reads the next tile, which the same
 * thread usually takes next. The fused
 * decoder's batch-1 native call, in one process (benchmarks/native_ab.py, session 7):
 * AVX-512 VNNI build 4.50 ms with no fetch, 4.27 with 3 KB ahead into L1, 3.71 with these;
 * AVX2 build (same Zen 4, int16) 3.37 with none, 3.39 with 3 KB into L1, 3.05 with these.
 * (Until then no build had fetched at all: GCC had deleted the helper's calls, see simd.h;
 * commit c1fc25a's 8-11% was the machine's drift.) */
static inline int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(__AVX512VNNI__)
/* ---- AVX-512 VNNI: 16 outputs per zmm; rows in groups that share each unpacked chunk
 * and each broadcast activation group (R rows x P planes x 2 halves accumulators) ---- */
#define I8_R(P) ((P) == 1 ? 4 : 2)
#define INLINE static inline __attribute__((always_inline))

/* The P planes' int32 sums of one (row, 16 outputs) -> float sum m q (see the top). */
INLINE __m512 combine16(__m512i s0, __m512i s1, __m512i s2, int P) {
    if (P == 1) return _mm512_cvtepi32_ps(s0);
    const __m512i lo = P == 2 ? _mm512_add_epi32(_mm512_slli_epi32(s0, 8), s1)
                              : _mm512_add_epi32(_mm512_slli_epi32(s1, 8), s2);
    if (P == 2) return _mm512_cvtepi32_ps(lo);
    return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s0), _mm512_set1_ps(65536.0f)), _mm512_cvtepi32_ps(lo));
}

INLINE void q4_1_i8_rows(const uint8_t *rec0, int nb, int K, const qact *a, int R, int P, float *y, size_t ldy,
                         int pf, int acc_y) {
    __m512 acc[4][2];
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) acc[r][h] = acc_y ? _mm512_loadu_ps(y + r * ldy + 16 * h) : _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = rec0 + (size_t)b * Q4_1_I8_RECORD;
        if (pf) prefetch_bytes_l2(rec + Q4_1_AHEAD_L2, Q4_1_I8_RECORD);
        __m512i s[4][3][2];
        for (int r = 0; r < R; r++)
            for (int p = 0; p < P; p++) s[r][p][0] = s[r][p][1] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            const __m512i v0 = _mm512_loadu_si512(rec + 128 + c * 64), v1 = _mm512_loadu_si512(rec + 128 + (4 + c) * 64);
            const __m512i lo0 = _mm512_and_si512(v0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
            const __m512i lo1 = _mm512_and_si512(v1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
            for (int r = 0; r < R; r++)
                for (int p = 0; p < P; p++) {
                    const int8_t *xq = a[r].q + (size_t)p * K + b * I8_QBLOCK + 8 * c;
                    const __m512i xl = _mm512_set1_epi32(load_i32(xq)), xh = _mm512_set1_epi32(load_i32(xq + 4));
                    s[r][p][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[r][p][0], lo0, xl), hi0, xh);
                    s[r][p][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[r][p][1], lo1, xl), hi1, xh);
                }
        }
        for (int h = 0; h < 2; h++) {
            const __m512 d = load_half16(rec + 32 * h), m = load_half16(rec + 64 + 32 * h);
            for (int r = 0; r < R; r++) {
                const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(a[r].d[b]));
                const __m512 tot = combine16(s[r][0][h], s[r][P > 1 ? 1 : 0][h], s[r][P > 2 ? 2 : 0][h], P);
                acc[r][h] = _mm512_fmadd_ps(tot, dd, acc[r][h]);
                acc[r][h] = _mm512_fmadd_ps(m, _mm512_set1_ps(a[r].s[b]), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(y + r * ldy, acc[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
}

/* Q8_0: the quants + 128 are vpdpbusd's unsigned side; 128 t (the digits' sum) comes back out. */
INLINE void q8_0_i8_rows(const uint8_t *rec0, int nb, int K, const qact *a, int R, int P, float *y, size_t ldy,
                         int pf, int acc_y) {
    __m512 acc[4][2];
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) acc[r][h] = acc_y ? _mm512_loadu_ps(y + r * ldy + 16 * h) : _mm512_setzero_ps();
    const size_t nt = (size_t)K / I8_QBLOCK; /* t's plane stride */
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = rec0 + (size_t)b * Q8_0_I8_RECORD;
        if (pf) prefetch_bytes_l2(rec + Q8_0_AHEAD_L2, Q8_0_I8_RECORD);
        __m512i s[4][3][2];
        for (int r = 0; r < R; r++)
            for (int p = 0; p < P; p++) s[r][p][0] = s[r][p][1] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++) {
            const __m512i q0 = _mm512_loadu_si512(rec + 64 + c * 64), q1 = _mm512_loadu_si512(rec + 64 + (8 + c) * 64);
            for (int r = 0; r < R; r++)
                for (int p = 0; p < P; p++) {
                    const __m512i x4 = _mm512_set1_epi32(load_i32(a[r].q + (size_t)p * K + b * I8_QBLOCK + 4 * c));
                    s[r][p][0] = _mm512_dpbusd_epi32(s[r][p][0], q0, x4);
                    s[r][p][1] = _mm512_dpbusd_epi32(s[r][p][1], q1, x4);
                }
        }
        __m512i off[4][3];
        for (int r = 0; r < R; r++)
            for (int p = 0; p < P; p++) off[r][p] = _mm512_set1_epi32(128 * a[r].t[(size_t)p * nt + b]);
        for (int h = 0; h < 2; h++) {
            const __m512 d = load_half16(rec + 32 * h);
            for (int r = 0; r < R; r++) {
                const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(a[r].d[b]));
                const __m512 tot = combine16(_mm512_sub_epi32(s[r][0][h], off[r][0]),
                                             _mm512_sub_epi32(s[r][P > 1 ? 1 : 0][h], off[r][P > 1 ? 1 : 0]),
                                             _mm512_sub_epi32(s[r][P > 2 ? 2 : 0][h], off[r][P > 2 ? 2 : 0]), P);
                acc[r][h] = _mm512_fmadd_ps(tot, dd, acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(y + r * ldy, acc[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
}
#else
/* ---- AVX2 (with or without AVX-VNNI): 8 outputs per ymm; one row (its float sums in
 * registers), or groups of I8_R rows that share each loaded and unpacked chunk (their float
 * sums in y between blocks: a float store and load change nothing, so each row's arithmetic
 * and bits are the one-row kernel's) ---- */
#define I8_R(P) ((P) == 3 ? 2 : 4)
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVXVNNI__)
#define DOT_ADD(s, u, x) s = _mm256_dpbusd_avx_epi32(s, u, x)
#define DOT_DONE(s) (s)
#else
/* int16 partial sums: 8 pair sums of at most 2 x 15 x 128 stay below 2^15 */
#define DOT_ADD(s, u, x) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u, x))
#define DOT_DONE(s) _mm256_madd_epi16(s, _mm256_set1_epi16(1))
#endif

INLINE __m256 combine8(const __m256i *s, int P) {
    if (P == 1) return _mm256_cvtepi32_ps(s[0]);
    const __m256i lo = _mm256_add_epi32(_mm256_slli_epi32(s[P - 2], 8), s[P - 1]); /* the two last */
    if (P == 2) return _mm256_cvtepi32_ps(lo);
    return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[0]), _mm256_set1_ps(65536.0f)), _mm256_cvtepi32_ps(lo));
}

/* One row's epilogue of a block's 8 outputs 8e..8e+7 (as the one-row kernels write it):
 * y = fma(sum m q, d dx, y) [, then fma(m, sx, y) for Q4_1]; y starts at 0 in block 0. */
INLINE void epilogue8(float *y, int b, __m256 tot, __m256 d8, float dx, const __m256 *m8, float sx) {
    __m256 acc = b ? _mm256_loadu_ps(y) : _mm256_setzero_ps();
    acc = _mm256_fmadd_ps(tot, _mm256_mul_ps(d8, _mm256_set1_ps(dx)), acc);
    if (m8) acc = _mm256_fmadd_ps(*m8, _mm256_set1_ps(sx), acc);
    _mm256_storeu_ps(y, acc);
}

INLINE void q4_1_i8_group(const uint8_t *rec0, int nb, int K, const qact *a, int R, int P, float *y, size_t ldy,
                          int pf) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = rec0 + (size_t)b * Q4_1_I8_RECORD;
        if (pf) prefetch_bytes_l2(rec + Q4_1_AHEAD_L2, Q4_1_I8_RECORD);
        for (int e = 0; e < 4; e++) {
            __m256i s[4][3];
            for (int r = 0; r < R; r++)
                for (int p = 0; p < P; p++) s[r][p] = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 128 + ((e / 2) * 4 + c) * 64 + 32 * (e % 2)));
                const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                for (int r = 0; r < R; r++)
                    for (int p = 0; p < P; p++) {
                        const int8_t *xq = a[r].q + (size_t)p * K + b * I8_QBLOCK + 8 * c;
                        DOT_ADD(s[r][p], lo, _mm256_set1_epi32(load_i32(xq)));
                        DOT_ADD(s[r][p], hi, _mm256_set1_epi32(load_i32(xq + 4)));
                    }
            }
            const __m256 d8 = load_half8(rec + 16 * e), m8 = load_half8(rec + 64 + 16 * e);
            for (int r = 0; r < R; r++) {
                for (int p = 0; p < P; p++) s[r][p] = DOT_DONE(s[r][p]);
                epilogue8(y + (size_t)r * ldy + 8 * e, b, combine8(s[r], P), d8, a[r].d[b], &m8, a[r].s[b]);
            }
        }
    }
}

INLINE void q8_0_i8_group(const uint8_t *rec0, int nb, int K, const qact *a, int R, int P, float *y, size_t ldy,
                          int pf) {
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = rec0 + (size_t)b * Q8_0_I8_RECORD;
        if (pf) prefetch_bytes_l2(rec + Q8_0_AHEAD_L2, Q8_0_I8_RECORD);
        for (int e = 0; e < 4; e++) {
            __m256i s[4][3];
            for (int r = 0; r < R; r++)
                for (int p = 0; p < P; p++) s[r][p] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i qu = _mm256_loadu_si256((const __m256i *)(rec + 64 + ((e / 2) * 8 + c) * 64 + 32 * (e % 2)));
#if !defined(__AVXVNNI__)
                const __m256i q = _mm256_xor_si256(qu, _mm256_set1_epi8((char)0x80));
#endif
                for (int r = 0; r < R; r++)
                    for (int p = 0; p < P; p++) {
                        const __m256i x4 = _mm256_set1_epi32(load_i32(a[r].q + (size_t)p * K + b * I8_QBLOCK + 4 * c));
#if defined(__AVXVNNI__)
                        s[r][p] = _mm256_dpbusd_avx_epi32(s[r][p], qu, x4);
#else
                        s[r][p] = _mm256_add_epi32(s[r][p], _mm256_madd_epi16(
                            _mm256_maddubs_epi16(_mm256_sign_epi8(x4, x4), _mm256_sign_epi8(q, x4)), _mm256_set1_epi16(1)));
#endif
                    }
            }
#if defined(__AVXVNNI__)
            for (int r = 0; r < R; r++)
                for (int p = 0; p < P; p++)
                    s[r][p] = _mm256_sub_epi32(s[r][p], _mm256_set1_epi32(128 * a[r].t[(size_t)p * (K / I8_QBLOCK) + b]));
#endif
            const __m256 d8 = load_half8(rec + 16 * e);
            for (int r = 0; r < R; r++)
                epilogue8(y + (size_t)r * ldy + 8 * e, b, combine8(s[r], P), d8, a[r].d[b], NULL, 0.0f);
        }
    }
}

INLINE void q4_1_i8_rows(const uint8_t *rec0, int nb, int K, const qact *a, int R, int P, float *y, size_t ldy,
                         int pf, int acc_y) {
    (void)acc_y; /* qi_few_rows (the only caller that sets it) is AVX-512 VNNI's */
    if (R > 1) {
        q4_1_i8_group(rec0, nb, K, a, R, P, y, ldy, pf);
        return;
    }
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = rec0 + (size_t)b * Q4_1_I8_RECORD;
        if (pf) prefetch_bytes_l2(rec + Q4_1_AHEAD_L2, Q4_1_I8_RECORD);
        const __m256 dx = _mm256_set1_ps(a[0].d[b]), sx = _mm256_set1_ps(a[0].s[b]);
        for (int e = 0; e < 4; e++) { /* outputs 8e..8e+7: half h = e / 2, bytes 32 (e % 2) */
            __m256i s[3];
            for (int p = 0; p < P; p++) s[p] = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 128 + ((e / 2) * 4 + c) * 64 + 32 * (e % 2)));
                const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                for (int p = 0; p < P; p++) {
                    const int8_t *xq = a[0].q + (size_t)p * K + b * I8_QBLOCK + 8 * c;
                    DOT_ADD(s[p], lo, _mm256_set1_epi32(load_i32(xq)));
                    DOT_ADD(s[p], hi, _mm256_set1_epi32(load_i32(xq + 4)));
                }
            }
            for (int p = 0; p < P; p++) s[p] = DOT_DONE(s[p]);
            const __m256 dd = _mm256_mul_ps(load_half8(rec + 16 * e), dx);
            acc[e] = _mm256_fmadd_ps(combine8(s, P), dd, acc[e]);
            acc[e] = _mm256_fmadd_ps(load_half8(rec + 64 + 16 * e), sx, acc[e]);
        }
    }
    for (int e = 0; e < 4; e++) _mm256_storeu_ps(y + 8 * e, acc[e]);
}

INLINE void q8_0_i8_rows(const uint8_t *rec0, int nb, int K, const qact *a, int R, int P, float *y, size_t ldy,
                         int pf, int acc_y) {
    (void)acc_y; /* qi_few_rows (the only caller that sets it) is AVX-512 VNNI's */
    if (R > 1) {
        q8_0_i8_group(rec0, nb, K, a, R, P, y, ldy, pf);
        return;
    }
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = rec0 + (size_t)b * Q8_0_I8_RECORD;
        if (pf) prefetch_bytes_l2(rec + Q8_0_AHEAD_L2, Q8_0_I8_RECORD);
        const __m256 dx = _mm256_set1_ps(a[0].d[b]);
        for (int e = 0; e < 4; e++) {
            __m256i s[3];
            for (int p = 0; p < P; p++) s[p] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i qu = _mm256_loadu_si256((const __m256i *)(rec + 64 + ((e / 2) * 8 + c) * 64 + 32 * (e % 2)));
#if !defined(__AVXVNNI__)
                const __m256i q = _mm256_xor_si256(qu, _mm256_set1_epi8((char)0x80));
#endif
                for (int p = 0; p < P; p++) {
                    const __m256i x4 = _mm256_set1_epi32(load_i32(a[0].q + (size_t)p * K + b * I8_QBLOCK + 4 * c));
#if defined(__AVXVNNI__)
                    s[p] = _mm256_dpbusd_avx_epi32(s[p], qu, x4);
#else
                    /* |digit| (unsigned) times q with the digit's sign: pair sums below 2^15
                     * as long as no q is -128 (repack_int8 refuses those) */
                    s[p] = _mm256_add_epi32(s[p], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(_mm256_sign_epi8(x4, x4), _mm256_sign_epi8(q, x4)), _mm256_set1_epi16(1)));
#endif
                }
            }
#if defined(__AVXVNNI__)
            for (int p = 0; p < P; p++)
                s[p] = _mm256_sub_epi32(s[p], _mm256_set1_epi32(128 * a[0].t[(size_t)p * (K / I8_QBLOCK) + b]));
#endif
            const __m256 dd = _mm256_mul_ps(load_half8(rec + 16 * e), dx);
            acc[e] = _mm256_fmadd_ps(combine8(s, P), dd, acc[e]);
        }
    }
    for (int e = 0; e < 4; e++) _mm256_storeu_ps(y + 8 * e, acc[e]);
}
#endif

/* R rows (a constant after inlining: the loops over rows and planes unroll) of one tile;
 * `pf`: fetch ahead (the first rows only: the later ones find the tile in the caches);
 * `acc_y`: add to y's sums (qi_few_rows) instead of starting from zero. */
INLINE void qi_rows(const uint8_t *rec, int qtype, int nb, int K, const qact *a, int R, int P, float *y, size_t ldy,
                    int pf, int acc_y) {
    if (qtype == QT_Q4_1_I8) q4_1_i8_rows(rec, nb, K, a, R, P, y, ldy, pf, acc_y);
    else q8_0_i8_rows(rec, nb, K, a, R, P, y, ldy, pf, acc_y);
}

#if defined(__AVX512VNNI__)
/* A few rows (2..FEW_ROWS) in one pass over the tile's records: each record, fetched from
 * memory once, is multiplied with every row while it is in L1, the rows' sums kept in y
 * between records. Row by row (groups of I8_R, then singles) after the whole tile, the
 * first group waited on memory and the others on arithmetic; here the two overlap. Each
 * row's arithmetic is the rows kernel's in the same order (y holds its float sums exactly):
 * the same bits. */
#define FEW_ROWS 16
INLINE void qi_few_rows(const uint8_t *rec0, int qtype, int nb, int K, const qact *a, int M, int P, float *y,
                        size_t ldy) {
    const size_t record = qi_record_bytes(qtype);
    qact v[FEW_ROWS];
    for (int b = 0; b < nb; b++) {
        for (int r = 0; r < M; r++) /* the rows from block b on: the kernel's block 0 */
            v[r] = (qact){a[r].q + b * I8_QBLOCK, a[r].d + b, a[r].s + b, a[r].t + b, a[r].th + b};
        const uint8_t *rec = rec0 + b * record;
        int r = 0;
        for (; r + I8_R(P) <= M; r += I8_R(P))
            qi_rows(rec, qtype, 1, K, v + r, I8_R(P), P, y + (size_t)r * ldy, ldy, r == 0, b > 0);
        for (; r < M; r++) qi_rows(rec, qtype, 1, K, v + r, 1, P, y + (size_t)r * ldy, ldy, r == 0, b > 0);
    }
}
#endif

/* ---- the qn types (quant_types.h): Q4_0, Q5_0, Q5_1, IQ4_NL, Q2_K-Q6_K, IQ4_XS ----
 *
 * Their records hold unsigned quants q in Q4_1's chunks (plus Q5's and Q6_K's high-bit planes),
 * the unsigned side of vpdpbusd as they are (IQ4's as kv[q] + 128, a vpshufb of the nibbles);
 * per sub-block of 32 (Q3_K, Q6_K: per half of 16) the exact int32 sum of q times the digits, less
 * zero times the digits' sum (Q4_0 8, Q5_0 16, Q3_K 4, Q6_K 32, IQ4 128), and then, as Q4_1's:
 *
 *   y = fma(float(sum v m), D dx, y)      [Q6_K: once per half, its own D]
 *   y = fma(M, sx, y)                     (Q5_1, Q4_K, Q5_K)
 *   y = fma(M_h, dx sum m, y)             (Q2_K, once per half after its D term: its digits' sum)
 *
 * with D, M the sub-block's scales in float32 (quant_types.h). AVX2 without VNNI sums
 * vpmaddubsw's pairs in int16 for as many chunks as cannot overflow (4 for 4-bit quants, 2
 * for 5-bit, 1 for 6-bit; 4 for Q3_K's 3-bit), then in int32; IQ4's values go signed there, with the digits'
 * signs (as Q8_0's). The sums are exact either way: every build gives the same bits.
 * Q8_CH's 8-bit q + 128 are vpdpbusd's unsigned side too, 128 times the digits' sum out;
 * vpmaddubsw takes them as 16 a + b (nibbles), each product's pairs below 2^15. */

/* The digits' sum of plane p over sub-block b's half kh (the whole block when halves == 1). */
INLINE int32_t qn_digits(const qact *a, int p, size_t nt, int b, int halves, int kh) {
    const int32_t t = a->t[(size_t)p * nt + b];
    if (halves == 1) return t;
    const int32_t th = a->th[(size_t)p * nt + b];
    return kh ? t - th : th;
}

/* Q2_K's: the sum of the row's x over half kh of block b as its digits give it (dx times the
 * integer), for the half's min: the mins meet the activations the quants meet, as in
 * llama.cpp's Q2_K dot product (its bsums). */
INLINE float qn_xsum(const qact *a, int P, size_t nt, int b, int kh) {
    int64_t m = 0;
    for (int p = 0; p < P; p++) m = m * 256 + qn_digits(a, p, nt, b, 2, kh);
    return a->d[b] * (float)m;
}

#if defined(__AVX512VNNI__)
INLINE void qn_i8_rows(const uint8_t *tile, int qt, int b0, int b1, int K, const qact *a, int R, int P, float *y,
                       size_t ldy, int pf, int acc_y) {
    const int halves = 1 + qn_split(qt), has_m = qn_has_m(qt), z = qn_table(qt) ? 128 : qn_zero(qt);
    const size_t nt = (size_t)K / I8_QBLOCK;
    const __m512i tab = _mm512_broadcast_i32x4(qn_utab(qt));
    __m512 acc[4][2];
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) acc[r][h] = acc_y ? _mm512_loadu_ps(y + r * ldy + 16 * h) : _mm512_setzero_ps();
    for (int b = b0; b < b1; b++) {
        const uint8_t *hdr = qn_hdr(tile, qt, b), *body = qn_sub(tile, qt, b);
        const int j = b % qn_group(qt);
        if (pf) prefetch_bytes_l2(tile + (size_t)b * qn_stride(qt) + qn_ahead(qt), qn_stride(qt));
        /* unrolled (Q6_K's two halves and their chunks): GCC had left them a loop of
         * computed offsets. A Q6_K 2048x8192 at 16 rows, int16: 1.14x (benchmarks.ab
         * linear; Zen 4); the same bits, the sums being exact. */
#pragma GCC unroll 2
        for (int kh = 0; kh < halves; kh++) {
            __m512i s[4][3][2];
            for (int r = 0; r < R; r++)
                for (int p = 0; p < P; p++) s[r][p][0] = s[r][p][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int c = kh * 4 / halves; c < (kh + 1) * 4 / halves; c++) {
                __m512i u[2][2];
                for (int h = 0; h < 2; h++) {
                    qn_quants16(body, qt, c, h, &u[h][0], &u[h][1]);
                    if (qn_table(qt)) {
                        u[h][0] = _mm512_shuffle_epi8(tab, u[h][0]);
                        u[h][1] = _mm512_shuffle_epi8(tab, u[h][1]);
                    }
                }
                for (int r = 0; r < R; r++)
                    for (int p = 0; p < P; p++) {
                        const int8_t *xq = a[r].q + (size_t)p * K + b * I8_QBLOCK + 8 * c;
                        const __m512i xl = _mm512_set1_epi32(load_i32(xq)), xh = _mm512_set1_epi32(load_i32(xq + 4));
                        for (int h = 0; h < 2; h++)
                            s[r][p][h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[r][p][h], u[h][0], xl), u[h][1], xh);
                    }
            }
            if (z)
                for (int r = 0; r < R; r++)
                    for (int p = 0; p < P; p++) {
                        const __m512i off = _mm512_set1_epi32(z * qn_digits(a + r, p, nt, b, halves, kh));
                        s[r][p][0] = _mm512_sub_epi32(s[r][p][0], off);
                        s[r][p][1] = _mm512_sub_epi32(s[r][p][1], off);
                    }
            for (int h = 0; h < 2; h++) {
                const __m512 d = qn_d16(hdr, qt, j, kh, 16 * h);
                for (int r = 0; r < R; r++) {
                    const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(a[r].d[b]));
                    const __m512 tot = combine16(s[r][0][h], s[r][P > 1 ? 1 : 0][h], s[r][P > 2 ? 2 : 0][h], P);
                    acc[r][h] = _mm512_fmadd_ps(tot, dd, acc[r][h]);
                }
                if (qn_half_m(qt)) {
                    const __m512 m = qn_hm16(hdr, j, kh, 16 * h);
                    for (int r = 0; r < R; r++)
                        acc[r][h] = _mm512_fmadd_ps(m, _mm512_set1_ps(qn_xsum(a + r, P, nt, b, kh)), acc[r][h]);
                }
            }
        }
        if (has_m)
            for (int h = 0; h < 2; h++) {
                const __m512 m = qn_m16(hdr, qt, j, 16 * h);
                for (int r = 0; r < R; r++) acc[r][h] = _mm512_fmadd_ps(m, _mm512_set1_ps(a[r].s[b]), acc[r][h]);
            }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(y + r * ldy, acc[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
}
#else
#if defined(__AVXVNNI__)
#define QN_VNNI 1
#else
#define QN_VNNI 0
#endif

/* The exact sums s[r][p] (the offset out) of outputs 8e..8e+7 over half kh of sub-block b. */
INLINE void qn_dots8(const uint8_t *body, int qt, int kh, int e, int b, int K, const qact *a, int R, int P,
                     __m256i s[4][3]) {
    const int halves = 1 + qn_split(qt), c0 = kh * 4 / halves, c1 = (kh + 1) * 4 / halves;
    const size_t nt = (size_t)K / I8_QBLOCK;
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) s[r][p] = _mm256_setzero_si256();
#if !QN_VNNI
    const int F = qn_bits(qt) <= 4 ? 4 : qn_bits(qt) == 5 ? 2 : 1; /* chunks an int16 sum takes */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s16[4][3];
#endif
    for (int c = c0; c < c1; c++) {
        __m256i lo, hi;
        qn_quants8(body, qt, c, e, &lo, &hi);
        if (qn_table(qt)) {
#if QN_VNNI
            const __m256i tab = _mm256_broadcastsi128_si256(qn_utab(qt));
#else
            const __m256i tab = _mm256_broadcastsi128_si256(qn_tab(qt));
#endif
            lo = _mm256_shuffle_epi8(tab, lo);
            hi = _mm256_shuffle_epi8(tab, hi);
        }
        for (int r = 0; r < R; r++)
            for (int p = 0; p < P; p++) {
                const int8_t *xq = a[r].q + (size_t)p * K + b * I8_QBLOCK + 8 * c;
                const __m256i xl = _mm256_set1_epi32(load_i32(xq)), xh = _mm256_set1_epi32(load_i32(xq + 4));
#if QN_VNNI
                s[r][p] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(s[r][p], lo, xl), hi, xh);
#else
                if (qn_bits(qt) == 8) { /* q + 128 = 16 a + b: vpmaddubsw's pairs of a or b below 2^15 */
                    const __m256i l4 = _mm256_set1_epi8(0x0F);
                    const __m256i pb = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(lo, l4), xl),
                                                        _mm256_maddubs_epi16(_mm256_and_si256(hi, l4), xh));
                    const __m256i pa = _mm256_add_epi16(
                        _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(lo, 4), l4), xl),
                        _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 4), l4), xh));
                    s[r][p] = _mm256_add_epi32(s[r][p], _mm256_add_epi32(_mm256_madd_epi16(pa, _mm256_set1_epi16(16)),
                                                                         _mm256_madd_epi16(pb, ones)));
                } else if (qn_table(qt)) { /* |digit| times v with the digit's sign (v > -128) */
                    s[r][p] = _mm256_add_epi32(s[r][p], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(_mm256_sign_epi8(xl, xl), _mm256_sign_epi8(lo, xl)), ones));
                    s[r][p] = _mm256_add_epi32(s[r][p], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(_mm256_sign_epi8(xh, xh), _mm256_sign_epi8(hi, xh)), ones));
                } else {
                    const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
                    s16[r][p] = (c - c0) % F ? _mm256_add_epi16(s16[r][p], pair) : pair;
                    if ((c - c0) % F == F - 1 || c == c1 - 1)
                        s[r][p] = _mm256_add_epi32(s[r][p], _mm256_madd_epi16(s16[r][p], ones));
                }
#endif
            }
    }
    const int z = qn_table(qt) ? (QN_VNNI ? 128 : 0) : qn_zero(qt);
    if (z)
        for (int r = 0; r < R; r++)
            for (int p = 0; p < P; p++)
                s[r][p] = _mm256_sub_epi32(s[r][p], _mm256_set1_epi32(z * qn_digits(a + r, p, nt, b, halves, kh)));
}

/* One row: its sums in registers; more: their float sums in y between blocks (as Q4_1's). */
INLINE void qn_i8_rows(const uint8_t *tile, int qt, int b0, int b1, int K, const qact *a, int R, int P, float *y,
                       size_t ldy, int pf, int acc_y) {
    const int halves = 1 + qn_split(qt), has_m = qn_has_m(qt), half_m = qn_half_m(qt);
    const size_t nt = (size_t)K / I8_QBLOCK;
    __m256 acc[4];
    for (int e = 0; R == 1 && e < 4; e++) acc[e] = acc_y ? _mm256_loadu_ps(y + 8 * e) : _mm256_setzero_ps();
    for (int b = b0; b < b1; b++) {
        const uint8_t *hdr = qn_hdr(tile, qt, b), *body = qn_sub(tile, qt, b);
        const int j = b % qn_group(qt);
        if (pf) prefetch_bytes_l2(tile + (size_t)b * qn_stride(qt) + qn_ahead(qt), qn_stride(qt));
        for (int e = 0; e < 4; e++)
            for (int kh = 0; kh < halves; kh++) {
                __m256i s[4][3];
                qn_dots8(body, qt, kh, e, b, K, a, R, P, s);
                const __m256 d8 = qn_d8(hdr, qt, j, kh, 8 * e);
                const int with_m = half_m || (has_m && kh == halves - 1);
                const __m256 m8 = half_m ? qn_hm8(hdr, j, kh, 8 * e) : with_m ? qn_m8(hdr, qt, j, 8 * e) : _mm256_setzero_ps();
                if (R == 1) {
                    acc[e] = _mm256_fmadd_ps(combine8(s[0], P), _mm256_mul_ps(d8, _mm256_set1_ps(a[0].d[b])), acc[e]);
                    if (with_m)
                        acc[e] = _mm256_fmadd_ps(m8, _mm256_set1_ps(half_m ? qn_xsum(a, P, nt, b, kh) : a[0].s[b]), acc[e]);
                    continue;
                }
                const int from_y = b > b0 || kh > 0 || acc_y;
                for (int r = 0; r < R; r++)
                    epilogue8(y + (size_t)r * ldy + 8 * e, from_y, combine8(s[r], P), d8, a[r].d[b], with_m ? &m8 : NULL,
                              half_m ? qn_xsum(a + r, P, nt, b, kh) : a[r].s[b]);
            }
    }
    for (int e = 0; R == 1 && e < 4; e++) _mm256_storeu_ps(y + 8 * e, acc[e]);
}
#endif

/* One copy of the kernel per (type, rows, planes), each a function of its own: the tile loop
 * and the few-rows loop call the same ones. */
#define QN_ROWS_ARGS const uint8_t *tile, int b0, int b1, int K, const qact *a, float *y, size_t ldy, int pf, int acc_y
typedef void (*qn_rows_fn)(QN_ROWS_ARGS);
#define QN_ROWS(T, P)                                                                        \
    static void qn_one_##T##_##P(QN_ROWS_ARGS) { qn_i8_rows(tile, T, b0, b1, K, a, 1, P, y, ldy, pf, acc_y); } \
    static void qn_grp_##T##_##P(QN_ROWS_ARGS) { qn_i8_rows(tile, T, b0, b1, K, a, I8_R(P), P, y, ldy, pf, acc_y); }
#define QN_TYPE(T) QN_ROWS(T, 1) QN_ROWS(T, 2) QN_ROWS(T, 3)
QN_TYPE(QT_Q4_0) QN_TYPE(QT_Q5_0) QN_TYPE(QT_Q5_1) QN_TYPE(QT_IQ4_NL)
QN_TYPE(QT_Q4_K) QN_TYPE(QT_Q5_K) QN_TYPE(QT_Q6_K) QN_TYPE(QT_IQ4_XS)
QN_TYPE(QT_Q4_G128) QN_TYPE(QT_Q4_G32) QN_TYPE(QT_Q8_CH) QN_TYPE(QT_Q3_K) QN_TYPE(QT_Q2_K)
QN_TYPE(QT_IQ2_XXS) QN_TYPE(QT_IQ2_XS) QN_TYPE(QT_IQ2_S) QN_TYPE(QT_IQ3_XXS) QN_TYPE(QT_IQ3_S) QN_TYPE(QT_IQ1_S)
QN_TYPE(QT_IQ1_M)

static qn_rows_fn qn_rows_for(int qt, int P, int group) {
#define QN_PICK(T)                                                                           \
    case T:                                                                                  \
        if (P == 1) return group ? qn_grp_##T##_1 : qn_one_##T##_1;                         \
        if (P == 2) return group ? qn_grp_##T##_2 : qn_one_##T##_2;                         \
        return group ? qn_grp_##T##_3 : qn_one_##T##_3;
    switch (qt) {
    QN_PICK(QT_Q4_0) QN_PICK(QT_Q5_0) QN_PICK(QT_Q5_1) QN_PICK(QT_IQ4_NL)
    QN_PICK(QT_Q4_K) QN_PICK(QT_Q5_K) QN_PICK(QT_Q6_K) QN_PICK(QT_IQ4_XS)
    QN_PICK(QT_Q4_G128) QN_PICK(QT_Q4_G32) QN_PICK(QT_Q8_CH) QN_PICK(QT_Q3_K) QN_PICK(QT_Q2_K)
    QN_PICK(QT_IQ2_XXS) QN_PICK(QT_IQ2_XS) QN_PICK(QT_IQ2_S) QN_PICK(QT_IQ3_XXS) QN_PICK(QT_IQ3_S) QN_PICK(QT_IQ1_S)
    QN_PICK(QT_IQ1_M)
    default: return NULL;
    }
#undef QN_PICK
}
#undef QN_TYPE
#undef QN_ROWS

/* qi_tile of a qn type: groups of I8_R(P) rows, then single rows; with AVX-512 VNNI, a few
 * rows (2..FEW_ROWS) sub-block by sub-block (see qi_few_rows). */
static void qn_tile_i8(const uint8_t *tile, int qt, int K, const qact *a, int P, int M, float *yt, size_t ldy) {
    const int nb = K / I8_QBLOCK, R = I8_R(P);
    const qn_rows_fn group = qn_rows_for(qt, P, 1), one = qn_rows_for(qt, P, 0);
#if defined(__AVX512VNNI__)
    if (M > 1 && M <= FEW_ROWS) {
        for (int b = 0; b < nb; b++) {
            int r = 0;
            for (; r + R <= M; r += R) group(tile, b, b + 1, K, a + r, yt + (size_t)r * ldy, ldy, r == 0, b > 0);
            for (; r < M; r++) one(tile, b, b + 1, K, a + r, yt + (size_t)r * ldy, ldy, r == 0, b > 0);
        }
        return;
    }
#endif
    int r = 0;
    for (; r + R <= M; r += R) group(tile, 0, nb, K, a + r, yt + (size_t)r * ldy, ldy, r == 0, 0);
    for (; r < M; r++) one(tile, 0, nb, K, a + r, yt + (size_t)r * ldy, ldy, r == 0, 0);
}

/* Tile t for rows 0..M-1 into yt[r * ldy + n] from their activations a in P planes. */
static void qi_tile(const uint8_t *w, int qtype, int K, const qact *a, int P, int M, float *yt, size_t ldy, int t) {
    const int nb = K / I8_QBLOCK;
    const uint8_t *rec = w + (size_t)t * tile_bytes(qtype, K);
    if (qn_is(qtype)) {
        qn_tile_i8(rec, qtype, K, a, P, M, yt, ldy);
        return;
    }
    /* groups of I8_R(P) rows, then one at a time; every count a constant after inlining */
#define ROWS(P)                                                                              \
    {                                                                                        \
        int r = 0;                                                                           \
        for (; r + I8_R(P) <= M; r += I8_R(P))                                              \
            qi_rows(rec, qtype, nb, K, a + r, I8_R(P), P, yt + (size_t)r * ldy, ldy, r == 0, 0);  \
        for (; r < M; r++) qi_rows(rec, qtype, nb, K, a + r, 1, P, yt + (size_t)r * ldy, ldy, r == 0, 0); \
    }
#if defined(__AVX512VNNI__)
    if (M > 1 && M <= FEW_ROWS) {
        if (P == 1) qi_few_rows(rec, qtype, nb, K, a, M, 1, yt, ldy);
        else if (P == 2) qi_few_rows(rec, qtype, nb, K, a, M, 2, yt, ldy);
        else qi_few_rows(rec, qtype, nb, K, a, M, 3, yt, ldy);
        return;
    }
#endif
    if (P == 1) ROWS(1)
    else if (P == 2) ROWS(2)
    else ROWS(3)
#undef ROWS
}

/* Row r's view into buffers for M rows: planes q [M][P K], d and s [M][K / 32], t and th
 * [M][P K / 32] (th: t's P K / 32 after M P K / 32). */
static inline qact qa_view(int8_t *q, float *d, float *s, int32_t *t, int r, int M, int K, int P) {
    const size_t nb = (size_t)K / I8_QBLOCK, per = (size_t)P * nb;
    const qact v = {q + (size_t)r * qa_bytes(K, P), d + (size_t)r * nb, s + (size_t)r * nb, t + (size_t)r * per,
                    t + (size_t)M * per + (size_t)r * per};
    return v;
}

static int qi_matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads, int qtype, int P) {
    if (!(qtype == QT_Q4_1_I8 || qtype == QT_Q8_0_I8 || qn_is(qtype))) return -1;
    if (K % record_k(qtype) || N % I8_TILE || M < 1 || P < 1 || P > 3) return -1;
    const int nb = K / I8_QBLOCK;
    int8_t *q = malloc((size_t)M * qa_bytes(K, P));
    float *ds = malloc(sizeof(float) * 2 * (size_t)M * nb);
    int32_t *t = malloc(sizeof(int32_t) * 2 * (size_t)M * (size_t)P * nb);
    qact *views = malloc(sizeof(qact) * (size_t)M);
    int rc = 0;
    if (!q || !ds || !t || !views) {
        rc = -3;
    } else {
#pragma omp parallel num_threads(nthreads)
        {
#pragma omp for schedule(static)
            for (int r = 0; r < M; r++) {
                views[r] = qa_view(q, ds, ds + (size_t)M * nb, t, r, M, K, P);
                qa_row(x + (size_t)r * K, K, P, views[r]);
            }
#pragma omp for schedule(static)
            for (int t = 0; t < N / I8_TILE; t++) qi_tile(w, qtype, K, views, P, M, y + (size_t)t * I8_TILE, (size_t)N, t);
        }
    }
    free(q);
    free(t);
    free(ds);
    free(views);
    return rc;
}

/* `planes`: P above (1 = int8 activations, 3 = about float32's precision). */
int q4_1_i8_matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads, int planes) {
    return qi_matmul(x, M, K, w, N, y, nthreads, QT_Q4_1_I8, planes);
}

int q8_0_i8_matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads, int planes) {
    return qi_matmul(x, M, K, w, N, y, nthreads, QT_Q8_0_I8, planes);
}

/* The qn types' (quant_types.h): <type>_i8_matmul. */
#define QI_EXPORT(name, T)                                                                  \
    int name##_i8_matmul(const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads, int planes) { \
        return qi_matmul(x, M, K, w, N, y, nthreads, T, planes);                             \
    }
QI_EXPORT(q4_0, QT_Q4_0) QI_EXPORT(q5_0, QT_Q5_0) QI_EXPORT(q5_1, QT_Q5_1) QI_EXPORT(iq4_nl, QT_IQ4_NL)
QI_EXPORT(q4_k, QT_Q4_K) QI_EXPORT(q5_k, QT_Q5_K) QI_EXPORT(q6_k, QT_Q6_K) QI_EXPORT(iq4_xs, QT_IQ4_XS)
QI_EXPORT(q4_g128, QT_Q4_G128) QI_EXPORT(q4_g32, QT_Q4_G32) QI_EXPORT(q8_ch, QT_Q8_CH) QI_EXPORT(q3_k, QT_Q3_K) QI_EXPORT(q2_k, QT_Q2_K)
QI_EXPORT(iq2_xxs, QT_IQ2_XXS) QI_EXPORT(iq2_xs, QT_IQ2_XS) QI_EXPORT(iq2_s, QT_IQ2_S) QI_EXPORT(iq3_xxs, QT_IQ3_XXS)
QI_EXPORT(iq3_s, QT_IQ3_S) QI_EXPORT(iq1_s, QT_IQ1_S) QI_EXPORT(iq1_m, QT_IQ1_M)
#undef QI_EXPORT

#endif
