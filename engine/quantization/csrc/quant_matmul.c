/* Quantized matrix products for the CPU, float32 in and out:
 *
 *   y[r, j] = sum_i x[r, i] * W[j, i] + bias[j]      r < m rows, j < n outputs, i < k inputs
 *
 * int8 (symmetric, one scale per output channel):  W[j, i] = s[j] * q[j, i]
 * int4 (asymmetric, per group of g inputs):        W[j, i] = s[j, i/g] * (q[j, i] - z[j, i/g])
 *
 * int4 packing: each row is cut into blocks of 32 inputs stored in 16 bytes; byte b of a
 * block holds input b in its low nibble and input b + 16 in its high nibble (the last
 * block is zero-padded).
 *
 * Both round each row of activations to int8 first and multiply integers. int4
 * (tandem_int4_matmul): a float path spent more on unpacking and converting nibbles than
 * it saved in weight bytes; from 16 rows on (x86 builds) int4 puts the output channels in
 * the vector lanes instead (int4_panel_matmul, at the end). int8
 * (tandem_int8_int8_matmul), at every row count: integer products are cheaper than float
 * ones, and a row's exact integer sums do not depend on the rows around it. (An int8
 * kernel with float activations served up to 16 rows until 68125f7.)
 *
 * Compiled once per instruction set (see kernels.py): with -mavx512f.. -mavx512vnni the
 * vector type is 16 floats, with -mavx2 8, otherwise GCC's generic vector extension of 4
 * floats, which needs no intrinsics at all. Every output is computed by one thread in a
 * fixed order whatever the thread count or the number of rows, so results do not depend
 * on either. OpenMP splits the output channels.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
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
#else
#define VL 4
#define ISA_NAME "portable"
typedef float vf __attribute__((vector_size(16)));
static inline vf vzero(void) { return (vf){0, 0, 0, 0}; }
static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vf vset1(float a) { return (vf){a, a, a, a}; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline float vsum(vf a) { return (a[0] + a[1]) + (a[2] + a[3]); }
#endif

#define BLOCK 32      /* int4 inputs per packed block */
#define ROWS 4        /* rows of x sharing one pass over a weight row */
#define PARALLEL_MACS (1 << 16)
/* Passes that touch each value once (rounding activations, rescaling int32 sums): threads
 * pay off only on large inputs (each parallel region is a barrier, slow on busy cores). */
#define PARALLEL_VALUES (1 << 20)

const char *tandem_quant_isa(void) { return ISA_NAME; }

static inline int nibble(const uint8_t *row, int64_t i) {
    uint8_t byte = row[(i / BLOCK) * (BLOCK / 2) + i % (BLOCK / 2)];
    return (i % BLOCK) < BLOCK / 2 ? byte & 15 : byte >> 4;
}

/* int4 products take int8 activations. Each group of each row of x is quantized
 * symmetrically once per call, x ~ sx * xq with sx = max|x| / 127 over the group and
 * xq = round(x / sx) in [-127, 127] (per row, so a row's result does not depend on its
 * batch; per group, so a row-parallel slice of whole groups rounds as the whole row
 * would), and a block's sum becomes an exact integer dot product of 4-bit weights and
 * 8-bit activations:
 *
 *   y[r, j] = sum_b s[g] * sx[r, g] * dot_b  -  sum_g s[g] * z[g] * sx[r, g] * xqsum[r, g]
 *             + bias[j]                                           (g the group of block b)
 *
 * with dot_b = sum_{i in block b} q[i] * xq[r, i] and xqsum[r, g] = sum_{i in g} xq[r, i].
 * One integer instruction takes 64 (AVX-512 VNNI vpdpbusd) or 32 (AVX2 vpmaddubsw)
 * products, where the float path took 16 or 8 after converting every weight to float.
 * The blocks are taken in pairs (a 64-input chunk), and each row of xq is zero-padded to
 * whole chunks, so a partial last block needs no scalar tail (its padding nibbles are 0). */
#define CHUNK 64

#if defined(__AVX512VNNI__)
/* A chunk's 32 packed bytes become one 64-byte vector: the bytes, then the bytes shifted
 * down a nibble, masked to 4 bits. Byte lanes 0-15 then hold inputs 0-15, 16-31 inputs
 * 32-47, 32-47 inputs 16-31, 48-63 inputs 48-63; xq is stored in that order
 * (act_position). int32 lanes 0-3 and 8-11 sum block 0, 4-7 and 12-15 block 1, hence
 * the blended scale. Two float accumulators per row take chunks in turn. */
