/* Paged decode attention for the CPU, float32: one query token per sequence.
 *
 * out[b, h, :] = softmax(scale * q[b, h, :] . K[b, lo:len, h / group, :]) @ V[b, lo:len, h / group, :]
 *
 * K/V rows are read straight from the paged cache through the sequence's block table
 * (no gather into a padded copy). Cache layout: [num_blocks, block_size, num_kv_heads,
 * head_dim], so one position's keys for all KV heads are one contiguous row and a block
 * is one contiguous tile: each task (one sequence) streams its K and V tiles once, front
 * to back, and every query head of the sequence reads them while they are in cache.
 * GQA: query head h uses KV head h / group (group = num_heads / num_kv_heads). With a
 * sliding window only the last `window` positions are read. OpenMP over sequences.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

static int64_t slot_of(const int64_t *table, int64_t pos, int64_t block_size) {
    return table[pos / block_size] * block_size + pos % block_size;
}

/* scores[h * n + i] = scale * q[h] . K[lo + i, h / group] for every head h. */
static void scores_of(const float *q, const float *k_cache, const int64_t *table, int64_t lo,
                      int64_t n, int64_t num_heads, int64_t group, int64_t row,
                      int64_t head_dim, int64_t block_size, float scale, float *scores) {
    for (int64_t i = 0; i < n; i++) {
        const float *k = k_cache + slot_of(table, lo + i, block_size) * row;
        for (int64_t h = 0; h < num_heads; h++)
            scores[h * n + i] = scale * dot(q + h * head_dim, k + (h / group) * head_dim, head_dim);
    }
}

/* In place: each head's scores become exp(s - max); returns nothing, sums in `totals`. */
static void softmax_numerators(float *scores, int64_t n, int64_t num_heads, float *totals) {
    for (int64_t h = 0; h < num_heads; h++) {
        float *s = scores + h * n;
        float max = s[0];
        for (int64_t i = 1; i < n; i++) max = s[i] > max ? s[i] : max;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) {
            s[i] = expf(s[i] - max);
            sum += s[i];
        }
        totals[h] = sum;
    }
}

/* out[h] = sum_i p[h, i] * V[lo + i, h / group] / totals[h]. */
static void weighted_values(const float *scores, const float *totals, const float *v_cache,
                            const int64_t *table, int64_t lo, int64_t n, int64_t num_heads,
                            int64_t group, int64_t row, int64_t head_dim,
                            int64_t block_size, float *out) {
    memset(out, 0, sizeof(float) * num_heads * head_dim);
    for (int64_t i = 0; i < n; i++) {
        const float *v = v_cache + slot_of(table, lo + i, block_size) * row;
        for (int64_t h = 0; h < num_heads; h++) {
            const float p = scores[h * n + i];
            const float *vh = v + (h / group) * head_dim;
            float *o = out + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) o[d] += p * vh[d];
        }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        const float inv = 1.0f / totals[h];
        float *o = out + h * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) o[d] *= inv;
    }
}

/* Returns 0, or -1 when a work buffer could not be allocated. */
int tandem_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                            const int64_t *block_table, const int64_t *seq_lens, float *out,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, int64_t max_blocks,
                            int64_t max_seq_len, float scale, int64_t window, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * num_heads * (max_seq_len > 0 ? max_seq_len : 1));
        float *totals = malloc(sizeof(float) * num_heads);
        if (scores == NULL || totals == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < num_seqs; b++) {
            if (scores == NULL || totals == NULL) continue;
            const int64_t len = seq_lens[b];
            const int64_t lo = (window > 0 && len > window) ? len - window : 0;
            const int64_t *table = block_table + b * max_blocks;
            const float *qb = q + b * num_heads * head_dim;
            scores_of(qb, k_cache, table, lo, len - lo, num_heads, group, row, head_dim,
                      block_size, scale, scores);
            softmax_numerators(scores, len - lo, num_heads, totals);
            weighted_values(scores, totals, v_cache, table, lo, len - lo, num_heads, group, row,
                            head_dim, block_size, out + b * num_heads * head_dim);
        }
        free(scores);
        free(totals);
    }
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------------------------------
 * The same attention over a quantized cache (engine/attention/kv_quant.py): the cache is
 * uint8, [num_blocks, block_size, num_kv_heads, head_dim + 4], each token-head row being
 * head_dim one-byte codes then the float32 scale they are multiplied by. A row is decoded
 * once into a float buffer and read by every query head of its GQA group; its scale is
 * folded into the score (keys) or the softmax weight (values), so the arithmetic after
 * the decode is the float32 kernel's. int8 codes convert directly; fp8 (e4m3) codes go
 * through `lut`, the 256 values of the code bytes, which the caller supplies (torch's own
 * decoding of float8_e4m3fn, so both paths agree bit for bit).
 */

