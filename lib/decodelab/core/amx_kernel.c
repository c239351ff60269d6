/* A bf16 linear layer on AMX for decode shapes: y (M, N) bf16 = x (M, K) bf16 W^T, fp32 accumulation.

   Why our own: oneDNN runs these products on the same AMX instruction (brg_matmul:avx10_1_512_amx at M = 1,
   ONEDNN_VERBOSE), but a decode step makes ~120 small calls, each paying oneDNN's fixed cost, and its weight
   stream gets no software prefetch; streaming a whole model's products, it reached ~19 GB/s here where this
   kernel reaches ~25 GB/s. transformers' bf16 greedy tokens must stay ours, so the arithmetic must be oneDNN's:
   one fp32 accumulator per output, fed by TDPBF16PS over 32-element k chunks in k order. TDPBF16PS adds the
   exact sum of a chunk's 32 products to the accumulator with one rounding (an emulation of exactly that
   matched oneDNN's outputs bit for bit, K = 576 and 1536), so using the instruction in the same k order gives
   oneDNN's results: tested bit for bit against F.linear. Rows never mix (each row of a tile is its own dot
   products), so a row's result does not depend on the rows beside it or on the thread count.

   Layout: the weight is packed once into 1 KB tiles, one per (16-column block, 32-k chunk), in AMX's pair
   (VNNI) layout: tile[p][2c + i] = W[16 b + c][32 j + 2 p + i]. Each thread takes whole column blocks, so each
   output is summed by one thread in k order, into its own accumulator (four blocks run side by side, one
   accumulator tile each: the chains never mix). Requires K % 32 == 0 (callers check) and the kernel's permission
   to use the tile registers (Linux arch_prctl; `amx_supported` asks for it). Build: cc -O3 -fopenmp -shared. */

#define _GNU_SOURCE
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TILE_ROWS 16
#define CHUNK 32          /* k values per TDPBF16PS (64 bytes of bf16 per tile row) */
#define TILE_ELEMS 512    /* bf16 values in one packed weight tile (16 pairs x 16 columns x 2) */
#define AHEAD 4           /* weight tiles prefetched ahead in each block's stream: 4 KB (2 ran alike; 8 ran slower) */
#define GROUP 4           /* column blocks summed side by side: four independent accumulator chains. One chain makes
                             every TDPBF16PS wait for the one before; four keep more weight tiles in flight (a decode
                             step in place: -9%, 25.3 vs 28.2 ms median of 6, interleaved) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

int amx_supported(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    int amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1, avx512_bf16 = 0;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) avx512_bf16 = (a >> 5) & 1;
    if (!amx_bf16 || !amx_tile || !avx512_bf16) return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

int64_t amx_packed_elems(int64_t n, int64_t k) { return (n + 15) / 16 * (k / CHUNK) * TILE_ELEMS; }

/* w (N, K) bf16 row-major -> out (amx_packed_elems(N, K)), zeros past N */
void amx_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *out) {
    int64_t blocks = (n + 15) / 16, chunks = k / CHUNK;
    memset(out, 0, sizeof(uint16_t) * amx_packed_elems(n, k));
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t j = 0; j < chunks; j++) {
            uint16_t *tile = out + (b * chunks + j) * TILE_ELEMS;
            for (int64_t col = 0; col < 16 && b * 16 + col < n; col++) {
                const uint16_t *row = w + (b * 16 + col) * k + j * CHUNK;
                for (int p = 0; p < 16; p++) {
                    tile[p * 32 + col * 2] = row[2 * p];
                    tile[p * 32 + col * 2 + 1] = row[2 * p + 1];
                }
            }
        }
}

