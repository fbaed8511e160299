/* Decode attention over a paged KV cache, float32, AVX2 + FMA: one query token per request,
 * read straight from the cache through the block table (no gather copy).
 *
 *   q, out   [T, Hq, D] rows q_stride / out_stride floats apart   rows[i]: request i's row
 *   caches   [num_blocks, block_size, Hkv, D]  token p of request i: block
 *            tables[i, p / block_size], offset p % block_size
 *
 * One work item per request (or per (request, kv head) when there are few requests): the
 * Hq / Hkv query heads of a kv head share every key and value read. Scores for all lens[i]
 * keys, then an exact softmax (max first), then the weighted sum of values in key order.
 * Each query head's arithmetic is the same whichever way the work is split, so a request's
 * result does not depend on the rest of the batch. (AVX2 code in every build: the same bits
 * on every ISA.)
 *
 * `attention_team` is an OpenMP team function (an orphaned `omp for`; see quant_matmul.c);
 * the fused decoder (decoder.c) shares out `attention_item`s its own way (workshare.h).
 */
#ifndef LLMWORKER_PAGED_ATTENTION_C
#define LLMWORKER_PAGED_ATTENTION_C

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
} attn_args;

/* Tokens ahead of the one being read whose keys (values) are prefetched. The cache is read
 * from memory every step (the weights streamed since evict it), a token's rows of a kv head
 * are a few lines at a stride, and a new block every block_size tokens: unaided, the loops
 * waited on memory for most of their time (at 400 tokens of context, 1.4x the whole step). */
#define PREFETCH_TOKENS 8

static inline const float *cached_row(const float *cache, const int64_t *table, int block_size, size_t tok,
                                      int64_t j) {
    return cache + ((size_t)table[j / block_size] * block_size + j % block_size) * tok;
}

static inline void prefetch_row(const float *row, int floats) {
    for (int c = 0; c < floats; c += 16) _mm_prefetch((const char *)(row + c), _MM_HINT_T0);
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

/* Floats of per-thread scratch `attention_team` needs for lengths up to max_len. */
static size_t attention_scratch(const attn_args *a, int64_t max_len) {
    return (size_t)a->num_heads * (size_t)(max_len + 8) + (size_t)a->num_heads * MAX_D + 16;
}

/* Items per request: with enough requests to share out, an item is a whole request and
 * reads each cached token's keys and values for all heads in one contiguous run; with few,
 * an item is one (request, kv head), so that every thread has work. */
static int attention_split(const attn_args *a, int nthreads) {
    return a->n >= 2 * nthreads ? 1 : a->num_kv_heads;
}

/* One item (of a->n * split); `scratch`: this thread's attention_scratch floats. */
static void attention_item(const attn_args *a, int64_t max_len, int split, int item, float *scratch) {
    const int group = a->num_heads / a->num_kv_heads, D = a->head_dim, num_heads = a->num_heads;
    const size_t tok = (size_t)a->num_kv_heads * D; /* floats per cached token */
    const size_t stride = (size_t)(max_len + 8);
    float *scores = scratch;
    float *o = (float *)(((uintptr_t)(scratch + (size_t)num_heads * stride) + 63) & ~(uintptr_t)63);
    const int heads_per_item = a->num_kv_heads / split;
    {
        const int i = item / split, h0 = (item % split) * heads_per_item;
        const int nh = heads_per_item * group; /* query heads of this item */
        const int64_t L = a->lens[i];
        const int64_t *table = a->tables + (size_t)i * a->max_blocks;
        const float *qi = a->q + (size_t)a->rows[i] * a->q_stride + (size_t)h0 * group * D;
        /* scores[a][j] = scale * q_a . k_j, a over the item's query heads */
        for (int64_t j = 0; j < L; j++) {
            const float *kt = cached_row(a->k_cache, table, a->block_size, tok, j) + (size_t)h0 * D;
            if (j + PREFETCH_TOKENS < L)
                prefetch_row(cached_row(a->k_cache, table, a->block_size, tok, j + PREFETCH_TOKENS) + (size_t)h0 * D,
                             heads_per_item * D);
            for (int h = 0; h < nh; h++) {
                const float *qa = qi + (size_t)h * D, *kp = kt + (size_t)(h / group) * D;
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                int d = 0;
                for (; d + 16 <= D; d += 16) {
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d), _mm256_loadu_ps(kp + d), a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d + 8), _mm256_loadu_ps(kp + d + 8), a1);
                }
                if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qa + d), _mm256_loadu_ps(kp + d), a0);
                scores[h * stride + j] = hsum8(_mm256_add_ps(a0, a1)) * a->scale;
            }
        }
        /* softmax per query head: subtract the max, exponentiate, sum */
        float inv_sum[MAX_HEADS];
        for (int h = 0; h < nh; h++) {
            float *sc = scores + h * stride;
            float mx = sc[0];
            for (int64_t j = 1; j < L; j++) mx = sc[j] > mx ? sc[j] : mx;
            const __m256 vmx = _mm256_set1_ps(mx);
            __m256 acc = _mm256_setzero_ps();
            int64_t j = 0;
            for (; j + 8 <= L; j += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vmx));
                _mm256_storeu_ps(sc + j, e);
                acc = _mm256_add_ps(acc, e);
            }
            float sum = hsum8(acc);
            if (j < L) { /* the tail through a padded copy */
                float tail[8] = {0};
                memcpy(tail, sc + j, sizeof(float) * (size_t)(L - j));
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), vmx));
                _mm256_storeu_ps(tail, e);
                for (int64_t t = 0; t < L - j; t++) { sc[j + t] = tail[t]; sum += tail[t]; }
            }
            inv_sum[h] = 1.0f / sum;
        }
        /* out_a = sum_j p_aj v_j / sum_a, in key order */
        memset(o, 0, sizeof(float) * (size_t)nh * D);
        for (int64_t j = 0; j < L; j++) {
            const float *vt = cached_row(a->v_cache, table, a->block_size, tok, j) + (size_t)h0 * D;
            if (j + PREFETCH_TOKENS < L)
                prefetch_row(cached_row(a->v_cache, table, a->block_size, tok, j + PREFETCH_TOKENS) + (size_t)h0 * D,
                             heads_per_item * D);
            for (int h = 0; h < nh; h++) {
                const __m256 p = _mm256_set1_ps(scores[h * stride + j]);
                const float *vp = vt + (size_t)(h / group) * D;
                float *oa = o + (size_t)h * D;
                for (int d = 0; d < D; d += 8)
                    _mm256_store_ps(oa + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(vp + d), _mm256_load_ps(oa + d)));
            }
        }
        for (int h = 0; h < nh; h++) {
            float *dst = a->out + (size_t)a->rows[i] * a->out_stride + ((size_t)h0 * group + h) * D;
            const __m256 inv = _mm256_set1_ps(inv_sum[h]);
            for (int d = 0; d < D; d += 8)
                _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_load_ps(o + (size_t)h * D + d), inv));
        }
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
    const attn_args a = {q, (size_t)num_heads * head_dim, k_cache, v_cache, block_size, num_kv_heads,
                         num_heads, head_dim, rows, tables, lens, max_blocks, n, scale, out,
                         (size_t)num_heads * head_dim};
    const int64_t max_len = attention_check(&a);
    if (max_len < 0) return (int)max_len;
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
    return failed ? -3 : 0;
}

#endif
