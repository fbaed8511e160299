/* Decode attention over a paged KV cache, AVX2 + FMA: one query token per request, read
 * straight from the cache through the block table (no gather copy). The cache holds float32,
 * or float16 (`kv_half`, --kv-cache-dtype float16: half the bytes a long context's step
 * reads), widened exactly as it is loaded; the arithmetic is float32 either way.
 *
 *   q, out   [T, Hq, D] rows q_stride / out_stride floats apart   rows[i]: request i's row
 *   caches   [num_blocks, block_size, Hkv, D]  token p of request i: block
 *            tables[i, p / block_size], offset p % block_size
 *
 * A row's keys are its request's first lens[i] tokens, or with a sliding window w (`window`,
 * a layer's own) the last w of them: keys (p - w, p] of the query at position p = lens[i] - 1,
 * as transformers' window. The loops start at the window's first key, so a windowed layer's
 * cost stops growing with the context, and a row's scores are kept from its first key on.
 *
 * A request's keys are split in up to four chunks by their count alone (see chunk_len);
 * each chunk's scores, an exact softmax over the chunk (max first) and its weighted sum of
 * values in key order, then the chunks combined in order. A work item is a whole request
 * when there are enough requests to share out, else one chunk (a request alone keeps both
 * threads busy; the last chunk to finish combines). A token's keys and values for every kv
 * head are one contiguous read, shared by the query heads. A request's arithmetic depends on
 * its length only, so its result does not depend on the rest of the batch. (AVX2 code in
 * every build: the same bits on every ISA.)
 *
 * The fused decoder (decoder.c) runs prefill rows here too, each a query of its own over
 * its position + 1 tokens: a prompt's bits then do not depend on its chunking. Consecutive
 * rows of one request (a prompt chunk's, or a speculative verification step's: the next
 * token and its drafts) are runs of up to ATTN_ROWS rows (attention_blocks) that read each key
 * and value once for all of them, each row's arithmetic unchanged. With few runs a run's
 * chunks are items of their own (attention_rows_chunk), as a lone request's are.
 *
 * `attention_team` is an OpenMP team function (an orphaned `omp for`; see quant_matmul.c);
 * the fused decoder (decoder.c) shares out `attention_item`s its own way (workshare.h).
 */
#ifndef LLMWORKER_PAGED_ATTENTION_C
#define LLMWORKER_PAGED_ATTENTION_C

#include <math.h>
#include <stdatomic.h>

#include "simd.h"

#define MAX_HEADS 256 /* query heads */
#define MAX_D 256

typedef struct {
    const float *q;
    size_t q_stride; /* floats from one query row to the next */
    const void *k_cache, *v_cache; /* float32, or float16 where kv_half */
    int kv_half;
    int block_size, num_kv_heads, num_heads, head_dim;
    const int64_t *rows, *tables, *lens; /* [n], [n, max_blocks], [n] */
    int max_blocks, n;
    float scale;
    float *out;
    size_t out_stride;
    float *parts;          /* [n][ATTN_CHUNKS] chunk partials (attention_parts floats) */
    atomic_int *pending;   /* [n] zeroed: chunks of each request done (the last combines) */
    int64_t window;        /* > 0: a row of length L reads keys [L - window, L) only; 0: every key */
    float softcap;         /* > 0: scores soft-capped, softcap tanh(score / softcap) (Gemma 2); 0: none */
} attn_args;

/* A row of length L's first key: L - window with a window it outgrows, else 0. A row's keys
 * are [row_start, L), its scores kept from row_start on. */
static inline int64_t row_start(const attn_args *a, int64_t L) {
    return a->window > 0 && L > a->window ? L - a->window : 0;
}

/* Bytes of one cached token's row (every kv head's values). */
static inline size_t token_bytes(const attn_args *a) {
    return (size_t)a->num_kv_heads * a->head_dim * (a->kv_half ? 2 : 4);
}

static inline const void *cached_row(const attn_args *a, const void *cache, const int64_t *table, int64_t j) {
    /* block_size is a power of two (attention_check): a shift and a mask, where a division
     * (tens of cycles, four a key) took a fifth of a long context's attention. */
    const int shift = __builtin_ctz((unsigned)a->block_size);
    const size_t row = (size_t)table[j >> shift] * a->block_size + (size_t)(j & (a->block_size - 1));
    return (const char *)cache + row * token_bytes(a);
}

/* Tokens f0..f1-1's 64 values from element `off` of their rows (a kv head's, or a slice of
 * it) into L2: what tile_scores64 and tile_values fetch a tile ahead (tile_rows' note).
 * Inlined: a call inside their loops would spill the query head they hold in registers
 * (not inlined, the 1,650-token decode call took 7.09 ms against 6.30 before any of this
 * fetching, in one native_ab run). */
static inline __attribute__((always_inline)) void fetch_slices(const attn_args *a, const void *cache,
                                                              const int64_t *table, int64_t f0, int64_t f1, size_t off) {
    const size_t esz = a->kv_half ? 2 : 4;
    for (int64_t f = f0; f < f1; f++) prefetch_bytes_l2((const char *)cached_row(a, cache, table, f) + off * esz, 64 * esz);
}

