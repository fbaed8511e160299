/* A Llama-family decoder's forward pass on the CPU in float32, as a few native calls per
 * step instead of hundreds of small torch ops (the wrapper is ops/cpu_decoder.py).
 *
 * One layer, for the step's M tokens (rows), with the residual stream r [M, H]:
 *
 *   attn_in    xn = rms_norm(r) * w_in                        (rows shared among threads)
 *              qkv = xn @ Wqkv^T (+ bias)   per head: its D/32 tiles, then (Qwen3) an RMSNorm
 *                                           of each q and k head over D, rotary on q and k
 *                                           heads' first rot_dim dimensions (the layer's
 *                                           cos/sin table: every RoPE variant precomputed),
 *                                           k and v heads written to the paged cache
 *   attention  att = softmax(q k^T / sqrt(D)) v   every row as a decode query over its
 *                                           request's first position + 1 cached tokens
 *                                           (paged_attention.c), prefill rows included;
 *                                           a layer with a sliding window w over the
 *                                           last w of them (layer_weights.window)
 *   attn_out   r += att @ Wo^T                         per tile, into r
 *              xn = rms_norm(r) * w_post
 *              act = silu(g) * u, [g | u] = xn @ Wgu^T  per tile pair (t, t + I/32)
 *              r += act @ Wdown^T                       per tile, into r
 *
 * and after the last layer hidden = rms_norm(r) * w_final, and in a decode step, when asked,
 * logits = hidden @ Whead^T (the LM head's tiles shared out in the same region: no region
 * of its own, no barrier, the same qi_tile/qf_tile code as its QuantLinear, so the same
 * bits), and, when asked, each row's greedy token: the first maximum of its logits (NaN
 * ranking first, as torch's argmax), found tile by tile while the tile is in L1 (argmax_tile
 * below). With integer activations
 * (quant_matmul_int8.c) each matmul's input is written as integers per row first; for the
 * float kernels' Q4_1 (quant_matmul.c) its block sums are.
 *
 * `cpu_decoder_decode` runs the whole step in one OpenMP parallel region (the runner's
 * batch-1 step is one call), its loops shared out without barriers (workshare.h: a thread
 * descheduled by the server's other threads holds nobody up). A row's arithmetic is the
 * same code on the row alone, its attention included: its bits depend neither on the
 * other rows nor on how its prompt was chunked.
 *
 * rms_norm: sum of squares in 16 float lanes over H in order, then hsum8 of the two
 * halves' sum (H a multiple of 16); rotary as the torch reference computes it (x cos +
 * x_rot sin, two products and a sum, no FMA: the same bits); silu(g) = g / (1 + e^-g).
 */
#include <math.h>
#include <unistd.h>

#include "lora.c"
#include "paged_attention.c"
#include "quant_matmul.c"
#include "quant_matmul_int8.c"
#include "workshare.h"

typedef struct {
    const uint8_t *w; /* tile records */
    int qtype;        /* QT_* (quant_types.h): Q4_1's and Q8_0's codes name their layout's arithmetic */
    int planes;       /* integer activations: bytes per activation (quant_matmul_int8.c); 0: float32 */
    int N, K;
    const float *bias; /* [N] or NULL */
} qlinear;

typedef struct {
    qlinear qkv, o, gate_up, down;
    const float *input_norm, *post_norm; /* [H] */
    int window; /* > 0: the layer's sliding window (paged_attention.c's attn_args.window); 0: none */
    const float *q_norm, *k_norm; /* [D] per-head RMSNorm weights of q and k before rotary, or NULL */
    const float *cos_sin;         /* [max_positions, rot_dim]: cos in the first half, sin in the second */
    /* Gemma: [H] norms of the attention's and the MLP's outputs before their residual adds
     * (post_attention_layernorm, post_feedforward_layernorm; post_norm is then the MLP's
     * input norm, pre_feedforward_layernorm), or NULL */
    const float *attn_out_norm, *ffn_out_norm;
    /* qkv's rows in up to three parts of their own block types (a GGUF file's attn_v in
     * another type than q and k: llama-quantize's Q4_K_M does it in half the layers;
     * ops/stacked_linear.py): qkv is the first part, qkv_rest the others; qkv_heads[p] the
     * heads (q, then k, then v, in that order) part p holds, 0 past the last. */
    qlinear qkv_rest[2];
    int qkv_heads[3];
} layer_weights;

#define EMBED_TABLE (-1) /* else embed_kind is the records' QT_* code */

typedef struct {
    int hidden, intermediate, num_heads, num_kv_heads, head_dim, num_layers;
    float eps, scale;
    const layer_weights *layers;
    const float *final_norm;
    int rot_dim; /* the rotating dimensions of each head (partial rotary: < head_dim), even */
    int embed_kind;       /* EMBED_TABLE: a float table [V, H]; else the QT_* code of its records
                           * (a tied head's, or its own: quant_row) */
    const void *embed;
    int block_size;
    const lora_layer *lora; /* [num_layers] adapter slots (lora.c), or NULL: LoRA off */
    int lora_rank;
    qlinear head; /* the LM head (head.w NULL: none), for decode steps that want logits */
    float embed_scale;   /* the embedding rows times this (Gemma: sqrt(hidden)); 1: none */
    float softcap;       /* > 0: attention scores soft-capped (paged_attention.c) */
    float final_softcap; /* > 0: the head's logits soft-capped, c tanh(x / c) */
    int gelu;            /* the MLP's activation: 1 GeGLU (gelu_pytorch_tanh, Gemma), 0 SwiGLU */
} model_desc;

