/* Weight-only quantized matrix products for the CPU, float32 activations:
 *
 *   y[r, j] = sum_i x[r, i] * W[j, i] + bias[j]      r < m rows, j < n outputs, i < k inputs
 *
 * int8 (symmetric, one scale per output channel):  W[j, i] = s[j] * q[j, i]
 * int4 (asymmetric, per group of g inputs):        W[j, i] = s[j, i/g] * (q[j, i] - z[j, i/g])
 *
 * int4 packing: each row is cut into blocks of 32 inputs stored in 16 bytes; byte b of a
 * block holds input b in its low nibble and input b + 16 in its high nibble (the last
 * block is zero-padded). One vector load of bytes then widens to two vectors of
 * consecutive inputs with an AND and a shift, no shuffles.
 *
 * The int4 sum is taken per group as s * (q . x - z * sum(x)), so the zero point costs
 * one multiply per group, not one per weight.
 *
 * Compiled once per instruction set (see kernels.py): with -mavx512f.. the vector type is
 * 16 floats, with -mavx2 8, otherwise GCC's generic vector extension of 4 floats, which
 * needs no intrinsics at all. Every output is computed by one thread in a fixed order
 * whatever the thread count or the number of rows, so results do not depend on either.
 * OpenMP splits the output channels.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VL 16
#define ISA_NAME "avx512"
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline vf vint8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* VL bytes -> the low nibbles and the high nibbles, as floats. */
static inline void vnibbles(const uint8_t *p, vf *lo, vf *hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
#define ISA_NAME "avx2"
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vset1(float a) { return _mm256_set1_ps(a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline float vsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vf vint8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline void vnibbles(const uint8_t *p, vf *lo, vf *hi) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
#else
#define VL 4
#define ISA_NAME "portable"
typedef float vf __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(16)));
typedef int8_t vi8 __attribute__((vector_size(4)));
typedef uint8_t vu8 __attribute__((vector_size(4)));
static inline vf vzero(void) { return (vf){0, 0, 0, 0}; }
static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vf vset1(float a) { return (vf){a, a, a, a}; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline float vsum(vf a) { return (a[0] + a[1]) + (a[2] + a[3]); }
static inline vf vint8(const int8_t *p) {
    vi8 v;
    memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, vf);
}
static inline void vnibbles(const uint8_t *p, vf *lo, vf *hi) {
    vu8 v;
    memcpy(&v, p, sizeof v);
    vi b = __builtin_convertvector(v, vi);
    *lo = __builtin_convertvector(b & 15, vf);
    *hi = __builtin_convertvector(b >> 4, vf);
}
#endif

#define BLOCK 32      /* int4 inputs per packed block */
#define ROWS 4        /* rows of x sharing one pass over a weight row */
#define PARALLEL_MACS (1 << 16)

const char *tandem_quant_isa(void) { return ISA_NAME; }

static inline int nibble(const uint8_t *row, int64_t i) {
    uint8_t byte = row[(i / BLOCK) * (BLOCK / 2) + i % (BLOCK / 2)];
    return (i % BLOCK) < BLOCK / 2 ? byte & 15 : byte >> 4;
}

/* out[r] = sum_i w[i] * x[r * ldx + i] for r < rows (rows a compile-time constant after
 * inlining). Two accumulators per row, alternating vectors, then the scalar tail: the
 * same order for any `rows`, so a row's result does not depend on its batch. */
static inline __attribute__((always_inline)) void int8_dots(const int8_t *w, const float *x,
                                                             int64_t ldx, int64_t k, int rows,
                                                             float *out) {
    vf a0[ROWS], a1[ROWS];
    for (int r = 0; r < rows; r++) a0[r] = a1[r] = vzero();
    int64_t i = 0;
    for (; i + 2 * VL <= k; i += 2 * VL) {
        vf w0 = vint8(w + i), w1 = vint8(w + i + VL);
        for (int r = 0; r < rows; r++) {
            a0[r] = vfma(w0, vload(x + r * ldx + i), a0[r]);
            a1[r] = vfma(w1, vload(x + r * ldx + i + VL), a1[r]);
        }
    }
    if (i + VL <= k) {
        vf w0 = vint8(w + i);
        for (int r = 0; r < rows; r++) a0[r] = vfma(w0, vload(x + r * ldx + i), a0[r]);
        i += VL;
    }
    for (int r = 0; r < rows; r++) {
        float acc = vsum(vadd(a0[r], a1[r]));
        for (int64_t t = i; t < k; t++) acc += (float)w[t] * x[r * ldx + t];
        out[r] = acc;
    }
}

int tandem_int8_matmul(const float *x, int64_t m, int64_t k, const int8_t *q,
                       const float *scales, const float *bias, float *y, int64_t n,
                       int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (m * n * k >= PARALLEL_MACS) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const int8_t *w = q + j * k;
        float b = bias ? bias[j] : 0.0f, dots[ROWS];
        int64_t r = 0;
        for (; r + ROWS <= m; r += ROWS) {
            int8_dots(w, x + r * k, k, k, ROWS, dots);
            for (int t = 0; t < ROWS; t++) y[(r + t) * n + j] = dots[t] * scales[j] + b;
        }
        for (; r < m; r++) {
            int8_dots(w, x + r * k, k, k, 1, dots);
            y[r * n + j] = dots[0] * scales[j] + b;
        }
    }
    return 0;
}

