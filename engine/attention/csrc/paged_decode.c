/* Paged decode attention for the CPU: one query token per sequence ("row").
 *
 * out[b, h, :] = softmax(scale * q[b, h, :] . K[b, lo:len, h / group, :]) @ V[b, lo:len, h / group, :]
 *
 * K/V rows are read straight from the paged cache through the sequence's block table
 * (no gather into a padded copy). Cache layout: [num_blocks, block_size, num_kv_heads,
 * width], one position's rows for all KV heads contiguous. GQA: query head h uses KV head
 * h / group (group = num_heads / num_kv_heads). With a sliding window only the last
 * `window` positions are read.
 *
 * With at least 4 rows per thread each thread takes a run of consecutive rows of about
 * equal total length; with fewer, (row, KV head) pairs are shared out OpenMP dynamic. For
 * each KV head the kernel streams the keys once for a tile of up to 4 query heads of the
 * group (one load or decode of a key feeds every head of the tile; four positions' dot
 * products share one reduction tree), takes the softmax, then streams the values with the
 * tile's output accumulators held in registers; rows are prefetched PREFETCH_ROWS ahead
 * (blocks lie anywhere in the pool). In a run of rows, a row's first KV head prefetches
 * every head's bytes of each position (the cache row), so its other heads find them in
 * cache, and while those heads compute, the next row of the run is asked for into L2 a few
 * lines per position (Ahead), so memory and arithmetic overlap. Measured (12 layers' caches
 * of 64 rows of 96-320 positions, 4 KV heads of 64, blocks laid out as the engine hands
 * them out): float32 20% less time with AVX-512 and 23% with AVX2 than without asking
 * ahead, int8 / fp8 7-8% with AVX-512; the 1-byte formats with AVX2 do not ask ahead (bound
 * by their conversions, it cost them ~10%).
 * Sizes that matter (head_dim / VL chunks, the tile's head count, the cache format) are
 * compile-time constants of specialised copies of one inlined body; other head dims take
 * the same body with run-time counts and a scalar tail.
 *
 * Cost (AVX-512 on Zen 4, one thread, 12 query / 4 KV heads of 64): about 12 ns per
 * position and KV head when the rows are in cache, near the FMA roof (24 512-bit FMAs
 * for 3 heads); int8 costs the same, fp8 ~1.5x. A float32 cache larger than the L3 is
 * bound by memory bandwidth instead, where the 1-byte formats read ~3.8x fewer bytes.
 *
 * Cache formats (engine/attention/kv_quant.py): float32, or one byte per element with the
 * row's float32 scale after its head_dim codes ([..., head_dim + 4] uint8). int8 codes are
 * converted in registers (vpmovsxbd + vcvtdq2ps on AVX-512); fp8 e4m3 codes are turned into
 * float16 bits and converted by the CPU (fp8_chunk; float32 bit manipulation where there
 * is no F16C): torch's float8_e4m3fn values exactly, NaN included, up to a power of two
 * folded into the scale. The key scale is folded into the score, the value scale into the
 * softmax weight.
 *
 * The library is built once per instruction set (engine/attention/native.py): VL floats
 * per GCC generic vector, 16 with AVX-512, 8 with AVX2, 4 otherwise.
 */
#include <float.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VL 16
#define ISA_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
#define ISA_NAME "avx2"
#else
#define VL 4
#define ISA_NAME "portable"
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

/* VL bytes sign-extended to 32-bit lanes (GCC 12 scalarises __builtin_convertvector
 * between lane widths, so the x86 builds say it with intrinsics). */
static inline vi widen_signed(const void *p) {
#if VL == 16
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif VL == 8
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    const int8_t *b = p;
    return (vi){b[0], b[1], b[2], b[3]};
#endif
}

enum { KIND_F32 = 0, KIND_I8 = 1, KIND_FP8 = 2 };

static inline vf vsplat(float a) { return a - (vf){0}; }

static inline float vsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* The lane sums of a, b, c, d into s[0..3]: a transposing reduction tree, about a third
 * of the instructions of four vsum calls. */
