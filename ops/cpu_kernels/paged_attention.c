/* Decode attention over a paged KV cache, float32, AVX2 + FMA: one query token per request,
 * read straight from the cache through the block table (no gather copy).
 *
 *   q, out   [T, Hq, D] rows q_stride / out_stride floats apart   rows[i]: request i's row
 *   caches   [num_blocks, block_size, Hkv, D]  token p of request i: block
 *            tables[i, p / block_size], offset p % block_size
 *
 * A request's keys are split in up to four chunks by its length alone (see chunk_len);
 * each chunk's scores, an exact softmax over the chunk (max first) and its weighted sum of
 * values in key order, then the chunks combined in order. A work item is a whole request
 * when there are enough requests to share out, else one chunk (a request alone keeps both
 * threads busy; the last chunk to finish combines). A token's keys and values for every kv
 * head are one contiguous read, shared by the query heads. A request's arithmetic depends on
 * its length only, so its result does not depend on the rest of the batch. (AVX2 code in
 * every build: the same bits on every ISA.)
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
    const float *k_cache, *v_cache;
    int block_size, num_kv_heads, num_heads, head_dim;
    const int64_t *rows, *tables, *lens; /* [n], [n, max_blocks], [n] */
    int max_blocks, n;
    float scale;
    float *out;
    size_t out_stride;
    float *parts;          /* [n][ATTN_CHUNKS] chunk partials (attention_parts floats) */
    atomic_int *pending;   /* [n] zeroed: chunks of each request done (the last combines) */
} attn_args;

/* Tokens ahead of the one being read whose keys (values) are prefetched. The cache is read
 * from memory every step (the weights streamed since evict it), a token's rows of a kv head
 * are a few lines at a stride, and a new block every block_size tokens: unaided, the loops
 * waited on memory for most of their time (at 400 tokens of context, 1.4x the whole step).
 * Into L2 (simd.h's T1 hint): a token's keys are 12 lines, 8 tokens ahead ~100 lines in flight,
 * more than L1's miss buffers hold. In one process (benchmarks/native_ab.py, session 7), into
 * L2 rather than L1: batch 1 at 500 tokens of context 4.73 -> 4.45 ms, at 100 3.49 -> 3.37;
 * 64 requests at 300 58.4 -> 52.3 ms (16 tokens ahead: no different). */
#define PREFETCH_TOKENS 8

static inline const float *cached_row(const float *cache, const int64_t *table, int block_size, size_t tok,
                                      int64_t j) {
    return cache + ((size_t)table[j / block_size] * block_size + j % block_size) * tok;
}

/* Checks the arguments; returns the longest length (>= 1), or < 0 when they are bad. */
static int64_t attention_check(const attn_args *a) {
    if (a->num_heads % a->num_kv_heads || a->num_heads > MAX_HEADS || a->head_dim % 8 || a->head_dim > MAX_D)
        return -1;
    int64_t max_len = 1;
    for (int i = 0; i < a->n; i++) {
        if (a->lens[i] < 1 || a->lens[i] > (int64_t)a->max_blocks * a->block_size) return -2;
        if (a->lens[i] > max_len) max_len = a->lens[i];
    }
    return max_len;
}

/* A request's L keys in chunks (flash-decoding's split): up to ATTN_CHUNKS of one length
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

/* Floats of one chunk's partial result: o [Hq, D] | m [Hq] | s [Hq], 64-byte aligned. */
static inline size_t part_floats(const attn_args *a) {
    return ((size_t)a->num_heads * (a->head_dim + 2) + 15) & ~(size_t)15;
}

/* Floats of the shared partials a call needs (`parts`: [n][ATTN_CHUNKS] of part_floats). */
static size_t attention_parts(const attn_args *a) { return (size_t)a->n * ATTN_CHUNKS * part_floats(a); }

/* Floats of per-thread scratch an item needs for lengths up to max_len. */
static size_t attention_scratch(const attn_args *a, int64_t max_len) {
    return (size_t)a->num_heads * (size_t)(max_len + 8) + ATTN_CHUNKS * part_floats(a) + 16;
}

/* Items per request: with enough requests to share out, an item is a whole request (its
 * chunks one after another); with few, an item is one chunk, so that every thread has work.
 * (An item past a request's last chunk does nothing.) */
static int attention_split(const attn_args *a, int nthreads) {
    return a->n >= 2 * nthreads ? 1 : ATTN_CHUNKS;
}

/* Chunk c of request i into part. `scores`: [Hq][stride] floats. Every kv head at once: a
 * token's keys (values) are one contiguous run of the cache. */