static inline int64_t act_position(int64_t i) {
    int64_t o = i % CHUNK;
    return i - o + (o % 32) / 16 * 32 + o / 32 * 16 + o % 16;
}
static inline __attribute__((always_inline)) void int4_chunk(const uint8_t *w, int two,
                                                              const int8_t *xq, int64_t ldxq,
                                                              float s0, float s1,
                                                              const float *sx0, const float *sx1,
                                                              int64_t ldsx, int odd, int rows,
                                                              vf *acc) {
    __m256i b = two ? _mm256_loadu_si256((const __m256i *)w)
                    : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)w));
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
    v = _mm512_and_si512(v, _mm512_set1_epi8(15));
    for (int r = 0; r < rows; r++) {
        __m512 scale = sx0 == sx1 ? _mm512_set1_ps(s0 * sx0[r * ldsx])
                                  : _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(s0 * sx0[r * ldsx]),
                                                         _mm512_set1_ps(s1 * sx1[r * ldsx]));
        __m512i x = _mm512_loadu_si512((const void *)(xq + r * ldxq));
        __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, x);
        acc[2 * r + odd] = vfma(_mm512_cvtepi32_ps(d), scale, acc[2 * r + odd]);
    }
}
#elif defined(__AVX2__)
/* A chunk's 32 packed bytes, masked, are inputs 0-15 and 32-47 (low nibbles) and, shifted
 * down a nibble, 16-31 and 48-63: xq is stored in that order (act_position, as for
 * AVX-512). vpmaddubsw multiplies the unsigned weight bytes by the signed activation bytes
 * and adds pairs into int16; the two products add in int16 (at most 4 * 15 * 127), and
 * vpmaddwd by ones widens to int32. The low 128-bit half then sums block 0, the high half
 * block 1: one scale, or each half its own when the blocks are in different groups (of
 * 32). A lone last block reads 16 bytes: the high halves are zero. */
static inline int64_t act_position(int64_t i) {
    int64_t o = i % CHUNK;
    return i - o + (o % 32) / 16 * 32 + o / 32 * 16 + o % 16;
}
static inline __attribute__((always_inline)) void int4_chunk(const uint8_t *w, int two,
                                                              const int8_t *xq, int64_t ldxq,
                                                              float s0, float s1,
                                                              const float *sx0, const float *sx1,
                                                              int64_t ldsx, int odd, int rows,
                                                              vf *acc) {
    __m256i b = two ? _mm256_loadu_si256((const __m256i *)w)
                    : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)w));
    __m256i nib = _mm256_set1_epi8(15);
    __m256i lo = _mm256_and_si256(b, nib), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
    for (int r = 0; r < rows; r++) {
        const int8_t *x = xq + r * ldxq;
        __m256i p = _mm256_add_epi16(
            _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 32))));
        __m256 scale = sx0 == sx1 ? vset1(s0 * sx0[r * ldsx])
                                  : _mm256_set_m128(_mm_set1_ps(s1 * sx1[r * ldsx]),
                                                    _mm_set1_ps(s0 * sx0[r * ldsx]));
        __m256 d = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
        acc[2 * r + odd] = vfma(d, scale, acc[2 * r + odd]);
    }
}
#else
/* Plain C, the same sums: each block's integer dot product, then scaled. */
static inline int64_t act_position(int64_t i) { return i; }
static inline int32_t block_dot(const uint8_t *w, const int8_t *xq) {
    int32_t dot = 0;
    for (int b = 0; b < BLOCK / 2; b++)
        dot += (w[b] & 15) * xq[b] + (w[b] >> 4) * xq[b + BLOCK / 2];
    return dot;
}
static inline void int4_chunk(const uint8_t *w, int two, const int8_t *xq, int64_t ldxq,
                              float s0, float s1, const float *sx0, const float *sx1,
                              int64_t ldsx, int odd, int rows, vf *acc) {
    (void)odd;
    for (int r = 0; r < rows; r++) {
        acc[2 * r][0] += s0 * sx0[r * ldsx] * (float)block_dot(w, xq + r * ldxq);
        if (two)
            acc[2 * r + 1][0] +=
                s1 * sx1[r * ldsx] * (float)block_dot(w + BLOCK / 2, xq + r * ldxq + BLOCK);
    }
}
#endif

/* out[r] = sum_b s[g(b)] * sx[r, g(b)] * dot_b for one packed int4 row and `rows` rows of
 * xq; block b is in group g(b) = b >> block_shift (groups are 32, 64 or 128 inputs: a
 * shift, not a division, which cost more than the products). */
static inline __attribute__((always_inline)) void int4_dots(const uint8_t *w, const float *s,
                                                             int64_t blocks, int block_shift,
                                                             const int8_t *xq, int64_t ldxq,
                                                             const float *sx, int64_t ldsx,
                                                             int rows, float *out) {
    vf acc[2 * ROWS];
    for (int t = 0; t < 2 * rows; t++) acc[t] = vzero();
    /* whole chunks two at a time (the accumulator index must be a constant to stay in a
     * register), then a whole chunk left over, then a lone last block */
    int64_t whole = blocks / 2, c = 0;
#define CHUNK_AT(c, two, odd)                                                                \
    do {                                                                                     \
        int64_t g0 = (2 * (c)) >> block_shift, g1 = two ? (2 * (c) + 1) >> block_shift : g0; \
        int4_chunk(w + (c) * BLOCK, two, xq + (c) * CHUNK, ldxq, s[g0], s[g1], sx + g0,      \
                   sx + g1, ldsx, odd, rows, acc);                                           \
    } while (0)
    for (; c + 2 <= whole; c += 2) {
        CHUNK_AT(c, 1, 0);
        CHUNK_AT(c + 1, 1, 1);
    }
    if (c < whole) {
        CHUNK_AT(c, 1, 0);
        c++;
    }
    if (blocks % 2) CHUNK_AT(c, 0, 0);
#undef CHUNK_AT
    for (int r = 0; r < rows; r++) out[r] = vsum(vadd(acc[2 * r], acc[2 * r + 1]));
}