typedef struct {
    int M; /* tokens this step */
    const int64_t *ids, *positions, *slots; /* [M]; a slot < 0 is not written */
    int n_dec;                              /* decode rows, one query each */
    const int64_t *dec_rows, *dec_tables, *dec_lens; /* [n_dec], [n_dec, max_blocks], [n_dec] */
    int max_blocks;
    void *const *k_caches, *const *v_caches; /* per layer: [num_blocks, block_size, Hkv, D] */
    /* state kept between the stages of one step, owned by the caller */
    float *residual; /* [M, H] */
    float *qkv;      /* [M, (Hq + 2 Hkv) D] */
    float *att;      /* [M, Hq D] */
    float *out;      /* [M, H]: the final hidden states */
    int nthreads;
    /* LoRA (when lora_slots): each row's adapter slot, -1 for the base model; the rows
     * that have one in pairs of the same slot (the second -1 when none), by slot (pairs
     * share the loads of A and B; a thread's run of them reads one adapter); and the
     * linears some adapter of the step targets (LORA_* bits) */
    const int32_t *lora_slots; /* [M] */
    const int32_t *lora_pairs; /* [n_lora][2] */
    int n_lora, lora_groups;
    float *logits; /* [M, V]: the decode entry computes the head's logits here (or NULL) */
    int64_t *argmax; /* [M] (with logits, or NULL): each row's first maximum, -1 where the
                      * maximum is not finite (NaN, +inf, or every logit -inf) */
    int wake_fd; /* >= 0: one byte is written to it as the call begins, its caller's GIL
                  * released for the whole call: a served worker's event loop is woken
                  * there (worker/engine.py), to run its Python beside the model */
    int kv_half; /* the caches hold float16 (--kv-cache-dtype float16), else float32 */
} step_desc;

/* A matmul's input as the kernels read it: float rows (a norm's output, when the input is
 * one), and for the integer kernels the rows as integers (quant_matmul_int8.c). */
#define MAX_PLANES 3
typedef struct {
    float *x;       /* [M, H] */
    int8_t *xq;     /* [M, MAX_PLANES Kmax] */
    int32_t *xt;    /* [2, M, MAX_PLANES Kmax / 32]: the digits' block sums, then their first halves' */
    float *xd, *xs; /* [M, Kmax / 32]: the integer rows' scales; block sums (both kernels) */
    qact *views;    /* [M] */
} input_buf;

/* Up to this many rows, each thread prepares every row of a matmul's input itself (a norm
 * and a quantization of a few rows cost less than the barrier that sharing them needs). */
#define PRIVATE_ROWS 16

/* A call's temporaries (one malloc). */
typedef struct {
    input_buf shared; /* rows shared among the team */
    input_buf *priv;  /* [threads]: each thread's own, when private_inputs */
    int private_inputs;
    float *act;       /* [M, I] */
    float *tmp;       /* [threads][M * 2 TILE]: a thread's tiles before their epilogue */
    float *attn;      /* [threads][attn_floats] */
    size_t attn_floats;
    float *attn_parts;        /* decode attention's chunk partials (paged_attention.c) */
    atomic_int *attn_pending; /* [n_dec], zeroed */
    int32_t *attn_items;      /* [n_dec][2]: attention_blocks' runs of rows */
    int n_attn_items;
    int64_t max_len;
    float *lora_h;    /* [M, 3 R]: each adapter row's shrink of the linear at hand */
    float *lora_x;    /* [threads][2][kmax]: a thread's normed rows for the shrink */
    size_t kmax;
    float *best_v;    /* [threads][M]: with argmax, each thread's best logit so far a row, */
    int32_t *best_i;  /* and its index (-1: none yet) */
    ws_phase *phases; /* the call's loops (workshare.h) */
    ws_counter *counters;
    int num_phases;
    void *block;
} temps;

static inline int is_integer(const qlinear *L) { return L->planes > 0; }

/* Whether linear L's float kernel needs its input's block sums (the m term of the types with one). */
static inline int needs_sums(const qlinear *L) { return !is_integer(L) && has_block_min(L->qtype); }

#define ALIGN64(n) (((n) + 63) & ~(size_t)63)

static size_t input_bytes(size_t M, size_t H, size_t kmax) {
    return ALIGN64(M * H * sizeof(float)) + ALIGN64(M * MAX_PLANES * kmax)
           + ALIGN64(2 * M * MAX_PLANES * (kmax / QBLOCK) * sizeof(int32_t))
           + 2 * ALIGN64(M * (kmax / QBLOCK) * sizeof(float)) + ALIGN64(M * sizeof(qact));
}

static char *input_carve(char *p, size_t M, size_t H, size_t kmax, input_buf *b) {
#define CARVE(field, type, count)                                                           \
    b->field = (type *)p;                                                                   \
    p += ALIGN64((count) * sizeof(type));
    CARVE(x, float, M * H)
    CARVE(xq, int8_t, M * MAX_PLANES * kmax)
    CARVE(xt, int32_t, 2 * M * MAX_PLANES * (kmax / QBLOCK))
    CARVE(xd, float, M * (kmax / QBLOCK))
    CARVE(xs, float, M * (kmax / QBLOCK))
    CARVE(views, qact, M)
#undef CARVE
    return p;
}

static attn_args decode_args(const model_desc *m, int l, const step_desc *s);

