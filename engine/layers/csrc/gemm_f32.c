/* Float32 GEMM over pre-packed weights, AVX2 + FMA (loaded by ../native_gemm.py).
 *
 *   y[m, n] = x[m, k] @ W[n, k]^T (+ bias)              tandem_gemm_f32
 *   y[m, n] = silu(x @ G^T) * (x @ U^T)                   tandem_gemm_gated_f32
 *
 * Weights are packed once, at load, into panels of 16 output columns: panel p holds
 * W[16p .. 16p + 15, :] transposed, k-major (16 consecutive floats per input channel), so
 * the kernel reads each panel front to back. The gated form packs 8 gate and the same 8 up
 * columns per panel, so one pass computes both and writes silu(g) * u straight away (no
 * [m, 2n] intermediate).
 *
 * The register tile is 6 rows x 16 columns: 12 accumulators, two weight vectors and one
 * broadcast input, 15 of the 16 ymm registers; per input channel 2 loads + 6 broadcasts
 * feed 12 FMAs. Loops, outermost first: row blocks of MC rows (their inputs stay in L2),
 * the thread's panels, KC-deep slices of a panel (16 KB, L1-resident while every 6-row tile
 * of the block passes over it), then the tiles. While a slice's tiles compute, the next
 * slice is requested into L2 a few lines per tile, so a decode step's weights (read once
 * per step, from memory) arrive ahead of the FMAs that need them. Partial sums of a tile
 * between slices live in a small per-thread buffer; the last slice applies the epilogue
 * (bias, or the SiLU product) and stores the valid columns only.
 *
 * Threads split the panels (each thread a contiguous range, so its weights are one
 * stream). Sums run in input-channel order per output, so a row's result does not depend
 * on how many rows are in the call or how the threads split them.
 *
 * Weights that are bfloat16 values (a bfloat16 checkpoint run in float32) may be packed
 * as such (tandem_gemm_pack_bf16, the same panel order, 2 bytes a value): the kernel
 * widens each to float32 exactly as it loads it (a 16-bit shift), so the products and
 * their order, and every result bit, are those of the float32 panels, from half the
 * bytes. The _bf16w entry points take such panels.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define NR 16  /* panel width: two ymm vectors */
#define MR 6   /* rows per register tile */
#define KC 256 /* panel slice depth: 16 KB of weights */
#define MC 192 /* rows per block (a multiple of MR): 192 x 256 x 4 = 192 KB of inputs */
#define LINE 64
#define PARALLEL_MIN (1 << 18) /* m * n * k below this runs on the calling thread */

enum { PLAIN = 0, GATED = 1 };

/* Packed size in floats of an [n, k] weight (n rounded up to whole panels). */
int64_t tandem_gemm_packed_floats(int64_t n, int64_t k) { return (n + NR - 1) / NR * NR * k; }

/* Packed size in floats of a gate + up pair of [n, k] weights (8 of each per panel). */
int64_t tandem_gemm_gated_packed_floats(int64_t n, int64_t k) {
    return (n + NR / 2 - 1) / (NR / 2) * NR * k;
}

/* packed[p][kk][c] = w[16p + c][kk]; columns past n are zero. T: float, or uint16_t for
 * bfloat16 weights (their raw patterns; the panel order is the same). */
#define PACK(name, T)                                                                      \
    void name(const T *w, int64_t n, int64_t k, T *packed) {                              \
        int64_t panels = (n + NR - 1) / NR;                                                \
        _Pragma("omp parallel for schedule(static)") for (int64_t p = 0; p < panels; p++)  \
            for (int c = 0; c < NR; c++) {                                                 \
                int64_t j = p * NR + c;                                                    \
                T *dst = packed + p * k * NR + c;                                          \
                for (int64_t kk = 0; kk < k; kk++) dst[kk * NR] = j < n ? w[j * k + kk] : 0; \
            }                                                                              \
    }
PACK(tandem_gemm_pack_f32, float)
PACK(tandem_gemm_pack_bf16, uint16_t)