__attribute__((target("amx-tile"))) static void configure(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {  /* 0-3: fp32 accumulators, 4: x's chunk (`rows` rows); 5-7: weight tiles */
        cfg.rows[t] = t < 5 ? (uint8_t)rows : 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* an accumulator tile's fp32 sums (rows x 16, in acc) -> bf16 (nearest even) at y[r0.., c0..], up to n columns */
__attribute__((target("avx512f,avx512bf16")))
static void store_block(const float *acc, int rows, uint16_t *y, int64_t n, int64_t r0, int64_t c0) {
    uint16_t half[16];
    int64_t cols = n - c0 < 16 ? n - c0 : 16;
    for (int r = 0; r < rows; r++) {
        __m256bh out = _mm512_cvtneps_pbh(_mm512_loadu_ps(acc + r * 16));
        memcpy(half, &out, sizeof half);
        memcpy(y + (r0 + r) * n + c0, half, sizeof(uint16_t) * cols);
    }
}

#define PREFETCH_TILE(tile) \
    for (int line = 0; line < 16; line++) _mm_prefetch((const char *)(tile) + line * 64, _MM_HINT_T0)

/* GROUP consecutive column blocks from b (weight tiles w: block b's chunks, then block b + 1's, ...) times x's
   rows r0 .. r0 + rows - 1. One accumulator per block, so each output is still one k-ordered chain. */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16")))
static void group_of_blocks(const uint16_t *x, int64_t k, int64_t chunks, const uint16_t *w, int64_t r0, int rows,
                            uint16_t *y, int64_t n, int64_t b, float *acc) {
    const int64_t stride = chunks * TILE_ELEMS;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = 0; j < chunks; j++) {
        const uint16_t *t = w + j * TILE_ELEMS;
        for (int g = 0; g < GROUP; g++) PREFETCH_TILE(t + g * stride + AHEAD * TILE_ELEMS);
        _tile_loadd(4, x + r0 * k + j * CHUNK, k * 2);
        _tile_loadd(5, t, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, t + stride, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, t + 2 * stride, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, t + 3 * stride, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, acc, 64);
    store_block(acc, rows, y, n, r0, b * 16);
    _tile_stored(1, acc, 64);
    store_block(acc, rows, y, n, r0, (b + 1) * 16);
    _tile_stored(2, acc, 64);
    store_block(acc, rows, y, n, r0, (b + 2) * 16);
    _tile_stored(3, acc, 64);
    store_block(acc, rows, y, n, r0, (b + 3) * 16);
}

/* one column block b (a thread's last blocks, fewer than GROUP), as `group_of_blocks` */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16")))
static void one_block(const uint16_t *x, int64_t k, int64_t chunks, const uint16_t *w, int64_t r0, int rows,
                      uint16_t *y, int64_t n, int64_t b, float *acc) {
    _tile_zero(0);
    for (int64_t j = 0; j < chunks; j++) {
        PREFETCH_TILE(w + (j + AHEAD) * TILE_ELEMS);
        _tile_loadd(4, x + r0 * k + j * CHUNK, k * 2);
        _tile_loadd(5, w + j * TILE_ELEMS, 64);
        _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, acc, 64);
    store_block(acc, rows, y, n, r0, b * 16);
}

/* x (m, k) bf16 row-major, a packed weight of n columns -> y (m, n) bf16 (fp32 sums rounded to nearest even).
   Each thread takes a contiguous range of column blocks, GROUP at a time, each group under every 16-row tile
   of x in turn (its weight tiles, read again for rows 17-32, are still in cache). */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16")))
void amx_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n, uint16_t *y) {
    int64_t blocks = (n + 15) / 16, chunks = k / CHUNK;
#pragma omp parallel
    {
        int threads = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t lo = blocks * me / threads, hi = blocks * (me + 1) / threads;
        int rows_now = m < TILE_ROWS ? (int)m : TILE_ROWS;
        float acc[TILE_ROWS * 16];
        configure(rows_now);
        for (int64_t b = lo; b < hi;) {
            int group = hi - b >= GROUP ? GROUP : 1;
            const uint16_t *w = packed + b * chunks * TILE_ELEMS;
            for (int64_t r0 = 0; r0 < m; r0 += TILE_ROWS) {
                int rows = m - r0 < TILE_ROWS ? (int)(m - r0) : TILE_ROWS;
                if (rows != rows_now) {
                    configure(rows);
                    rows_now = rows;
                }
                if (group == GROUP)
                    group_of_blocks(x, k, chunks, w, r0, rows, y, n, b, acc);
                else
                    one_block(x, k, chunks, w, r0, rows, y, n, b, acc);
            }
            b += group;
        }
        _tile_release();
    }
}
