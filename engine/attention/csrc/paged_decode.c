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