static int temps_alloc(const model_desc *m, const step_desc *s, int nthreads, temps *t) {
    const size_t M = (size_t)s->M, H = (size_t)m->hidden, I = (size_t)m->intermediate;
    const size_t Dq = (size_t)m->num_heads * m->head_dim;
    const size_t kmax = I > H ? (I > Dq ? I : Dq) : (H > Dq ? H : Dq); /* widest matmul input */
    attn_args probe = {0}; /* what attention_scratch and attention_parts read */
    probe.num_heads = m->num_heads;
    probe.num_kv_heads = m->num_kv_heads;
    probe.head_dim = m->head_dim;
    probe.kv_half = s->kv_half;
    probe.n = s->n_dec;
    /* the most keys a row reads in any layer (its scores' room): its length, or the widest
     * window where every layer has one */
    int64_t cap = 0; /* 0: some layer reads every key */
    for (int l = 0; l < m->num_layers; l++) {
        const int64_t w = m->layers[l].window;
        if (w <= 0) {
            cap = 0;
            break;
        }
        if (w > cap) cap = w;
    }
    t->max_len = 1;
    for (int i = 0; i < s->n_dec; i++) {
        const int64_t keys = cap && s->dec_lens[i] > cap ? cap : s->dec_lens[i];
        if (keys > t->max_len) t->max_len = keys;
    }
    t->attn_floats = ALIGN64(attention_scratch(&probe, t->max_len));
    t->private_inputs = s->M <= PRIVATE_ROWS;
    const size_t copies = 1 + (t->private_inputs ? (size_t)nthreads : 0);
    /* loops of a decode step: embed and final, and per layer at most 9 (4 of them inputs
     * shared among the team) */
    /* + LoRA: a shrink per linear; + the head: its input, its tiles */
    /* + Gemma's output norms: a loop of rows each */
    t->num_phases = 4 + (9 + (m->lora ? 4 : 0) + (m->layers[0].attn_out_norm ? 2 : 0)) * m->num_layers;
    t->kmax = kmax;
    const size_t R = m->lora ? (size_t)m->lora_rank : 0;
    const size_t pending_bytes = ALIGN64((size_t)s->n_dec * sizeof(atomic_int));
    const size_t phase_bytes = ALIGN64((size_t)t->num_phases * sizeof(ws_phase))
                               + ALIGN64((size_t)t->num_phases * nthreads * sizeof(ws_counter)) + pending_bytes;
    const size_t parts_bytes = ALIGN64(attention_parts(&probe) * sizeof(float));
    const size_t items_bytes = ALIGN64((size_t)s->n_dec * 2 * sizeof(int32_t));
    const size_t best_bytes = s->argmax ? (size_t)nthreads * ALIGN64(M * sizeof(float)) * 2 : 0;
    const size_t bytes = best_bytes + copies * input_bytes(M, H, kmax) + ALIGN64(copies * sizeof(input_buf))
                         + ALIGN64(M * I * sizeof(float)) + (size_t)nthreads * ALIGN64(M * 2 * TILE * sizeof(float))
                         + (size_t)nthreads * t->attn_floats * sizeof(float) + phase_bytes
                         + ALIGN64(M * 3 * R * sizeof(float)) + 2 * (size_t)nthreads * ALIGN64(kmax * sizeof(float))
                         + parts_bytes + items_bytes;
    char *p = aligned_alloc(64, ALIGN64(bytes));
    if (!p) return -3;
    t->block = p;
    t->phases = (ws_phase *)p;
    t->counters = (ws_counter *)(p + ALIGN64((size_t)t->num_phases * sizeof(ws_phase)));
    t->attn_pending = (atomic_int *)(p + phase_bytes - pending_bytes);
    memset(p, 0, phase_bytes);
    p += phase_bytes;
    t->attn_parts = (float *)p;
    p += parts_bytes;
    t->attn_items = (int32_t *)p;
    p += items_bytes;
    t->best_v = (float *)p;
    t->best_i = (int32_t *)(p + best_bytes / 2);
    for (size_t i = 0; s->argmax && i < (size_t)nthreads * ALIGN64(M * sizeof(float)) / sizeof(float); i++)
        t->best_i[i] = -1;
    p += best_bytes;
    if (s->n_dec) {
        attn_args a = decode_args(m, 0, s);
        t->n_attn_items = attention_blocks(&a, t->max_len, t->attn_items);
    }
    p = input_carve(p, M, H, kmax, &t->shared);
    t->priv = (input_buf *)p;
    p += ALIGN64(copies * sizeof(input_buf));
    for (size_t i = 0; i + 1 < copies; i++) p = input_carve(p, M, H, kmax, &t->priv[i]);
    t->act = (float *)p;
    p += ALIGN64(M * I * sizeof(float));
    t->tmp = (float *)p;
    p += (size_t)nthreads * ALIGN64(M * 2 * TILE * sizeof(float));
    t->attn = (float *)p;
    p += (size_t)nthreads * t->attn_floats * sizeof(float);
    t->lora_h = (float *)p;
    p += ALIGN64(M * 3 * R * sizeof(float));
    t->lora_x = (float *)p;
    return 0;
}

/* ---- elementwise pieces, one row at a time ---- */

static void rms_norm_row(const float *x, const float *w, int H, float eps, float *y) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int i = 0; i < H; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    const float var = hsum8(_mm256_add_ps(a0, a1)) / (float)H;
    const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(var + eps));
    for (int i = 0; i < H; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv), _mm256_loadu_ps(w + i)));
}