static inline void vsum4(vf a, vf b, vf c, vf d, float *s) {
#if VL == 16
    const vi lo = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi hi = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vf ab = __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
    const vf cd = __builtin_shuffle(c, d, lo) + __builtin_shuffle(c, d, hi);
    const vi lo2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const vi hi2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    vf x = __builtin_shuffle(ab, cd, lo2) + __builtin_shuffle(ab, cd, hi2); /* a c b d */
    x += __builtin_shuffle(x, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    x += __builtin_shuffle(x, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    s[0] = x[0], s[1] = x[8], s[2] = x[4], s[3] = x[12];
#elif VL == 8
    const vi lo = {0, 1, 2, 3, 8, 9, 10, 11}, hi = {4, 5, 6, 7, 12, 13, 14, 15};
    const vf ab = __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
    const vf cd = __builtin_shuffle(c, d, lo) + __builtin_shuffle(c, d, hi);
    const vi lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    vf x = __builtin_shuffle(ab, cd, lo2) + __builtin_shuffle(ab, cd, hi2); /* a c b d */
    x += __builtin_shuffle(x, (vi){1, 0, 3, 2, 5, 4, 7, 6});
    s[0] = x[0], s[1] = x[4], s[2] = x[2], s[3] = x[6];
#else
    const vi lo = {0, 1, 4, 5}, hi = {2, 3, 6, 7};
    const vf ab = __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
    const vf cd = __builtin_shuffle(c, d, lo) + __builtin_shuffle(c, d, hi);
    const vf x = __builtin_shuffle(ab, cd, (vi){0, 2, 4, 6}) + __builtin_shuffle(ab, cd, (vi){1, 3, 5, 7});
    s[0] = x[0], s[1] = x[1], s[2] = x[2], s[3] = x[3];
#endif
}

/* e4m3fn code bytes (zero-extended to 32 bits) -> float32 bits. */
static inline vu fp8_bits(vu x) {
    const vu mag = x & 0x7F;
    const vu normal = (mag << 20) + (120u << 23);            /* exponent bias 7 -> 127 */
    const vf sub = __builtin_convertvector((vi)mag, vf) * 0x1p-9f; /* m * 2^-9, exact */
    const vu is_sub = (vu)(mag < 8), is_nan = (vu)(mag == 0x7F);
    vu bits = (normal & ~is_sub) | ((vu)sub & is_sub);
    bits = (bits & ~is_nan) | (0x7FC00000u & is_nan);
    return bits | ((x & 0x80) << 24);
}

static inline float fp8_value(uint8_t code) {
    const uint32_t mag = code & 0x7F;
    uint32_t bits;
    if (mag == 0x7F) {
        bits = 0x7FC00000u;
    } else if (mag < 8) {
        const float sub = (float)mag * 0x1p-9f;
        memcpy(&bits, &sub, sizeof bits);
    } else {
        bits = (mag << 20) + (120u << 23);
    }
    bits |= (uint32_t)(code & 0x80) << 24;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* e4m3 codes decode through float16 where the CPU converts it (F16C, in every AVX2 and
 * AVX-512 CPU): the code's exponent and mantissa shifted left by 7 are a float16 with the
 * same mantissa and an exponent bias 8 too large (15, not 7), subnormals included, so
 * vcvtph2ps gives value / 2^8, and FP8_UNIT = 2^8 is folded into the row's scale. The
 * sign comes from sign-extending the byte to 16 bits (bit 15; bit 14 masked off). Codes
 * 0x7F / 0xFF are NaN in e4m3fn (the quantizer never writes them): made float16 NaNs. */
#if (VL == 16 || VL == 8) && defined(__F16C__)
#define FP8_UNIT 256.0f
typedef int16_t vh __attribute__((vector_size(VL * 2)));
static inline vf fp8_chunk(const void *p) {
#if VL == 16
    const vh codes = (vh)_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
#else
    const vh codes = (vh)_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
#endif
    vh bits = (codes << 7) & (short)0xBF80;
    bits |= ((bits & 0x7F80) == 0x3F80) & 0x7E00; /* NaN codes: exponent all ones */
#if VL == 16
    return (vf)_mm512_cvtph_ps((__m256i)bits);
#else
    return (vf)_mm256_cvtph_ps((__m128i)bits);
#endif
}
#else
#define FP8_UNIT 1.0f
static inline vf fp8_chunk(const void *p) {
    const uint8_t *b = p;
    vu codes;
    for (int i = 0; i < VL; i++) codes[i] = b[i];
    return (vf)fp8_bits(codes);
}
#endif

const char *tandem_paged_decode_isa(void) { return ISA_NAME; }

/* VL elements of a row at element index `d`, as floats. */
static inline vf load_chunk(int kind, const void *row, int64_t d) {
    if (kind == KIND_F32) {
        vf v;
        memcpy(&v, (const float *)row + d, sizeof v);
        return v;
    }
    if (kind == KIND_I8) return __builtin_convertvector(widen_signed((const int8_t *)row + d), vf);
    return fp8_chunk((const uint8_t *)row + d); /* value / FP8_UNIT */
}

static inline float load_one(int kind, const void *row, int64_t d) {
    if (kind == KIND_F32) return ((const float *)row)[d];
    if (kind == KIND_I8) return (float)((const int8_t *)row)[d];
    return fp8_value(((const uint8_t *)row)[d]) / FP8_UNIT; /* as load_chunk's */
}

/* The row's scale: 1 for float32, else the float32 after its codes (unaligned), times
 * FP8_UNIT for fp8 (see load_chunk). */
static inline float row_scale(int kind, const uint8_t *row, int64_t head_dim) {
    if (kind == KIND_F32) return 1.0f;
    float s;
    memcpy(&s, row + head_dim, sizeof s);
    return kind == KIND_FP8 ? s * FP8_UNIT : s;
}

/* ---------------------------------------------------------------------------------------
 * One tile: T query heads of one KV head's group, one row.
 */

#define MAX_TILE 4
#define MAX_CHUNKS 64 /* head_dim up to 64 * VL through the vector path */
#define INLINE static inline __attribute__((always_inline))

typedef struct {
    const float *q;       /* the tile's first query head; heads head_dim apart */
    const uint8_t *k, *v; /* this KV head's row at cache offset 0 (byte address) */
    const int64_t *offs;  /* byte offset of each visible position's row, n of them */
    int64_t n, head_dim;
    int64_t prefetch; /* bytes of each row to ask for ahead of use */
    float scale;
    float *scores; /* scratch, [MAX_TILE][n] */
    float *out;    /* the tile's first output head */
    struct Ahead *ahead; /* the next row's bytes to ask for meanwhile, or NULL */
} Tile;

/* The next row of a thread's run, asked for (into L2) a few cache lines per position while
 * the current row's later KV heads are computed from cache: its keys' cache rows, then its
 * values'. */
typedef struct Ahead {
    const uint8_t *base[2]; /* key and value cache at offset 0 */
    const int64_t *offs;    /* the next row's row offsets, n of them */
    int64_t n, row_bytes;
    int64_t half, pos, byte; /* cursor: which cache, position, byte within the row */
    int64_t per_step;        /* lines per pump */
} Ahead;

/* Asks for the next `per_step` lines of `a`; prefetcht1 (into L2: prefetcht0 measured
 * slower, it pushes the current row out of L1). */
INLINE void pump(Ahead *a) {
    if (a == NULL) return;
    for (int64_t j = 0; j < a->per_step && a->half < 2; j++) {
        __builtin_prefetch(a->base[a->half] + a->offs[a->pos] + a->byte, 0, 2);
        a->byte += 64;
        if (a->byte >= a->row_bytes) {
            a->byte = 0;
            if (++a->pos == a->n) a->pos = 0, a->half++;
        }
    }
}

#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 16
#endif

/* Asks for row `i`'s bytes ahead of use: rows are a row stride apart and blocks anywhere
 * in the pool, which the hardware prefetchers follow only partly. */
INLINE void prefetch_row(const uint8_t *base, const int64_t *offs, int64_t i, int64_t n,
                         int64_t bytes) {
    if (PREFETCH_ROWS == 0 || i >= n) return;
    const uint8_t *p = base + offs[i];
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

/* scores[h][i] = scale * k_scale[i] * q[h] . K[i] for the tile's T heads: four positions
 * at a time, their dot products' lane sums reduced together (vsum4). */
INLINE void tile_scores(const int kind, const int64_t nch, const int64_t T, const Tile *t,
                        const int64_t hd) {
    const int64_t n = t->n;
    int64_t i = 0;
    for (; nch > 0 && hd == nch * VL && i + 4 <= n; i += 4) {
        vf acc[MAX_TILE][4];
        float ks[4];
#pragma GCC unroll 4
        for (int64_t p = 0; p < 4; p++) {
            const uint8_t *k = t->k + t->offs[i + p];
            prefetch_row(t->k, t->offs, i + p + PREFETCH_ROWS, n, t->prefetch);
            pump(t->ahead);
            vf kv[MAX_CHUNKS];
#pragma GCC unroll 16
            for (int64_t c = 0; c < nch; c++) kv[c] = load_chunk(kind, k, c * VL);
            ks[p] = t->scale * row_scale(kind, k, hd);
#pragma GCC unroll 4
            for (int64_t h = 0; h < T; h++) {
                const float *qh = t->q + h * hd;
                acc[h][p] = (vf){0};
#pragma GCC unroll 16
                for (int64_t c = 0; c < nch; c++)
                    acc[h][p] += load_chunk(KIND_F32, qh, c * VL) * kv[c];
            }
        }
#pragma GCC unroll 4
        for (int64_t h = 0; h < T; h++) {
            float s[4];
            vsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3], s);
            for (int64_t p = 0; p < 4; p++) t->scores[h * n + i + p] = ks[p] * s[p];
        }
    }
    for (; i < n; i++) {
        const uint8_t *k = t->k + t->offs[i];
        prefetch_row(t->k, t->offs, i + PREFETCH_ROWS, n, t->prefetch);
        pump(t->ahead);
        vf kv[MAX_CHUNKS];
#pragma GCC unroll 16
        for (int64_t c = 0; c < nch; c++) kv[c] = load_chunk(kind, k, c * VL);
        const float ks = t->scale * row_scale(kind, k, hd);
#pragma GCC unroll 4
        for (int64_t h = 0; h < T; h++) {
            const float *qh = t->q + h * hd;
            vf acc = {0};
#pragma GCC unroll 16
            for (int64_t c = 0; c < nch; c++) acc += load_chunk(KIND_F32, qh, c * VL) * kv[c];
            float s = vsum(acc);
            for (int64_t d = nch * VL; d < hd; d++) s += qh[d] * load_one(kind, k, d);
            t->scores[h * n + i] = ks * s;
        }
    }
}

/* In place: scores[h] become exp(s - max); returns their sum. */
static float softmax_numerators(float *s, int64_t n) {
    float max = s[0];
    for (int64_t i = 1; i < n; i++) max = s[i] > max ? s[i] : max;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) {
        s[i] = expf(s[i] - max);
        sum += s[i];
    }
    return sum;
}

/* out[h] = sum_i p[h][i] * v_scale[i] * V[i] / totals[h], accumulators in registers. */
INLINE void tile_values(const int kind, const int64_t nch, const int64_t T, const Tile *t,
                        const int64_t hd, const float *inv_totals) {
    const int64_t n = t->n, tail = hd - nch * VL;
    vf acc[MAX_TILE][MAX_CHUNKS];
    float tail_acc[MAX_TILE][VL];
#pragma GCC unroll 4
    for (int64_t h = 0; h < T; h++) {
#pragma GCC unroll 16
        for (int64_t c = 0; c < nch; c++) acc[h][c] = (vf){0};
        for (int64_t d = 0; d < tail; d++) tail_acc[h][d] = 0.0f;
    }
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *v = t->v + t->offs[i];
        prefetch_row(t->v, t->offs, i + PREFETCH_ROWS, n, t->prefetch);
        pump(t->ahead);
        vf vv[MAX_CHUNKS];
#pragma GCC unroll 16
        for (int64_t c = 0; c < nch; c++) vv[c] = load_chunk(kind, v, c * VL);
        const float vs = row_scale(kind, v, hd);
#pragma GCC unroll 4
        for (int64_t h = 0; h < T; h++) {
            const float p = vs * t->scores[h * n + i];
            const vf pv = vsplat(p);
#pragma GCC unroll 16
            for (int64_t c = 0; c < nch; c++) acc[h][c] += pv * vv[c];
            for (int64_t d = 0; d < tail; d++) tail_acc[h][d] += p * load_one(kind, v, nch * VL + d);
        }
    }
#pragma GCC unroll 4
    for (int64_t h = 0; h < T; h++) {
        float *o = t->out + h * hd;
        const vf inv = vsplat(inv_totals[h]);
#pragma GCC unroll 16
        for (int64_t c = 0; c < nch; c++) {
            const vf r = acc[h][c] * inv;
            memcpy(o + c * VL, &r, sizeof r);
        }
        for (int64_t d = 0; d < tail; d++) o[nch * VL + d] = tail_acc[h][d] * inv_totals[h];
    }
}

