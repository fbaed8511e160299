/* The GGUF types besides Q4_1 and Q8_0 as tile records: their codes, the records' geometry,
 * and the pieces every kernel reads them with (quant_matmul.c in float32, quant_matmul_int8.c
 * with integer activations, decoder.c's embedding lookup). ops/quantized_linear.py repacks a
 * file's blocks into these records at load.
 *
 * One layout serves both arithmetics ("qn" types: Q4_0, Q5_0, Q5_1, IQ4_NL, and the 256-blocks
 * Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS and the grid types below). Output rows in tiles of 32, K in sub-blocks of 32; a record is
 * one (tile, group of G sub-blocks): G = 1 for the 32-blocks, 8 for the 256-blocks; tiles
 * outermost, then records along K. A record is a header (the scales) and G bodies:
 *
 *   body (one sub-block's quants q, unsigned, 32 outputs n x 32 k, k = 8p + 4s + j):
 *     nibbles  [512]  chunks c = 4h + p (h: outputs 16h..16h+15), byte 4n' + j of a chunk:
 *                     q(16h + n', 8p + j) & 15 | (q(16h + n', 8p + 4 + j) & 15) << 4
 *                     (the integer kernels' Q4_1 chunks: one 32-bit lane is one output's k)
 *     5-bit    [128]  two 64-byte planes H[h]: byte 4n' + j, bit 2p + s = bit 4 of
 *                     q(16h + n', 8p + 4s + j)
 *     6-bit    [256]  four planes H2[h][g] (g = p / 2, the half of k): byte 4n' + j, bits
 *                     2i, 2i + 1 (i = 2 (p % 2) + s) = bits 4, 5 of q(16h + n', 8p + 4s + j)
 *   Q3_K's 3-bit body [384], no nibbles: four planes L[h][g] as H2's holding bits 0, 1 of q,
 *                     then two planes as the 5-bit's H holding bit 2 of q
 *   Q2_K's 2-bit body [256]: the planes L[h][g] alone
 *
 *   headers ([32] fields: one value per output, outputs in order):
 *     Q4_0, Q5_0, IQ4_NL   d[32] fp16                                        64 bytes
 *     Q5_1                 d[32] fp16 | m[32] fp16                          128
 *     Q4_K, Q5_K           d[32] | dmin[32] fp16 | sc[8][32] u8 | mn[8][32] u8   640
 *     Q6_K                 d[32] fp16 | sc[16][32] int8                     576
 *     Q3_K                 d[32] fp16 | sc[16][32] int8 (the 6-bit scale - 32)   576
 *     Q2_K                 d[32] | dmin[32] fp16 | sm[16][32] u8 (the file's: sc | mn << 4)   640
 *     IQ4_XS               d[32] fp16 | ls[8][32] int8 (the 6-bit scale - 32)   320
 *
 * The weights (k in sub-block j of the record, output n), and what each kernel computes with:
 *
 *   Q4_0 d (q - 8); Q5_0 d (q - 16); IQ4_NL d kv[q]; Q5_1 d q + m; Q8_0 d q
 *   Q4_K, Q5_K (d sc_j) q - (dmin mn_j); Q6_K (d sc_(2j + k / 16)) (q - 32); IQ4_XS (d ls_j) kv[q]
 *   Q3_K (d sc_(2j + k / 16)) (q - 4), q = its 2 low bits | its hmask bit << 2
 *   Q2_K (d sc_i) q - (dmin mn_i), i = 2j + k / 16: a min per 16 k, M per half (qn_half_m)
 *
 * so every sub-block is a block of 32 small integers v (q - zero, or kv[q]) with a float32
 * scale D and, for Q5_1/Q4_K/Q5_K, an offset M: D and M are formed in the kernel as above,
 * exactly in float32 (an fp16 times an integer of at most 8 bits), never rounded to fp16.
 * Q6_K, Q3_K and Q2_K have a D per half (16 k) of their sub-blocks, Q2_K an M per half too. kv is IQ4's table (kvalues_iq4nl).
 *
 * The grid types IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (llama.cpp's i-quants:
 * 8 or 4 weights share an index into a grid of magnitudes, with sign bits) are table types: at
 * load each weight's grid value with its sign is decoded (ops/quant_records.py, on gguf-py's
 * grids) into its index in the type's ascending table of signed values kv (qn_kv): IQ2's
 * +-8, 25, 43 and IQ1's 8 g + delta (g in -1, 0, 1; delta +-1: 6 values) as a 3-bit body
 * (Q3_K's), IQ3_XXS's +-4..62 and IQ3_S's odd +-1..15 (16 values) as nibbles. Their header
 * is IQ4_XS's (a scale per 32) or Q6_K's (IQ2_XS, IQ2_S, IQ1_M: a scale per 16): d[32] fp16
 * (IQ1_M's put together from its scale words' nibbles) | S[..][32] int8, S = 2 s + 1 of the
 * file's 3- or 4-bit s; the weight is (d (S u)) kv[q], u = 1/8 (IQ1, IQ2), 1/4 (IQ3_XXS), 1
 * (IQ3_S): exactly gguf-py's d (1/2 + s) / 4 grid sign etc. The grids' sharing is not kept,
 * so these hold more than the file: bytes per 256 weights of a row 106 (IQ1_S, IQ2_XXS), 114
 * (IQ1_M, IQ2_XS, IQ2_S), 138 (IQ3_XXS, IQ3_S), against the file's 50, 56, 66, 74, 82, 98,
 * 110 (1.25x-2.12x; the float32 they were dequantized to before is 1024).
 *
 * Bytes against the file's: Q4_0, Q5_0, Q5_1, IQ4_NL, Q6_K exactly the file's; Q4_K 4736 per
 * 4608 (+2.8%: the 6-bit scales and mins held a byte each), Q5_K 5760 per 5632 (+2.3%),
 * IQ4_XS 4416 per 4352 (+1.5%), Q3_K 3648 per 3520 (+3.6%: its 6-bit scales a byte each), Q2_K
 * exactly the file's (2688).
 *
 * F16 and BF16 (float32 activations only) keep their 2-byte values, one record per (tile,
 * sub-block of 32): w[32 k][32 n], 2048 bytes, the file's size.
 *
 * Pre-quantized checkpoints' int4 and int8 (worker/weights/hf_quantized.py), qn types whose
 * header fields are float32, so that no checkpoint scale is rounded to fp16:
 *
 *   Q4_G128, Q4_G32  (AWQ / GPTQ with zero points: a group of 128 or 32, G = 4 or 1)
 *                    d[32] f32 | m[32] f32, 256 bytes; nibbles body; w = d q + m with d = s
 *                    and m = -s z (exact in float32 for fp16 / bf16 scales s, z < 16)
 *   Q8_CH            (int8 per output channel: W8A8, W8A16; G = 4, 128 k a record)
 *                    d[32] f32, 128 bytes (the channel's scale, repeated per record: +3.1%);
 *                    8-bit body [1024]: chunks c = 8h + 2p + s (Q8_0_I8's), byte 4n' + j =
 *                    q(16h + n', 8p + 4s + j) + 128; w = d (q - 128 + 128) = d q
 */
