/* The head-first inverse CDF of decodelab.core.draw, row by row: dense over precomputed weights
   (dense_draw_rows), or over a row's few kept ids alone (sparse_draw_rows, which computes their weights).

   Per row (V float32 values x, weights w = exp(x - max) in float32, a cut c, the head a = the row's first
   argmax, a uniform u): every id i != a counts with weight w_i where x_i >= c, else 0; rest = the sum of
   those, C = 1 + rest, target = u C - 1. The head when target < 0 (or rest <= 0, or x_a is not finite),
   else the first id in vocabulary order whose running sum exceeds target.
   Two levels: float32 sums of CHUNK consecutive weights (vectorized), their running sum in float64 finds
   the chunk, a float64 running sum inside it finds the id. Each level is clamped to its last entry that
   adds weight (where rounding leaves the target at or past its end), so a picked id always has w_i > 0
   and x_i >= c. The weights are only read. Build: cc -O3 -fopenmp -shared -fPIC (decodelab.core.native). */

#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <immintrin.h>

#define CHUNK 256
#define BLOCK 64 /* the sparse pass tests a block at once and visits only blocks with kept ids */

/* sum of w_i over start <= i < end with x_i >= cut, in float32: LANES independent partial sums (lane j
   adds the ids = j mod LANES; GCC/clang vector types make the lanes explicit, so the code vectorizes on
   every ISA with the same sums), then a fixed pairwise order */
typedef float f4 __attribute__((vector_size(16)));
typedef int32_t i4 __attribute__((vector_size(16)));
#define LANES 16

static float kept_mass(const float *x, const float *w, int64_t start, int64_t end, float cut) {
    f4 acc[LANES / 4] = {{0}}, xv, wv;
    f4 cv = {cut, cut, cut, cut};
    int64_t i = start;
    if (cut == -INFINITY)  /* every id kept: x need not be read (the same sums) */
        for (; i + LANES <= end; i += LANES)
            for (int j = 0; j < LANES / 4; j++) {
                memcpy(&wv, w + i + 4 * j, sizeof wv);
                acc[j] += wv;
            }
    for (; i + LANES <= end; i += LANES)
        for (int j = 0; j < LANES / 4; j++) {
            memcpy(&xv, x + i + 4 * j, sizeof xv);
            memcpy(&wv, w + i + 4 * j, sizeof wv);
            acc[j] += (f4)((i4)wv & (i4)(xv >= cv));  /* w where kept, +0 elsewhere */
        }
    float lane[LANES];
    memcpy(lane, acc, sizeof lane);
    for (; i < end; i++) lane[0] += x[i] >= cut ? w[i] : 0.0f;
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) lane[j] += lane[j + width];
    return lane[0];
}

static int64_t draw_row(const float *x, const float *w, int64_t V, float cut, int64_t head, double u,
                        double *cum) {
    if (!isfinite(x[head])) return head;
    int64_t n_chunks = (V + CHUNK - 1) / CHUNK, last_chunk = -1;
    double run = 0.0;
    for (int64_t k = 0; k < n_chunks; k++) {
        int64_t start = k * CHUNK, end = start + CHUNK < V ? start + CHUNK : V;
        float s = head >= start && head < end
                      ? kept_mass(x, w, start, head, cut) + kept_mass(x, w, head + 1, end, cut)  /* the head apart */
                      : kept_mass(x, w, start, end, cut);
        if (s > 0.0f) last_chunk = k;
        run += s;
        cum[k] = run;
    }
    if (!(run > 0.0)) return head;
    double target = u * (1.0 + run) - 1.0;
    if (target < 0.0) return head;
    int64_t k = 0;
    while (k < last_chunk && cum[k] <= target) k++;
    double inside = target - (k > 0 ? cum[k - 1] : 0.0), acc = 0.0;
    int64_t start = k * CHUNK, end = start + CHUNK < V ? start + CHUNK : V, last = head;
    for (int64_t i = start; i < end; i++) {
        if (i == head || !(x[i] >= cut) || !(w[i] > 0.0f)) continue;
        acc += w[i];
        last = i;
        if (acc > inside) return i;
    }
    return last;
}

/* x (B, V) row-major; w_rows (R,) the address of each listed row's V weights; cut (B,) or NULL (keep all);
   head (B,), u (B,); rows (R,) indices into x -> tokens (R,). Returns 0, or -1 without scratch memory. */
int dense_draw_rows(const float *x, const float *const *w_rows, const float *cut, const int64_t *head,
                    const double *u, const int64_t *rows, int64_t n_rows, int64_t V, int64_t *tokens) {
    int status = 0;
#pragma omp parallel if (n_rows > 1)
    {
        double *cum = malloc((size_t)((V + CHUNK - 1) / CHUNK) * sizeof(double));
        if (!cum) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < n_rows; j++) {
            int64_t r = rows[j];
            if (cum) tokens[j] = draw_row(x + r * V, w_rows[j], V, cut ? cut[r] : -INFINITY, head[r], u[r], cum);
        }
        free(cum);
    }
    return status;
}