/* xq[r] (act_position order, zero-padded to `padded`), sx[r, g] and
 * xqsum[r, g] = sx[r, g] * (the sum of xq over group g), for each row of x. */
static void quantize_rows(const float *x, int64_t m, int64_t k, int64_t padded, int64_t group,
                          int64_t groups, int natural, int8_t *xq, float *sx, float *xqsum) {
    memset(xq, 0, (size_t)(m * padded));
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + r * k + g * group;
            int64_t size = k - g * group < group ? k - g * group : group;
            float amax = 0.0f, sum = 0.0f;
            for (int64_t i = 0; i < size; i++) amax = fmaxf(amax, fabsf(xg[i]));
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int64_t i = 0; i < size; i++) {
                float v = nearbyintf(xg[i] * inv);
                xq[r * padded + (natural ? g * group + i : act_position(g * group + i))] = (int8_t)v;
                sum += v;
            }
            sx[r * groups + g] = amax / 127.0f;
            xqsum[r * groups + g] = sx[r * groups + g] * sum;
        }
}

/* sum_g s[g] * z[g] * xqsum[g]: the zero points' share of one output, one product per
 * group. AVX2 takes eight groups per instruction (the scalar loop was a quarter of a
 * 768-input row's instructions at batch 1); elsewhere four independent sums (one chain of
 * dependent adds was as slow as the products for K = 3072). */
#if defined(__AVX2__)
/* a + s * z * xqsum for eight groups, z's eight bytes given as one integer */
static inline __m256 zero_terms(__m256 a, __m256 s, uint64_t z, __m256 xqsum) {
    __m256 zf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)z)));
    return _mm256_fmadd_ps(_mm256_mul_ps(s, zf), xqsum, a);
}
static inline float zero_share(const float *s, const uint8_t *z, const float *xqsum,
                               int64_t groups) {
    __m256 a = _mm256_setzero_ps();
    uint64_t zz;
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
        memcpy(&zz, z + g, sizeof zz);
        a = zero_terms(a, _mm256_loadu_ps(s + g), zz, _mm256_loadu_ps(xqsum + g));
    }
    int64_t rest = groups - g;
    if (rest > 0 && groups >= 8) { /* the last few, masked; z's 8 bytes read up to its end */
        static const int32_t lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1};
        __m256i mask = _mm256_loadu_si256((const __m256i *)(lanes + 8 - rest));
        memcpy(&zz, z + groups - 8, sizeof zz);
        a = zero_terms(a, _mm256_maskload_ps(s + g, mask), zz >> (8 * (8 - rest)),
                       _mm256_maskload_ps(xqsum + g, mask));
    } else {
        for (; g < groups; g++) a[0] += s[g] * (float)z[g] * xqsum[g];
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#else
static inline float zero_share(const float *s, const uint8_t *z, const float *xqsum,
                               int64_t groups) {
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t g = 0;
    for (; g + 4 <= groups; g += 4)
        for (int t = 0; t < 4; t++) part[t] += s[g + t] * (float)z[g + t] * xqsum[g + t];
    for (; g < groups; g++) part[0] += s[g] * (float)z[g] * xqsum[g];
    return (part[0] + part[1]) + (part[2] + part[3]);
}
#endif

#if defined(__AVX2__)
/* From PANEL_ROWS rows on, int4 goes through int4_panel_matmul (after the int8 x int8
 * product, whose vector helpers it shares). With a step's weights from memory (the medium
 * model's four shapes x 12 layers) it took 1.1x the time of the loop above at 8 rows
 * and 1.8-2.4x at 2-4 (AVX2 and AVX-512; each panel reads eight weight rows at a time),
 * and 0.92x at 16 rows, 0.68x at 32 and 0.45-0.63x at 64. */
#define PANEL_ROWS 16
static int int4_panel_matmul(const int8_t *xq, int64_t ldxq, int64_t m, const uint8_t *q,
                             int64_t row_bytes, int64_t blocks, const float *scales,
                             const uint8_t *zeros, int64_t group, int64_t groups,
                             const float *sx, const float *xqsum, const float *bias, float *y,
                             int64_t n, int num_threads);
#endif

/* The row count from which int4 takes the panel kernel (0: never, the portable build). */
int tandem_int4_panel_rows(void) {
#ifdef PANEL_ROWS
    return PANEL_ROWS;
#else
    return 0;
#endif
}

int tandem_int4_matmul(const float *x, int64_t m, int64_t k, const uint8_t *q,
                       const float *scales, const uint8_t *zeros, int64_t group,
                       const float *bias, float *y, int64_t n, int num_threads) {
    int64_t groups = (k + group - 1) / group, blocks = (k + BLOCK - 1) / BLOCK;
    int64_t row_bytes = blocks * (BLOCK / 2), padded = (blocks + 1) / 2 * CHUNK;
    float *sx = malloc((size_t)(2 * m * groups) * sizeof(float));
    int8_t *xq = malloc((size_t)(m * padded));
    if (sx == NULL || xq == NULL) {
        free(sx), free(xq);
        return -1;
    }
    float *xqsum = sx + m * groups;
    int block_shift = __builtin_ctzll((unsigned long long)group) - 5;
#ifdef PANEL_ROWS
    if (m >= PANEL_ROWS) {
        quantize_rows(x, m, k, padded, group, groups, 1, xq, sx, xqsum);
        int status = int4_panel_matmul(xq, padded, m, q, row_bytes, blocks, scales, zeros, group,
                                       groups, sx, xqsum, bias, y, n, num_threads);
        free(sx), free(xq);
        return status;
    }
#endif
    quantize_rows(x, m, k, padded, group, groups, 0, xq, sx, xqsum);
#pragma omp parallel for num_threads(num_threads) if (m * n * k >= PARALLEL_MACS) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *w = q + j * row_bytes, *z = zeros + j * groups;
        const float *s = scales + j * groups;
        float b = bias ? bias[j] : 0.0f, dots[ROWS];
        for (int64_t r = 0; r < m;) {
            int rows = m - r >= ROWS ? ROWS : 1;
            if (rows == ROWS)
                int4_dots(w, s, blocks, block_shift, xq + r * padded, padded,
                          sx + r * groups, groups, ROWS, dots);
            else
                int4_dots(w, s, blocks, block_shift, xq + r * padded, padded,
                          sx + r * groups, groups, 1, dots);
            for (int t = 0; t < rows; t++, r++) {
                y[r * n + j] = dots[t] - zero_share(s, z, xqsum + r * groups, groups) + b;
            }
        }
    }
    free(sx), free(xq);
    return 0;
}