#ifndef LLMWORKER_QUANT_TYPES_H
#define LLMWORKER_QUANT_TYPES_H

#include "simd.h"

/* The kernels' qtype codes (ops/quantized_linear.py's _TYPES): Q4_1 and Q8_0 have a layout of
 * each arithmetic's own (quant_matmul.c, quant_matmul_int8.c), the others one for both. */
enum {
    QT_Q4_1 = 0, QT_Q8_0 = 1, QT_Q4_1_I8 = 2, QT_Q8_0_I8 = 3,
    QT_Q4_0, QT_Q5_0, QT_Q5_1, QT_IQ4_NL, QT_Q4_K, QT_Q5_K, QT_Q6_K, QT_IQ4_XS, QT_F16, QT_BF16,
    QT_Q4_G128, QT_Q4_G32, QT_Q8_CH, /* pre-quantized checkpoints' (float32 headers, see below) */
    QT_Q3_K, QT_Q2_K,
    QT_IQ2_XXS, QT_IQ2_XS, QT_IQ2_S, QT_IQ3_XXS, QT_IQ3_S, QT_IQ1_S, QT_IQ1_M, /* the grid types (see below) */
    QT_COUNT
};
#define Q4_1_RECORD 640  /* both of Q4_1's layouts */
#define Q8_0_RECORD 1088 /* both of Q8_0's */

#define QN_INLINE static inline __attribute__((always_inline))