/* `nch` and `hd` are compile-time constants in the specialised copies (hd == nch * VL). */
INLINE void attend_tile(const int kind, const int64_t nch, const int64_t T, const Tile *t,
                        const int64_t hd) {
    float inv_totals[MAX_TILE];
    tile_scores(kind, nch, T, t, hd);
    for (int64_t h = 0; h < T; h++)
        inv_totals[h] = 1.0f / softmax_numerators(t->scores + h * t->n, t->n);
    tile_values(kind, nch, T, t, hd, inv_totals);
}

/* All `group` heads of one KV head, in tiles of up to `max_tile`. */
INLINE void attend_group(const int kind, const int64_t nch, const int64_t hd,
                         const int64_t max_tile, Tile t, int64_t group) {
    for (int64_t h0 = 0; h0 < group; h0 += max_tile) {
        const int64_t left = group - h0;
        if (left >= 4 && max_tile >= 4) attend_tile(kind, nch, 4, &t, hd);
        else if (left == 3 && max_tile >= 3) attend_tile(kind, nch, 3, &t, hd);
        else if (left >= 2 && max_tile >= 2) attend_tile(kind, nch, 2, &t, hd);
        else attend_tile(kind, nch, 1, &t, hd);
        const int64_t done = left < max_tile ? left : max_tile;
        t.q += done * hd;
        t.out += done * hd;
    }
}