/* out[j, i] = W[j, i] in float32: int4's many-row path (a dequantized weight fed to a
 * float GEMM) and QuantizedLinear.dequantized. */
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

/* ---- int8 weights times int8 activations (W8A8), for more than 16 rows ------------------
 *
 * The activations are rounded per row, x ~ sx[r] * xq[r, :], sx = max|x[r]| / ACT_MAX and
 * xq = round(x * (ACT_MAX / max|x[r]|)) in [-ACT_MAX, ACT_MAX] (a zero row: sx = 0,
 * xq = 0), and
 *
 *   y[r, j] = (float)(sum_i xq[r, i] * q[j, i]) * sx[r] * s[j] + bias[j]
 *
 * The integer sums are exact (int32: at most 128 * 127 * k), so their order does not
 * matter and a row's result depends on neither its batch nor the thread count.
 *
 * x86's byte products take one unsigned and one signed operand, so the activations are
 * moved up by OFFSET into unsigned bytes once per call, u = xq + OFFSET, and
 *
 *   sum_i xq[r, i] * q[j, i] = sum_i u[r, i] * q[j, i] - OFFSET * wsum[j]
 *
 * with wsum[j] = sum_i q[j, i]. The inner loop is then nothing but products:
 * - AVX-512 VNNI: vpdpbusd adds four u8 x s8 products straight into int32, so any code
 *   fits: ACT_MAX = 127, OFFSET = 128.
 * - AVX2: vpmaddubsw adds pairs of products into int16 and saturates beyond 32767, so u
 *   must stay <= 128 (2 * 128 * 127 = 32512): ACT_MAX = 64, OFFSET = 64 (129 levels per
 *   row instead of 255, the "reduced range" other x86 int8 engines use on AVX2 for the
 *   same reason); vpmaddwd by ones widens to int32. Taking |x| and moving x's sign onto
 *   the weight instead keeps 8 bits but costs two more instructions per product vector,
 *   half again the time.
 * - portable: plain int32 dot products of the codes, ACT_MAX = 127.
 *
 * A register block is IROWS rows of u times ICOLS weight rows, so each weight vector serves
 * IROWS rows and each activation vector ICOLS columns; its IROWS * ICOLS vector sums are
 * reduced four at a time (reduce4). */
#define ROW_TILE 64

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define ACT_MAX 127
#define OFFSET 128
#define IVL 64
#define IROWS 4
#define ICOLS 4
typedef __m512i vi;
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
static inline vi vi_dot(vi acc, vi u, vi w) { return _mm512_dpbusd_epi32(acc, u, w); }
static inline __m256i vi_half(vi a) {
    return _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
}
#elif defined(__AVX2__)
#define ACT_MAX 64
#define OFFSET 64
#define IVL 32
#define IROWS 2
#define ICOLS 4
typedef __m256i vi;
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline vi vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi vi_dot(vi acc, vi u, vi w) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, w), _mm256_set1_epi16(1)));
}
static inline __m256i vi_half(vi a) { return a; }
#else
#define ACT_MAX 127
#define OFFSET 0
#define IROWS 1
#define ICOLS 2
#endif