/* x[0..R) rotated in place by the position's row of cos_sin (rotate-half layout over the
 * first R dimensions; the rest of the head passes through: partial rotary). */
static void rotary_row(float *x, const float *cs, int R) {
    const int half = R / 2;
    int i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 c = _mm256_loadu_ps(cs + i), sn = _mm256_loadu_ps(cs + half + i);
        const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
        _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, sn)));
        _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, sn)));
    }
    for (; i < half; i++) { /* (a half not a multiple of 8: Phi-4-mini's 48 is, tiny tests' 12 not) */
        const float c = cs[i], sn = cs[half + i], x1 = x[i], x2 = x[half + i];
        x[i] = x1 * c - x2 * sn;
        x[half + i] = x2 * c + x1 * sn;
    }
}

static void silu_mul_row(const float *g, const float *u, int n, float *y) {
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, neg))));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
}

/* gelu_tanh(g) * u, as torch's gelu(approximate="tanh"): 0.5 g (1 + tanh z), z = sqrt(2/pi)
 * (g + 0.044715 g^3), computed as g / (1 + e^-2z) (the same value; silu_mul_row's form) in 8
 * lanes (n is a whole number of tiles), where a scalar tanhf a value cost a Gemma step ~10%. */
static void gelu_mul_row(const float *g, const float *u, int n, float *y) {
    const __m256 m2beta = _mm256_set1_ps(-2.0f * 0.7978845608028654f), kappa = _mm256_set1_ps(0.044715f);
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int i = 0; i < n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 z = _mm256_fmadd_ps(_mm256_mul_ps(kappa, x), _mm256_mul_ps(x, x), x);
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_mul_ps(m2beta, z))));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
}

static void embed_row(const model_desc *m, int64_t id, float *y) {
    const int H = m->hidden;
    if (m->embed_kind == EMBED_TABLE)
        memcpy(y, (const float *)m->embed + (size_t)id * H, sizeof(float) * (size_t)H);
    else
        quant_row((const uint8_t *)m->embed, m->embed_kind, H, id, y);
    if (m->embed_scale != 1.0f)
        for (int i = 0; i < H; i++) y[i] *= m->embed_scale;
}

/* ---- team pieces ---- */

/* Row r of a matmul's input into b: normed by w (when w), written in `planes` integer
 * planes (when planes > 0), its block sums for the float kernel (when sums). */
static void prepare_row(const float *src, size_t ld, int r, int M, int K, const float *w, float eps, int planes,
                        int sums, input_buf *b) {
    const float *x = src + (size_t)r * ld;
    if (w) {
        rms_norm_row(x, w, K, eps, b->x + (size_t)r * K);
        x = b->x + (size_t)r * K;
    }
    if (sums) block_sums(x, K, b->xs + (size_t)r * (K / QBLOCK));
    if (!planes) return;
    b->views[r] = qa_view(b->xq, b->xd, b->xs, b->xt, r, M, K, planes);
    qa_row(x, K, planes, b->views[r]);
}

/* A matmul's input: rows of src [M, K] (stride ld), normed by w when w != NULL, in integer
 * planes when planes > 0. Few rows: each thread prepares them all in its own buffer, when it
 * takes its first item of the matmul (`prepare_mine`; a thread that takes none skips it);
 * many: the rows are shared among the team, one loop of their own (`prepare`). */
typedef struct {
    const float *x; /* the float rows */
    size_t ldx;
    const float *xs; /* their block sums [M, K / 32] for the float kernel (when sums) */
    const input_buf *b; /* their quantized form */
    /* what prepare_mine needs */
    const float *src, *w;
    size_t ld;
    int M, K, planes, sums;
    float eps;
} matmul_input;

/* The input of linear L (its planes, and whether it needs block sums). */
static matmul_input prepare(const float *src, size_t ld, int M, int K, const float *w, float eps, const qlinear *L,
                            temps *t, ws_local *ws) {
    const int planes = L->planes, sums = needs_sums(L);
    input_buf *b = t->private_inputs ? &t->priv[omp_get_thread_num()] : &t->shared;
    if ((w || planes || sums) && !t->private_inputs) {
        WS_FOR(ws, r, mine, M) prepare_row(src, ld, r, M, K, w, eps, planes, sums, b);
    }
    const matmul_input in = {w ? b->x : src, w ? (size_t)K : ld, sums ? b->xs : NULL, b, src, w, ld, M, K,
                             planes, sums, eps};
    return in;
}

/* Before this thread's first item of a matmul: its own copy of the input, when private. */
static void prepare_mine(const matmul_input *in, const temps *t) {
    if (!t->private_inputs || !(in->w || in->planes || in->sums)) return;
    input_buf *b = (input_buf *)in->b;
    for (int r = 0; r < in->M; r++)
        prepare_row(in->src, in->ld, r, in->M, in->K, in->w, in->eps, in->planes, in->sums, b);
}

/* Tiles t0..t1-1 of linear L for M rows into y (the first tile's columns, stride ldy):
 * from the float rows or their quantized form, then the bias. */