static float decode_row(const uint8_t *row, int64_t head_dim, const float *lut, float *buf) {
    if (lut == NULL) {
        const int8_t *codes = (const int8_t *)row;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) buf[d] = (float)codes[d];
    } else {
        for (int64_t d = 0; d < head_dim; d++) buf[d] = lut[row[d]];
    }
    float scale;
    memcpy(&scale, row + head_dim, sizeof scale); /* rows need not be 4-byte aligned */
    return scale;
}

static void scores_of_q8(const float *q, const uint8_t *k_cache, const int64_t *table,
                         int64_t lo, int64_t n, int64_t num_kv_heads, int64_t group,
                         int64_t head_dim, int64_t block_size, float scale, const float *lut,
                         float *buf, float *scores) {
    const int64_t width = head_dim + 4, row = num_kv_heads * width;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *k = k_cache + slot_of(table, lo + i, block_size) * row;
        for (int64_t g = 0; g < num_kv_heads; g++) {
            const float s = scale * decode_row(k + g * width, head_dim, lut, buf);
            for (int64_t h = g * group; h < (g + 1) * group; h++)
                scores[h * n + i] = s * dot(q + h * head_dim, buf, head_dim);
        }
    }
}

static void weighted_values_q8(const float *scores, const float *totals, const uint8_t *v_cache,
                               const int64_t *table, int64_t lo, int64_t n, int64_t num_heads,
                               int64_t num_kv_heads, int64_t group, int64_t head_dim,
                               int64_t block_size, const float *lut, float *buf, float *out) {
    const int64_t width = head_dim + 4, row = num_kv_heads * width;
    memset(out, 0, sizeof(float) * num_heads * head_dim);
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *v = v_cache + slot_of(table, lo + i, block_size) * row;
        for (int64_t g = 0; g < num_kv_heads; g++) {
            const float s = decode_row(v + g * width, head_dim, lut, buf);
            for (int64_t h = g * group; h < (g + 1) * group; h++) {
                const float p = s * scores[h * n + i];
                float *o = out + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) o[d] += p * buf[d];
            }
        }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        const float inv = 1.0f / totals[h];
        float *o = out + h * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) o[d] *= inv;
    }
}

static int paged_decode_q8(const float *q, const uint8_t *k_cache, const uint8_t *v_cache,
                           const int64_t *block_table, const int64_t *seq_lens, float *out,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t max_blocks,
                           int64_t max_seq_len, float scale, int64_t window, int num_threads,
                           const float *lut) {
    const int64_t group = num_heads / num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * num_heads * (max_seq_len > 0 ? max_seq_len : 1));
        float *totals = malloc(sizeof(float) * num_heads);
        float *buf = malloc(sizeof(float) * head_dim);
        if (scores == NULL || totals == NULL || buf == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < num_seqs; b++) {
            if (scores == NULL || totals == NULL || buf == NULL) continue;
            const int64_t len = seq_lens[b];
            const int64_t lo = (window > 0 && len > window) ? len - window : 0;
            const int64_t *table = block_table + b * max_blocks;
            scores_of_q8(q + b * num_heads * head_dim, k_cache, table, lo, len - lo, num_kv_heads,
                         group, head_dim, block_size, scale, lut, buf, scores);
            softmax_numerators(scores, len - lo, num_heads, totals);
            weighted_values_q8(scores, totals, v_cache, table, lo, len - lo, num_heads,
                               num_kv_heads, group, head_dim, block_size, lut, buf,
                               out + b * num_heads * head_dim);
        }
        free(scores);
        free(totals);
        free(buf);
    }
    return failed ? -1 : 0;
}

