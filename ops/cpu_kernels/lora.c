/* Batched LoRA inside the fused decoder (decoder.c): ops/lora.py's contract, for the rows
 * of a step that name an adapter, on the adapter slots of worker/lora/slots.py.
 *
 * A linear's slots, n output slices (q/k/v: 3, gate/up: 2, o and down: 1), rank R:
 *
 *   a      [num_slots, n R, K]          A of each slice, stacked on R (zero-padded rank)
 *   bt[i]  [num_slots, R, out_i]        B of slice i transposed, the adapter's scale in it
 *
 * shrink   h[r] = x[r] @ a[slot r]^T                  one row of the step, [n R]
 * expand   y[r, cols] += h[r, i R:(i+1) R] @ bt[i][slot r][:, cols]
 *          for a tile's columns of slice i, right after the tile's matmul and before its
 *          epilogue (rotary, silu, the residual add), as torch adds the delta to the
 *          linear's output. The delta of a tile is summed over the rank first (the same
 *          order in every tile), then added once.
 *
 * B is stored transposed so that the expand of 32 columns is R broadcast-FMAs into four
 * 8-lane sums, with no horizontal sums. A row's arithmetic reads only that row: its bits do
 * not depend on the batch. Rows of the base model (slot < 0) are never touched.
 */
#ifndef LLMWORKER_LORA_C
#define LLMWORKER_LORA_C

#include "simd.h"

typedef struct {
    const float *a;     /* [num_slots, n R, K] */
    const float *bt[3]; /* per output slice: [num_slots, R, out_i] */
    int n;              /* output slices */
    int out[3];         /* their widths */
} lora_linear;

typedef struct {
    lora_linear qkv, o, gate_up, down;
} lora_layer;

/* lora_groups bits: the linears some adapter of the step targets (the others are zeros). */
enum { LORA_QKV = 1, LORA_O = 2, LORA_GATE_UP = 4, LORA_DOWN = 8 };

/* y[0..3] = x . a_j for the four rows a, a + K, a + 2K, a + 3K (K a multiple of 8), and
 * the same for x2 into y2 when x2 (a second row of the same adapter: a's loads shared;
 * each row's sums are the same operations in the same order either way). */
static inline void lora_dot4(const float *x, const float *x2, const float *a, int K, float *y, float *y2) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(),
           s3 = _mm256_setzero_ps();
    if (!x2) {
        for (int k = 0; k < K; k += 8) {
            const __m256 v = _mm256_loadu_ps(x + k);
            s0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(a + k), s0);
            s1 = _mm256_fmadd_ps(v, _mm256_loadu_ps(a + (size_t)K + k), s1);
            s2 = _mm256_fmadd_ps(v, _mm256_loadu_ps(a + 2 * (size_t)K + k), s2);
            s3 = _mm256_fmadd_ps(v, _mm256_loadu_ps(a + 3 * (size_t)K + k), s3);
        }
        y[0] = hsum8(s0), y[1] = hsum8(s1), y[2] = hsum8(s2), y[3] = hsum8(s3);
        return;
    }
    __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps(), t2 = _mm256_setzero_ps(),
           t3 = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) {
        const __m256 v = _mm256_loadu_ps(x + k), w = _mm256_loadu_ps(x2 + k);
        const __m256 a0 = _mm256_loadu_ps(a + k), a1 = _mm256_loadu_ps(a + (size_t)K + k);
        const __m256 a2 = _mm256_loadu_ps(a + 2 * (size_t)K + k), a3 = _mm256_loadu_ps(a + 3 * (size_t)K + k);
        s0 = _mm256_fmadd_ps(v, a0, s0), t0 = _mm256_fmadd_ps(w, a0, t0);
        s1 = _mm256_fmadd_ps(v, a1, s1), t1 = _mm256_fmadd_ps(w, a1, t1);
        s2 = _mm256_fmadd_ps(v, a2, s2), t2 = _mm256_fmadd_ps(w, a2, t2);
        s3 = _mm256_fmadd_ps(v, a3, s3), t3 = _mm256_fmadd_ps(w, a3, t3);
    }
    y[0] = hsum8(s0), y[1] = hsum8(s1), y[2] = hsum8(s2), y[3] = hsum8(s3);
    y2[0] = hsum8(t0), y2[1] = hsum8(t1), y2[2] = hsum8(t2), y2[3] = hsum8(t3);
}