int tandem_int8_act_max(void) { return ACT_MAX; }

#ifdef IVL
/* The four int32 sums of four vectors. */
static inline __m128i reduce4(vi a, vi b, vi c, vi d) {
    __m256i ab = _mm256_hadd_epi32(vi_half(a), vi_half(b));
    __m256i cd = _mm256_hadd_epi32(vi_half(c), vi_half(d));
    __m256i s = _mm256_hadd_epi32(ab, cd); /* a b c d of each 128-bit half */
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}
static inline int32_t vi_sum(vi a) {
    return _mm_cvtsi128_si32(reduce4(a, vi_zero(), vi_zero(), vi_zero()));
}

#if IVL == 32
/* The full AVX2 block, 2 rows x 4 columns, spelled out: with the generic loop below GCC
 * kept an accumulator on the stack, and 4 rows x 2 columns ran 10-15% slower (both
 * measured on workload A's shapes). */
static inline __attribute__((always_inline)) int64_t avx2_block(const uint8_t *u, const int8_t *w,
                                                                 int64_t k, vi *acc) {
    vi a0 = vi_zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    int64_t i = 0;
    for (; i + IVL <= k; i += IVL) {
        vi x0 = vi_load(u + i), x1 = vi_load(u + k + i), wv;
        wv = vi_load(w + i);
        a0 = vi_dot(a0, x0, wv), a4 = vi_dot(a4, x1, wv);
        wv = vi_load(w + k + i);
        a1 = vi_dot(a1, x0, wv), a5 = vi_dot(a5, x1, wv);
        wv = vi_load(w + 2 * k + i);
        a2 = vi_dot(a2, x0, wv), a6 = vi_dot(a6, x1, wv);
        wv = vi_load(w + 3 * k + i);
        a3 = vi_dot(a3, x0, wv), a7 = vi_dot(a7, x1, wv);
    }
    acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3;
    acc[4] = a4, acc[5] = a5, acc[6] = a6, acc[7] = a7;
    return i;
}
#endif

/* acc[r * cols + c] = the vector sums of u[r * k + i] * w[c * k + i] over whole vectors of
 * i, for r < rows, c < cols (constants after inlining); returns where the vectors ended. */
static inline __attribute__((always_inline)) int64_t products(const uint8_t *u, const int8_t *w,
                                                               int64_t k, int rows, int cols,
                                                               vi *acc) {
#if IVL == 32
    if (rows == IROWS && cols == ICOLS) return avx2_block(u, w, k, acc);
#endif
    for (int t = 0; t < rows * cols; t++) acc[t] = vi_zero();
    int64_t i = 0;
    for (; i + IVL <= k; i += IVL) {
        vi wv[ICOLS];
        for (int c = 0; c < cols; c++) wv[c] = vi_load(w + c * k + i);
        for (int r = 0; r < rows; r++) {
            vi ur = vi_load(u + r * k + i);
            for (int c = 0; c < cols; c++) acc[r * cols + c] = vi_dot(acc[r * cols + c], ur, wv[c]);
        }
    }
    return i;
}

/* out[r * ldo + c] = sum_i u[r * k + i] * w[c * k + i] for r < rows, c < cols (constants
 * after inlining): whole vectors, then a scalar tail. */
static inline __attribute__((always_inline)) void int8x8_block(const uint8_t *u, const int8_t *w,
                                                                int64_t k, int rows, int cols,
                                                                int32_t *out, int64_t ldo) {
    vi acc[IROWS * ICOLS];
    int64_t i = products(u, w, k, rows, cols, acc);
    int32_t sums[IROWS * ICOLS];
    int t = 0;
    for (; t + 4 <= rows * cols; t += 4)
        _mm_storeu_si128((__m128i *)(sums + t), reduce4(acc[t], acc[t + 1], acc[t + 2], acc[t + 3]));
    for (; t < rows * cols; t++) sums[t] = vi_sum(acc[t]);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            int32_t sum = sums[r * cols + c];
            for (int64_t e = i; e < k; e++) sum += (int32_t)u[r * k + e] * w[c * k + e];
            out[r * ldo + c] = sum;
        }
}
#else
/* Plain C (GCC vectorizes the int32 dot product); u is the codes themselves (OFFSET 0). */
static inline void int8x8_block(const uint8_t *u, const int8_t *w, int64_t k, int rows,
                                int cols, int32_t *out, int64_t ldo) {
    const int8_t *x = (const int8_t *)u;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            int32_t sum = 0;
            for (int64_t i = 0; i < k; i++) sum += (int32_t)x[r * k + i] * w[c * k + i];
            out[r * ldo + c] = sum;
        }
}
#endif