static void linear_tiles(const qlinear *L, const matmul_input *in, int M, float *y, size_t ldy, int t0, int t1) {
#if defined(LLMWORKER_SKIP_MATMULS) || defined(LLMWORKER_READ_ONLY_MATMULS)
    /* benchmarks/ab_kernels.py --breakdown: the call's time without the matmuls, and with
     * each tile's records read (a plain sum of their bytes, kept from the optimizer) in
     * the place of its arithmetic: what reading the weights in the call's order costs */
    for (int r = 0; r < M; r++) memset(y + (size_t)r * ldy, 0, sizeof(float) * (size_t)(t1 - t0) * TILE);
#ifdef LLMWORKER_READ_ONLY_MATMULS
    const size_t bytes = tile_bytes(L->qtype, L->K);
    const uint8_t *p = L->w + (size_t)t0 * bytes, *end = p + (size_t)(t1 - t0) * bytes;
    __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    for (; p + 128 <= end; p += 128)
        for (int j = 0; j < 4; j++) acc[j] = _mm256_add_epi32(acc[j], _mm256_loadu_si256((const __m256i *)(p + 32 * j)));
    __m256i all = _mm256_add_epi32(_mm256_add_epi32(acc[0], acc[1]), _mm256_add_epi32(acc[2], acc[3]));
    if (_mm256_testz_si256(all, all) && p < end && *p == 0x5a) y[0] = 1.0f; /* a use of the sum */
#endif
    return;
#endif
    for (int tile = t0; tile < t1; tile++) {
        float *yt = y + (size_t)(tile - t0) * TILE;
        if (is_integer(L)) qi_tile(L->w, L->qtype, L->K, in->b->views, L->planes, M, yt, ldy, tile);
        else qf_tile(L->w, L->qtype, L->K, in->x, in->ldx, in->xs, (size_t)(L->K / QBLOCK), M, yt, ldy, tile);
        if (L->bias)
            for (int r = 0; r < M; r++)
                for (int n = 0; n < TILE; n++) yt[(size_t)r * ldy + n] += L->bias[tile * TILE + n];
    }
}

/* A one-row call of the integer kernels reads its weights from memory with little else to
 * do: between two matmuls (a loop's end, the attention, the norms) the memory sat idle and
 * the next matmul began cold. So each thread asks, at the end of the loop it is about to run
 * (ws_end), for the first WARM_BYTES of its part of linear L's next loop (`items` items of
 * `per` tiles; with `second`, each item also takes the tile `second` tiles on: gate and up),
 * which then streams in meanwhile. Zen 4, batch 1, 40 alternating rounds: 1.016x the native
 * call. Where the arithmetic is the bound it costs what the thread spends issuing the
 * fetches: a 4-row verification call lost 1% with it, and the AVX2 build's float32 kernels
 * (the AVX2-only machines' default) 6% at batch 1: only one row, AVX-512 VNNI's integer
 * kernels. */
#ifdef __AVX512VNNI__
#define WARM_BYTES 262144
#else
#define WARM_BYTES 0
#endif
static void warm_next(ws_local *ws, const step_desc *s, const qlinear *L, int items, int per, int second) {
    if (!WARM_BYTES || s->M != 1 || !is_integer(L)) return;
    const size_t tile = tile_bytes(L->qtype, L->K);
    int lo, hi; /* the thread's own block, which it takes first (workshare.h) */
    ws_block(items, ws->tid, ws->nthreads, &lo, &hi);
    size_t n = (size_t)(hi - lo) * per * tile, cap = second ? WARM_BYTES / 2 : WARM_BYTES;
    if (n > cap) n = cap;
    for (int j = 0; j < 1 + (second > 0); j++) {
        ws->warm[j] = L->w + ((size_t)lo * per + (size_t)j * second) * tile;
        ws->warm_n[j] = n;
    }
}

/* ---- LoRA (lora.c) ---- */

static int lora_on(const model_desc *m, const step_desc *s, int group) {
    return m->lora && s->lora_slots && s->n_lora && (s->lora_groups & group);
}

/* Row r of the matmul's float input (a norm's output is recomputed into `local` when each
 * thread keeps its own copy, which may not be written yet). */
static const float *lora_input(const matmul_input *in, const temps *t, int r, float *local) {
    if (!(in->w && t->private_inputs)) return in->x + (size_t)r * in->ldx;
    rms_norm_row(in->src + (size_t)r * in->ld, in->w, in->K, in->eps, local);
    return local;
}

/* One loop: the shrink of linear L for every pair of adapter rows. */
static void lora_shrink_team(const lora_linear *L, const model_desc *m, const matmul_input *in,
                             const step_desc *s, temps *t, ws_local *ws) {
    const size_t kmax = ALIGN64(t->kmax * sizeof(float)) / sizeof(float), hw = 3 * (size_t)m->lora_rank;
    float *local = t->lora_x + 2 * (size_t)omp_get_thread_num() * kmax;
    WS_FOR(ws, i, mine, s->n_lora) {
        const int r = s->lora_pairs[2 * i], r2 = s->lora_pairs[2 * i + 1];
        const float *x = lora_input(in, t, r, local), *x2 = r2 >= 0 ? lora_input(in, t, r2, local + kmax) : NULL;
        lora_shrink_rows(L, m->lora_rank, in->K, s->lora_slots[r], x, t->lora_h + r * hw, x2,
                         r2 >= 0 ? t->lora_h + r2 * hw : NULL);
    }
}

/* The delta of columns col .. col + ncols of slice `slice` into y (M rows, stride ldy). */
static void lora_expand_tile(const lora_linear *L, const model_desc *m, const step_desc *s, const temps *t,
                             int slice, int col, int ncols, float *y, size_t ldy) {
    const size_t hw = 3 * (size_t)m->lora_rank;
    for (int i = 0; i < s->n_lora; i++) {
        const int r = s->lora_pairs[2 * i], r2 = s->lora_pairs[2 * i + 1];
        lora_expand_rows(L, m->lora_rank, slice, col, ncols, s->lora_slots[r], t->lora_h + r * hw,
                         y + (size_t)r * ldy, r2 >= 0 ? t->lora_h + r2 * hw : NULL,
                         r2 >= 0 ? y + (size_t)r2 * ldy : NULL);
    }
}