/* packed[p][kk][c] = gate[8p + c][kk] for c < 8, up[8p + c - 8][kk] for c >= 8. */
#define PACK_GATED(name, T)                                                                \
    void name(const T *gate, const T *up, int64_t n, int64_t k, T *packed) {              \
        const int half = NR / 2;                                                           \
        int64_t panels = (n + half - 1) / half;                                            \
        _Pragma("omp parallel for schedule(static)") for (int64_t p = 0; p < panels; p++)  \
            for (int c = 0; c < NR; c++) {                                                 \
                int64_t j = p * half + c % half;                                           \
                const T *src = c < half ? gate : up;                                       \
                T *dst = packed + p * k * NR + c;                                          \
                for (int64_t kk = 0; kk < k; kk++) dst[kk * NR] = j < n ? src[j * k + kk] : 0; \
            }                                                                              \
    }
PACK_GATED(tandem_gemm_pack_gated_f32, float)
PACK_GATED(tandem_gemm_pack_gated_bf16, uint16_t)

/* Eight bfloat16 values widened to float32 (exact: the high half of each float). */
static inline __m256 widen8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* e^x for x in [-87, 88] (clamped), eight at a time: x = n ln2 + r, e^r by its Taylor
 * polynomial to r^7, times 2^n built in the exponent bits (about 1e-7 relative). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    static const float coef[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 7; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(coef[i]));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* silu(g) * u; below g = -87 silu(g) is 0 in float32 (e^g underflows), which the clamped
 * exp would not give (g / e^88 is not 0 for huge |g|); NaN gates stay NaN. */
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    __m256 denom = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)));
    __m256 silu = _mm256_div_ps(g, denom);
    silu = _mm256_andnot_ps(_mm256_cmp_ps(g, _mm256_set1_ps(-87.0f), _CMP_LT_OQ), silu);
    return _mm256_mul_ps(silu, u);
}

/* What the last slice of a tile does with its sums. */
typedef struct {
    float *y;          /* the tile's first output row, first column */
    int64_t ldy;       /* output row stride */
    int cols;          /* valid output columns of this panel: 1..16 (PLAIN), 1..8 (GATED) */
    const float *bias; /* PLAIN only: 16 floats (zero-padded) or NULL */
    int mode;
} Epilogue;

static inline void store_row(float *dst, __m256 lo, __m256 hi, const Epilogue *e) {
    if (e->mode == GATED) {
        __m256 v = silu_mul8(lo, hi);
        if (e->cols == NR / 2) {
            _mm256_storeu_ps(dst, v);
        } else {
            float tmp[NR / 2];
            _mm256_storeu_ps(tmp, v);
            memcpy(dst, tmp, (size_t)e->cols * sizeof(float));
        }
        return;
    }
    if (e->bias) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(e->bias));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(e->bias + 8));
    }
    if (e->cols == NR) {
        _mm256_storeu_ps(dst, lo);
        _mm256_storeu_ps(dst + 8, hi);
    } else {
        float tmp[NR];
        _mm256_storeu_ps(tmp, lo);
        _mm256_storeu_ps(tmp + 8, hi);
        memcpy(dst, tmp, (size_t)e->cols * sizeof(float));
    }
}

/* rows (compile-time 1..6 after inlining) x 16 over one slice of kc input channels.
 * partial: the tile's running sums (rows x 16), read unless first, written unless e.
 * Named accumulators, not arrays: GCC keeps an array of vectors in memory. */