QN_INLINE int qn_is(int qt) { return (qt >= QT_Q4_0 && qt <= QT_IQ4_XS) || (qt >= QT_Q4_G128 && qt <= QT_IQ1_M); }
/* IQ1_S-IQ3_S: their grids' values decoded at load into indices of a table (qn_tab) */
QN_INLINE int qn_grid(int qt) { return qt >= QT_IQ2_XXS && qt <= QT_IQ1_M; }
/* The checkpoints' types: their header's fields are float32, not fp16. */
QN_INLINE int qn_f32(int qt) { return qt >= QT_Q4_G128 && qt <= QT_Q8_CH; }
QN_INLINE int is_f16(int qt) { return qt == QT_F16 || qt == QT_BF16; }
QN_INLINE int qn_group(int qt) {
    return (qt >= QT_Q4_K && qt <= QT_IQ4_XS) || qt == QT_Q3_K || qt == QT_Q2_K || qn_grid(qt) ? 8
         : qt == QT_Q4_G128 || qt == QT_Q8_CH ? 4 : 1;
}
QN_INLINE int qn_bits(int qt) {
    return qt == QT_Q5_0 || qt == QT_Q5_1 || qt == QT_Q5_K ? 5 : qt == QT_Q6_K ? 6 : qt == QT_Q8_CH ? 8
         : qt == QT_Q3_K ? 3 : qt == QT_Q2_K ? 2 : qt == QT_IQ3_XXS || qt == QT_IQ3_S ? 4 : qn_grid(qt) ? 3 : 4;
}
QN_INLINE int qn_split(int qt) { /* a scale per 16 k */
    return qt == QT_Q6_K || qt == QT_Q3_K || qt == QT_Q2_K || qt == QT_IQ2_XS || qt == QT_IQ2_S || qt == QT_IQ1_M;
}
QN_INLINE int qn_header(int qt) {
    if (qn_grid(qt)) return qn_split(qt) ? 576 : 320; /* Q6_K's header, or IQ4_XS's */
    switch (qt) {
    case QT_Q5_1: return 128;
    case QT_Q4_K: case QT_Q5_K: case QT_Q2_K: return 640;
    case QT_Q6_K: case QT_Q3_K: return 576;
    case QT_IQ4_XS: return 320;
    case QT_Q4_G128: case QT_Q4_G32: return 256;
    case QT_Q8_CH: return 128;
    default: return 64;
    }
}
QN_INLINE int qn_body(int qt) {
    if (qn_bits(qt) <= 3) return 128 * qn_bits(qt);
    return qn_bits(qt) == 8 ? 1024 : 512 + (qn_bits(qt) == 5 ? 128 : qn_bits(qt) == 6 ? 256 : 0);
}
QN_INLINE int qn_record(int qt) { return qn_header(qt) + qn_group(qt) * qn_body(qt); }
QN_INLINE int qn_has_m(int qt) {
    return qt == QT_Q5_1 || qt == QT_Q4_K || qt == QT_Q5_K || qt == QT_Q4_G128 || qt == QT_Q4_G32;
}
QN_INLINE int qn_table(int qt) { return qt == QT_IQ4_NL || qt == QT_IQ4_XS || qn_grid(qt); }
/* The grid types' scale: d times their odd integer S times this power of two (exact). */
QN_INLINE float qn_unit(int qt) {
    return qt == QT_IQ3_S || !qn_grid(qt) ? 1.0f : qt == QT_IQ3_XXS ? 0.25f : 0.125f;
}
/* Q2_K's min per 16 k (M of each half; the block's sum of x does not serve it). */
QN_INLINE int qn_half_m(int qt) { return qt == QT_Q2_K; }
QN_INLINE int qn_zero(int qt) {
    return qt == QT_Q4_0 ? 8 : qt == QT_Q5_0 ? 16 : qt == QT_Q6_K ? 32 : qt == QT_Q8_CH ? 128 : qt == QT_Q3_K ? 4 : 0;
}
/* Sub-block b's header and body in a tile's records. */
QN_INLINE const uint8_t *qn_hdr(const uint8_t *tile, int qt, int b) {
    return tile + (size_t)(b / qn_group(qt)) * qn_record(qt);
}
QN_INLINE const uint8_t *qn_sub(const uint8_t *tile, int qt, int b) {
    return qn_hdr(tile, qt, b) + qn_header(qt) + (size_t)(b % qn_group(qt)) * qn_body(qt);
}
/* The stream's bytes per sub-block, and how far ahead of it the kernels fetch into L2: ten
 * sub-blocks, about Q4_1's Q4_1_AHEAD_L2 (simd.h) for the 4-bit types. */