static void chunk_partial(const attn_args *a, int i, int c, float *scores, size_t stride, float *part) {
    const int group = a->num_heads / a->num_kv_heads, D = a->head_dim, nh = a->num_heads;
    const size_t tok = (size_t)a->num_kv_heads * D; /* floats per cached token */
    const int64_t L = a->lens[i], clen = chunk_len(L), j0 = c * clen, j1 = j0 + clen < L ? j0 + clen : L;
    const int64_t n = j1 - j0;
    const int64_t *table = a->tables + (size_t)i * a->max_blocks;
    const float *qi = a->q + (size_t)a->rows[i] * a->q_stride;
    float *o = part, *mh = part + (size_t)nh * D, *sh = mh + nh;
    /* scores[h][j - j0] = scale * q_h . k_j */
    for (int64_t j = j0; j < j1; j++) {
        const float *kt = cached_row(a->k_cache, table, a->block_size, tok, j);
        if (j + PREFETCH_TOKENS < j1)
            prefetch_bytes_l2(cached_row(a->k_cache, table, a->block_size, tok, j + PREFETCH_TOKENS), tok * sizeof(float));
        for (int h = 0; h < nh; h++) {
            const float *qa = qi + (size_t)h * D, *kp = kt + (size_t)(h / group) * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            int d = 0;
            for (; d + 16 <= D; d += 16) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d), _mm256_loadu_ps(kp + d), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d + 8), _mm256_loadu_ps(kp + d + 8), a1);
            }
            if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d), _mm256_loadu_ps(kp + d), a0);
            scores[h * stride + (j - j0)] = hsum8(_mm256_add_ps(a0, a1)) * a->scale;
        }
    }
    /* per query head: the max, e^(score - max) in place, their sum */
    for (int h = 0; h < nh; h++) {
        float *sc = scores + h * stride;
        float mx = sc[0];
        for (int64_t j = 1; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;
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
    /* o_h = sum_j e_hj v_j, in key order */
    memset(o, 0, sizeof(float) * (size_t)nh * D);
    for (int64_t j = j0; j < j1; j++) {
        const float *vt = cached_row(a->v_cache, table, a->block_size, tok, j);
        if (j + PREFETCH_TOKENS < j1)
            prefetch_bytes_l2(cached_row(a->v_cache, table, a->block_size, tok, j + PREFETCH_TOKENS), tok * sizeof(float));
        for (int h = 0; h < nh; h++) {
            const __m256 p = _mm256_set1_ps(scores[h * stride + (j - j0)]);
            const float *vp = vt + (size_t)(h / group) * D;
            float *oa = o + (size_t)h * D;
            for (int d = 0; d < D; d += 8)
                _mm256_store_ps(oa + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(vp + d), _mm256_load_ps(oa + d)));
        }
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

/* One item (of a->n * split); `scratch`: this thread's attention_scratch floats. */
static void attention_item(const attn_args *a, int64_t max_len, int split, int item, float *scratch) {
    const size_t stride = (size_t)(max_len + 8);
    float *scores = scratch;
    float *local = (float *)(((uintptr_t)(scratch + (size_t)a->num_heads * stride) + 63) & ~(uintptr_t)63);
    const size_t pf = part_floats(a);
    if (split == 1) { /* the whole request, its partials here */
        const int i = item, nc = num_chunks(a->lens[i]);
        for (int c = 0; c < nc; c++) chunk_partial(a, i, c, scores, stride, local + c * pf);
        combine_chunks(a, i, local, nc);
        return;
    }
    const int i = item / ATTN_CHUNKS, c = item % ATTN_CHUNKS, nc = num_chunks(a->lens[i]);
    if (c >= nc) return;
    float *parts = a->parts + (size_t)i * ATTN_CHUNKS * pf;
    chunk_partial(a, i, c, scores, stride, parts + c * pf);
    /* the request's last chunk to finish combines (acq_rel: the others' partials seen), then
     * re-arms the count for the next call (before this item counts as done) */
    if (atomic_fetch_add_explicit(&a->pending[i], 1, memory_order_acq_rel) == nc - 1) {
        combine_chunks(a, i, parts, nc);
        atomic_store_explicit(&a->pending[i], 0, memory_order_relaxed);
    }
}

/* The items, shared among the team; `scratch`: this thread's attention_scratch floats. */
static void attention_team(const attn_args *a, int64_t max_len, int nthreads, float *scratch) {
    const int split = attention_split(a, nthreads);
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < a->n * split; item++) attention_item(a, max_len, split, item, scratch);
}

int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, int block_size,
                           int num_kv_heads, int num_heads, int head_dim, const int64_t *rows,
                           const int64_t *tables, int max_blocks, const int64_t *lens, int n,
                           float scale, float *out, int nthreads) {
    attn_args a = {q, (size_t)num_heads * head_dim, k_cache, v_cache, block_size, num_kv_heads,
                   num_heads, head_dim, rows, tables, lens, max_blocks, n, scale, out,
                   (size_t)num_heads * head_dim, NULL, NULL};
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