/* Eight of a cached row's values from d, as floats: float32 as they are, float16
 * (--kv-cache-dtype float16) converted, exactly. `half` is a constant where it is inlined. */
static inline __attribute__((always_inline)) __m256 kv8(const void *row, size_t d, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d)))
                : _mm256_loadu_ps((const float *)row + d);
}

/* Checks the arguments; returns the most keys a row reads (>= 1: its scores' room), or < 0
 * when they are bad. */
static int64_t attention_check(const attn_args *a) {
    if (a->num_heads % a->num_kv_heads || a->num_heads > MAX_HEADS || a->head_dim % 8 || a->head_dim > MAX_D ||
        a->block_size < 1 || (a->block_size & (a->block_size - 1)) || a->window < 0)
        return -1;
    int64_t max_len = 1;
    for (int i = 0; i < a->n; i++) {
        if (a->lens[i] < 1 || a->lens[i] > (int64_t)a->max_blocks * a->block_size) return -2;
        const int64_t keys = a->lens[i] - row_start(a, a->lens[i]);
        if (keys > max_len) max_len = keys;
    }
    return max_len;
}

/* A row's L keys in chunks (flash-decoding's split): up to ATTN_CHUNKS of one length
 * (the last shorter), at least 16 keys each. Each chunk gives every query head its max m, its sum
 * s of e^(score - m) and its sum o of e^(score - m) v; then, over the chunks in order,
 *
 *   M = max m_c,  S = sum_c e^(m_c - M) s_c,  O = sum_c e^(m_c - M) o_c,  out = O (1 / S)
 *
 * The chunks depend on L alone, so a request's arithmetic is the same whether its chunks
 * are items of their own (few requests: every thread gets work) or one item runs them all
 * (many). With one chunk, e^0 = 1 and the sums are the single pass's, bit for bit. */
#define ATTN_CHUNKS 4

static inline int64_t chunk_len(int64_t L) {
    int64_t n = (L + 15) / 16;
    if (n > ATTN_CHUNKS) n = ATTN_CHUNKS;
    return (L + n - 1) / n;
}

static inline int num_chunks(int64_t L) { return (int)((L + chunk_len(L) - 1) / chunk_len(L)); }

/* Chunk c's keys of a row of length L: [*j0, *j1) (chunks of its keys from row_start),
 * empty (both L) when the row has fewer. */
static inline void chunk_keys(const attn_args *a, int64_t L, int c, int64_t *j0, int64_t *j1) {
    const int64_t s = row_start(a, L), clen = chunk_len(L - s), b = s + c * clen;
    *j0 = b < L ? b : L;
    *j1 = b + clen < L ? b + clen : L;
}

/* How many chunks a row of length L has. */
static inline int row_chunks(const attn_args *a, int64_t L) { return num_chunks(L - row_start(a, L)); }

/* Floats of one chunk's partial result: o [Hq, D] | m [Hq] | s [Hq], 64-byte aligned. */
static inline size_t part_floats(const attn_args *a) {
    return ((size_t)a->num_heads * (a->head_dim + 2) + 15) & ~(size_t)15;
}

/* Floats of the shared partials a call needs (`parts`: [n][ATTN_CHUNKS] of part_floats). */
static size_t attention_parts(const attn_args *a) { return (size_t)a->n * ATTN_CHUNKS * part_floats(a); }

/* Rows of one request's prefill a work item takes at most (attention_blocks), and the
 * scores of those rows kept at once at most (floats: 4 MB; a long context takes fewer rows). */
#define ATTN_ROWS 8
#define ATTN_SCORES_MAX (1 << 20)

/* Keys (values) of one tile of ATTN_TILE tokens, read by every row of a block: 24 KB for
 * the default model's three kv heads, so a tile stays in L1 while the rows take turns. */
#define ATTN_TILE 32

static inline int rows_max(const attn_args *a, int64_t max_len) {
    const size_t fit = ATTN_SCORES_MAX / ((size_t)a->num_heads * (size_t)(max_len + 8));
    return fit < 1 ? 1 : fit > ATTN_ROWS ? ATTN_ROWS : (int)fit;
}

/* Floats of per-thread scratch an item needs for rows of up to max_len keys: for each of up
 * to rows_max rows, its scores [Hq][max_len + 8] and its chunks' partials. */
static size_t attention_scratch(const attn_args *a, int64_t max_len) {
    const size_t widened = a->kv_half ? (size_t)ATTN_TILE * a->num_kv_heads * a->head_dim + 16 : 0; /* tile_buffer */
    return rows_max(a, max_len) * ((size_t)a->num_heads * (size_t)(max_len + 8) + ATTN_CHUNKS * part_floats(a)) + 16 +
           widened;
}

/* Items per request: with enough requests to share out, an item is a whole request (its
 * chunks one after another); with few, an item is one chunk, so that every thread has work.
 * (An item past a request's last chunk does nothing.) */
static int attention_split(const attn_args *a, int nthreads) {
    return a->n >= 2 * nthreads ? 1 : ATTN_CHUNKS;
}

/* A query head's dot product with one key's kv head (from kp in its row), as two 8-lane
 * chains over d = 0, 16, ... and 8, 24, ... (a head_dim of 8 mod 16 ends on the first): a0 +
 * a1 before the horizontal sum. The tiles (q64_dot, dot4) reproduce these chains. */