#define EACH_ROW(X) X(0) X(1) X(2) X(3) X(4) X(5)
static inline __attribute__((always_inline)) void tile(const int rows, const int w16,
                                                       const float *a, int64_t lda,
                                                       const void *b, int64_t kc,
                                                       float *partial, int first,
                                                       const Epilogue *e) {
    const float *bf = (const float *)b;
    const uint16_t *bh = (const uint16_t *)b;
#define START(r)                                                                           \
    __m256 lo##r = _mm256_setzero_ps(), hi##r = _mm256_setzero_ps();                       \
    const float *a##r = a + (r < rows ? r : 0) * lda;                                      \
    if (r < rows && !first) {                                                              \
        lo##r = _mm256_load_ps(partial + r * NR);                                          \
        hi##r = _mm256_load_ps(partial + r * NR + 8);                                      \
    }
    EACH_ROW(START)
    for (int64_t kk = 0; kk < kc; kk++) {
        __m256 b0 = w16 ? widen8(bh + kk * NR) : _mm256_load_ps(bf + kk * NR);
        __m256 b1 = w16 ? widen8(bh + kk * NR + 8) : _mm256_load_ps(bf + kk * NR + 8);
#define STEP(r)                                                                            \
    if (r < rows) {                                                                        \
        __m256 av = _mm256_broadcast_ss(a##r + kk);                                        \
        lo##r = _mm256_fmadd_ps(av, b0, lo##r);                                            \
        hi##r = _mm256_fmadd_ps(av, b1, hi##r);                                            \
    }
        EACH_ROW(STEP)
    }
#define FINISH(r)                                                                          \
    if (r < rows) {                                                                        \
        if (e) {                                                                           \
            store_row(e->y + r * e->ldy, lo##r, hi##r, e);                                 \
        } else {                                                                           \
            _mm256_store_ps(partial + r * NR, lo##r);                                      \
            _mm256_store_ps(partial + r * NR + 8, hi##r);                                  \
        }                                                                                  \
    }
    EACH_ROW(FINISH)
#undef START
#undef STEP
#undef FINISH
}

#define ANY_TILE(name, w16)                                                                \
    static void name(int rows, const float *a, int64_t lda, const void *b, int64_t kc,    \
                     float *partial, int first, const Epilogue *e) {                      \
        switch (rows) {                                                                    \
        case 6: tile(6, w16, a, lda, b, kc, partial, first, e); break;                     \
        case 5: tile(5, w16, a, lda, b, kc, partial, first, e); break;                     \
        case 4: tile(4, w16, a, lda, b, kc, partial, first, e); break;                     \
        case 3: tile(3, w16, a, lda, b, kc, partial, first, e); break;                     \
        case 2: tile(2, w16, a, lda, b, kc, partial, first, e); break;                     \
        default: tile(1, w16, a, lda, b, kc, partial, first, e); break;                    \
        }                                                                                  \
    }
ANY_TILE(any_tile_f32, 0)
ANY_TILE(any_tile_bf16, 1)

/* One thread's panels [p0, p1) for every row. out_per_panel: output columns a panel
 * yields (16 PLAIN, 8 GATED); n: valid output columns in all. */
static void run_panels(const float *x, int64_t m, int64_t k, const void *packed, int64_t n,
                       const float *bias, float *y, int mode, int w16, int64_t p0,
                       int64_t p1) {
    const int64_t width = w16 ? 2 : 4; /* bytes a packed weight value */
    float partial[MC * NR] __attribute__((aligned(64)));
    float bias_pad[NR] __attribute__((aligned(64)));
    const int out_per_panel = mode == GATED ? NR / 2 : NR;
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
        int64_t mc = m - m0 < MC ? m - m0 : MC;
        int64_t tiles = (mc + MR - 1) / MR;
        for (int64_t p = p0; p < p1; p++) {
            int64_t col0 = p * out_per_panel;
            int cols = n - col0 < out_per_panel ? (int)(n - col0) : out_per_panel;
            const float *panel_bias = NULL;
            if (bias) {
                memset(bias_pad, 0, sizeof bias_pad);
                memcpy(bias_pad, bias + col0, (size_t)cols * sizeof(float));
                panel_bias = bias_pad;
            }
            for (int64_t k0 = 0; k0 < k; k0 += KC) {
                int64_t kc = k - k0 < KC ? k - k0 : KC;
                const char *b = (const char *)packed + (p * k + k0) * NR * width;
                /* the slice after this one (this panel's next, else the next panel's first;
                 * contiguous either way), nothing past this thread's last panel */
                int64_t next_kc = k0 + kc < k ? k - k0 - kc : p + 1 < p1 ? k : 0;
                if (next_kc > KC) next_kc = KC;
                const char *next = b + kc * NR * width;
                int64_t next_lines = next_kc * NR * width / LINE;
                int64_t per_tile = (next_lines + tiles - 1) / tiles;
                int last = k0 + kc >= k;
                for (int64_t t = 0; t < tiles; t++) {
                    for (int64_t l = t * per_tile; l < (t + 1) * per_tile && l < next_lines; l++)
                        _mm_prefetch(next + l * LINE, _MM_HINT_T1);
                    int64_t r0 = t * MR;
                    int rows = mc - r0 < MR ? (int)(mc - r0) : MR;
                    Epilogue e = {y + (m0 + r0) * n + col0, n, cols, panel_bias, mode};
                    (w16 ? any_tile_bf16 : any_tile_f32)(rows, x + (m0 + r0) * k + k0, k, b,
                                                         kc, partial + r0 * NR, k0 == 0,
                                                         last ? &e : NULL);
                }
            }
        }
    }
}

static void gemm(const float *x, int64_t m, int64_t k, const void *packed, int64_t n,
                 const float *bias, float *y, int mode, int w16, int threads) {
    int64_t out_per_panel = mode == GATED ? NR / 2 : NR;
    int64_t panels = (n + out_per_panel - 1) / out_per_panel;
    if (panels == 0) return;
    if (threads < 1 || m * n * k < PARALLEL_MIN) threads = 1;
    if (threads > panels) threads = (int)panels;
#pragma omp parallel num_threads(threads)
    {
        int64_t t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        run_panels(x, m, k, packed, n, bias, y, mode, w16, panels * t / nt,
                   panels * (t + 1) / nt);
    }
}

/* y[m, n] = x[m, k] @ W^T + bias (bias may be NULL); packed by tandem_gemm_pack_f32. */
void tandem_gemm_f32(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                     const float *bias, float *y, int threads) {
    gemm(x, m, k, packed, n, bias, y, PLAIN, 0, threads);
}

/* y[m, n] = silu(x @ gate^T) * (x @ up^T); packed by tandem_gemm_pack_gated_f32. */
void tandem_gemm_gated_f32(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                           float *y, int threads) {
    gemm(x, m, k, packed, n, NULL, y, GATED, 0, threads);
}

/* As tandem_gemm_f32, over panels packed by tandem_gemm_pack_bf16. */
void tandem_gemm_bf16w(const float *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                       const float *bias, float *y, int threads) {
    gemm(x, m, k, packed, n, bias, y, PLAIN, 1, threads);
}

/* As tandem_gemm_gated_f32, over panels packed by tandem_gemm_pack_gated_bf16. */
void tandem_gemm_gated_bf16w(const float *x, int64_t m, int64_t k, const uint16_t *packed,
                             int64_t n, float *y, int threads) {
    gemm(x, m, k, packed, n, NULL, y, GATED, 1, threads);
}

/* A mixture of experts' products in one call: rows [offsets[e], offsets[e + 1]) of x
 * (sorted by expert) times expert e's packed weight, at packed + e * stride floats, into
 * the same rows of y; experts without rows cost nothing. Every thread takes its panels
 * of each expert in turn, so one parallel region serves all experts. */
static void grouped(const float *x, const int64_t *offsets, int64_t experts, int64_t k,
                    const float *packed, int64_t stride, int64_t n, float *y, int mode,
                    int threads) {
    int64_t out_per_panel = mode == GATED ? NR / 2 : NR;
    int64_t panels = (n + out_per_panel - 1) / out_per_panel;
    int64_t m = offsets[experts] - offsets[0];
    if (panels == 0 || m == 0) return;
    if (threads < 1 || m * n * k < PARALLEL_MIN) threads = 1;
    if (threads > panels) threads = (int)panels;
#pragma omp parallel num_threads(threads)
    {
        int64_t t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        for (int64_t e = 0; e < experts; e++) {
            int64_t r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
            if (rows > 0)
                run_panels(x + r0 * k, rows, k, packed + e * stride, n, NULL, y + r0 * n, mode,
                           0, panels * t / nt, panels * (t + 1) / nt);
        }
    }
}

/* Per expert e: y[rows of e] = x[rows of e] @ W_e^T, each W_e packed by
 * tandem_gemm_pack_f32 at packed + e * stride floats. */
void tandem_gemm_grouped_f32(const float *x, const int64_t *offsets, int64_t experts, int64_t k,
                             const float *packed, int64_t stride, int64_t n, float *y,
                             int threads) {
    grouped(x, offsets, experts, k, packed, stride, n, y, PLAIN, threads);
}

/* Per expert e: y[rows of e] = silu(x @ G_e^T) * (x @ U_e^T), packed by
 * tandem_gemm_pack_gated_f32 at packed + e * stride floats. */
void tandem_gemm_grouped_gated_f32(const float *x, const int64_t *offsets, int64_t experts,
                                   int64_t k, const float *packed, int64_t stride, int64_t n,
                                   float *y, int threads) {
    grouped(x, offsets, experts, k, packed, stride, n, y, GATED, threads);
}