static inline float lora_dot1(const float *x, const float *a, int K) {
    __m256 s = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(a + k), s);
    return hsum8(s);
}

/* h[0 .. n R) = x[0 .. K) @ a[slot]^T, and h2 from x2 when x2 (a row of the same slot). */
static void lora_shrink_rows(const lora_linear *L, int R, int K, int slot, const float *x, float *h,
                             const float *x2, float *h2) {
    const int nr = L->n * R;
    const float *a = L->a + (size_t)slot * nr * K;
    int j = 0;
    for (; j + 4 <= nr; j += 4) lora_dot4(x, x2, a + (size_t)j * K, K, h + j, x2 ? h2 + j : NULL);
    for (; j < nr; j++) {
        h[j] = lora_dot1(x, a + (size_t)j * K, K);
        if (x2) h2[j] = lora_dot1(x2, a + (size_t)j * K, K);
    }
}

static inline void lora_add8(float *y, __m256 d) { _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), d)); }

/* y[0 .. ncols) += h[slice R .. (slice + 1) R) @ bt[slice][slot][:, col .. col + ncols),
 * ncols a multiple of 32: one row's columns of one slice; and the same from h2 into y2
 * when h2 (a second row of the same slot, sharing the loads of B). */
static void lora_expand_rows(const lora_linear *L, int R, int slice, int col, int ncols, int slot, const float *h,
                             float *y, const float *h2, float *y2) {
    const int out = L->out[slice];
    const float *bt = L->bt[slice] + (size_t)slot * R * out + col;
    h += (size_t)slice * R;
    if (h2) h2 += (size_t)slice * R;
    for (int c = 0; c < ncols; c += 32) {
        __m256 d0 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps(), d2 = _mm256_setzero_ps(),
               d3 = _mm256_setzero_ps();
        if (!h2) {
            for (int j = 0; j < R; j++) {
                const __m256 hj = _mm256_set1_ps(h[j]);
                const float *b = bt + (size_t)j * out + c;
                d0 = _mm256_fmadd_ps(hj, _mm256_loadu_ps(b), d0);
                d1 = _mm256_fmadd_ps(hj, _mm256_loadu_ps(b + 8), d1);
                d2 = _mm256_fmadd_ps(hj, _mm256_loadu_ps(b + 16), d2);
                d3 = _mm256_fmadd_ps(hj, _mm256_loadu_ps(b + 24), d3);
            }
        } else {
            __m256 e0 = _mm256_setzero_ps(), e1 = _mm256_setzero_ps(), e2 = _mm256_setzero_ps(),
                   e3 = _mm256_setzero_ps();
            for (int j = 0; j < R; j++) {
                const __m256 hj = _mm256_set1_ps(h[j]), gj = _mm256_set1_ps(h2[j]);
                const float *b = bt + (size_t)j * out + c;
                const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
                const __m256 b2 = _mm256_loadu_ps(b + 16), b3 = _mm256_loadu_ps(b + 24);
                d0 = _mm256_fmadd_ps(hj, b0, d0), e0 = _mm256_fmadd_ps(gj, b0, e0);
                d1 = _mm256_fmadd_ps(hj, b1, d1), e1 = _mm256_fmadd_ps(gj, b1, e1);
                d2 = _mm256_fmadd_ps(hj, b2, d2), e2 = _mm256_fmadd_ps(gj, b2, e2);
                d3 = _mm256_fmadd_ps(hj, b3, d3), e3 = _mm256_fmadd_ps(gj, b3, e3);
            }
            float *yc = y2 + c;
            lora_add8(yc, e0), lora_add8(yc + 8, e1), lora_add8(yc + 16, e2), lora_add8(yc + 24, e3);
        }
        float *yc = y + c;
        lora_add8(yc, d0), lora_add8(yc + 8, d1), lora_add8(yc + 16, d2), lora_add8(yc + 24, d3);
    }
}

#endif