static inline __attribute__((always_inline)) __m256 dot1(const float *qa, const void *row, size_t kp, int D,
                                                        int half) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int d = 0;
    for (; d + 16 <= D; d += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d), kv8(row, kp + d, half), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d + 8), kv8(row, kp + d + 8, half), a1);
    }
    if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d), kv8(row, kp + d, half), a0);
    return _mm256_add_ps(a0, a1);
}

/* Row i's scores against one key token, every query head: scores[h * stride + j] = scale *
 * q_h . k (j: the key's place from the row's first key). `kt`: the token's keys, every kv
 * head (one contiguous run of the cache). */
static inline void key_scores(const attn_args *a, int i, const void *kt, int64_t j, float *scores, size_t stride,
                              int half) {
    const int group = a->num_heads / a->num_kv_heads, D = a->head_dim, nh = a->num_heads;
    const float *qi = a->q + (size_t)a->rows[i] * a->q_stride;
    for (int h = 0; h < nh; h++) /* the kv head's values from (h / group) D in the token's row */
        scores[h * stride + j] = hsum8(dot1(qi + (size_t)h * D, kt, (size_t)(h / group) * D, D, half)) * a->scale;
}

/* The first of sc[0..n-1]'s largest values as `mx = sc[j] > mx ? sc[j] : mx` from sc[0] finds
 * it, in four vector lanes' worth of such folds: a scalar fold waited on each max's latency
 * (~70% of the softmax at 4,000 keys). The value is the same; where the maximum is a zero of
 * either sign either may come back, which changes no bit downstream (z - 0 = z - (-0)). */
static inline float row_max(const float *sc, int64_t n) {
    float mx = sc[0];
    int64_t j = 1;
    if (n >= 32) {
        __m256 m0 = _mm256_set1_ps(sc[0]), m1 = m0, m2 = m0, m3 = m0;
        for (j = 0; j + 32 <= n; j += 32) { /* max_ps(x, m): x where x > m, else m */
            m0 = _mm256_max_ps(_mm256_loadu_ps(sc + j), m0);
            m1 = _mm256_max_ps(_mm256_loadu_ps(sc + j + 8), m1);
            m2 = _mm256_max_ps(_mm256_loadu_ps(sc + j + 16), m2);
            m3 = _mm256_max_ps(_mm256_loadu_ps(sc + j + 24), m3);
        }
        float lanes[32];
        _mm256_storeu_ps(lanes, m0), _mm256_storeu_ps(lanes + 8, m1);
        _mm256_storeu_ps(lanes + 16, m2), _mm256_storeu_ps(lanes + 24, m3);
        for (int l = 0; l < 32; l++) mx = lanes[l] > mx ? lanes[l] : mx;
    }
    for (; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;
    return mx;
}

/* Keys j0..j1-1 of every head's scores (scores[h * stride + j]): the max, e^(score - max)
 * in place, their sum, into part's m and s. */
static void chunk_softmax(const attn_args *a, int64_t j0, int64_t j1, float *scores, size_t stride, float *part) {
    const int D = a->head_dim, nh = a->num_heads;
    const int64_t n = j1 - j0;
    float *mh = part + (size_t)nh * D, *sh = mh + nh;
    for (int h = 0; h < nh; h++) {
        float *sc = scores + h * stride + j0;
        if (a->softcap > 0.0f) softcap_inplace(sc, n, a->softcap); /* Gemma 2 */
        const float mx = row_max(sc, n);
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 acc = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vmx));
            _mm256_storeu_ps(sc + j, e);
            acc = _mm256_add_ps(acc, e);
        }
        float sum = hsum8(acc);
        if (j < n) { /* the tail through a padded copy */
            float tail[8] = {0};
            memcpy(tail, sc + j, sizeof(float) * (size_t)(n - j));
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), vmx));
            _mm256_storeu_ps(tail, e);
            for (int64_t t = 0; t < n - j; t++) { sc[j + t] = tail[t]; sum += tail[t]; }
        }
        mh[h] = mx;
        sh[h] = sum;
    }
}

/* o_h += e_hj v_j for every query head (o: [Hq, D], aligned): key j's turn in its chunk (j:
 * its place from the row's first key, as its score is kept). */
static inline void key_values(const attn_args *a, const void *vt, int64_t j, const float *scores, size_t stride,
                              float *o, int half) {
    const int group = a->num_heads / a->num_kv_heads, D = a->head_dim, nh = a->num_heads;
    for (int h = 0; h < nh; h++) {
        const __m256 p = _mm256_set1_ps(scores[h * stride + j]);
        const size_t vp = (size_t)(h / group) * D;
        float *oa = o + (size_t)h * D;
        for (int d = 0; d < D; d += 8)
            _mm256_store_ps(oa + d, _mm256_fmadd_ps(p, kv8(vt, vp + d, half), _mm256_load_ps(oa + d)));
    }
}