static void embed_team(const model_desc *m, const step_desc *s, ws_local *ws) {
    WS_FOR(ws, r, mine, s->M) embed_row(m, s->ids[r], s->residual + (size_t)r * m->hidden);
}

static void attn_in_team(const model_desc *m, int l, const step_desc *s, temps *t, ws_local *ws) {
    const layer_weights *L = m->layers + l;
    const int M = s->M, H = m->hidden, D = m->head_dim, Hq = m->num_heads, Hkv = m->num_kv_heads;
    const size_t ld = (size_t)(Hq + 2 * Hkv) * D;
    /* The parts share the activations' planes (one setting a model); the float kernels' block
     * sums are made where any part's type has a min. */
    const qlinear *prep = &L->qkv;
    for (int p = 1; p < 3 && L->qkv_heads[p]; p++)
        if (needs_sums(&L->qkv_rest[p - 1])) prep = &L->qkv_rest[p - 1];
    const matmul_input in = prepare(s->residual, (size_t)H, M, H, L->input_norm, m->eps, prep, t, ws);
    const lora_linear *lq = lora_on(m, s, LORA_QKV) ? &m->lora[l].qkv : NULL;
    if (lq) lora_shrink_team(lq, m, &in, s, t, ws);
    warm_next(ws, s, &L->o, H / TILE, 1, 0); /* streams in during the attention */
    /* one item per head: q heads 0..Hq-1, k heads, v heads (columns in that order) */
    WS_FOR(ws, h, mine, Hq + 2 * Hkv) {
        if (!mine) prepare_mine(&in, t);
        float *y = s->qkv + (size_t)h * D;
        int p = 0, hp = h; /* the part holding head h, and the head's index there */
        while (hp >= L->qkv_heads[p]) hp -= L->qkv_heads[p++];
        linear_tiles(p ? &L->qkv_rest[p - 1] : &L->qkv, &in, M, y, ld, hp * D / TILE, (hp + 1) * D / TILE);
        const int is_k = h >= Hq && h < Hq + Hkv, is_v = h >= Hq + Hkv;
        if (lq) /* slices q, k, v: the head's columns within its slice */
            lora_expand_tile(lq, m, s, t, is_k ? 1 : is_v ? 2 : 0, (is_k ? h - Hq : is_v ? h - Hq - Hkv : h) * D,
                             D, y, ld);
        const float *qk_norm = h < Hq ? L->q_norm : is_k ? L->k_norm : NULL;
        for (int r = 0; r < M; r++) {
            float *row = y + (size_t)r * ld;
            if (qk_norm) rms_norm_row(row, qk_norm, D, m->eps, row); /* (in place: each x read before its y) */
            if (!is_v) rotary_row(row, L->cos_sin + (size_t)s->positions[r] * m->rot_dim, m->rot_dim);
            if (s->slots[r] < 0 || h < Hq) continue;
            void *cache = is_k ? s->k_caches[l] : s->v_caches[l];
            const size_t at = ((size_t)s->slots[r] * Hkv + (is_k ? h - Hq : h - Hq - Hkv)) * D;
            if (s->kv_half) /* rounded to nearest even, as torch's .half() */
                for (int d = 0; d < D; d += 8)
                    _mm_storeu_si128((__m128i *)((uint16_t *)cache + at + d),
                                     _mm256_cvtps_ph(_mm256_loadu_ps(row + d), _MM_FROUND_TO_NEAREST_INT));
            else
                memcpy((float *)cache + at, row, sizeof(float) * (size_t)D);
        }
    }
}

static attn_args decode_args(const model_desc *m, int l, const step_desc *s) {
    const size_t Dq = (size_t)m->num_heads * m->head_dim;
    const attn_args a = {s->qkv, Dq + 2 * (size_t)m->num_kv_heads * m->head_dim, s->k_caches[l], s->v_caches[l],
                         s->kv_half, m->block_size, m->num_kv_heads, m->num_heads, m->head_dim, s->dec_rows,
                         s->dec_tables, s->dec_lens, s->max_blocks, s->n_dec, m->scale, s->att, Dq,
                         NULL, NULL, m->layers[l].window, m->softcap};
    return a;
}

static void attention_decode_team(const model_desc *m, int l, const step_desc *s, temps *t, ws_local *ws) {
    attn_args a = decode_args(m, l, s);
    a.parts = t->attn_parts;
    a.pending = t->attn_pending;
    float *scratch = t->attn + (size_t)omp_get_thread_num() * t->attn_floats;
    /* runs of rows (attention_blocks; a decode row alone is a run of one), whole or, when
     * few, chunk by chunk */
    const int C = attention_chunked(t->n_attn_items, ws->nthreads) ? ATTN_CHUNKS : 1;
    WS_FOR(ws, k, mine, t->n_attn_items * C) {
        const int i0 = t->attn_items[2 * (k / C)], R = t->attn_items[2 * (k / C) + 1], c = k % C;
        if (C == 1) attention_rows(&a, t->max_len, i0, R, scratch);
        else attention_rows_chunk(&a, t->max_len, i0, R, c, scratch);
    }
}