QN_INLINE size_t qn_stride(int qt) { return (size_t)qn_record(qt) / qn_group(qt); }
QN_INLINE size_t qn_ahead(int qt) { return 10 * qn_stride(qt); }
#define F16_RECORD 2048
#define F16_AHEAD_L2 16384

/* Bytes of one tile (32 outputs) of K columns, any code. */
static inline size_t tile_bytes(int qt, int K) {
    const size_t nb = (size_t)K / 32;
    if (qn_is(qt)) return nb / qn_group(qt) * qn_record(qt);
    if (is_f16(qt)) return nb * F16_RECORD;
    return nb * (qt == QT_Q4_1 || qt == QT_Q4_1_I8 ? Q4_1_RECORD : Q8_0_RECORD);
}
/* The columns a record covers (K must be a multiple). */
static inline int record_k(int qt) { return qn_is(qt) ? 32 * qn_group(qt) : 32; }
/* Whether the float kernel adds M sx (the block sums of x). */
static inline int has_block_min(int qt) { return qt == QT_Q4_1 || (qn_is(qt) && qn_has_m(qt)); }

/* The table types' values v by index: kvalues_iq4nl; the grid types' grid values with either
 * sign, ascending (IQ2's 8, 25, 43 x 1/8 of the scale; IQ3_XXS's 4..62 x 1/4; IQ3_S's odd
 * 1..15; IQ1's 8 g + delta, g in -1, 0, 1, delta +-1, x 1/8). Indices past a table's end
 * never occur. */
#define IQ4_VALUES -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113
#define IQ2_VALUES -43, -25, -8, 8, 25, 43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
#define IQ3XXS_VALUES -62, -52, -44, -36, -28, -20, -12, -4, 4, 12, 20, 28, 36, 44, 52, 62
#define IQ3S_VALUES -15, -13, -11, -9, -7, -5, -3, -1, 1, 3, 5, 7, 9, 11, 13, 15
#define IQ1_VALUES -9, -7, -1, 1, 7, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
static const int8_t QN_KV[5][16] = {{IQ4_VALUES}, {IQ2_VALUES}, {IQ3XXS_VALUES}, {IQ3S_VALUES}, {IQ1_VALUES}};
QN_INLINE const int8_t *qn_kv(int qt) {
    switch (qt) {
    case QT_IQ2_XXS: case QT_IQ2_XS: case QT_IQ2_S: return QN_KV[1];
    case QT_IQ3_XXS: return QN_KV[2];
    case QT_IQ3_S: return QN_KV[3];
    case QT_IQ1_S: case QT_IQ1_M: return QN_KV[4];
    default: return QN_KV[0];
    }
}
/* A table as the 16 bytes vpshufb looks up; + 128 (the unsigned side of vpdpbusd): v ^ 0x80 */
QN_INLINE __m128i qn_tab(int qt) { /* constants (qt is one), not loads from QN_KV */
    switch (qt) {
    case QT_IQ2_XXS: case QT_IQ2_XS: case QT_IQ2_S: return _mm_setr_epi8(IQ2_VALUES);
    case QT_IQ3_XXS: return _mm_setr_epi8(IQ3XXS_VALUES);
    case QT_IQ3_S: return _mm_setr_epi8(IQ3S_VALUES);
    case QT_IQ1_S: case QT_IQ1_M: return _mm_setr_epi8(IQ1_VALUES);
    default: return _mm_setr_epi8(IQ4_VALUES);
    }
}
QN_INLINE __m128i qn_utab(int qt) { return _mm_xor_si128(qn_tab(qt), _mm_set1_epi8((char)0x80)); }

/* ---- 8 outputs (AVX2) ---- */

/* 8 bytes at p, unsigned or signed, as floats (vpmovzxbd/vpmovsxbd from memory) */
QN_INLINE __m256 u8_f8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
QN_INLINE __m256 i8_f8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
/* The low (hi = 0) or high nibbles of 8 bytes at p as floats (Q2_K's scales and mins) */
QN_INLINE __m256 nib_f8(const uint8_t *p, int hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtepi32_ps(hi ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15)));
}

