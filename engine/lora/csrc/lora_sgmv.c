/* Batched LoRA products over a batch that mixes adapters (Punica-style SGMV/BGMV).
 *
 * Every token row t runs under the adapter in slot slots[t] (-1: none). With the slot's
 * stacked weights A [S*R, in] (slice j's rank-r rows at j*R) and B^T [S*R, out] (slice j's
 * rows only in its output columns [off_j, off_{j+1})):
 *
 *     shrink:  u[t, j*R + r] = A[s, j*R + r, :] . x[t, :]          (r < ranks[s])
 *     expand:  y[t, off_j:off_{j+1}] += sum_r u[t, j*R + r] * Bt[s, j*R + r, off_j:off_{j+1}]
 *
 * The scaling (alpha / r) is folded into Bt. Split in two calls so a row-parallel layer
 * can sum u over its ranks in between. Rows are independent: OpenMP splits tokens. */
#include <stdint.h>
#include <string.h>

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

void tandem_lora_shrink_f32(const float *x, int64_t x_stride, float *u, int64_t tokens,
                            const int64_t *slots, const float *a, const int32_t *ranks,
                            int64_t num_slices, int64_t max_rank, int64_t in_features,
                            int threads) {
    const int64_t width = num_slices * max_rank;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens > 1 && threads > 1)
    for (int64_t t = 0; t < tokens; t++) {
        float *ut = u + t * width;
        memset(ut, 0, sizeof(float) * width);
        const int64_t s = slots[t];
        if (s < 0) continue;
        const int32_t rank = ranks[s];
        const float *xt = x + t * x_stride;
        for (int64_t j = 0; j < num_slices; j++)
            for (int32_t r = 0; r < rank; r++) {
                const int64_t row = j * max_rank + r;
                ut[row] = dot(a + (s * width + row) * in_features, xt, in_features);
            }
    }
}

void tandem_lora_expand_f32(const float *u, float *y, int64_t y_stride, int64_t tokens,
                            const int64_t *slots, const float *bt, const int32_t *ranks,
                            const int64_t *offsets, int64_t num_slices, int64_t max_rank,
                            int64_t out_features, int threads) {
    const int64_t width = num_slices * max_rank;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens > 1 && threads > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        const int32_t rank = ranks[s];
        const float *ut = u + t * width;
        float *yt = y + t * y_stride;
        for (int64_t j = 0; j < num_slices; j++) {
            const int64_t lo = offsets[j], n = offsets[j + 1] - offsets[j];
            float *restrict dst = yt + lo;
            for (int32_t r = 0; r < rank; r++) {
                const int64_t row = j * max_rank + r;
                const float c = ut[row];
                if (c == 0.0f) continue;
                const float *restrict src = bt + (s * width + row) * out_features + lo;
#pragma omp simd
                for (int64_t o = 0; o < n; o++) dst[o] += c * src[o];
            }
        }
    }
}

const char *tandem_lora_isa(void) { return TANDEM_ISA; }
