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
 * can sum u over its ranks in between. Activations and sums are float32; the weights are
 * float32 (_f32) or bfloat16 widened exactly on load (_bf16: half the bytes, which is
 * what a decode step with many adapters waits for).
 *
 * Rows arrive sorted by slot, so the work is done in tiles of up to TILE consecutive rows
 * of one slot: each weight row loaded is used for every row of the tile, and the tile's
 * dot products are independent accumulators (a single one would wait on its own add
 * latency); the expand adds one weight row at a time across the whole slice, so each
 * weight row streams from memory in one run (CHUNK only bounds slices wider than any
 * model's: 512-column chunks measured 12% slower, the rows' streams broken up). OpenMP
 * splits the tiles. Every row's sums are the same chain of explicit fmaf whatever its
 * tile (no other contraction: -ffp-contract=off), so a row's result does not depend on
 * the batch around it. Both return 0, or -1 when the tile list cannot be allocated. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 4
#define CHUNK 8192 /* output columns per pass */

static inline float load_f32(const float *w, int64_t i) { return w[i]; }

static inline float load_bf16(const uint16_t *w, int64_t i) {
    union {
        uint32_t u;
        float f;
    } v = {.u = (uint32_t)w[i] << 16};
    return v.f;
}

/* [start, end) of the tile that begins at row t: up to TILE rows of slot slots[t]. */
static inline int64_t tile_end(const int64_t *slots, int64_t t, int64_t tokens) {
    int64_t end = t + 1;
    while (end < tokens && end - t < TILE && slots[end] == slots[t]) end++;
    return end;
}

/* Tile starts (a tile never crosses a change of slot), then ``tokens``; returns how many. */
static int64_t tiles_of(const int64_t *slots, int64_t tokens, int64_t *starts) {
    int64_t n = 0;
    for (int64_t t = 0; t < tokens; t = tile_end(slots, t, tokens)) starts[n++] = t;
    starts[n] = tokens;
    return n;
}

/* One weight row against the tile's rows: NROWS independent fused multiply-adds per
 * weight (explicit fmaf: every row's sum is the same chain whatever its tile). */
#define DOT_ROWS(NROWS, WT, LOAD)                                                              \
    do {                                                                                      \
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;                                     \
        if (NROWS == 1) {                                                                     \
            _Pragma("omp simd reduction(+ : s0)") for (int64_t i = 0; i < in; i++)            \
                s0 = fmaf(LOAD(w, i), x0[i], s0);                                             \
        } else if (NROWS == 2) {                                                              \
            _Pragma("omp simd reduction(+ : s0, s1)") for (int64_t i = 0; i < in; i++) {      \
                const float wi = LOAD(w, i);                                                  \
                s0 = fmaf(wi, x0[i], s0);                                                     \
                s1 = fmaf(wi, x1[i], s1);                                                     \
            }                                                                                 \
        } else {                                                                              \
            _Pragma("omp simd reduction(+ : s0, s1, s2, s3)") for (int64_t i = 0; i < in;     \
                                                                   i++) {                     \
                const float wi = LOAD(w, i);                                                  \
                s0 = fmaf(wi, x0[i], s0);                                                     \
                s1 = fmaf(wi, x1[i], s1);                                                     \
                s2 = fmaf(wi, x2[i], s2);                                                     \
                s3 = fmaf(wi, x3[i], s3);                                                     \
            }                                                                                 \
        }                                                                                     \
        sums[0] = s0, sums[1] = s1, sums[2] = s2, sums[3] = s3;                               \
    } while (0)