/* D of outputs n0..n0+7 in sub-block j (j = b % G) of a record, half kh (Q6_K) */
QN_INLINE __m256 qn_d8(const uint8_t *hdr, int qt, int j, int kh, int n0) {
    if (qn_f32(qt)) return _mm256_loadu_ps((const float *)(hdr + 4 * n0));
    const __m256 d = load_half8(hdr + 2 * n0);
    if (qt == QT_Q4_K || qt == QT_Q5_K) return _mm256_mul_ps(d, u8_f8(hdr + 128 + 32 * j + n0));
    if (qt == QT_Q2_K) return _mm256_mul_ps(d, nib_f8(hdr + 128 + 32 * (2 * j + kh) + n0, 0));
    if (qt == QT_IQ4_XS || qn_split(qt) || qn_grid(qt)) {
        __m256 s = i8_f8(hdr + 64 + 32 * (qn_split(qt) ? 2 * j + kh : j) + n0);
        if (qn_unit(qt) != 1.0f) s = _mm256_mul_ps(s, _mm256_set1_ps(qn_unit(qt)));
        return _mm256_mul_ps(d, s);
    }
    return d;
}
/* Q2_K's M of half kh: -(dmin mn), mn the high nibble of its scale byte */
QN_INLINE __m256 qn_hm8(const uint8_t *hdr, int j, int kh, int n0) {
    const __m256 m = _mm256_mul_ps(load_half8(hdr + 64 + 2 * n0), nib_f8(hdr + 128 + 32 * (2 * j + kh) + n0, 1));
    return _mm256_xor_ps(m, _mm256_set1_ps(-0.0f));
}
/* M (Q5_1: m; Q4_K, Q5_K: -(dmin mn_j)) */
QN_INLINE __m256 qn_m8(const uint8_t *hdr, int qt, int j, int n0) {
    if (qn_f32(qt)) return _mm256_loadu_ps((const float *)(hdr + 128 + 4 * n0));
    const __m256 m = load_half8(hdr + 64 + 2 * n0);
    if (qt == QT_Q5_1) return m;
    return _mm256_xor_ps(_mm256_mul_ps(m, u8_f8(hdr + 384 + 32 * j + n0)), _mm256_set1_ps(-0.0f));
}

/* Bit b (0..7) of each byte of H at bit 4, the rest 0; bits 2i, 2i + 1 at bits 4, 5. Shifts
 * of 16-bit lanes: within the shift's range each byte's bits land in the same byte. */
QN_INLINE __m256i bit_at4_8(__m256i H, int b) {
    const __m256i t = b <= 4 ? _mm256_slli_epi16(H, 4 - b) : _mm256_srli_epi16(H, b - 4);
    return _mm256_and_si256(t, _mm256_set1_epi8(0x10));
}
QN_INLINE __m256i bits2_at4_8(__m256i H, int i) {
    const __m256i t = i <= 2 ? _mm256_slli_epi16(H, 4 - 2 * i) : _mm256_srli_epi16(H, 2);
    return _mm256_and_si256(t, _mm256_set1_epi8(0x30));
}
/* Q3_K's: bits 2i, 2i + 1 of each byte of L at bits 0, 1; bit b of H at bit 2. */
QN_INLINE __m256i bits2_at0_8(__m256i L, int i) {
    return _mm256_and_si256(_mm256_srli_epi16(L, 2 * i), _mm256_set1_epi8(0x03));
}
QN_INLINE __m256i bit_at2_8(__m256i H, int b) {
    const __m256i t = b <= 2 ? _mm256_slli_epi16(H, 2 - b) : _mm256_srli_epi16(H, b - 2);
    return _mm256_and_si256(t, _mm256_set1_epi8(0x04));
}

/* The quants q (unsigned) of outputs 8e..8e+7 for k = 8p + j (*lo) and 8p + 4 + j (*hi), j =
 * 0..3 the bytes of each output's 32-bit lane. */