/* Rows r0 <= r < r1 of `acc` for output channels j < j + cols (cols a constant). */
static inline __attribute__((always_inline)) void int8x8_tile(const uint8_t *u, int64_t r0,
                                                               int64_t r1, int64_t k,
                                                               const int8_t *w, int cols,
                                                               int32_t *acc, int64_t n) {
    int64_t r = r0;
    for (; r + IROWS <= r1; r += IROWS) int8x8_block(u + r * k, w, k, IROWS, cols, acc + r * n, n);
    for (; r < r1; r++) int8x8_block(u + r * k, w, k, 1, cols, acc + r * n, n);
}

static inline float rescaled(int32_t acc, float sx, float s, float b) {
    return (float)acc * sx * s + b;
}

/* wsum[j] = sum_i q[j, i] (the offset's correction; callers that multiply the same
 * weight again keep it). */
void tandem_int8_weight_sums(const int8_t *q, int64_t n, int64_t k, int32_t *wsum) {
    for (int64_t j = 0; j < n; j++) {
        int32_t sum = 0;
        for (int64_t i = 0; i < k; i++) sum += q[j * k + i];
        wsum[j] = sum;
    }
}

/* acc[r, j] = sum_i xq[r, i] * q[j, i], exactly (codes within +-ACT_MAX); then, when sx is
 * given, in place, ((float *)acc)[r, j] = rescaled(acc[r, j], sx[r], scales[j], bias[j]).
 * wsum: tandem_int8_weight_sums of q. Threads take blocks of COL_BLOCK output channels; a
 * block goes over the rows ROW_TILE at a time, so its weight rows, a tile of u and the
 * tile's outputs all stay in L2 (with whole rows of outputs per tile, 768x6144 at 512
 * rows ran 1.3x slower than at 64: each output line was evicted between the column
 * groups that fill it). Returns -1 when the offset codes cannot be allocated. */
#define COL_BLOCK (16 * ICOLS)
int tandem_int8_int8_matmul(const int8_t *xq, int64_t m, int64_t k, const int8_t *q, int64_t n,
                            const int32_t *wsum, int32_t *acc, const float *sx,
                            const float *scales, const float *bias, int num_threads) {
    uint8_t *u = malloc((size_t)(m * k) + 1);
    if (u == NULL) return -1;
    for (int64_t i = 0; i < m * k; i++) u[i] = (uint8_t)(xq[i] + OFFSET);
    int64_t blocks = (n + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for num_threads(num_threads) if (m * n * k >= PARALLEL_MACS) schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
        int64_t j0 = block * COL_BLOCK, j1 = n - j0 < COL_BLOCK ? n : j0 + COL_BLOCK;
        for (int64_t r0 = 0; r0 < m; r0 += ROW_TILE) {
            int64_t r1 = m - r0 < ROW_TILE ? m : r0 + ROW_TILE, j = j0;
            for (; j + ICOLS <= j1; j += ICOLS) {
                /* The first row tile reads the block's weights from memory: ask for the
                 * next block's matching rows into L2 meanwhile (+7-8% at 64-512 rows on
                 * 768 x 6144, AVX2; none past this call's weights). */
                if (r0 == 0 && j + COL_BLOCK + ICOLS <= n) {
                    const char *next = (const char *)(q + (j + COL_BLOCK) * k);
                    for (int64_t l = 0; l < ICOLS * k; l += 64) __builtin_prefetch(next + l, 0, 2);
                }
                int8x8_tile(u, r0, r1, k, q + j * k, ICOLS, acc + j, n);
            }
            for (; j < j1; j++) int8x8_tile(u, r0, r1, k, q + j * k, 1, acc + j, n);
            float *y = (float *)acc;
            for (int64_t r = r0; r < r1; r++)
                for (j = j0; j < j1; j++) {
                    int32_t exact = acc[r * n + j] - OFFSET * wsum[j];
                    if (sx == NULL)
                        acc[r * n + j] = exact;
                    else
                        y[r * n + j] = rescaled(exact, sx[r], scales[j], bias ? bias[j] : 0.0f);
                }
        }
    }
    free(u);
    return 0;
}

/* y[r, j] = rescaled(acc[r, j], sx[r], scales[j], bias[j]); y may be acc itself. */
void tandem_int8_rescale(const int32_t *acc, int64_t m, int64_t n, const float *sx,
                         const float *scales, const float *bias, float *y, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (m * n >= PARALLEL_VALUES) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        if (bias)
            for (int64_t j = 0; j < n; j++) y[r * n + j] = rescaled(acc[r * n + j], sx[r], scales[j], bias[j]);
        else
            for (int64_t j = 0; j < n; j++) y[r * n + j] = rescaled(acc[r * n + j], sx[r], scales[j], 0.0f);
    }
}