/* ---------------------------------------------------------------------------------------
 * Specialised copies: (format, head_dim / VL) compile-time where head_dim is 2, 4 or 8
 * vectors; any other head_dim runs the same body with run-time counts (accumulators in
 * memory: at head_dim 128 with AVX2 float32 costs ~1.1x the previous kernel, int8 / fp8
 * 0.6-0.8x; a 16-vector copy would win ~30% but takes ~30 s to compile). Tiles of up to
 * 4 heads: at 8 vectors per row the accumulators spill a little (with AVX2's 16
 * registers, at 4 too), which still beats re-reading the rows for a second tile
 * (measured: 2-head tiles cost 1.2-1.5x at head_dim 128 on AVX-512).
 */

typedef void (*GroupFn)(Tile t, int64_t group);

#define DEFINE_GROUP(kind, name, nch, max_tile)                                             \
    static void group_##name##_##nch(Tile t, int64_t group) {                               \
        attend_group(kind, nch, (nch) * VL, max_tile, t, group);                                        \
    }
#define DEFINE_GROUPS(kind, name)                                                           \
    DEFINE_GROUP(kind, name, 2, 4)                                                          \
    DEFINE_GROUP(kind, name, 4, 4)                                                          \
    DEFINE_GROUP(kind, name, 8, 4)                                                          \
    static void group_##name##_any(Tile t, int64_t group) {                                 \
        attend_group(kind, t.head_dim / VL, t.head_dim, 4, t, group);                                   \
    }                                                                                       \
    static GroupFn group_fn_##name(int64_t head_dim) {                                      \
        if (head_dim == 2 * VL) return group_##name##_2;                                    \
        if (head_dim == 4 * VL) return group_##name##_4;                                    \
        if (head_dim == 8 * VL) return group_##name##_8;                                    \
        return group_##name##_any;                                                          \
    }