/* out[r] = sum_g s[g] * (q_g . x_r,g - z[g] * xsum[r, g]) for one packed int4 row. */
static inline __attribute__((always_inline)) void int4_dots(
    const uint8_t *w, const float *s, const uint8_t *z, const float *x, int64_t ldx,
    const float *xsum, int64_t groups, int64_t k, int64_t group, int rows, float *out) {
    vf total[ROWS];
    float offset[ROWS];
    for (int r = 0; r < rows; r++) total[r] = vzero(), offset[r] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        int64_t lo = g * group, hi = lo + group < k ? lo + group : k, i = lo;
        vf a0[ROWS], a1[ROWS];
        for (int r = 0; r < rows; r++) a0[r] = a1[r] = vzero();
        for (; i + BLOCK <= hi; i += BLOCK) {
            const uint8_t *p = w + i / 2;
            for (int b = 0; b < BLOCK / 2; b += VL) {
                vf l, h;
                vnibbles(p + b, &l, &h);
                for (int r = 0; r < rows; r++) {
                    a0[r] = vfma(l, vload(x + r * ldx + i + b), a0[r]);
                    a1[r] = vfma(h, vload(x + r * ldx + i + BLOCK / 2 + b), a1[r]);
                }
            }
        }
        vf scale = vset1(s[g]);
        for (int r = 0; r < rows; r++) {
            float tail = 0.0f;
            for (int64_t t = i; t < hi; t++) tail += (float)nibble(w, t) * x[r * ldx + t];
            total[r] = vfma(scale, vadd(a0[r], a1[r]), total[r]);
            offset[r] += s[g] * (tail - (float)z[g] * xsum[r * groups + g]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = vsum(total[r]) + offset[r];
}

int tandem_int4_matmul(const float *x, int64_t m, int64_t k, const uint8_t *q,
                       const float *scales, const uint8_t *zeros, int64_t group,
                       const float *bias, float *y, int64_t n, int num_threads) {
    int64_t groups = (k + group - 1) / group, row_bytes = (k + BLOCK - 1) / BLOCK * (BLOCK / 2);
    float *xsum = malloc((size_t)(m * groups) * sizeof(float));
    if (xsum == NULL) return -1;
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            float acc = 0.0f;
            for (int64_t i = g * group; i < k && i < (g + 1) * group; i++) acc += x[r * k + i];
            xsum[r * groups + g] = acc;
        }
#pragma omp parallel for num_threads(num_threads) if (m * n * k >= PARALLEL_MACS) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *w = q + j * row_bytes, *z = zeros + j * groups;
        const float *s = scales + j * groups;
        float b = bias ? bias[j] : 0.0f, dots[ROWS];
        int64_t r = 0;
        for (; r + ROWS <= m; r += ROWS) {
            int4_dots(w, s, z, x + r * k, k, xsum + r * groups, groups, k, group, ROWS, dots);
            for (int t = 0; t < ROWS; t++) y[(r + t) * n + j] = dots[t] + b;
        }
        for (; r < m; r++) {
            int4_dots(w, s, z, x + r * k, k, xsum + r * groups, groups, k, group, 1, dots);
            y[r * n + j] = dots[0] + b;
        }
    }
    free(xsum);
    return 0;
}

/* out[j, i] = W[j, i] in float32, for the many-row path (a dequantized weight fed to a
 * float GEMM). */
void tandem_int8_dequantize(const int8_t *q, const float *scales, int64_t n, int64_t k,
                            float *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < k; i++) out[j * k + i] = (float)q[j * k + i] * scales[j];
}

void tandem_int4_dequantize(const uint8_t *q, const float *scales, const uint8_t *zeros,
                            int64_t group, int64_t n, int64_t k, float *out, int num_threads) {
    int64_t groups = (k + group - 1) / group, row_bytes = (k + BLOCK - 1) / BLOCK * (BLOCK / 2);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < k; i++) {
            int64_t g = j * groups + i / group;
            out[j * k + i] = scales[g] * (float)(nibble(q + j * row_bytes, i) - zeros[g]);
        }
}