static int64_t count_row(const float *x, int64_t V, float cut) {
    if (cut == -INFINITY) return V;  /* keeps every id: x need not be read */
    int64_t n = 0;
#pragma omp simd reduction(+ : n)
    for (int64_t i = 0; i < V; i++) n += x[i] >= cut;
    return n;
}

/* The same inverse CDF over the few ids with x_i >= c: their weights exp(x_i - x_a) in float64, in
   vocabulary order, one running sum; clamped to the last id that adds weight. -1 when more than max_kept
   ids are kept (the caller draws the row dense). The count reads the row first, so the gather reads it
   from cache. ids, w: max_kept entries of scratch. */
static int64_t sparse_row(const float *x, int64_t V, float cut, int64_t head, double u, int64_t max_kept,
                          int64_t *ids, double *w) {
    if (count_row(x, V, cut) > max_kept) return -1;
    double top = x[head], rest = 0.0;
    int64_t n = 0;
    for (int64_t start = 0; start < V; start += BLOCK) {
        int64_t end = start + BLOCK < V ? start + BLOCK : V, hits = 0;
#pragma omp simd reduction(+ : hits)
        for (int64_t i = start; i < end; i++) hits += x[i] >= cut;
        if (!hits) continue;
        for (int64_t i = start; i < end; i++)
            if (x[i] >= cut && i != head) {
                ids[n] = i;
                w[n] = exp((double)x[i] - top);
                rest += w[n++];
            }
    }
    double target = u * (1.0 + rest) - 1.0;
    if (!(rest > 0.0) || target < 0.0) return head;
    double acc = 0.0;
    int64_t last = head;
    for (int64_t k = 0; k < n; k++) {
        if (!(w[k] > 0.0)) continue;
        acc += w[k];
        last = ids[k];
        if (acc > target) return ids[k];
    }
    return last;
}

/* x (B, V) row-major; cut, head, u (B,); rows (R,) -> tokens (R,), each row drawn over its kept ids alone,
   or -1 where it keeps more than max_kept (every listed row's x_a finite, no NaN in x). Returns 0, or -1
   without scratch memory. */
int sparse_draw_rows(const float *x, const float *cut, const int64_t *head, const double *u, const int64_t *rows,
                     int64_t n_rows, int64_t V, int64_t max_kept, int64_t *tokens) {
    int status = 0;
#pragma omp parallel if (n_rows > 1)
    {
        int64_t *ids = malloc((size_t)(max_kept + 1) * sizeof(int64_t));
        double *w = malloc((size_t)(max_kept + 1) * sizeof(double));
        if (!ids || !w) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < n_rows; j++) {
            int64_t r = rows[j];
            if (ids && w) tokens[j] = sparse_row(x + r * V, V, cut[r], head[r], u[r], max_kept, ids, w);
        }
        free(ids);
        free(w);
    }
    return status;
}

/* x (B, V) row-major -> head (B,): each row's first maximal id, as numpy's and torch's argmax (a NaN counts
   as the maximum: the first NaN). Two passes per row, 16 ids at a time: the max (NaNs noted aside), then
   the first id holding it; rows shared among OpenMP threads. AVX-512F through a target attribute: returns
   -1 on a CPU without it (the caller keeps numpy's argmax), else 0. */
__attribute__((target("avx512f"))) static int64_t row_argmax(const float *x, int64_t V) {
    __m512 best = _mm512_set1_ps(x[0]);
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 16 <= V; i += 16) {
        __m512 xv = _mm512_loadu_ps(x + i);
        best = _mm512_max_ps(xv, best);  /* a NaN in xv yields best: kept out of the max */
        nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
    }
    float m = _mm512_reduce_max_ps(best);
    for (int64_t j = i; j < V; j++) {
        m = x[j] > m ? x[j] : m;
        nan |= x[j] != x[j];
    }
    __m512 target = _mm512_set1_ps(m);
    for (i = 0; i + 16 <= V; i += 16) {
        __m512 xv = _mm512_loadu_ps(x + i);
        __mmask16 hit = nan ? _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(xv, target, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
    for (; i < V; i++)
        if (nan ? x[i] != x[i] : x[i] == m) return i;
    return 0;  /* not reached: some id holds the max */
}

int argmax_rows(const float *x, int64_t B, int64_t V, int64_t *head) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f")) return -1;
#pragma omp parallel for if (B > 1) schedule(static)
    for (int64_t r = 0; r < B; r++) head[r] = row_argmax(x + r * V, V);
    return 0;
}