DEFINE_GROUPS(KIND_F32, f32)
DEFINE_GROUPS(KIND_I8, i8)
DEFINE_GROUPS(KIND_FP8, fp8)

static GroupFn group_fn(int kind, int64_t head_dim) {
    if (kind == KIND_I8) return group_fn_i8(head_dim);
    if (kind == KIND_FP8) return group_fn_fp8(head_dim);
    return group_fn_f32(head_dim);
}

/* offs[i] = byte offset of position lo + i's row; returns the count. */
static int64_t row_offsets(const int64_t *table, int64_t lo, int64_t len, int64_t block_size,
                           int64_t row_bytes, int64_t *offs) {
    int64_t i = 0;
    for (int64_t pos = lo; pos < len;) {
        const int64_t base = table[pos / block_size] * block_size;
        for (int64_t off = pos % block_size; off < block_size && pos < len; off++, pos++)
            offs[i++] = (base + off) * row_bytes;
    }
    return i;
}

static int64_t width_bytes(int kind, int64_t head_dim) {
    return kind == KIND_F32 ? 4 * head_dim : head_dim + 4;
}

static int64_t visible_start(int64_t len, int64_t window) {
    return (window > 0 && len > window) ? len - window : 0;
}

/* What every task of one call shares. */
typedef struct {
    const float *q;
    const uint8_t *k_cache, *v_cache;
    const int64_t *block_table, *seq_lens;
    float *out;
    int64_t num_heads, num_kv_heads, group, head_dim, width, row_bytes;
    int64_t block_size, max_blocks, window;
    float scale;
    GroupFn fn;
} Call;

/* offs[i] = byte offset of row b's visible position i; returns their count. */
static int64_t offsets_of(const Call *c, int64_t b, int64_t *offs) {
    const int64_t len = c->seq_lens[b];
    return row_offsets(c->block_table + b * c->max_blocks, visible_start(len, c->window), len,
                       c->block_size, c->row_bytes, offs);
}

/* KV head g of row b, whose n visible positions' offsets are `offs`. */
static void attend(const Call *c, int64_t b, int64_t g, const int64_t *offs, int64_t n,
                   int64_t prefetch, float *scores, Ahead *ahead) {
    const Tile t = {
        .q = c->q + (b * c->num_heads + g * c->group) * c->head_dim,
        .k = c->k_cache + g * c->width,
        .v = c->v_cache + g * c->width,
        .offs = offs,
        .n = n,
        .head_dim = c->head_dim,
        .prefetch = prefetch,
        .scale = c->scale,
        .scores = scores,
        .out = c->out + (b * c->num_heads + g * c->group) * c->head_dim,
        .ahead = ahead,
    };
    c->fn(t, c->group);
}

