/* Load time: a weight's unsigned quants -> its records' bodies (the layouts in quant_types.h's
 * "body"; the width and size a type's: qn_bits, qn_body), for ops/quant_records.py, which
 * decodes each type's blocks into quants with numpy. Scattering bits into planes is what
 * numpy does slowest (a strided pass per bit); here it is one pass over the quants, a tile's
 * sub-block at a time (the caller runs chunks of rows on threads of its own).
 *
 *   q     [n][nb][32] uint8: row r, sub-block b of 32 k, k; each quant < 2^qn_bits
 *   out   [n / 32][nb][qn_body] uint8
 *
 * Row r = 32 t + 16 h + n' of tile t, k = 8 p + 4 s + j (p < 4, s < 2, j < 4).
 */
#include <stdint.h>
#include <string.h>

#include "quant_types.h"

/* A qn type's body bytes per (tile, sub-block); 0 for a type without these bodies. */
int body_bytes(int qt) { return qn_is(qt) ? qn_body(qt) : 0; }

/* A row's 4 consecutive quants as one word, byte j the quant k + j: a tile's 4 j are its
 * records' byte lanes, so every layout below is word arithmetic, 4 quants at a time. */
static inline uint32_t word(const uint8_t *r) {
    uint32_t v;
    memcpy(&v, r, 4);
    return v;
}

static inline void put(uint8_t *o, uint32_t v) { memcpy(o, &v, 4); }

/* One sub-block of a tile: the quants of its 32 rows, row i at q + i * stride. */
static void nibbles(const uint8_t *q, int64_t stride, uint8_t *o) {
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 4; p++)
            for (int n = 0; n < 16; n++) {
                const uint8_t *r = q + (16 * h + n) * stride + 8 * p;
                put(o + ((4 * h + p) * 16 + n) * 4, (word(r) & 0x0F0F0F0Fu) | (word(r + 4) & 0x0F0F0F0Fu) << 4);
            }
}

/* Bit `bit` of each quant: byte (h, n', j) holds it for k = 8 p + 4 s + j at bit 2 p + s. */
static void plane1(const uint8_t *q, int64_t stride, int bit, uint8_t *o) {
    for (int i = 0; i < 32; i++) {
        const uint8_t *r = q + i * stride;
        uint32_t v = 0;
        for (int ps = 0; ps < 8; ps++) v |= ((word(r + 4 * ps) >> bit) & 0x01010101u) << ps;
        put(o + 4 * i, v);
    }
}

/* Bits `bit`, `bit` + 1 of each quant: planes [h][g] (g the half of k, k = 16 g + 4 i + j),
 * byte (n', j) holds them at bits 2 i, 2 i + 1. */
static void planes2(const uint8_t *q, int64_t stride, int bit, uint8_t *o) {
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < 2; g++)
            for (int n = 0; n < 16; n++) {
                const uint8_t *r = q + (16 * h + n) * stride + 16 * g;
                uint32_t v = 0;
                for (int i = 0; i < 4; i++) v |= ((word(r + 4 * i) >> bit) & 0x03030303u) << (2 * i);
                put(o + ((2 * h + g) * 16 + n) * 4, v);
            }
}

/* Q8's chunks: chunk 8 h + p (k = 4 p + j), byte 4 n' + j. */
static void chunks8(const uint8_t *q, int64_t stride, uint8_t *o) {
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 8; p++)
            for (int n = 0; n < 16; n++) put(o + ((8 * h + p) * 16 + n) * 4, word(q + (16 * h + n) * stride + 4 * p));
}

/* Returns 0, or -1 for a type without these bodies or rows not a multiple of 32. */
int repack_body(const uint8_t *q, int64_t n, int64_t nb, int qt, uint8_t *out) {
    if (!qn_is(qt) || n % 32 != 0 || nb < 0) return -1;
    const int bits = qn_bits(qt);
    const int64_t bytes = qn_body(qt), stride = nb * 32, tiles = n / 32;
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *s = q + t * 32 * stride + b * 32;
            uint8_t *o = out + (t * nb + b) * bytes;
            switch (bits) {
                case 2: planes2(s, stride, 0, o); break;
                case 3: planes2(s, stride, 0, o); plane1(s, stride, 2, o + 256); break;
                case 4: nibbles(s, stride, o); break;
                case 5: nibbles(s, stride, o); plane1(s, stride, 4, o + 512); break;
                case 6: nibbles(s, stride, o); planes2(s, stride, 4, o + 512); break;
                default: chunks8(s, stride, o); break;
            }
        }
    return 0;
}