QN_INLINE void qn_quants8(const uint8_t *body, int qt, int p, int e, __m256i *lo, __m256i *hi) {
    const size_t part = 32 * (size_t)(e % 2);
    if (qn_bits(qt) == 8) { /* chunks c = 8h + 2p + s of 16 outputs x 4 k (Q8_0_I8's) */
        *lo = _mm256_loadu_si256((const __m256i *)(body + ((e / 2) * 8 + 2 * p) * 64 + part));
        *hi = _mm256_loadu_si256((const __m256i *)(body + ((e / 2) * 8 + 2 * p + 1) * 64 + part));
        return;
    }
    if (qn_bits(qt) <= 3) { /* 2-bit planes L[h][p / 2], then (Q3_K) the third bit's planes H[h] */
        const __m256i L = _mm256_loadu_si256((const __m256i *)(body + ((e / 2) * 2 + p / 2) * 64 + part));
        *lo = bits2_at0_8(L, 2 * (p % 2));
        *hi = bits2_at0_8(L, 2 * (p % 2) + 1);
        if (qn_bits(qt) == 3) {
            const __m256i H = _mm256_loadu_si256((const __m256i *)(body + 256 + (e / 2) * 64 + part));
            *lo = _mm256_or_si256(*lo, bit_at2_8(H, 2 * p));
            *hi = _mm256_or_si256(*hi, bit_at2_8(H, 2 * p + 1));
        }
        return;
    }
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(body + ((e / 2) * 4 + p) * 64 + part));
    __m256i l = _mm256_and_si256(v, low), h = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if (qn_bits(qt) == 5) {
        const __m256i H = _mm256_loadu_si256((const __m256i *)(body + 512 + (e / 2) * 64 + part));
        l = _mm256_or_si256(l, bit_at4_8(H, 2 * p));
        h = _mm256_or_si256(h, bit_at4_8(H, 2 * p + 1));
    } else if (qn_bits(qt) == 6) {
        const __m256i H = _mm256_loadu_si256((const __m256i *)(body + 512 + ((e / 2) * 2 + p / 2) * 64 + part));
        l = _mm256_or_si256(l, bits2_at4_8(H, 2 * (p % 2)));
        h = _mm256_or_si256(h, bits2_at4_8(H, 2 * (p % 2) + 1));
    }
    *lo = l;
    *hi = h;
}

/* The signed values v (q - zero, or kv[q]) as bytes, for the float kernels. */
QN_INLINE __m256i qn_values8(__m256i q, int qt) {
    if (qn_table(qt)) return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(qn_tab(qt)), q);
    if (qn_zero(qt)) return _mm256_sub_epi8(q, _mm256_set1_epi8((char)qn_zero(qt)));
    return q;
}

/* Byte j of each 32-bit lane of X, sign-extended, as 8 floats. */
QN_INLINE __m256 byte_f8(__m256i X, int j) {
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(j == 3 ? X : _mm256_slli_epi32(X, 24 - 8 * j), 24));
}