/* Request i's output from its nc chunks' partials (parts, part_floats apart), in order. */
static void combine_chunks(const attn_args *a, int i, const float *parts, int nc) {
    const int D = a->head_dim, nh = a->num_heads;
    const size_t pf = part_floats(a);
    for (int h = 0; h < nh; h++) {
        float mx = parts[(size_t)nh * D + h];
        for (int c = 1; c < nc; c++) {
            const float m = parts[c * pf + (size_t)nh * D + h];
            mx = m > mx ? m : mx;
        }
        __m256 acc[MAX_D / 8];
        for (int d = 0; d < D; d += 8) acc[d / 8] = _mm256_setzero_ps();
        float sum = 0.0f;
        for (int c = 0; c < nc; c++) {
            const float *part = parts + c * pf;
            const float w = expf(part[(size_t)nh * D + h] - mx);
            sum += w * part[(size_t)nh * D + nh + h];
            const __m256 vw = _mm256_set1_ps(w);
            for (int d = 0; d < D; d += 8)
                acc[d / 8] = _mm256_fmadd_ps(vw, _mm256_load_ps(part + (size_t)h * D + d), acc[d / 8]);
        }
        float *dst = a->out + (size_t)a->rows[i] * a->out_stride + (size_t)h * D;
        const __m256 inv = _mm256_set1_ps(1.0f / sum);
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(acc[d / 8], inv));
    }
}

/* The scratch's layout: row r's scores at r Hq stride, its partials after every row's
 * scores (64-byte aligned). */
static inline float *scratch_parts(const attn_args *a, float *scratch, size_t stride, int rows) {
    return (float *)(((uintptr_t)(scratch + (size_t)rows * a->num_heads * stride) + 63) & ~(uintptr_t)63);
}

/* One of request i's nc chunks is in `parts`: the last to finish combines them (acq_rel: the
 * others' partials seen), then re-arms the count for the next call (before its item counts as
 * done). */
static inline void chunk_done(const attn_args *a, int i, const float *parts, int nc) {
    if (atomic_fetch_add_explicit(&a->pending[i], 1, memory_order_acq_rel) == nc - 1) {
        combine_chunks(a, i, parts, nc);
        atomic_store_explicit(&a->pending[i], 0, memory_order_relaxed);
    }
}

/* A query head's 64 floats in registers, and its dot product with a key's 64 as key_scores
 * makes it: a0 + a1 before the horizontal sum. (An AVX-512 form, one 16-lane chain that is
 * a0 and a1 at once with the same bits, was 7-10% faster alone but ~1% in a step: not kept.) */
typedef struct {
    __m256 y[8];
} q64;
static inline q64 q64_load(const float *qa) {
    q64 q;
    for (int d = 0; d < 8; d++) q.y[d] = _mm256_loadu_ps(qa + 8 * d);
    return q;
}
static inline __attribute__((always_inline)) __m256 q64_dot(const q64 *q, const void *row, size_t kp, int half) {
    __m256 a0 = _mm256_fmadd_ps(q->y[0], kv8(row, kp, half), _mm256_setzero_ps());
    __m256 a1 = _mm256_fmadd_ps(q->y[1], kv8(row, kp + 8, half), _mm256_setzero_ps());
    a0 = _mm256_fmadd_ps(q->y[2], kv8(row, kp + 16, half), a0);
    a1 = _mm256_fmadd_ps(q->y[3], kv8(row, kp + 24, half), a1);
    a0 = _mm256_fmadd_ps(q->y[4], kv8(row, kp + 32, half), a0);
    a1 = _mm256_fmadd_ps(q->y[5], kv8(row, kp + 40, half), a1);
    a0 = _mm256_fmadd_ps(q->y[6], kv8(row, kp + 48, half), a0);
    a1 = _mm256_fmadd_ps(q->y[7], kv8(row, kp + 56, half), a1);
    return _mm256_add_ps(a0, a1);
}

/* Rows of a run, head_dim 64: row r's scores against keys lo[r]..hi[r]-1 of the tile (from
 * t0; its scores kept from its first key base[r] on), key_scores' arithmetic with the query head held in registers and eight keys' sums
 * reduced together (hsum8x8). With pf_len (> 0), the first row's first head of each kv head
 * also fetches that kv head's keys a tile on (below pf_len) into L2, eight keys a step: the
 * fetches spread over the tile's work instead of tile_rows' burst (tile_rows' note). */
static inline __attribute__((always_inline)) void tile_scores64(const attn_args *a, int i0, int R, const int64_t *lo,
                                                               const int64_t *hi, const int64_t *base,
                                                               const void *const *kt, int64_t t0,
                                                               float *scratch, size_t sh, size_t stride, int half,
                                                               const int64_t *table, int64_t pf_len) {
    const int group = a->num_heads / a->num_kv_heads, nh = a->num_heads;
    const __m256 scale = _mm256_set1_ps(a->scale);
    for (int r = 0; r < R; r++) {
        const float *qi = a->q + (size_t)a->rows[i0 + r] * a->q_stride;
        for (int h = 0; lo[r] < hi[r] && h < nh; h++) {
            const q64 q = q64_load(qi + (size_t)h * 64);
            float *sc = scratch + r * sh + (size_t)h * stride;
            const int64_t b = base[r];
            const size_t off = (size_t)(h / group) * 64;
            int64_t j = lo[r];
            const int fetch = r == 0 && h % group == 0;
            for (; j + 8 <= hi[r]; j += 8) {
                if (fetch) fetch_slices(a, a->k_cache, table, j + ATTN_TILE, j + ATTN_TILE + 8 < pf_len ? j + ATTN_TILE + 8 : pf_len, off);
                __m256 v[8];
                for (int u = 0; u < 8; u++) v[u] = q64_dot(&q, kt[j + u - t0], off, half);
                _mm256_storeu_ps(sc + (j - b), _mm256_mul_ps(hsum8x8(v), scale));
            }
            for (; j < hi[r]; j++) sc[j - b] = hsum8(q64_dot(&q, kt[j - t0], off, half)) * a->scale;
        }
    }
}