static inline float absmax(const float *x, int64_t k) {
    float a[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= k; i += 8)
        for (int t = 0; t < 8; t++) {
            float v = fabsf(x[i + t]);
            a[t] = v > a[t] ? v : a[t];
        }
    for (; i < k; i++) a[0] = fmaxf(a[0], fabsf(x[i]));
    for (int t = 1; t < 8; t++) a[0] = fmaxf(a[0], a[t]);
    return a[0];
}

/* amax[r] = max_i |x[r, i]|. */
void tandem_row_absmax(const float *x, int64_t m, int64_t k, float *amax, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (m * k >= PARALLEL_VALUES) schedule(static)
    for (int64_t r = 0; r < m; r++) amax[r] = absmax(x + r * k, k);
}

/* xq[r, i] = round(x[r, i] * (ACT_MAX / a)) (to nearest, ties to even) and sx[r] = a / ACT_MAX,
 * with a = amax[r], or the row's own max |x| when amax is NULL; a zero a gives zeros.
 * amax (given) is the maximum |x| over the whole row of which x holds a slice. */
void tandem_int8_quantize_rows(const float *x, int64_t m, int64_t k, const float *amax,
                               int8_t *xq, float *sx, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (m * k >= PARALLEL_VALUES) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        float a = amax ? amax[r] : absmax(x + r * k, k), inv = a > 0.0f ? (float)ACT_MAX / a : 0.0f;
        for (int64_t i = 0; i < k; i++) xq[r * k + i] = (int8_t)(int32_t)nearbyintf(x[r * k + i] * inv);
        sx[r] = a / (float)ACT_MAX;
    }
}

#ifdef PANEL_ROWS
/* ---------------------------------------------------------------------------------------
 * int4 times int8 activations for many rows (PANEL_ROWS and more). tandem_int4_matmul's
 * loop takes one weight row at a time and spends most of its instructions on per-chunk
 * bookkeeping (the group of each chunk, a scale per row and chunk, a horizontal sum and
 * the zero points per output), which is cheap next to streaming the weight at one row
 * but not when 16 or 128 rows share each weight. Here the output channels are the vector
 * lanes instead:
 *
 * - a thread takes PANEL_NB output channels at a time and unpacks their nibbles once into
 *   a panel of bytes: for each quad of inputs t, the channels' four codes side by side
 *   (panel[(t * PANEL_NB + c) * 4 + e] = q[j0 + c, 4t + e]), the layout vpdpbusd reads;
 * - for PANEL_R rows at a time and each group, the exact int32 sums over the group's
 *   quads: a weight vector (PANEL_NB / PANEL_C channels x 4 codes) times the row's four
 *   activation codes broadcast, unsigned codes x signed activations (vpdpbusd, or AVX2's
 *   vpmaddubsw + vpmaddwd: at most 2 * 15 * 127 per int16 pair);
 * - then per group, in float: acc += sums * (s[j, g] * sx[r, g]) - (s * z)[j, g] *
 *   xqsum[r, g], the group's zero points with it; the channels' scales are gathered once
 *   per panel.
 *
 * The sums are exact and the float steps run in group order per output, so a row's result
 * depends on neither the other rows nor the threads (but is not bitwise the one-row
 * loop's: its float sums go chunk by chunk). */
#define PANEL_C 2
#define PANEL_LANES (IVL / 4)
#define PANEL_NB (PANEL_C * PANEL_LANES)
/* vf, vload, vset1 and vfma are the float helpers at the top of the file (16 or 8 lanes,
 * as many as the integer vector has int32 words). */
static inline vi panel_bcast(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, sizeof v);
#if IVL == 64
    return _mm512_set1_epi32(v);
}
#define PANEL_R 4
static inline vf vf_int(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline void vstore(float *p, vf a) { _mm512_storeu_ps(p, a); }
#else
    return _mm256_set1_epi32(v);
}
#define PANEL_R 3
static inline vf vf_int(vi a) { return _mm256_cvtepi32_ps(a); }
static inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline void vstore(float *p, vf a) { _mm256_storeu_ps(p, a); }
#endif

/* Eight vectors of eight int32 words transposed: r[i][j] becomes r[j][i]. */
static inline void transpose8_epi32(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

/* The panel of channels j0 <= j < j0 + cols (the rest zero), `blocks` blocks deep, and
 * their scales and scale x zero point per group: sg / szg[g * PANEL_NB + c]. Eight
 * channels' blocks at a time: each block's 16 bytes unpacked to its 32 codes in input
 * order (eight quads), then the 8 x 8 quads transposed so that each quad's eight channels
 * sit side by side. */
static void int4_panel(const uint8_t *q, int64_t row_bytes, int64_t blocks, int64_t j0,
                       int cols, const float *scales, const uint8_t *zeros, int64_t groups,
                       uint8_t *panel, float *sg, float *szg) {
    const __m256i nib = _mm256_set1_epi8(15);
    for (int c0 = 0; c0 < PANEL_NB; c0 += 8)
        for (int64_t b = 0; b < blocks; b++) {
            __m256i r[8];
            for (int i = 0; i < 8; i++) {
                if (c0 + i >= cols) {
                    r[i] = _mm256_setzero_si256();
                    continue;
                }
                __m128i v = _mm_loadu_si128((const __m128i *)(q + (j0 + c0 + i) * row_bytes +
                                                               b * (BLOCK / 2)));
                r[i] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), nib);
            }
            transpose8_epi32(r);
            for (int i = 0; i < 8; i++)
                _mm256_storeu_si256((__m256i *)(panel + ((b * 8 + i) * PANEL_NB + c0) * 4), r[i]);
        }
    for (int64_t g = 0; g < groups; g++)
        for (int c = 0; c < PANEL_NB; c++) {
            float scale = c < cols ? scales[(j0 + c) * groups + g] : 0.0f;
            sg[g * PANEL_NB + c] = scale;
            szg[g * PANEL_NB + c] = c < cols ? scale * (float)zeros[(j0 + c) * groups + g] : 0.0f;
        }
}

