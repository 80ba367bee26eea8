/* Float32 matmuls of a few rows that stream each weight once: y[M,N] = x[M,K] · W[N,K]ᵀ (+ b).
 *
 * Built by clover.kernels.rows (`cc -O3 -march=native -shared -fPIC`) on first use and loaded with
 * ctypes. The weight is read as nn.Linear stores it (row-major [N, K], no packed copy). A tile of
 * R weight rows × MB activation rows keeps R·MB vector accumulators in registers; the K loop loads
 * each weight vector once from memory and each activation vector once per tile (from L1/L2: M rows
 * of K floats), so for up to 8 rows the loop stays at the memory stream's speed, as a GEMV does.
 * More than MB rows run as several row blocks over the same R weight rows, which are in L1 by then.
 * AVX-512 or AVX2+FMA where the compiler targets them, else a portable scalar loop (the same code
 * with a vector of one float).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vf;
#define VL 16
#define MAX_MB 8
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vsum(v) _mm512_reduce_add_ps(v)
#define ISA "avx512"
/* weight rows per tile for MB activation rows: R·MB + R + 1 ≤ 32 registers */
static const int R_OF[MAX_MB + 1] = {0, 8, 8, 6, 5, 4, 4, 3, 3};
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vf;
#define VL 8
#define MAX_MB 4
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float vsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define ISA "avx2"
/* R·MB + R + 1 ≤ 16 registers */
static const int R_OF[MAX_MB + 1] = {0, 4, 4, 3, 2};
#else
typedef float vf;
#define VL 1
#define MAX_MB 4
#define vzero() 0.0f
#define vload(p) (*(p))
#define vfma(a, b, c) ((a) * (b) + (c))
#define vsum(v) (v)
#define ISA "scalar"
static const int R_OF[MAX_MB + 1] = {0, 4, 4, 2, 2};
#endif

/* Each weight row is prefetched this many floats ahead of its loads, into L1, and near its end the
 * same row of the next tile (R rows on) from its start: 512 bytes measured best at 8 rows (~10%
 * faster than the hardware prefetcher alone; 64…1024 floats into L1 or L2, a second prefetch further
 * ahead, and non-temporal prefetches were slower); the next tile's heads gain 17–20% on rows of 512
 * floats (an expert's down projection). A prefetch never faults: past the last row it is a no-op. */
#define PREFETCH 128

#define INLINE static inline __attribute__((always_inline))

/* y[m, r] (m < MB, r < R; y's row stride ldy) = x[m, :K] · w[r, :K] (+ b[r]): one tile. */
INLINE void tile(const int R, const int MB, const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw,
                 const float *b, float *y, ptrdiff_t ldy, ptrdiff_t K) {
    vf acc[8][MAX_MB];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int m = 0; m < MB; m++) acc[r][m] = vzero();
    const ptrdiff_t Kv = K - K % VL;
    for (ptrdiff_t k = 0; k < Kv; k += VL) {
        vf xv[MAX_MB];
#pragma GCC unroll 8
        for (int m = 0; m < MB; m++) xv[m] = vload(x + m * ldx + k);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __builtin_prefetch(k + PREFETCH < K ? w + r * ldw + k + PREFETCH : w + (r + R) * ldw + k + PREFETCH - K, 0, 3);
            vf wv = vload(w + r * ldw + k);
#pragma GCC unroll 8
            for (int m = 0; m < MB; m++) acc[r][m] = vfma(wv, xv[m], acc[r][m]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int m = 0; m < MB; m++) {
            float s = vsum(acc[r][m]);
            for (ptrdiff_t k = Kv; k < K; k++) s += x[m * ldx + k] * w[r * ldw + k];
            y[m * ldy + r] = b ? s + b[r] : s;
        }
}

/* One function per tile shape (R weight rows × MB activation rows): the loops unrolled, the
 * accumulators in registers (no spill in the AVX-512 3 × 8 tile's K loop, checked with objdump). */
#define TILE(RR, MM)                                                                                   \
    static void tile_##RR##_##MM(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw,          \
                                 const float *b, float *y, ptrdiff_t ldy, ptrdiff_t K) {               \
        tile(RR, MM, x, ldx, w, ldw, b, y, ldy, K);                                                    \
    }
typedef void (*tile_fn)(const float *, ptrdiff_t, const float *, ptrdiff_t, const float *, float *, ptrdiff_t,
                        ptrdiff_t);