/* How many positions row b attends to. */
static int64_t visible_len(const Call *c, int64_t b) {
    return c->seq_lens[b] - visible_start(c->seq_lens[b], c->window);
}

/* The rows [lo, hi) whose middle, in visible positions, falls in thread `tid`'s share. */
static void thread_rows(const Call *c, int64_t num_seqs, int64_t total, int64_t tid, int64_t nt,
                        int64_t *lo, int64_t *hi) {
    *lo = *hi = num_seqs;
    int64_t before = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t len = visible_len(c, b);
        const int64_t owner = total > 0 ? (2 * before + len) * nt / (2 * total) : b * nt / num_seqs;
        if (owner == tid && *lo == num_seqs) *lo = b;
        if (owner > tid) {
            *hi = b;
            return;
        }
        before += len;
    }
}

/* Rows [lo, hi) one after another, each one's next asked for meanwhile when `ask_ahead`. */
static void attend_run(const Call *c, int64_t lo, int64_t hi, int ask_ahead, float *scores,
                       int64_t *offs, int64_t *next_offs) {
    int64_t n = lo < hi ? offsets_of(c, lo, offs) : 0;
    for (int64_t b = lo; b < hi; b++) {
        Ahead ahead = {.base = {c->k_cache, c->v_cache}, .offs = next_offs, .row_bytes = c->row_bytes};
        const int has_next = ask_ahead && b + 1 < hi && c->num_kv_heads > 1;
        if (has_next) {
            ahead.n = offsets_of(c, b + 1, next_offs);
            const int64_t lines = 2 * ahead.n * ((c->row_bytes + 63) / 64);
            const int64_t steps = 2 * (c->num_kv_heads - 1) * (n > 0 ? n : 1);
            ahead.per_step = (lines + steps - 1) / steps;
        }
        /* Rows of one prefill chunk read the same blocks: nothing to ask for. */
        const int ask = has_next && ahead.n > 0 && !(n > 0 && next_offs[0] == offs[0]);
        for (int64_t g = 0; g < c->num_kv_heads && n > 0; g++)
            attend(c, b, g, offs, n, g == 0 ? c->row_bytes : c->width, scores,
                   ask && g > 0 ? &ahead : NULL);
        if (has_next) {
            int64_t *swap = offs;
            offs = next_offs, next_offs = swap, n = ahead.n;
        } else if (b + 1 < hi) {
            n = offsets_of(c, b + 1, offs);
        }
    }
}

/* The largest head_dim the kernels take: a row's vectors live in MAX_CHUNKS-long arrays. */
int64_t tandem_paged_decode_max_head_dim(void) { return (int64_t)MAX_CHUNKS * VL; }

static int paged_decode(int kind, const float *q, const void *k_cache, const void *v_cache,
                        const int64_t *block_table, const int64_t *seq_lens, float *out,
                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, int64_t max_blocks,
                        int64_t max_seq_len, float scale, int64_t window, int num_threads) {
    if (head_dim > tandem_paged_decode_max_head_dim()) return -2;
    const int64_t width = width_bytes(kind, head_dim);
    const Call c = {
        .q = q,
        .k_cache = k_cache,
        .v_cache = v_cache,
        .block_table = block_table,
        .seq_lens = seq_lens,
        .out = out,
        .num_heads = num_heads,
        .num_kv_heads = num_kv_heads,
        .group = num_heads / num_kv_heads,
        .head_dim = head_dim,
        .width = width,
        .row_bytes = num_kv_heads * width,
        .block_size = block_size,
        .max_blocks = max_blocks,
        .window = window,
        .scale = scale,
        .fn = group_fn(kind, head_dim),
    };
    const int64_t max_len = max_seq_len > 0 ? max_seq_len : 1;
    /* Runs of whole rows when there are enough rows to balance the threads, else (row, KV
     * head) tasks. The 1-byte formats with 8-lane AVX2 are bound by their conversions, not
     * by memory: asking ahead only adds instructions there (measured ~10% slower). */
    const int whole_rows = num_seqs >= 4 * num_threads;
    const int ask_ahead = kind == KIND_F32 || VL >= 16;
    int64_t total = 0;
    for (int64_t b = 0; whole_rows && b < num_seqs; b++) total += visible_len(&c, b);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * MAX_TILE * max_len);
        int64_t *offs = malloc(sizeof(int64_t) * max_len);
        int64_t *next_offs = malloc(sizeof(int64_t) * max_len);
        const int ready = scores != NULL && offs != NULL && next_offs != NULL;
        if (!ready) failed = 1;
        if (whole_rows) {
            int64_t lo, hi;
            thread_rows(&c, num_seqs, total, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
            if (ready) attend_run(&c, lo, hi, ask_ahead, scores, offs, next_offs);
        } else {
            int64_t offs_of = -1, n = 0; /* the row whose offsets `offs` holds */
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
                const int64_t b = task / num_kv_heads, g = task % num_kv_heads;
                if (!ready) continue;
                if (b != offs_of) n = offsets_of(&c, b, offs), offs_of = b;
                if (n > 0) attend(&c, b, g, offs, n, width, scores, NULL);
            }
        }
        free(scores);
        free(offs);
        free(next_offs);
    }
    return failed ? -1 : 0;
}

