/* Fused element-wise layers of the decoder, float32, CPU (loaded by ../native_ops.py).
 *
 * Plain C that the compiler vectorises; one build per instruction set (-m flags and
 * TANDEM_ISA set by the loader). Built with -ffp-contract=off so that every product and
 * sum is rounded exactly where the torch code rounds it: only the RMSNorm sum of squares
 * is ordered differently (accumulated in double, so at least as accurate as torch's).
 *
 * Threads: rows are split over `threads` OpenMP threads when a call has enough work to
 * pay for the fork (PARALLEL_MIN elements); a decode row runs on the calling thread.
 */
#include <math.h>
#include <stdint.h>

#ifndef TANDEM_ISA
#define TANDEM_ISA "unknown"
#endif

#define PARALLEL_MIN 65536

const char *tandem_fused_isa(void) { return TANDEM_ISA; }

/* 1 / sqrt(mean(x^2) + eps), the mean rounded to float as torch's float32 mean is. */
static inline float inv_rms(const float *x, int64_t n, float eps) {
    double sum = 0.0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += (double)x[i] * (double)x[i];
    float mean = (float)(sum / (double)n);
    return 1.0f / sqrtf(mean + eps);
}

/* out = w * (x * r): the HF order (normalise, then scale), two roundings. */
static inline void scale_row(const float *x, const float *w, float *out, int64_t n, float r) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* out[rows, n] = rmsnorm(x[rows, n]) * w[n]; rows contiguous. */
void tandem_rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t n,
                         float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        scale_row(xr, w, out + r * n, n, inv_rms(xr, n, eps));
    }
}

/* residual += x (in place), then out = rmsnorm(residual) * w; all [rows, n] contiguous. */
void tandem_add_rms_norm_f32(const float *x, float *residual, const float *w, float *out,
                             int64_t rows, int64_t n, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *res = residual + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) res[i] = xr[i] + res[i];
        scale_row(res, w, out + r * n, n, inv_rms(res, n, eps));
    }
}

/* One head, rotate_half layout: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), with the
 * cos / sin rows holding each pair's value at i and i + half, as the torch tables do. */
static inline void rotate_head(const float *src, float *dst, const float *c, const float *s,
                               int64_t half) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        float x1 = src[i], x2 = src[i + half];
        dst[i] = x1 * c[i] - x2 * s[i];
        dst[i + half] = x2 * c[i + half] + x1 * s[i + half];
    }
}

static void rotate_rows(const float *src, int64_t row_stride, int64_t head_stride, float *dst,
                        int64_t heads, int64_t dim, int64_t t, const float *c, const float *s) {
    for (int64_t h = 0; h < heads; h++)
        rotate_head(src + t * row_stride + h * head_stride, dst + (t * heads + h) * dim, c, s,
                    dim / 2);
}

/* q_out[T, QH, D] and k_out[T, KH, D] (contiguous) = q and k rotated by their token's
 * position. q and k may be strided views (token and head strides given; the head dim
 * contiguous). cos / sin: [max_positions, D]. Returns -1 (nothing written for that
 * token) when a position is outside the tables, else 0. */
int tandem_rotary_f32(const float *q, int64_t q_row_stride, int64_t q_head_stride, int64_t q_heads,
                      const float *k, int64_t k_row_stride, int64_t k_head_stride, int64_t k_heads,
                      float *q_out, float *k_out, int64_t tokens, int64_t dim,
                      const int64_t *positions, const float *cos, const float *sin,
                      int64_t max_positions, int threads) {
    int status = 0;
#pragma omp parallel for num_threads(threads) \
    if (tokens * (q_heads + k_heads) * dim >= PARALLEL_MIN) schedule(static) reduction(min : status)
    for (int64_t t = 0; t < tokens; t++) {
        int64_t p = positions[t];
        if (p < 0 || p >= max_positions) {
            status = -1;
            continue;
        }
        const float *c = cos + p * dim, *s = sin + p * dim;
        rotate_rows(q, q_row_stride, q_head_stride, q_out, q_heads, dim, t, c, s);
        rotate_rows(k, k_row_stride, k_head_stride, k_out, k_heads, dim, t, c, s);
    }
    return status;
}

/* e^x for x in [-87, 88] (clamped), to about 1e-7 relative: x = n ln2 + r with n an
 * integer and |r| <= ln2 / 2 (ln2 in two parts, so n ln2 is exact enough), e^r by its
 * Taylor polynomial to r^7 (remainder below 2e-8), times 2^n built in the exponent bits.
 * Written so that `omp simd` vectorises it (libm's expf would be one call per value); the
 * clamp's compares become blends only with -fno-trapping-math (native_ops.py: GCC keeps
 * branches otherwise, and the AVX2 loop then does not vectorise). */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    float t = x * 1.44269504f;
    float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 +
              r * (1.0f / 720 + r * (1.0f / 5040)))))));
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* out[r, j] = silu(gu[r, j]) * gu[r, n + j], silu(g) = g / (1 + e^-g): the gated MLP's
 * activation over a [rows, 2n] gate_up product (gate first), one pass instead of torch's
 * silu, a product and their temporaries. */
void tandem_silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gu + r * 2 * n, *up = gate + n;
        float *o = out + r * n;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) o[j] = gate[j] / (1.0f + exp_approx(-gate[j])) * up[j];
    }
}