/* r[:, tile] += tmp (M rows of one tile): the residual add, one rounding as torch's. */
static void add_tile(float *r, size_t H, int tile, const float *tmp, int M) {
    for (int i = 0; i < M; i++) {
        float *dst = r + (size_t)i * H + (size_t)tile * TILE;
        for (int n = 0; n < TILE; n++) dst[n] += tmp[i * TILE + n];
    }
}

/* Gemma: rows of y (M x H, the sublayer's output) normed by w, then added to the residual. */
static void normed_add_team(const model_desc *m, const step_desc *s, float *y, const float *w, ws_local *ws) {
    const size_t H = (size_t)m->hidden;
    WS_FOR(ws, r, mine, s->M) {
        float *row = y + (size_t)r * H, *res = s->residual + (size_t)r * H;
        rms_norm_row(row, w, (int)H, m->eps, row);
        for (size_t i = 0; i < H; i++) res[i] += row[i];
    }
}

static void copy_tile(float *y, size_t H, int tile, const float *tmp, int M) {
    for (int i = 0; i < M; i++) memcpy(y + (size_t)i * H + (size_t)tile * TILE, tmp + i * TILE, sizeof(float) * TILE);
}

static void attn_out_team(const model_desc *m, int l, const step_desc *s, temps *t, ws_local *ws) {
    const layer_weights *L = m->layers + l;
    const int M = s->M, H = m->hidden, I = m->intermediate, Dq = m->num_heads * m->head_dim;
    float *tmp = t->tmp + (size_t)omp_get_thread_num() * ALIGN64((size_t)M * 2 * TILE * sizeof(float)) / sizeof(float);
    const matmul_input att = prepare(s->att, (size_t)Dq, M, Dq, NULL, 0.0f, &L->o, t, ws);
    const lora_layer *ll = m->lora ? &m->lora[l] : NULL;
    const int lo = lora_on(m, s, LORA_O), lgu = lora_on(m, s, LORA_GATE_UP), ld = lora_on(m, s, LORA_DOWN);
    if (lo) lora_shrink_team(&ll->o, m, &att, s, t, ws);
    warm_next(ws, s, &L->gate_up, I / TILE, 1, I / TILE);
    WS_FOR(ws, tile, mine, H / TILE) {
        if (!mine) prepare_mine(&att, t);
        linear_tiles(&L->o, &att, M, tmp, TILE, tile, tile + 1);
        if (lo) lora_expand_tile(&ll->o, m, s, t, 0, tile * TILE, TILE, tmp, TILE);
        if (L->attn_out_norm) copy_tile(s->out, (size_t)H, tile, tmp, M); /* (s->out: free until the final norm) */
        else add_tile(s->residual, (size_t)H, tile, tmp, M);
    }
    if (L->attn_out_norm) normed_add_team(m, s, s->out, L->attn_out_norm, ws);
    const matmul_input xn = prepare(s->residual, (size_t)H, M, H, L->post_norm, m->eps, &L->gate_up, t, ws);
    if (lgu) lora_shrink_team(&ll->gate_up, m, &xn, s, t, ws);
    /* gate tile g and up tile g + I/32 together, so that silu(gate) * up needs no barrier */
    warm_next(ws, s, &L->down, H / TILE, 1, 0);
    WS_FOR(ws, g, mine, I / TILE) {
        if (!mine) prepare_mine(&xn, t);
        linear_tiles(&L->gate_up, &xn, M, tmp, 2 * TILE, g, g + 1);
        linear_tiles(&L->gate_up, &xn, M, tmp + TILE, 2 * TILE, g + I / TILE, g + I / TILE + 1);
        if (lgu) {
            lora_expand_tile(&ll->gate_up, m, s, t, 0, g * TILE, TILE, tmp, 2 * TILE);
            lora_expand_tile(&ll->gate_up, m, s, t, 1, g * TILE, TILE, tmp + TILE, 2 * TILE);
        }
        for (int r = 0; r < M; r++)
            (m->gelu ? gelu_mul_row : silu_mul_row)(tmp + (size_t)r * 2 * TILE, tmp + (size_t)r * 2 * TILE + TILE,
                                                     TILE, t->act + (size_t)r * I + (size_t)g * TILE);
    }
    const matmul_input act = prepare(t->act, (size_t)I, M, I, NULL, 0.0f, &L->down, t, ws);
    if (ld) lora_shrink_team(&ll->down, m, &act, s, t, ws);
    if (l + 1 < m->num_layers) warm_next(ws, s, &m->layers[l + 1].qkv, m->layers[l + 1].qkv_heads[0], m->head_dim / TILE, 0);
    else if (s->logits) warm_next(ws, s, &m->head, m->head.N / TILE, 1, 0);
    WS_FOR(ws, tile, mine, H / TILE) {
        if (!mine) prepare_mine(&act, t);
        linear_tiles(&L->down, &act, M, tmp, TILE, tile, tile + 1);
        if (ld) lora_expand_tile(&ll->down, m, s, t, 0, tile * TILE, TILE, tmp, TILE);
        if (L->ffn_out_norm) copy_tile(s->out, (size_t)H, tile, tmp, M);
        else add_tile(s->residual, (size_t)H, tile, tmp, M);
    }
    if (L->ffn_out_norm) normed_add_team(m, s, s->out, L->ffn_out_norm, ws);
}