/* Returns 0, -1 when a work buffer could not be allocated, or -2 for a head_dim beyond
 * tandem_paged_decode_max_head_dim() (nothing written). */
int tandem_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                            const int64_t *block_table, const int64_t *seq_lens, float *out,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, int64_t max_blocks,
                            int64_t max_seq_len, float scale, int64_t window, int num_threads) {
    return paged_decode(KIND_F32, q, k_cache, v_cache, block_table, seq_lens, out, num_seqs,
                        num_heads, num_kv_heads, head_dim, block_size, max_blocks, max_seq_len,
                        scale, window, num_threads);
}

/* int8 codes; arguments as tandem_paged_decode_f32's, caches uint8 [..., head_dim + 4]. */
int tandem_paged_decode_i8(const float *q, const uint8_t *k_cache, const uint8_t *v_cache,
                           const int64_t *block_table, const int64_t *seq_lens, float *out,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t max_blocks,
                           int64_t max_seq_len, float scale, int64_t window, int num_threads) {
    return paged_decode(KIND_I8, q, k_cache, v_cache, block_table, seq_lens, out, num_seqs,
                        num_heads, num_kv_heads, head_dim, block_size, max_blocks, max_seq_len,
                        scale, window, num_threads);
}

/* fp8 e4m3 codes; arguments as tandem_paged_decode_i8's. */
int tandem_paged_decode_fp8(const float *q, const uint8_t *k_cache, const uint8_t *v_cache,
                            const int64_t *block_table, const int64_t *seq_lens, float *out,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, int64_t max_blocks,
                            int64_t max_seq_len, float scale, int64_t window, int num_threads) {
    return paged_decode(KIND_FP8, q, k_cache, v_cache, block_table, seq_lens, out, num_seqs,
                        num_heads, num_kv_heads, head_dim, block_size, max_blocks, max_seq_len,
                        scale, window, num_threads);
}

/* out[i] = the float32 value of e4m3 code codes[i] (the kernels' decoding, for tests). */
void tandem_fp8_decode(const uint8_t *codes, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        const vf v = load_chunk(KIND_FP8, codes, i) * FP8_UNIT;
        memcpy(out + i, &v, sizeof v);
    }
    for (; i < n; i++) out[i] = load_one(KIND_FP8, codes, i) * FP8_UNIT;
}

/* ---------------------------------------------------------------------------------------
 * The quantizing write: new keys and values into a quantized cache, one pass per
 * token-head row (absmax, scale, codes), bit for bit kv_quant.QuantizedKV.quantize:
 * scale = max(max|x| / max_code, FLT_MIN) and codes = round-half-even(x / scale) clamped to
 * [-127, 127] (int8), or x / scale clamped to [-448, 448] and rounded to the nearest e4m3
 * value, ties to even (fp8). Compiled without -ffast-math: the division must stay a
 * correctly rounded division, as torch's is, not a multiply by a reciprocal.
 */
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

static uint8_t fp8_code(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    const float a = fabsf(x);
    if (a != a) return sign | 0x7F;
    if (a < 0x1p-6f) return sign | (uint8_t)nearbyintf(a * 512.0f); /* subnormal steps of 2^-9 */
    bits &= 0x7FFFFFFFu;
    bits += 0x7FFFFu + ((bits >> 20) & 1); /* round the mantissa to 3 bits, ties to even */
    return sign | (uint8_t)((bits >> 20) - (120u << 3)); /* exponent bias 127 -> 7 */
}

static void quantize_row(int fp8, const float *x, int64_t head_dim, uint8_t *row) {
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int64_t d = 0; d < head_dim; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    float scale = amax / (fp8 ? 448.0f : 127.0f);
    if (!(scale >= FLT_MIN)) scale = FLT_MIN;
    if (fp8) {
        for (int64_t d = 0; d < head_dim; d++) {
            float y = x[d] / scale;
            y = y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y);
            row[d] = fp8_code(y);
        }
    } else {
        int8_t *codes = (int8_t *)row;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) {
            float y = nearbyintf(x[d] / scale);
            y = y > 127.0f ? 127.0f : (y < -127.0f ? -127.0f : y);
            codes[d] = (int8_t)y;
        }
    }
    memcpy(row + head_dim, &scale, sizeof scale);
}