/* dot1 for four keys at once, any head_dim a multiple of 16: the query's vectors are read
 * from L1 once for the four (64 floats of them fit in registers, q64; 128 do not). */
static inline __attribute__((always_inline)) void dot4(const float *qa, const void *const *rows, size_t kp, int D,
                                                      int half, __m256 *out) {
    __m256 a0[4], a1[4];
    for (int u = 0; u < 4; u++) a0[u] = a1[u] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        const __m256 q0 = _mm256_loadu_ps(qa + d), q1 = _mm256_loadu_ps(qa + d + 8);
        for (int u = 0; u < 4; u++) {
            a0[u] = _mm256_fmadd_ps(q0, kv8(rows[u], kp + d, half), a0[u]);
            a1[u] = _mm256_fmadd_ps(q1, kv8(rows[u], kp + d + 8, half), a1[u]);
        }
    }
    for (int u = 0; u < 4; u++) out[u] = _mm256_add_ps(a0[u], a1[u]);
}

/* Rows of a run, head_dim a multiple of 64 above 64 (Llama 3's 128): tile_scores64 with the
 * query read from L1 (dot4), eight keys' sums reduced together (hsum8x8); key_scores' bits. */
static inline __attribute__((always_inline)) void tile_scores_wide(const attn_args *a, int i0, int R, const int64_t *lo,
                                                                  const int64_t *hi, const int64_t *base,
                                                                  const void *const *kt, int64_t t0,
                                                                  float *scratch, size_t sh, size_t stride, int half) {
    const int group = a->num_heads / a->num_kv_heads, nh = a->num_heads, D = a->head_dim;
    const __m256 scale = _mm256_set1_ps(a->scale);
    for (int r = 0; r < R; r++) {
        const float *qi = a->q + (size_t)a->rows[i0 + r] * a->q_stride;
        for (int h = 0; lo[r] < hi[r] && h < nh; h++) {
            const float *qa = qi + (size_t)h * D;
            float *sc = scratch + r * sh + (size_t)h * stride;
            const int64_t b = base[r];
            const size_t off = (size_t)(h / group) * D;
            int64_t j = lo[r];
            for (; j + 8 <= hi[r]; j += 8) {
                __m256 v[8];
                dot4(qa, kt + (j - t0), off, D, half, v);
                dot4(qa, kt + (j + 4 - t0), off, D, half, v + 4);
                _mm256_storeu_ps(sc + (j - b), _mm256_mul_ps(hsum8x8(v), scale));
            }
            for (; j < hi[r]; j++) sc[j - b] = hsum8(dot1(qa, kt[j - t0], off, D, half)) * a->scale;
        }
    }
}

/* Rows of a run, head_dim a multiple of 64: row r's values lo[r]..hi[r]-1 of the tile into its
 * chunks' partials part[r] (ATTN_CHUNKS of part_floats), key_values' arithmetic with 64 of a
 * head's output sums held in registers over the keys of one chunk within the tile (a wider
 * head a slice of 64 at a time: each sum's chain over the keys is key_values' either way).
 * With pf_len (> 0), the first row's first head of each kv head fetches that slice's values a
 * tile on (below pf_len) into L2 before its keys, as tile_scores64 does. */