static void final_team(const model_desc *m, const step_desc *s, ws_local *ws) {
    WS_FOR(ws, r, mine, s->M)
        rms_norm_row(s->residual + (size_t)r * m->hidden, m->final_norm, m->hidden, m->eps, s->out + (size_t)r * m->hidden);
}

/* Whether logit v at index i comes before the best so far (bv at bi; bi < 0: none), in
 * torch's argmax order: a NaN before every number, then the larger, then the lower index. */
static inline int argmax_before(float v, int32_t i, float bv, int32_t bi) {
    if (bi < 0) return 1;
    if (isnan(v) || isnan(bv)) return isnan(v) && (!isnan(bv) || i < bi);
    return v > bv || (v == bv && i < bi);
}

/* Folds one row's TILE logits x (indices base..base+TILE-1) into its best (*bv, *bi). The
 * tile's max and NaN test are a few vector ops; only a tile that may hold a new best (its
 * max at least the best's, or a NaN) is scanned. A thread takes tiles in any order (its own
 * block first, then others'), and the order above is total, so the result does not depend
 * on which thread took which tile. */
static inline void argmax_tile(const float *x, int32_t base, float *bv, int32_t *bi) {
    const __m256 a = _mm256_loadu_ps(x), b = _mm256_loadu_ps(x + 8);
    const __m256 c = _mm256_loadu_ps(x + 16), d = _mm256_loadu_ps(x + 24);
    const __m256 nan = _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q));
    __m256 mx = _mm256_max_ps(_mm256_max_ps(a, b), _mm256_max_ps(c, d));
    mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 1));
    mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0x4e));
    mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0xb1));
    const float h = _mm256_cvtss_f32(mx);
    if (!_mm256_movemask_ps(nan) && *bi >= 0 && (isnan(*bv) || h < *bv || (h == *bv && base > *bi))) return;
    for (int j = 0; j < TILE; j++)
        if (argmax_before(x[j], base + j, *bv, *bi)) *bv = x[j], *bi = base + j;
}

/* logits = out @ Whead^T for the step's M rows; with argmax, each thread folds the tiles it
 * computed into its own best per row, and thread 0 combines them once every tile is done. */
static void head_team(const model_desc *m, const step_desc *s, temps *t, ws_local *ws) {
    const qlinear *L = &m->head;
    const matmul_input in = prepare(s->out, (size_t)m->hidden, s->M, m->hidden, NULL, 0.0f, L, t, ws);
    const size_t stride = ALIGN64((size_t)s->M * sizeof(float)) / sizeof(float);
    float *bv = s->argmax ? t->best_v + (size_t)ws->tid * stride : NULL;
    int32_t *bi = s->argmax ? t->best_i + (size_t)ws->tid * stride : NULL;
    WS_FOR(ws, tile, mine, L->N / TILE) {
        if (!mine) prepare_mine(&in, t);
        float *y = s->logits + (size_t)tile * TILE;
        linear_tiles(L, &in, s->M, y, (size_t)L->N, tile, tile + 1);
        if (m->final_softcap > 0.0f)
            for (int r = 0; r < s->M; r++) softcap_inplace(y + (size_t)r * L->N, TILE, m->final_softcap);
        for (int r = 0; bv && r < s->M; r++) argmax_tile(y + (size_t)r * L->N, tile * TILE, &bv[r], &bi[r]);
    }
    /* Past the loop's end every tile's fold is written (workshare.h: acquire on its count). */
    if (!s->argmax || ws->tid != 0) return;
    for (int r = 0; r < s->M; r++) {
        float v = 0.0f;
        int32_t i = -1;
        for (int k = 0; k < ws->nthreads; k++) {
            const float kv = t->best_v[(size_t)k * stride + r];
            const int32_t ki = t->best_i[(size_t)k * stride + r];
            if (ki >= 0 && argmax_before(kv, ki, v, i)) v = kv, i = ki;
        }
        s->argmax[r] = i >= 0 && isfinite(v) ? i : -1;
    }
}

/* ---- the entry point: one parallel region ---- */

/* The whole step: every row is an attention row (n_dec == M; a prefill row's length is
 * its position + 1). */
int cpu_decoder_decode(const model_desc *m, const step_desc *s) {
    if (s->M < 1 || s->n_dec != s->M) return -1;
    if (s->logits && (!m->head.w || m->head.K != m->hidden || m->head.N % TILE)) return -1;
    if (s->argmax && !s->logits) return -1;
    const attn_args a = decode_args(m, 0, s);
    if (attention_check(&a) < 0) return -2;
    temps t;
    if (temps_alloc(m, s, s->nthreads, &t)) return -3;
    if (s->wake_fd >= 0) {
        const char byte = 0;
        if (write(s->wake_fd, &byte, 1) < 0) { /* full or closed: the reader is awake anyway */ }
    }
#pragma omp parallel num_threads(s->nthreads)
    {
        /* this thread's view of the loops */
        ws_local ws = {t.phases, t.counters, t.num_phases, 0, omp_get_thread_num(), omp_get_num_threads(), {0}, {0}};
        warm_next(&ws, s, &m->layers[0].qkv, m->layers[0].qkv_heads[0], m->head_dim / TILE, 0);
        embed_team(m, s, &ws);
        for (int i = 0; i < m->num_layers; i++) {
            attn_in_team(m, i, s, &t, &ws);
            attention_decode_team(m, i, s, &t, &ws);
            attn_out_team(m, i, s, &t, &ws);
        }
        final_team(m, s, &ws);
        if (s->logits) head_team(m, s, &t, &ws);
    }
    free(t.block);
    return 0;
}