#define LORA_KERNELS(SUFFIX, WT, LOAD)                                                        \
    static void shrink_tile_##SUFFIX(const float *x, int64_t xs, float *u, int64_t width,     \
                                     const WT *a, int64_t in, int64_t t0, int64_t n,          \
                                     int32_t rank, int64_t num_slices, int64_t max_rank) {    \
        const float *x0 = x + t0 * xs, *x1 = x0 + (n > 1) * xs, *x2 = x0 + (n > 2) * 2 * xs,  \
                    *x3 = x0 + (n > 3) * 3 * xs;                                              \
        float sums[TILE];                                                                     \
        for (int64_t j = 0; j < num_slices; j++)                                              \
            for (int32_t r = 0; r < rank; r++) {                                              \
                const int64_t row = j * max_rank + r;                                         \
                const WT *w = a + row * in;                                                   \
                if (n == 1)                                                                   \
                    DOT_ROWS(1, WT, LOAD);                                                    \
                else if (n == 2)                                                              \
                    DOT_ROWS(2, WT, LOAD);                                                    \
                else                                                                          \
                    DOT_ROWS(4, WT, LOAD);                                                    \
                for (int64_t k = 0; k < n; k++) u[(t0 + k) * width + row] = sums[k];          \
            }                                                                                 \
    }                                                                                         \
                                                                                              \
    static void expand_tile_##SUFFIX(const float *u, int64_t width, float *y, int64_t ys,     \
                                     const WT *bt, int64_t out, const int64_t *offsets,       \
                                     int64_t t0, int64_t n, int32_t rank, int64_t num_slices, \
                                     int64_t max_rank) {                                      \
        float *y0 = y + t0 * ys, *y1 = y0 + (n > 1) * ys, *y2 = y0 + (n > 2) * 2 * ys,        \
              *y3 = y0 + (n > 3) * 3 * ys;                                                    \
        const float *u0 = u + t0 * width;                                                     \
        for (int64_t j = 0; j < num_slices; j++) {                                            \
            const int64_t lo = offsets[j], hi = offsets[j + 1], row0 = j * max_rank;          \
            for (int64_t c0 = lo; c0 < hi; c0 += CHUNK) {                                     \
                const int64_t c1 = c0 + CHUNK < hi ? c0 + CHUNK : hi;                         \
                for (int32_t r = 0; r < rank; r++) {                                          \
                    const WT *w = bt + (row0 + r) * out;                                      \
                    const int64_t col = row0 + r;                                             \
                    const float a0 = u0[col], a1 = n > 1 ? u0[width + col] : 0.0f,            \
                                a2 = n > 2 ? u0[2 * width + col] : 0.0f,                      \
                                a3 = n > 3 ? u0[3 * width + col] : 0.0f;                      \
                    if (n == TILE) {                                                          \
                        _Pragma("omp simd") for (int64_t o = c0; o < c1; o++) {               \
                            const float wo = LOAD(w, o);                                      \
                            y0[o] = fmaf(a0, wo, y0[o]);                                      \
                            y1[o] = fmaf(a1, wo, y1[o]);                                      \
                            y2[o] = fmaf(a2, wo, y2[o]);                                      \
                            y3[o] = fmaf(a3, wo, y3[o]);                                      \
                        }                                                                     \
                        continue;                                                             \
                    }                                                                         \
                    _Pragma("omp simd") for (int64_t o = c0; o < c1; o++) y0[o] =             \
                        fmaf(a0, LOAD(w, o), y0[o]);                                          \
                    if (n > 1) {                                                              \
                        _Pragma("omp simd") for (int64_t o = c0; o < c1; o++) y1[o] =         \
                            fmaf(a1, LOAD(w, o), y1[o]);                                      \
                    }                                                                         \
                    if (n > 2) {                                                              \
                        _Pragma("omp simd") for (int64_t o = c0; o < c1; o++) y2[o] =         \
                            fmaf(a2, LOAD(w, o), y2[o]);                                      \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    int tandem_lora_shrink_##SUFFIX(const float *x, int64_t x_stride, float *u,              \
                                     int64_t tokens, const int64_t *slots, const WT *a,       \
                                     const int32_t *ranks, int64_t num_slices,                \
                                     int64_t max_rank, int64_t in_features, int threads) {    \
        const int64_t width = num_slices * max_rank;                                          \
        memset(u, 0, sizeof(float) * tokens * width);                                         \
        int64_t *starts = malloc(sizeof(int64_t) * (tokens + 1));                             \
        if (starts == NULL) return -1;                                                        \
        const int64_t n_tiles = tiles_of(slots, tokens, starts);                              \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (n_tiles > 1)")   \
        for (int64_t k = 0; k < n_tiles; k++) {                                               \
            const int64_t t0 = starts[k], n = starts[k + 1] - t0, s = slots[t0];              \
            if (s < 0 || ranks[s] == 0) continue;                                             \
            shrink_tile_##SUFFIX(x, x_stride, u, width, a + s * width * in_features,          \
                                 in_features, t0, n, ranks[s], num_slices, max_rank);         \
        }                                                                                     \
        free(starts);                                                                         \
        return 0;                                                                             \
    }                                                                                         \
                                                                                              \
    int tandem_lora_expand_##SUFFIX(const float *u, float *y, int64_t y_stride,              \
                                     int64_t tokens, const int64_t *slots, const WT *bt,      \
                                     const int32_t *ranks, const int64_t *offsets,            \
                                     int64_t num_slices, int64_t max_rank,                    \
                                     int64_t out_features, int threads) {                     \
        const int64_t width = num_slices * max_rank;                                          \
        int64_t *starts = malloc(sizeof(int64_t) * (tokens + 1));                             \
        if (starts == NULL) return -1;                                                        \
        const int64_t n_tiles = tiles_of(slots, tokens, starts);                              \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (n_tiles > 1)")   \
        for (int64_t k = 0; k < n_tiles; k++) {                                               \
            const int64_t t0 = starts[k], n = starts[k + 1] - t0, s = slots[t0];              \
            if (s < 0 || ranks[s] == 0) continue;                                             \
            expand_tile_##SUFFIX(u, width, y, y_stride, bt + s * width * out_features,        \
                                 out_features, offsets, t0, n, ranks[s], num_slices,          \
                                 max_rank);                                                   \
        }                                                                                     \
        free(starts);                                                                         \
        return 0;                                                                             \
    }

LORA_KERNELS(f32, float, load_f32)
LORA_KERNELS(bf16, uint16_t, load_bf16)

const char *tandem_lora_isa(void) { return TANDEM_ISA; }
