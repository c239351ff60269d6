/* RoPE on queries and keys in one call per forward's layer, rounding as torch does it op by op:

     out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[half:], x[:half])

   each product and the sum rounded to x's dtype as torch's separate ops round them (bf16: computed in float32,
   rounded to nearest even; a product of two bf16 values is exact in float32, so each op rounds once). The
   rotation's negation and copy are exact. x: (B, T, NH, D) with any strides over its first three dimensions
   (a view into the q/k/v product) and D contiguous; cos, sin: (B, T, D) contiguous; out: (B, T, NH, D)
   contiguous. Rows (b, t) are shared among OpenMP threads from 4096 heads up (a prefill).
   Build: cc -O3 -fopenmp -ffp-contract=off (decodelab.core.native): no fused multiply-add, which torch's
   separate product and sum do not have. */

#include <stdint.h>
#include <string.h>

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

static float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* Returns 0, or -1 where D is odd. Strides in elements. */
int rope_f32(const float *x, int64_t sb, int64_t st, int64_t sh, const float *cos, const float *sin, float *out,
             int64_t B, int64_t T, int64_t NH, int64_t D) {
    if (D % 2) return -1;
    const int64_t half = D / 2;
    #pragma omp parallel for if (B * T * NH >= 4096)
    for (int64_t bt = 0; bt < B * T; ++bt) {
        const int64_t b = bt / T, t = bt % T;
        const float *c = cos + bt * D, *s = sin + bt * D;
        for (int64_t h = 0; h < NH; ++h) {
            const float *v = x + b * sb + t * st + h * sh;
            float *o = out + (bt * NH + h) * D;
            for (int64_t d = 0; d < half; ++d) {
                const float lo = v[d] * c[d], rot_lo = -v[d + half] * s[d];
                o[d] = lo + rot_lo;
                const float hi = v[d + half] * c[d + half], rot_hi = v[d] * s[d + half];
                o[d + half] = hi + rot_hi;
            }
        }
    }
    return 0;
}

/* x, cos, sin, out as bfloat16 bits. Returns 0, or -1 where D is odd. */
int rope_bf16(const uint16_t *x, int64_t sb, int64_t st, int64_t sh, const uint16_t *cos, const uint16_t *sin,
              uint16_t *out, int64_t B, int64_t T, int64_t NH, int64_t D) {
    if (D % 2) return -1;
    const int64_t half = D / 2;
    #pragma omp parallel for if (B * T * NH >= 4096)
    for (int64_t bt = 0; bt < B * T; ++bt) {
        const int64_t b = bt / T, t = bt % T;
        const uint16_t *c = cos + bt * D, *s = sin + bt * D;
        for (int64_t h = 0; h < NH; ++h) {
            const uint16_t *v = x + b * sb + t * st + h * sh;
            uint16_t *o = out + (bt * NH + h) * D;
            for (int64_t d = 0; d < half; ++d) {
                const float a = bf16_to_f32(v[d]), z = bf16_to_f32(v[d + half]);
                const float lo = round_bf16(a * bf16_to_f32(c[d])), rot_lo = round_bf16(-z * bf16_to_f32(s[d]));
                o[d] = f32_to_bf16(lo + rot_lo);
                const float hi = round_bf16(z * bf16_to_f32(c[d + half]));
                const float rot_hi = round_bf16(a * bf16_to_f32(s[d + half]));
                o[d + half] = f32_to_bf16(hi + rot_hi);
            }
        }
    }
    return 0;
}
