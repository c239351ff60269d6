/* A row-invariant fp32 linear layer for decode shapes: y (M, N) = x (M, K) W^T (+ b).

   Every output element is one running sum over k = 0, 1, ..., K-1 in that order, one fused multiply-add per
   k, started from +0 (the bias added after): the same operations whatever M is, however the rows are tiled
   and however the panels are split among threads. So a row's output never depends on the other rows in
   the call (the property speculative verification needs: a row verified with k drafts beside it gets the
   logits plain decoding gets). BLAS kernels change their summation order with M (MKL's M = 1 path differs
   from M = 2..15); oneDNN keeps it, but pays a fixed cost per call that a decode step's ~120 small products
   feel (decodelab.core.packed_linear).

   Layout: the weight is packed once into panels of NR = 32 output columns, (ceil(N / NR), K, NR), zeros past
   N, so a panel streams contiguously. The micro-kernel holds MR <= 12 rows x 32 columns in 24 AVX-512
   accumulators (the shape BLIS uses on Skylake-X); rows are blocked by MB so a block of x stays in L2 while
   the panels stream past it, and the panels are shared among OpenMP threads (torch's own runtime: the
   library links libgomp.so.1, which torch has already loaded).

   AVX-512F through target attributes (no -march: the library may be shared between hosts); callers ask
   `linear_kernel_supported()` first and keep oneDNN where it answers 0. Build: cc -O3 -fopenmp -shared. */

#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#define NR 32
#define MR 12
#define MB 96
#define AHEAD 32 /* software prefetch distance in k steps (4 KB): wider tiles leave the hardware too little run-ahead */

int linear_kernel_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
}

int64_t packed_floats(int64_t n, int64_t k) { return (n + NR - 1) / NR * k * NR; }

/* w (N, K) row-major -> out (packed_floats(N, K)): panel p holds columns p NR .. p NR + NR - 1, k-major */
void pack_weight(const float *w, int64_t n, int64_t k, float *out) {
    int64_t panels = (n + NR - 1) / NR;
    memset(out, 0, sizeof(float) * packed_floats(n, k));
    for (int64_t p = 0; p < panels; p++)
        for (int64_t c = 0; c < NR && p * NR + c < n; c++) {
            const float *row = w + (p * NR + c) * k;
            float *dst = out + p * k * NR + c;
            for (int64_t i = 0; i < k; i++) dst[i * NR] = row[i];
        }
}

/* rows x[0..R-1] (stride ldx) times one panel -> acc (R, NR); R a compile-time constant per variant */
#define TILE(R)                                                                                          \
    __attribute__((target("avx512f"))) static void tile##R(const float *x, int64_t ldx, const float *panel, \
                                                          int64_t k, float *acc) {                       \
        __m512 lo[R], hi[R];                                                                             \
        for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_ps();                                 \
        for (int64_t i = 0; i < k; i++) {                                                                \
            _mm_prefetch((const char *)(panel + (i + AHEAD) * NR), _MM_HINT_T0);                         \
            _mm_prefetch((const char *)(panel + (i + AHEAD) * NR + 16), _MM_HINT_T0);                    \
            __m512 w0 = _mm512_loadu_ps(panel + i * NR), w1 = _mm512_loadu_ps(panel + i * NR + 16);      \
            for (int r = 0; r < R; r++) {                                                                \
                __m512 xr = _mm512_set1_ps(x[r * ldx + i]);                                              \
                lo[r] = _mm512_fmadd_ps(xr, w0, lo[r]);                                                  \
                hi[r] = _mm512_fmadd_ps(xr, w1, hi[r]);                                                  \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < R; r++) {                                                                    \
            _mm512_storeu_ps(acc + r * NR, lo[r]);                                                       \
            _mm512_storeu_ps(acc + r * NR + 16, hi[r]);                                                  \
        }                                                                                                \
    }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12)

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *);
static const tile_fn TILES[MR + 1] = {0, tile1, tile2, tile3, tile4, tile5, tile6,
                                      tile7, tile8, tile9, tile10, tile11, tile12};

/* x (m, k) row-major, packed weight of n columns, bias (n) or NULL -> y (m, n) row-major */
void linear(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias, float *y) {
    int64_t panels = (n + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < m; m0 += MB) {
        int64_t m1 = m0 + MB < m ? m0 + MB : m;
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            float acc[MR * NR];
            int64_t c0 = p * NR, cols = n - c0 < NR ? n - c0 : NR;
            for (int64_t r0 = m0; r0 < m1; r0 += MR) {
                int rows = m1 - r0 < MR ? (int)(m1 - r0) : MR;
                TILES[rows](x + r0 * k, k, packed + p * k * NR, k, acc);
                for (int r = 0; r < rows; r++) {
                    float *dst = y + (r0 + r) * n + c0;
                    if (bias)
                        for (int64_t c = 0; c < cols; c++) dst[c] = acc[r * NR + c] + bias[c0 + c];
                    else
                        memcpy(dst, acc + r * NR, sizeof(float) * cols);
                }
            }
        }
    }
}