/* int8 codes; arguments as tandem_paged_decode_f32's, caches uint8 as above. */
int tandem_paged_decode_i8(const float *q, const uint8_t *k_cache, const uint8_t *v_cache,
                           const int64_t *block_table, const int64_t *seq_lens, float *out,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t max_blocks,
                           int64_t max_seq_len, float scale, int64_t window, int num_threads) {
    return paged_decode_q8(q, k_cache, v_cache, block_table, seq_lens, out, num_seqs, num_heads,
                           num_kv_heads, head_dim, block_size, max_blocks, max_seq_len, scale,
                           window, num_threads, NULL);
}

/* fp8 e4m3 codes, decoded through `lut` (256 floats, indexed by the code byte). */
int tandem_paged_decode_fp8(const float *q, const uint8_t *k_cache, const uint8_t *v_cache,
                            const int64_t *block_table, const int64_t *seq_lens, float *out,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, int64_t max_blocks,
                            int64_t max_seq_len, float scale, int64_t window, int num_threads,
                            const float *lut) {
    return paged_decode_q8(q, k_cache, v_cache, block_table, seq_lens, out, num_seqs, num_heads,
                           num_kv_heads, head_dim, block_size, max_blocks, max_seq_len, scale,
                           window, num_threads, lut);
}

/* ---------------------------------------------------------------------------------------
 * A whole Llama-family forward for a few tokens, one token ("row") at a time, float32.
 *
 * For small models at small batch a step is mostly per-operator overhead (a dozen torch
 * calls per layer, each a few microseconds, around matrix products of a few microseconds),
 * so a draft model's step costs half the target's whatever its size. Here one call runs
 * every layer of every row: embedding, RMSNorm, fused QKV (+ bias), rotary (rotate-half
 * layout, cos/sin tables from the model), the row's K/V written to the paged cache and
 * attended causally through the block table (the kernel above, one row), output
 * projection, SwiGLU MLP, residuals, final norm and, for the rows asked for, the logits.
 * Rows run in the order given, so a row sees the K/V of the earlier rows of its sequence.
 * Matrix-vector products of at least PARALLEL_MACS multiply-adds are split over threads.
 */

typedef struct {
    const float *input_norm; /* [hidden] */
    const float *qkv;        /* [(heads + 2 kv_heads) * head_dim, hidden] */
    const float *qkv_bias;   /* [(heads + 2 kv_heads) * head_dim] or NULL */
    const float *o;          /* [hidden, heads * head_dim] */
    const float *post_norm;  /* [hidden] */
    const float *gate_up;    /* [2 * intermediate, hidden]: gate rows, then up rows */
    const float *down;       /* [hidden, intermediate] */
    float *k_cache;          /* [num_blocks, block_size, kv_heads, head_dim] */
    float *v_cache;
    int64_t window;          /* sliding window, 0: none */
} TandemLayer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab;
    int64_t block_size, max_positions;
    float eps, scale;
    const float *embed, *final_norm, *lm_head, *cos, *sin; /* cos/sin: [max_positions, head_dim] */
} TandemModel;

#define PARALLEL_MACS 131072

static void matvec(const float *w, const float *bias, const float *x, float *y, int64_t out,
                   int64_t in, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (out * in >= PARALLEL_MACS) schedule(static)
    for (int64_t o = 0; o < out; o++) y[o] = dot(w + o * in, x, in) + (bias ? bias[o] : 0.0f);
}

static void rms_norm(const float *x, const float *weight, float *y, int64_t n, float eps) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < n; i++) squares += x[i] * x[i];
    const float inv = 1.0f / sqrtf(squares / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] = weight[i] * (x[i] * inv);
}