static inline __attribute__((always_inline)) void tile_values(const attn_args *a, int R, int64_t L0,
                                                               const int64_t *lo, const int64_t *hi, const int64_t *base,
                                                               const void *const *vt, int64_t t0, const float *scratch,
                                                               size_t sh, size_t stride, float *const *part, int half,
                                                               const int64_t *table, int64_t pf_len) {
    const int group = a->num_heads / a->num_kv_heads, nh = a->num_heads, D = a->head_dim;
    const size_t pf = part_floats(a);
    for (int r = 0; r < R; r++) {
        const int64_t b = base[r], clen = chunk_len(L0 + r - b);
        for (int64_t js = lo[r]; js < hi[r];) { /* [js, je): one chunk's keys within the tile */
            const int64_t c = (js - b) / clen, je = b + (c + 1) * clen < hi[r] ? b + (c + 1) * clen : hi[r];
            for (int hs = 0; hs < nh * (D / 64); hs++) { /* head h, its slice of 64: hs = h D/64 + slice */
                const int h = hs / (D / 64), slice = hs % (D / 64);
                float *o = part[r] + c * pf + (size_t)h * D + (size_t)slice * 64;
                const float *sc = scratch + r * sh + (size_t)h * stride;
                const size_t off = (size_t)(h / group) * D + (size_t)slice * 64;
                __m256 o0 = _mm256_load_ps(o), o1 = _mm256_load_ps(o + 8), o2 = _mm256_load_ps(o + 16),
                       o3 = _mm256_load_ps(o + 24), o4 = _mm256_load_ps(o + 32), o5 = _mm256_load_ps(o + 40),
                       o6 = _mm256_load_ps(o + 48), o7 = _mm256_load_ps(o + 56);
                if (r == 0 && h % group == 0)
                    fetch_slices(a, a->v_cache, table, js + ATTN_TILE, je + ATTN_TILE < pf_len ? je + ATTN_TILE : pf_len, off);
                for (int64_t j = js; j < je; j++) {
                    const __m256 p = _mm256_set1_ps(sc[j - b]);
                    const void *vp = vt[j - t0];
                    o0 = _mm256_fmadd_ps(p, kv8(vp, off, half), o0);
                    o1 = _mm256_fmadd_ps(p, kv8(vp, off + 8, half), o1);
                    o2 = _mm256_fmadd_ps(p, kv8(vp, off + 16, half), o2);
                    o3 = _mm256_fmadd_ps(p, kv8(vp, off + 24, half), o3);
                    o4 = _mm256_fmadd_ps(p, kv8(vp, off + 32, half), o4);
                    o5 = _mm256_fmadd_ps(p, kv8(vp, off + 40, half), o5);
                    o6 = _mm256_fmadd_ps(p, kv8(vp, off + 48, half), o6);
                    o7 = _mm256_fmadd_ps(p, kv8(vp, off + 56, half), o7);
                }
                _mm256_store_ps(o, o0), _mm256_store_ps(o + 8, o1), _mm256_store_ps(o + 16, o2);
                _mm256_store_ps(o + 24, o3), _mm256_store_ps(o + 32, o4), _mm256_store_ps(o + 40, o5);
                _mm256_store_ps(o + 48, o6), _mm256_store_ps(o + 56, o7);
            }
            js = je;
        }
    }
}

/* tile[j - t0] = token j's row of `cache` for j in t0..t1-1; with `fetch`, the next tile's
 * rows (below Lmax) fetched into L2 meanwhile (simd.h's T1 hint). The cache is read from
 * memory every step (the weights streamed since evict it), and unaided the loops waited on
 * memory for most of their time (session 7: at 400 tokens of context, 1.4x the whole step);
 * into L2 rather than L1, as L1's miss buffers hold fewer lines than are in flight. But a
 * tile's 32 rows of fetches at once (384 lines with 3 kv heads of 64 floats) wait on those
 * buffers in turn, so the fetch and the tile's work took turns: where tile_scores64 and
 * tile_values read the rows as they lie in the cache, they fetch them instead, a kv head and
 * a few keys at a time between their loops (Zen 4, 1,650 tokens, one layer's attention from
 * memory: 1.15x, BENCHMARKS session 25). */
static inline void tile_rows(const attn_args *a, const void *cache, const int64_t *table, int64_t t0, int64_t t1,
                             int64_t Lmax, const void **tile, int fetch) {
    const size_t bytes = token_bytes(a);
    for (int64_t j = t0; j < t1; j++) {
        tile[j - t0] = cached_row(a, cache, table, j);
        if (fetch && j + ATTN_TILE < Lmax) prefetch_bytes_l2(cached_row(a, cache, table, j + ATTN_TILE), bytes);
    }
}

/* The float32 rows a float16 tile is widened into: after a thread's partials in its
 * scratch (attention_scratch counts them). */
static inline float *tile_buffer(const attn_args *a, float *scratch, size_t stride) {
    const int rm = rows_max(a, (int64_t)stride - 8);
    const float *end = scratch_parts(a, scratch, stride, rm) + (size_t)rm * ATTN_CHUNKS * part_floats(a);
    return (float *)(((uintptr_t)end + 63) & ~(uintptr_t)63);
}

/* A float16 tile's n rows widened into buf (exactly), tile[] re-pointed there: a run of R
 * rows reads each key R times, and converting it each time made a 1,000-token prefill 5%
 * slower than over a float32 cache. */
static inline void widen_tile(const attn_args *a, const void **tile, int n, float *buf) {
    const size_t tok = (size_t)a->num_kv_heads * a->head_dim;
    for (int j = 0; j < n; j++) {
        float *dst = buf + (size_t)j * tok;
        for (size_t d = 0; d < tok; d += 8) _mm256_store_ps(dst + d, kv8(tile[j], d, 1));
        tile[j] = dst;
    }
}

/* Row r's keys [j0, j1) within the tile [t0, t1): [lo, hi), empty when they miss it. */
static inline void tile_part(int64_t j0, int64_t j1, int64_t t0, int64_t t1, int64_t *lo, int64_t *hi) {
    *lo = j0 > t0 ? j0 : t0;
    *hi = j1 < t1 ? j1 : t1;
    if (*hi < *lo) *hi = *lo;
}

/* A run: rows i0..i0+R-1 of one request, row r of length lens[i0] + r (their tables agree on
 * every block they read: attention_blocks). Row r's keys [j0[r], j1[r]) (whole chunks of it)
 * a tile at a time for every row, so each key and value token is read once for all R rows (a
 * row alone reads them all again: from L3, past ~300 tokens): the scores, each chunk's
 * softmax, the values, into part[r] (the row's ATTN_CHUNKS partials). Each row's arithmetic
 * is a lone row's, in the same order: the same bits as the row alone. */
