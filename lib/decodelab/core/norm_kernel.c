/* RMSNorm of a transformers Llama/Qwen2 norm in one call per tensor, rounding as torch does it op by op:

     h = float32(x); s = sum(h * h) in torch's CPU reduction order; r = 1 / sqrt(s / d + eps);
     y = round(h * r) to x's dtype; out = round(w * y) in x's dtype (w: the norm's weight, x's dtype)

   which is `norm.weight * F.rms_norm(x, (d,), None, eps)` (decodelab.core.transformer.rms_norm), itself equal
   bit for bit to transformers' module. The sum follows ATen's vectorized inner sum (SumKernel.cpp): the row
   as vectors of LANES floats, interleaved over 4 partial sums (ILP), each a cascade of up to 4 levels of
   2^level_power vectors, then the partials in order and the lanes in order. LANES is a parameter: the Python
   side finds which one reproduces this torch build's sums on a probe and uses the kernel only then.
   Rows are shared among OpenMP threads from 64 rows up (a prefill). Build: cc -O3 -fopenmp -ffp-contract=off
   -shared -fPIC (decodelab.core.native): no fused multiply-adds, whose single rounding torch's ops do not have. */

#include <stdint.h>
#include <string.h>
#include <math.h>

#define MAX_LANES 16
#define ILP 4
#define LEVELS 4

static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t bits = 0, v = x - 1;
    while (v) { bits++; v >>= 1; }
    return bits;
}

/* acc[k][l] += vector (i * ILP + k) of the row, the cascade of ATen's multi_row_sum over `size` groups */
static void multi_row_sum(const float *sq, int64_t lanes, int64_t size, float out[ILP][MAX_LANES]) {
    float acc[LEVELS][ILP][MAX_LANES];
    memset(acc, 0, sizeof acc);
    int64_t level_power = ceil_log2(size) / LEVELS;
    if (level_power < 4) level_power = 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    int64_t i = 0;
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; ++j, ++i)
            for (int k = 0; k < ILP; ++k)
                for (int64_t l = 0; l < lanes; ++l) acc[0][k][l] += sq[(i * ILP + k) * lanes + l];
        for (int j = 1; j < LEVELS; ++j) {
            for (int k = 0; k < ILP; ++k)
                for (int64_t l = 0; l < lanes; ++l) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < size; ++i)
        for (int k = 0; k < ILP; ++k)
            for (int64_t l = 0; l < lanes; ++l) acc[0][k][l] += sq[(i * ILP + k) * lanes + l];
    for (int j = 1; j < LEVELS; ++j)
        for (int k = 0; k < ILP; ++k)
            for (int64_t l = 0; l < lanes; ++l) acc[0][k][l] += acc[j][k][l];
    memcpy(out, acc[0], sizeof acc[0]);
}

/* sum of sq[0 .. d) in ATen's order for `lanes`-wide vectors (sq: the squares, float32) */
static float torch_sum(const float *sq, int64_t d, int64_t lanes) {
    const int64_t vec_size = d / lanes, size_ilp = vec_size / ILP;
    float partial[ILP][MAX_LANES];
    multi_row_sum(sq, lanes, size_ilp, partial);
    for (int64_t i = size_ilp * ILP; i < vec_size; ++i)
        for (int64_t l = 0; l < lanes; ++l) partial[0][l] += sq[i * lanes + l];
    for (int k = 1; k < ILP; ++k)
        for (int64_t l = 0; l < lanes; ++l) partial[0][l] += partial[k][l];
    float total = 0.0f;
    for (int64_t i = vec_size * lanes; i < d; ++i) total += sq[i];
    for (int64_t l = 0; l < lanes; ++l) total += partial[0][l];
    return total;
}

static float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's conversion (a NaN: 0x7fc0) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* x, out: (rows, d) float32; w: (d,) float32. Returns 0, or -1 where lanes is out of range. */
int rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t d, float eps, int64_t lanes) {
    if (lanes < 1 || lanes > MAX_LANES) return -1;
    #pragma omp parallel for if (rows >= 64)
    for (int64_t r = 0; r < rows; ++r) {
        float sq[d];
        const float *h = x + r * d;
        for (int64_t i = 0; i < d; ++i) sq[i] = h[i] * h[i];
        const float inv = 1.0f / sqrtf(torch_sum(sq, d, lanes) / (float)d + eps);
        for (int64_t i = 0; i < d; ++i) out[r * d + i] = w[i] * (h[i] * inv);
    }
    return 0;
}

/* x, out: (rows, d) bfloat16 bits; w: (d,) bfloat16 bits. Returns 0, or -1 where lanes is out of range. */
int rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows, int64_t d, float eps,
                  int64_t lanes) {
    if (lanes < 1 || lanes > MAX_LANES) return -1;
    #pragma omp parallel for if (rows >= 64)
    for (int64_t r = 0; r < rows; ++r) {
        float h[d], sq[d];
        for (int64_t i = 0; i < d; ++i) {
            h[i] = bf16_to_f32(x[r * d + i]);
            sq[i] = h[i] * h[i];
        }
        const float inv = 1.0f / sqrtf(torch_sum(sq, d, lanes) / (float)d + eps);
        for (int64_t i = 0; i < d; ++i) {
            const float y = bf16_to_f32(f32_to_bf16(h[i] * inv));
            out[r * d + i] = f32_to_bf16(bf16_to_f32(w[i]) * y);
        }
    }
    return 0;
}