#if MAX_MB == 8
TILE(8, 1) TILE(8, 2) TILE(6, 3) TILE(5, 4) TILE(4, 5) TILE(4, 6) TILE(3, 7) TILE(3, 8)
TILE(1, 1) TILE(1, 2) TILE(1, 3) TILE(1, 4) TILE(1, 5) TILE(1, 6) TILE(1, 7) TILE(1, 8)
static const tile_fn FULL[MAX_MB + 1] = {0, tile_8_1, tile_8_2, tile_6_3, tile_5_4, tile_4_5, tile_4_6, tile_3_7, tile_3_8};
static const tile_fn ONE[MAX_MB + 1] = {0, tile_1_1, tile_1_2, tile_1_3, tile_1_4, tile_1_5, tile_1_6, tile_1_7, tile_1_8};
#elif VL == 8
TILE(4, 1) TILE(4, 2) TILE(3, 3) TILE(2, 4)
TILE(1, 1) TILE(1, 2) TILE(1, 3) TILE(1, 4)
static const tile_fn FULL[MAX_MB + 1] = {0, tile_4_1, tile_4_2, tile_3_3, tile_2_4};
static const tile_fn ONE[MAX_MB + 1] = {0, tile_1_1, tile_1_2, tile_1_3, tile_1_4};
#else
TILE(4, 1) TILE(4, 2) TILE(2, 3) TILE(2, 4)
TILE(1, 1) TILE(1, 2) TILE(1, 3) TILE(1, 4)
static const tile_fn FULL[MAX_MB + 1] = {0, tile_4_1, tile_4_2, tile_2_3, tile_2_4};
static const tile_fn ONE[MAX_MB + 1] = {0, tile_1_1, tile_1_2, tile_1_3, tile_1_4};
#endif

const char *clover_rows_isa(void) { return ISA; }

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) · w[N, K]ᵀ (row stride ldw) + b[N] (b may be NULL). */
void clover_rows_linear(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw, const float *b, float *y,
                        ptrdiff_t ldy, ptrdiff_t M, ptrdiff_t N, ptrdiff_t K) {
    if (M <= 0 || N <= 0) return;
    const ptrdiff_t blocks = (M + MAX_MB - 1) / MAX_MB;
    const int mb = (int)((M + blocks - 1) / blocks); /* balanced: 12 rows are 6 + 6, not 8 + 4 */
    const int R = R_OF[mb];
    ptrdiff_t n = 0;
    for (; n + R <= N; n += R)
        for (ptrdiff_t m0 = 0; m0 < M; m0 += mb) {
            const int rows = (int)(M - m0 < mb ? M - m0 : mb);
            const tile_fn f = rows == mb ? FULL[mb] : ONE[rows];
            if (rows == mb)
                f(x + m0 * ldx, ldx, w + n * ldw, ldw, b ? b + n : 0, y + m0 * ldy + n, ldy, K);
            else /* a short last block: its rows one weight row at a time */
                for (int r = 0; r < R; r++)
                    f(x + m0 * ldx, ldx, w + (n + r) * ldw, ldw, b ? b + n + r : 0, y + m0 * ldy + n + r, ldy, K);
        }
    for (; n < N; n++) /* the last N % R weight rows */
        for (ptrdiff_t m0 = 0; m0 < M; m0 += mb) {
            const int rows = (int)(M - m0 < mb ? M - m0 : mb);
            ONE[rows](x + m0 * ldx, ldx, w + n * ldw, ldw, b ? b + n : 0, y + m0 * ldy + n, ldy, K);
        }
}

/* Routed experts, SwiGLU, for N tokens of H features with k experts each (top_idx / top_w [N, k]):
 * out[N, H] += Σ_j top_w[t, j] · down[e] · (silu(g) ⊙ u), [g; u] = gate_up[e] · x[t], e = top_idx[t, j];
 * gate_up [E, 2I, H], down [E, H, I], contiguous. The touched experts in order, each once, on the rows of
 * the tokens routed to it (gathered). `scratch`: at least N·(H + 3I + H) floats; `rows`: N ints. */
void clover_rows_experts(const float *x, ptrdiff_t N, ptrdiff_t H, const int64_t *top_idx, const float *top_w,
                         ptrdiff_t k, const float *gate_up, const float *down, ptrdiff_t E, ptrdiff_t I, float *out,
                         float *scratch, int64_t *rows, float *row_w) {
    float *xs = scratch, *gu = xs + N * H, *h = gu + N * 2 * I, *ys = h + N * I;
    for (ptrdiff_t e = 0; e < E; e++) {
        ptrdiff_t M = 0;
        for (ptrdiff_t t = 0; t < N; t++)
            for (ptrdiff_t j = 0; j < k; j++)
                if (top_idx[t * k + j] == e) {
                    rows[M] = t;
                    row_w[M] = top_w[t * k + j];
                    memcpy(xs + M * H, x + t * H, (size_t)H * sizeof(float));
                    M++;
                }
        if (!M) continue;
        clover_rows_linear(xs, H, gate_up + e * 2 * I * H, H, 0, gu, 2 * I, M, 2 * I, H);
        for (ptrdiff_t m = 0; m < M; m++)
            for (ptrdiff_t i = 0; i < I; i++) {
                const float g = gu[m * 2 * I + i];
                h[m * I + i] = g / (1.0f + expf(-g)) * gu[m * 2 * I + I + i];
            }
        clover_rows_linear(h, I, down + e * H * I, I, 0, ys, H, M, H, I);
        for (ptrdiff_t m = 0; m < M; m++) {
            float *o = out + rows[m] * H;
            const float *yr = ys + m * H, wm = row_w[m];
            for (ptrdiff_t i = 0; i < H; i++) o[i] += wm * yr[i];
        }
    }
}