static void run_keys(const attn_args *a, int i0, int R, const int64_t *j0, const int64_t *j1, float *scratch,
                     size_t stride, float *const *part) {
    const size_t sh = (size_t)a->num_heads * stride, pf = part_floats(a);
    const int64_t L0 = a->lens[i0];
    const int64_t *table = a->tables + (size_t)(i0 + R - 1) * a->max_blocks;
    int64_t U0 = INT64_MAX, U1 = 0, lo[ATTN_ROWS], hi[ATTN_ROWS], base[ATTN_ROWS];
    for (int r = 0; r < R; r++) {
        base[r] = row_start(a, L0 + r); /* where row r's scores begin */
        if (j0[r] >= j1[r]) continue;
        U0 = j0[r] < U0 ? j0[r] : U0;
        U1 = j1[r] > U1 ? j1[r] : U1;
    }
    const void *tile[ATTN_TILE];
    /* head_dim a multiple of 64 (the models here: 64, 128): a tile at a time; else key by key */
#ifdef ATTN_PER_KEY /* tests: the key-by-key arithmetic the tiles must reproduce bit for bit */
    const int tiled = 0, d64 = 0;
#else
    const int tiled = a->head_dim % 64 == 0, d64 = a->head_dim == 64;
#endif
    /* A float16 cache's tile is read as it lies by a row alone, widened once for several */
    float *widened = a->kv_half && R > 1 ? tile_buffer(a, scratch, stride) : NULL;
    const int half = a->kv_half && !widened;
    /* the tile kernels fetch the next tile themselves where they read the cache's own rows */
    const int64_t pf_len = widened ? 0 : U1;
    for (int64_t t0 = U0; t0 < U1; t0 += ATTN_TILE) {
        const int64_t t1 = t0 + ATTN_TILE < U1 ? t0 + ATTN_TILE : U1;
        tile_rows(a, a->k_cache, table, t0, t1, U1, tile, !(d64 && pf_len));
        if (widened) widen_tile(a, tile, (int)(t1 - t0), widened);
        for (int r = 0; r < R; r++) tile_part(j0[r], j1[r], t0, t1, &lo[r], &hi[r]);
        if (d64) {
            if (half) tile_scores64(a, i0, R, lo, hi, base, tile, t0, scratch, sh, stride, 1, table, pf_len);
            else tile_scores64(a, i0, R, lo, hi, base, tile, t0, scratch, sh, stride, 0, table, pf_len);
            continue;
        }
        if (tiled) {
            if (half) tile_scores_wide(a, i0, R, lo, hi, base, tile, t0, scratch, sh, stride, 1);
            else tile_scores_wide(a, i0, R, lo, hi, base, tile, t0, scratch, sh, stride, 0);
            continue;
        }
        for (int r = 0; r < R; r++)
            for (int64_t j = lo[r]; j < hi[r]; j++)
                key_scores(a, i0 + r, tile[j - t0], j - base[r], scratch + r * sh, stride, half);
    }
    for (int r = 0; r < R; r++) {
        const int64_t b = base[r], clen = chunk_len(L0 + r - b);
        for (int64_t c0 = j0[r]; c0 < j1[r]; c0 += clen) {
            float *p = part[r] + ((c0 - b) / clen) * pf;
            chunk_softmax(a, c0 - b, (c0 + clen < j1[r] ? c0 + clen : j1[r]) - b, scratch + r * sh, stride, p);
            memset(p, 0, sizeof(float) * (size_t)a->num_heads * a->head_dim);
        }
    }
    for (int64_t t0 = U0; t0 < U1; t0 += ATTN_TILE) {
        const int64_t t1 = t0 + ATTN_TILE < U1 ? t0 + ATTN_TILE : U1;
        tile_rows(a, a->v_cache, table, t0, t1, U1, tile, !(tiled && pf_len));
        if (widened) widen_tile(a, tile, (int)(t1 - t0), widened);
        for (int r = 0; r < R; r++) tile_part(j0[r], j1[r], t0, t1, &lo[r], &hi[r]);
        if (tiled) {
            if (half) tile_values(a, R, L0, lo, hi, base, tile, t0, scratch, sh, stride, part, 1, table, pf_len);
            else tile_values(a, R, L0, lo, hi, base, tile, t0, scratch, sh, stride, part, 0, table, pf_len);
            continue;
        }
        for (int r = 0; r < R; r++)
            for (int64_t j = lo[r]; j < hi[r]; j++)
                key_values(a, tile[j - t0], j - base[r], scratch + r * sh, stride,
                           part[r] + ((j - base[r]) / chunk_len(L0 + r - base[r])) * pf, half);
    }
}

