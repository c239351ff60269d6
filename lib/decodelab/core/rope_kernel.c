/* RoPE on float32 queries and keys in one call per forward's layer, rounding as torch does it op by op:

     out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[half:], x[:half])

   each product and the sum rounded as torch's separate ops round them; the rotation's negation and copy are
   exact. x: (B, T, NH, D) with any strides over its first three dimensions (a view into the q/k/v product) and
   D contiguous; cos, sin: (B, T, D) contiguous; out: (B, T, NH, D) contiguous. Rows (b, t) are shared among
   OpenMP threads from 4096 heads up (a prefill). Build: cc -O3 -fopenmp -ffp-contract=off
   (decodelab.core.native): no fused multiply-add, which torch's separate product and sum do not have.
   (bfloat16 is left to torch: written the same way, with its conversions, this portable build ran 2x slower
   than torch's vectorized ops beyond two rows.) */

#include <stdint.h>

/* Strides in elements. Returns 0, or -1 where D is odd. */
int rope_f32(const float *x, int64_t sb, int64_t st, int64_t sh, const float *cos, const float *sin, float *out,
             int64_t B, int64_t T, int64_t NH, int64_t D) {
    if (D % 2) return -1;
    const int64_t half = D / 2;
    #pragma omp parallel for if (B * T * NH >= 4096)
    for (int64_t bt = 0; bt < B * T; ++bt) {
        const float *c = cos + bt * D, *s = sin + bt * D;
        for (int64_t h = 0; h < NH; ++h) {
            const float *v = x + (bt / T) * sb + (bt % T) * st + h * sh;
            float *o = out + (bt * NH + h) * D;
            for (int64_t d = 0; d < half; ++d) {
                o[d] = v[d] * c[d] + (-v[d + half]) * s[d];
                o[d + half] = v[d + half] * c[d + half] + v[d] * s[d + half];
            }
        }
    }
    return 0;
}
