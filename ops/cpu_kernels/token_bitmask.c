/* A grammar's token bitmask applied to logits on the CPU, in place: logits[rows[k], j] =
 * -inf wherever bit j of bitmask row k is 0 (bit j of 32-bit word w is token 32 w + j, as
 * llguidance and xgrammar write it). One pass over the bitmask words; a word that allows all
 * 32 tokens is skipped, one that allows none writes 32 -infs; only mixed words test bits.
 * The torch path (worker/logits_masks.py) builds an [n, V] additive mask and adds it: three
 * passes over [n, V] floats. The same result: -inf where banned, the logit where allowed.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

void apply_token_bitmask(float *logits, int64_t ld, const int32_t *bitmask, int words,
                         const int64_t *rows, int n, int vocab, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n > 1)
    for (int k = 0; k < n; k++) {
        float *l = logits + rows[k] * ld;
        const uint32_t *bm = (const uint32_t *)bitmask + (int64_t)k * words;
        for (int w = 0; w < words; w++) {
            const uint32_t m = bm[w];
            if (m == 0xFFFFFFFFu) continue;
            const int base = w * 32, lim = vocab - base < 32 ? vocab - base : 32;
            if (m == 0) {
                for (int j = 0; j < lim; j++) l[base + j] = -INFINITY;
            } else {
                for (int j = 0; j < lim; j++)
                    if (!((m >> j) & 1u)) l[base + j] = -INFINITY;
            }
        }
    }
}