/* A run whole (every chunk of every row), its partials in this thread's scratch. */
static void attention_rows(const attn_args *a, int64_t max_len, int i0, int R, float *scratch) {
    const size_t stride = (size_t)(max_len + 8), pf = part_floats(a);
    float *parts = scratch_parts(a, scratch, stride, rows_max(a, max_len)), *part[ATTN_ROWS];
    int64_t j0[ATTN_ROWS], j1[ATTN_ROWS];
    for (int r = 0; r < R; r++)
        j1[r] = a->lens[i0] + r, j0[r] = row_start(a, j1[r]), part[r] = parts + (size_t)r * ATTN_CHUNKS * pf;
    run_keys(a, i0, R, j0, j1, scratch, stride, part);
    for (int r = 0; r < R; r++) combine_chunks(a, i0 + r, part[r], row_chunks(a, a->lens[i0] + r));
}

/* Chunk c of every row of a run (a row with fewer chunks has none), into the shared partials;
 * a row's last chunk to finish combines, as attention_item's. With few runs a run's chunks are
 * items of their own: every thread gets work, and the run's keys are still read once (a
 * 4-row verification step at 250 tokens of context read them four times). */
static void attention_rows_chunk(const attn_args *a, int64_t max_len, int i0, int R, int c, float *scratch) {
    const size_t stride = (size_t)(max_len + 8), pf = part_floats(a);
    float *part[ATTN_ROWS];
    int64_t j0[ATTN_ROWS], j1[ATTN_ROWS];
    for (int r = 0; r < R; r++) {
        chunk_keys(a, a->lens[i0] + r, c, &j0[r], &j1[r]);
        part[r] = a->parts + (size_t)(i0 + r) * ATTN_CHUNKS * pf;
    }
    run_keys(a, i0, R, j0, j1, scratch, stride, part);
    for (int r = 0; r < R; r++)
        if (j0[r] < j1[r]) chunk_done(a, i0 + r, part[r], row_chunks(a, a->lens[i0] + r));
}

/* One item (of a->n * split): request i whole, or one of its chunks, as a run of one row
 * (its keys a tile at a time, as a run's: the query head and its output sums held in
 * registers; a key at a time, the step's attention cost ~1.1x more at 4,000 tokens).
 * `scratch`: this thread's attention_scratch floats. */
static void attention_item(const attn_args *a, int64_t max_len, int split, int item, float *scratch) {
    if (split == 1) attention_rows(a, max_len, item, 1, scratch);
    else attention_rows_chunk(a, max_len, item / ATTN_CHUNKS, 1, item % ATTN_CHUNKS, scratch);
}

/* Runs of consecutive rows of one request (each the previous row's length + 1, as a prompt
 * chunk's or a verification step's rows), up to rows_max a run; a decode row of its own is a
 * run alone. items[2k], items[2k + 1]: the first row and the count. `max_len`: the longest
 * row, as the scratch was sized for (attention_scratch). */
static int attention_blocks(const attn_args *a, int64_t max_len, int32_t *items) {
    const int most = rows_max(a, max_len);
    int n_items = 0;
    for (int i = 0; i < a->n;) {
        int R = 1;
        while (R < most && i + R < a->n && a->lens[i + R] == a->lens[i] + R) {
            /* the longer row's table must hold the shorter rows' blocks */
            const int64_t *t0 = a->tables + (size_t)(i + R - 1) * a->max_blocks, *t1 = t0 + a->max_blocks;
            const int64_t used = (a->lens[i + R - 1] + a->block_size - 1) / a->block_size;
            if (memcmp(t0, t1, sizeof(int64_t) * (size_t)used)) break;
            R++;
        }
        items[2 * n_items] = i, items[2 * n_items + 1] = R;
        n_items++;
        i += R;
    }
    return n_items;
}

/* Whether runs are shared out chunk by chunk (ATTN_CHUNKS items a run) rather than whole: when
 * they are too few to give every thread four. */
static inline int attention_chunked(int n_runs, int nthreads) { return n_runs < 4 * nthreads; }

/* The items, shared among the team; `scratch`: this thread's attention_scratch floats. */
static void attention_team(const attn_args *a, int64_t max_len, int nthreads, float *scratch) {
    const int split = attention_split(a, nthreads);
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < a->n * split; item++) attention_item(a, max_len, split, item, scratch);
}

int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, int block_size,
                           int num_kv_heads, int num_heads, int head_dim, const int64_t *rows,
                           const int64_t *tables, int max_blocks, const int64_t *lens, int n,
                           float scale, float *out, int nthreads, int64_t window, float softcap) {
    attn_args a = {q, (size_t)num_heads * head_dim, k_cache, v_cache, 0, block_size, num_kv_heads,
                   num_heads, head_dim, rows, tables, lens, max_blocks, n, scale, out,
                   (size_t)num_heads * head_dim, NULL, NULL, window, softcap};
    const int64_t max_len = attention_check(&a);
    if (max_len < 0) return (int)max_len;
    a.parts = aligned_alloc(64, sizeof(float) * attention_parts(&a));
    a.pending = calloc((size_t)n, sizeof(atomic_int));
    if (!a.parts || !a.pending) {
        free(a.parts);
        free(a.pending);
        return -3;
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *scratch = malloc(sizeof(float) * attention_scratch(&a, max_len));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) attention_team(&a, max_len, omp_get_num_threads(), scratch);
        free(scratch);
    }
    free(a.parts);
    free(a.pending);
    return failed ? -3 : 0;
}

#endif