#ifdef __AVX512F__
/* ---- 16 outputs (AVX-512) ---- */
QN_INLINE __m512 u8_f16(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
QN_INLINE __m512 i8_f16(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
QN_INLINE __m512 nib_f16(const uint8_t *p, int hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtepi32_ps(hi ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15)));
}
QN_INLINE __m512 qn_d16(const uint8_t *hdr, int qt, int j, int kh, int n0) {
    if (qn_f32(qt)) return _mm512_loadu_ps((const float *)(hdr + 4 * n0));
    const __m512 d = load_half16(hdr + 2 * n0);
    if (qt == QT_Q4_K || qt == QT_Q5_K) return _mm512_mul_ps(d, u8_f16(hdr + 128 + 32 * j + n0));
    if (qt == QT_Q2_K) return _mm512_mul_ps(d, nib_f16(hdr + 128 + 32 * (2 * j + kh) + n0, 0));
    if (qt == QT_IQ4_XS || qn_split(qt) || qn_grid(qt)) {
        __m512 s = i8_f16(hdr + 64 + 32 * (qn_split(qt) ? 2 * j + kh : j) + n0);
        if (qn_unit(qt) != 1.0f) s = _mm512_mul_ps(s, _mm512_set1_ps(qn_unit(qt)));
        return _mm512_mul_ps(d, s);
    }
    return d;
}
QN_INLINE __m512 qn_hm16(const uint8_t *hdr, int j, int kh, int n0) {
    const __m512 m = _mm512_mul_ps(load_half16(hdr + 64 + 2 * n0), nib_f16(hdr + 128 + 32 * (2 * j + kh) + n0, 1));
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(m), _mm512_set1_epi32((int)0x80000000u)));
}
QN_INLINE __m512 qn_m16(const uint8_t *hdr, int qt, int j, int n0) {
    if (qn_f32(qt)) return _mm512_loadu_ps((const float *)(hdr + 128 + 4 * n0));
    const __m512 m = load_half16(hdr + 64 + 2 * n0);
    if (qt == QT_Q5_1) return m;
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(m, u8_f16(hdr + 384 + 32 * j + n0))),
                                                _mm512_set1_epi32((int)0x80000000u)));
}
QN_INLINE __m512i bit_at4_16(__m512i H, int b) {
    const __m512i t = b <= 4 ? _mm512_slli_epi16(H, 4 - b) : _mm512_srli_epi16(H, b - 4);
    return _mm512_and_si512(t, _mm512_set1_epi8(0x10));
}
QN_INLINE __m512i bits2_at4_16(__m512i H, int i) {
    const __m512i t = i <= 2 ? _mm512_slli_epi16(H, 4 - 2 * i) : _mm512_srli_epi16(H, 2);
    return _mm512_and_si512(t, _mm512_set1_epi8(0x30));
}
QN_INLINE __m512i bits2_at0_16(__m512i L, int i) {
    return _mm512_and_si512(_mm512_srli_epi16(L, 2 * i), _mm512_set1_epi8(0x03));
}
QN_INLINE __m512i bit_at2_16(__m512i H, int b) {
    const __m512i t = b <= 2 ? _mm512_slli_epi16(H, 2 - b) : _mm512_srli_epi16(H, b - 2);
    return _mm512_and_si512(t, _mm512_set1_epi8(0x04));
}
/* The quants of outputs 16h..16h+15 for k = 8p + j (*lo) and 8p + 4 + j (*hi): chunk 4h + p. */
QN_INLINE void qn_quants16(const uint8_t *body, int qt, int p, int h, __m512i *lo, __m512i *hi) {
    if (qn_bits(qt) == 8) {
        *lo = _mm512_loadu_si512(body + (8 * h + 2 * p) * 64);
        *hi = _mm512_loadu_si512(body + (8 * h + 2 * p + 1) * 64);
        return;
    }
    if (qn_bits(qt) <= 3) {
        const __m512i L = _mm512_loadu_si512(body + (2 * h + p / 2) * 64);
        *lo = bits2_at0_16(L, 2 * (p % 2));
        *hi = bits2_at0_16(L, 2 * (p % 2) + 1);
        if (qn_bits(qt) == 3) {
            const __m512i H = _mm512_loadu_si512(body + 256 + h * 64);
            *lo = _mm512_or_si512(*lo, bit_at2_16(H, 2 * p));
            *hi = _mm512_or_si512(*hi, bit_at2_16(H, 2 * p + 1));
        }
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i v = _mm512_loadu_si512(body + (4 * h + p) * 64);
    __m512i l = _mm512_and_si512(v, low), u = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    if (qn_bits(qt) == 5) {
        const __m512i H = _mm512_loadu_si512(body + 512 + h * 64);
        l = _mm512_or_si512(l, bit_at4_16(H, 2 * p));
        u = _mm512_or_si512(u, bit_at4_16(H, 2 * p + 1));
    } else if (qn_bits(qt) == 6) {
        const __m512i H = _mm512_loadu_si512(body + 512 + (h * 2 + p / 2) * 64);
        l = _mm512_or_si512(l, bits2_at4_16(H, 2 * (p % 2)));
        u = _mm512_or_si512(u, bits2_at4_16(H, 2 * (p % 2) + 1));
    }
    *lo = l;
    *hi = u;
}
#endif

/* ---- one output row at a time (the embedding lookup) ---- */

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float f32_at(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

/* q(n, k) of a body (n, k < 32). */
static inline int qn_quant(const uint8_t *body, int qt, int n, int k) {
    const int h = n / 16, i = 4 * (n % 16) + k % 4, p = k / 8, s = (k % 8) / 4;
    if (qn_bits(qt) == 8) return body[(8 * h + k / 4) * 64 + i];
    if (qn_bits(qt) <= 3) {
        const int low = (body[(2 * h + p / 2) * 64 + i] >> (2 * (2 * (p % 2) + s))) & 3;
        return qn_bits(qt) == 2 ? low : low | ((body[256 + h * 64 + i] >> (2 * p + s)) & 1) << 2;
    }
    int q = (body[(4 * h + p) * 64 + i] >> (4 * s)) & 15;
    if (qn_bits(qt) == 5) q |= ((body[512 + h * 64 + i] >> (2 * p + s)) & 1) << 4;
    if (qn_bits(qt) == 6) q |= ((body[512 + (2 * h + p / 2) * 64 + i] >> (2 * (2 * (p % 2) + s))) & 3) << 4;
    return q;
}

/* Row n of tile `tile` of a qn weight, K columns, into y: each weight as gguf-py's dequantize
 * computes it (the float32 table's row bit for bit: its products and sums in its order). */
static void qn_row(const uint8_t *tile, int qt, int K, int n, float *y) {
    const int8_t *kv = qn_kv(qt);
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *hdr = qn_hdr(tile, qt, b), *body = qn_sub(tile, qt, b);
        const int j = b % qn_group(qt);
        const float d = qn_f32(qt) ? f32_at(hdr + 4 * n) : half_at(hdr + 2 * n);
        for (int k = 0; k < 32; k++) {
            const int q = qn_quant(body, qt, n, k);
            const float v = qn_table(qt) ? (float)kv[q] : (float)(q - qn_zero(qt));
            float w;
            switch (qt) {
            case QT_Q5_1: w = d * v + half_at(hdr + 64 + 2 * n); break;
            case QT_Q4_G128: case QT_Q4_G32: w = d * v + f32_at(hdr + 128 + 4 * n); break;
            case QT_Q4_K: case QT_Q5_K:
                w = (d * (float)hdr[128 + 32 * j + n]) * v - half_at(hdr + 64 + 2 * n) * (float)hdr[384 + 32 * j + n];
                break;
            case QT_Q6_K: case QT_Q3_K: w = (d * (float)(int8_t)hdr[64 + 32 * (2 * j + k / 16) + n]) * v; break;
            case QT_Q2_K: {
                const int sm = hdr[128 + 32 * (2 * j + k / 16) + n];
                w = (d * (float)(sm & 15)) * v - half_at(hdr + 64 + 2 * n) * (float)(sm >> 4);
                break;
            }
            case QT_IQ4_XS: w = (d * (float)(int8_t)hdr[64 + 32 * j + n]) * v; break;
            default:
                if (qn_grid(qt)) /* d S u, u a power of two: exact, as gguf-py's d (1/2 + ls) / 4 etc. */
                    w = (d * ((float)(int8_t)hdr[64 + 32 * (qn_split(qt) ? 2 * j + k / 16 : j) + n] * qn_unit(qt))) * v;
                else
                    w = d * v;
            }
            y[32 * b + k] = w;
        }
    }
}

/* Row n of an F16/BF16 tile. */
static void f16_row(const uint8_t *tile, int qt, int K, int n, float *y) {
    for (int k = 0; k < K; k++) {
        uint16_t u;
        memcpy(&u, tile + (size_t)(k / 32) * F16_RECORD + 64 * (k % 32) + 2 * n, 2);
        if (qt == QT_F16) {
            y[k] = _cvtsh_ss(u);
        } else {
            const uint32_t bits = (uint32_t)u << 16;
            memcpy(y + k, &bits, 4);
        }
    }
}

/* Row `row` of a weight's records (any code; K columns) into y, as gguf-py dequantizes it. */
static void quant_row(const uint8_t *w, int qt, int K, int64_t row, float *y) {
    const uint8_t *tile = w + (size_t)(row / 32) * tile_bytes(qt, K);
    const int n = (int)(row % 32);
    if (qn_is(qt)) {
        qn_row(tile, qt, K, n, y);
        return;
    }
    if (is_f16(qt)) {
        f16_row(tile, qt, K, n, y);
        return;
    }
    const int record = qt == QT_Q4_1 || qt == QT_Q4_1_I8 ? Q4_1_RECORD : Q8_0_RECORD;
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *rec = tile + (size_t)b * record;
        const float d = half_at(rec + 2 * n);
        for (int k = 0; k < 32; k++) {
            float v;
            if (qt == QT_Q4_1) v = d * (float)((rec[128 + 16 * k + n % 16] >> (4 * (n / 16))) & 15) + half_at(rec + 64 + 2 * n);
            else if (qt == QT_Q4_1_I8) v = d * (float)qn_quant(rec + 128, QT_Q4_0, n, k) + half_at(rec + 64 + 2 * n);
            else if (qt == QT_Q8_0) v = (float)(int8_t)rec[64 + 32 * k + n] * d;
            else v = (float)(int8_t)(rec[64 + ((n / 16) * 8 + k / 4) * 64 + 4 * (n % 16) + k % 4] ^ 0x80) * d;
            y[32 * b + k] = v;
        }
    }
}

#endif