/* k, v: [num_tokens, num_kv_heads, head_dim] float32, heads contiguous, tokens `k_stride` /
 * `v_stride` floats apart; token t goes to cache slot slots[t]. */
void tandem_kv_write_q8(int fp8, const float *k, const float *v, int64_t k_stride,
                        int64_t v_stride, const int64_t *slots, int64_t num_tokens,
                        int64_t num_kv_heads, int64_t head_dim, uint8_t *k_cache,
                        uint8_t *v_cache, int num_threads) {
    const int64_t width = head_dim + 4, rows = num_tokens * num_kv_heads;
#pragma omp parallel for num_threads(num_threads) if (rows * head_dim >= 65536) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r / num_kv_heads, g = r % num_kv_heads;
        const int64_t at = (slots[t] * num_kv_heads + g) * width;
        quantize_row(fp8, k + t * k_stride + g * head_dim, head_dim, k_cache + at);
        quantize_row(fp8, v + t * v_stride + g * head_dim, head_dim, v_cache + at);
    }
}

#pragma GCC pop_options
/* ---------------------------------------------------------------------------------------
 * A whole Llama-family forward for a few tokens, one token ("row") at a time, float32.
 *
 * For small models at small batch a step is mostly per-operator overhead (a dozen torch
 * calls per layer, each a few microseconds, around matrix products of a few microseconds),
 * so a draft model's step costs half the target's whatever its size. Here one call runs
 * every layer of every row: embedding, RMSNorm, fused QKV (+ bias), rotary (rotate-half
 * layout, cos/sin tables from the model), the row's K/V written to the paged cache and
 * attended causally through the block table (the float32 kernel above, one row), output
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

static float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

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
 * its block table, -5 for a head_dim beyond tandem_paged_decode_max_head_dim() (checked
 * before anything is written). */
int tandem_llama_rows_f32(const TandemModel *m, const TandemLayer *layers, int64_t num_rows,
                          const int64_t *tokens, const int64_t *positions,
                          const int64_t *tables, int64_t max_blocks, const int64_t *row_table,
                          const int64_t *logit_rows, float *logits, int num_threads) {
    const int64_t d = m->hidden, hd = m->head_dim, heads = m->num_heads, kvh = m->num_kv_heads;
    const int64_t q_size = heads * hd, kv_size = kvh * hd, inter = m->intermediate;
    int64_t max_len = 1;
    if (hd > tandem_paged_decode_max_head_dim()) return -5;
    for (int64_t r = 0; r < num_rows; r++) {
        if (positions[r] < 0 || positions[r] >= m->max_positions) return -2;
        if (tokens[r] < 0 || tokens[r] >= m->vocab) return -3;
        if (positions[r] / m->block_size >= max_blocks) return -4;
        if (positions[r] + 1 > max_len) max_len = positions[r] + 1;
    }
    float *h = malloc(sizeof(float) * d), *x = malloc(sizeof(float) * d);
    float *qkv = malloc(sizeof(float) * (q_size + 2 * kv_size));
    float *attn = malloc(sizeof(float) * q_size), *mlp = malloc(sizeof(float) * 2 * inter);
    float *scores = malloc(sizeof(float) * MAX_TILE * max_len);
    int64_t *offs = malloc(sizeof(int64_t) * max_len);
    const GroupFn attend = group_fn(KIND_F32, hd);
    int status = 0;
    if (!h || !x || !qkv || !attn || !mlp || !scores || !offs) status = -1;
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
            const int64_t slot = (table[pos / m->block_size] * m->block_size + pos % m->block_size) * kv_size;
            memcpy(L->k_cache + slot, qkv + q_size, sizeof(float) * kv_size);
            memcpy(L->v_cache + slot, qkv + q_size + kv_size, sizeof(float) * kv_size);
            const int64_t len = pos + 1;
            const int64_t lo = (L->window > 0 && len > L->window) ? len - L->window : 0;
            const int64_t n = row_offsets(table, lo, len, m->block_size, 4 * kv_size, offs);
            for (int64_t g = 0; g < kvh; g++) {
                const Tile t = {
                    .q = qkv + g * (heads / kvh) * hd,
                    .k = (const uint8_t *)(L->k_cache + g * hd),
                    .v = (const uint8_t *)(L->v_cache + g * hd),
                    .offs = offs,
                    .n = n,
                    .head_dim = hd,
                    .scale = m->scale,
                    .scores = scores,
                    .out = attn + g * (heads / kvh) * hd,
                };
                attend(t, heads / kvh);
            }
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
    free(h); free(x); free(qkv); free(attn); free(mlp); free(scores); free(offs);
    return status;
}