static void rotate(float *x, int64_t num_heads, int64_t head_dim, const float *cos,
                   const float *sin) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < num_heads; h++) {
        float *v = x + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* Returns 0; -1 when a work buffer could not be allocated; -2 for a position outside the
 * rotary tables, -3 for a token outside the vocabulary, -4 for a position past the end of
 * its block table (checked before anything is written). */
int tandem_llama_rows_f32(const TandemModel *m, const TandemLayer *layers, int64_t num_rows,
                          const int64_t *tokens, const int64_t *positions,
                          const int64_t *tables, int64_t max_blocks, const int64_t *row_table,
                          const int64_t *logit_rows, float *logits, int num_threads) {
    const int64_t d = m->hidden, hd = m->head_dim, heads = m->num_heads, kvh = m->num_kv_heads;
    const int64_t q_size = heads * hd, kv_size = kvh * hd, inter = m->intermediate;
    int64_t max_len = 1;
    for (int64_t r = 0; r < num_rows; r++) {
        if (positions[r] < 0 || positions[r] >= m->max_positions) return -2;
        if (tokens[r] < 0 || tokens[r] >= m->vocab) return -3;
        if (positions[r] / m->block_size >= max_blocks) return -4;
        if (positions[r] + 1 > max_len) max_len = positions[r] + 1;
    }
    float *h = malloc(sizeof(float) * d), *x = malloc(sizeof(float) * d);
    float *qkv = malloc(sizeof(float) * (q_size + 2 * kv_size));
    float *attn = malloc(sizeof(float) * q_size), *mlp = malloc(sizeof(float) * 2 * inter);
    float *scores = malloc(sizeof(float) * heads * max_len), *totals = malloc(sizeof(float) * heads);
    int status = 0;
    if (!h || !x || !qkv || !attn || !mlp || !scores || !totals) status = -1;
    for (int64_t r = 0; r < num_rows && status == 0; r++) {
        const int64_t pos = positions[r];
        const int64_t *table = tables + row_table[r] * max_blocks;
        const float *cos = m->cos + pos * hd, *sin = m->sin + pos * hd;
        memcpy(h, m->embed + tokens[r] * d, sizeof(float) * d);
        for (int64_t l = 0; l < m->num_layers; l++) {
            const TandemLayer *L = layers + l;
            rms_norm(h, L->input_norm, x, d, m->eps);
            matvec(L->qkv, L->qkv_bias, x, qkv, q_size + 2 * kv_size, d, num_threads);
            rotate(qkv, heads, hd, cos, sin);
            rotate(qkv + q_size, kvh, hd, cos, sin);
            const int64_t slot = slot_of(table, pos, m->block_size) * kv_size;
            memcpy(L->k_cache + slot, qkv + q_size, sizeof(float) * kv_size);
            memcpy(L->v_cache + slot, qkv + q_size + kv_size, sizeof(float) * kv_size);
            const int64_t len = pos + 1;
            const int64_t lo = (L->window > 0 && len > L->window) ? len - L->window : 0;
            scores_of(qkv, L->k_cache, table, lo, len - lo, heads, heads / kvh, kv_size, hd,
                      m->block_size, m->scale, scores);
            softmax_numerators(scores, len - lo, heads, totals);
            weighted_values(scores, totals, L->v_cache, table, lo, len - lo, heads, heads / kvh,
                            kv_size, hd, m->block_size, attn);
            matvec(L->o, NULL, attn, x, d, q_size, num_threads);
            for (int64_t i = 0; i < d; i++) h[i] += x[i];
            rms_norm(h, L->post_norm, x, d, m->eps);
            matvec(L->gate_up, NULL, x, mlp, 2 * inter, d, num_threads);
            for (int64_t i = 0; i < inter; i++) {
                const float g = mlp[i];
                mlp[i] = g / (1.0f + expf(-g)) * mlp[inter + i];
            }
            matvec(L->down, NULL, mlp, x, d, inter, num_threads);
            for (int64_t i = 0; i < d; i++) h[i] += x[i];
        }
        if (logit_rows[r] >= 0) {
            rms_norm(h, m->final_norm, x, d, m->eps);
            matvec(m->lm_head, NULL, x, logits + logit_rows[r] * m->vocab, m->vocab, d,
                   num_threads);
        }
    }
    free(h); free(x); free(qkv); free(attn); free(mlp); free(scores); free(totals);
    return status;
}