/* Rows r < rows (a constant after inlining) of one panel: out[r * ldy + c] for c < cols. */
static inline __attribute__((always_inline)) void int4_panel_rows(
    const uint8_t *panel, int64_t quads, int64_t group_quads, int64_t groups, const float *sg,
    const float *szg, const int8_t *xq, int64_t ldxq, const float *sx, const float *xqsum,
    int rows, const float *bias, int cols, float *out, int64_t ldy) {
    vf acc[PANEL_R][PANEL_C];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < PANEL_C; c++) acc[r][c] = vzero();
    for (int64_t g = 0; g < groups; g++) {
        vi sums[PANEL_R][PANEL_C];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < PANEL_C; c++) sums[r][c] = vi_zero();
        int64_t t1 = (g + 1) * group_quads < quads ? (g + 1) * group_quads : quads;
        for (int64_t t = g * group_quads; t < t1; t++) {
            vi w[PANEL_C];
            for (int c = 0; c < PANEL_C; c++)
                w[c] = vi_load(panel + (t * PANEL_NB + c * PANEL_LANES) * 4);
            for (int r = 0; r < rows; r++) {
                vi xb = panel_bcast(xq + r * ldxq + 4 * t);
                for (int c = 0; c < PANEL_C; c++) sums[r][c] = vi_dot(sums[r][c], w[c], xb);
            }
        }
        for (int r = 0; r < rows; r++) {
            vf a = vset1(sx[r * groups + g]), z = vset1(xqsum[r * groups + g]);
            for (int c = 0; c < PANEL_C; c++) {
                vf s = vload(sg + g * PANEL_NB + c * PANEL_LANES);
                vf sz = vload(szg + g * PANEL_NB + c * PANEL_LANES);
                acc[r][c] = vfnma(sz, z, vfma(vf_int(sums[r][c]), s * a, acc[r][c]));
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float lanes[PANEL_NB];
        for (int c = 0; c < PANEL_C; c++) vstore(lanes + c * PANEL_LANES, acc[r][c]);
        for (int c = 0; c < cols; c++) out[r * ldy + c] = lanes[c] + (bias ? bias[c] : 0.0f);
    }
}

static int int4_panel_matmul(const int8_t *xq, int64_t ldxq, int64_t m, const uint8_t *q,
                             int64_t row_bytes, int64_t blocks, const float *scales,
                             const uint8_t *zeros, int64_t group, int64_t groups,
                             const float *sx, const float *xqsum, const float *bias, float *y,
                             int64_t n, int num_threads) {
    int64_t quads = blocks * (BLOCK / 4), panels = (n + PANEL_NB - 1) / PANEL_NB;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (m * n * blocks * BLOCK >= PARALLEL_MACS)
    {
        size_t panel_bytes = (size_t)(quads * PANEL_NB * 4), scale_floats = (size_t)(groups * PANEL_NB);
        uint8_t *scratch = malloc(panel_bytes + 2 * scale_floats * sizeof(float) + 64);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            float *sg = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63), *szg = sg + scale_floats;
            uint8_t *panel = (uint8_t *)(szg + scale_floats);
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                int64_t j0 = p * PANEL_NB;
                int cols = n - j0 < PANEL_NB ? (int)(n - j0) : PANEL_NB;
                int4_panel(q, row_bytes, blocks, j0, cols, scales, zeros, groups, panel, sg, szg);
                const float *b = bias ? bias + j0 : NULL;
                int64_t r = 0;
                for (; r + PANEL_R <= m; r += PANEL_R)
                    int4_panel_rows(panel, quads, group / 4, groups, sg, szg, xq + r * ldxq, ldxq,
                                    sx + r * groups, xqsum + r * groups, PANEL_R, b, cols,
                                    y + r * n + j0, n);
                for (; r < m; r++)
                    int4_panel_rows(panel, quads, group / 4, groups, sg, szg, xq + r * ldxq, ldxq,
                                    sx + r * groups, xqsum + r * groups, 1, b, cols,
                                    y + r * n + j0, n);
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
#endif
