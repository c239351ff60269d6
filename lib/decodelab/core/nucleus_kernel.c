/* The top-p threshold search of decodelab.core.nucleus, one pass over each row plus its crossing bucket.

   Per row (V float32 logits x, their weights w = exp(x - max) in float32, the row's P):
     Z = sum w (float64); the nucleus holds the K largest values, K = min{k : s_k >= P Z}, s_k the sum
     of the k largest weights, and the threshold is the K-th largest value.
   The first pass sums Z and gathers the few largest weights on the way (a peaked row's nucleus is among
   them, and a sort of those alone decides it). Otherwise radix select instead of a sort: w lies in [0, 1], and its float32 bits order it, so a bucket id made
   of w's exponent (the 64 octaves below 1; every smaller weight lumped into bucket 0) and its top 8
   mantissa bits orders the weights, and so the values, by bucket. One pass builds each bucket's mass;
   a scan from the top bucket finds the one where the running mass crosses P Z (`above` = the mass of
   the buckets over it); a second pass gathers that bucket's values, sorted descending, and the K-th
   is among them. A row is `clear` when s_{K-1} and s_K lie more than band (1 - P) Z from P Z, where the
   float32 reference (a full sort, softmax and cumulative sum) decides alike; the caller takes the
   reference for the other rows. Build: cc -O3 -fopenmp -shared -fPIC (decodelab.core.native). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define OCTAVES 64
#define SUB_BITS 6
#define N_BUCKETS (OCTAVES << SUB_BITS)
#define HISTOGRAMS 4
/* the window tried first: the weights >= (1 - P) / (2 WINDOW_SPREAD), if at most WINDOW_MAX of them */
#define WINDOW_SPREAD 256.0
#define WINDOW_MAX 4096
#define BLOCK 64 /* the passes that gather a few entries test a block at once */

/* w in [0, 1] -> its bucket: the exponent and top SUB_BITS mantissa bits of its float32 bits, less the
   octaves below 2^-OCTAVES (clamped to 0); w in the top octave and w == 1 share the top bucket.
   Monotone in w, branch-free (the loops over it vectorize). */
static inline int bucket_of(float w) {
    uint32_t bits;
    memcpy(&bits, &w, sizeof bits);
    int id = (int)(bits >> (23 - SUB_BITS)) - ((127 - OCTAVES) << SUB_BITS);
    return id < 0 ? 0 : (id > N_BUCKETS - 1 ? N_BUCKETS - 1 : id);
}

typedef struct { float x, w; } entry;

static int descending(const void *a, const void *b) {
    float x = ((const entry *)a)->x, y = ((const entry *)b)->x;
    return (x < y) - (x > y);
}

/* The K-th largest among the n picked entries (sorted here), `above` the mass of every weight over them
   -> 1 and *threshold when clear; 0 when unclear or when the picked mass falls short of the target. */
static int resolve(entry *picked, int64_t n, double above, double target, double margin, float *threshold) {
    qsort(picked, (size_t)n, sizeof(entry), descending);
    double s_before = above;
    for (int64_t k = 0; k < n; k++) {
        double s = s_before + picked[k].w;
        if (s >= target) {
            if (s >= target + margin && s_before < target - margin && isfinite(picked[k].x)) {
                *threshold = picked[k].x;
                return 1;
            }
            return 0;
        }
        s_before = s;
    }
    return 0;
}

/* One row -> 1 and *threshold when the row is clear, else 0. mass: HISTOGRAMS N_BUCKETS doubles of
   scratch; picked: V entries of scratch. */
static int row_threshold(const float *x, const float *w, int64_t V, double big_p, double band,
                         float row_max, double *mass, entry *picked, float *threshold) {
    /* One pass: Z (as sum_weights adds it, lane by lane), and the window of a peaked row gathered on the
       way: the weights >= (1 - P) / (2 WINDOW_SPREAD), which (Z >= 1: the max weighs 1) hold every weight
       >= (1 - P) Z / (2 WINDOW_SPREAD), while they are at most WINDOW_MAX. */
    float window = (float)((1.0 - big_p) / (2.0 * WINDOW_SPREAD));
    double acc[8] = {0}, window_mass = 0.0;
    int64_t n = 0, i = 0;
    int overflow = 0;
    for (int64_t start = 0; start < V; start += BLOCK) {
        int64_t end = start + BLOCK < V ? start + BLOCK : V;
        for (i = start; i + 8 <= end; i += 8)
            for (int j = 0; j < 8; j++) acc[j] += w[i + j];
        if (end == V)
            for (; i < V; i++) acc[0] += w[i];
        if (overflow) continue;
        int hits = 0;
#pragma omp simd reduction(+ : hits)
        for (int64_t k = start; k < end; k++) hits += w[k] >= window;
        if (!hits) continue;
        if (n + hits > WINDOW_MAX) {
            overflow = 1;
            continue;
        }
        for (int64_t k = start; k < end; k++)
            if (w[k] >= window) {
                picked[n++] = (entry){x[k], w[k]};
                window_mass += w[k];
            }
    }
    double z = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    double target = big_p * z, margin = band * (1.0 - big_p) * z;
    if (target <= 0.0) { /* P <= 0: the reference keeps the top token alone */
        *threshold = row_max;
        return 1;
    }
    if (!overflow && window_mass >= target + 2 * margin && resolve(picked, n, 0.0, target, margin, threshold))
        return 1;
    /* otherwise radix select: each bucket's mass (HISTOGRAMS interleaved copies: no chain of adds to one
       bucket), then the bucket where the running mass from the top crosses P Z */
    memset(mass, 0, HISTOGRAMS * N_BUCKETS * sizeof(double));
    for (i = 0; i + HISTOGRAMS <= V; i += HISTOGRAMS)
        for (int h = 0; h < HISTOGRAMS; h++) mass[h * N_BUCKETS + bucket_of(w[i + h])] += w[i + h];
    for (; i < V; i++) mass[bucket_of(w[i])] += w[i];
    double above = 0.0;
    int b = N_BUCKETS - 1;
    for (; b > 0; b--) {
        double bucket_mass = 0.0;
        for (int h = 0; h < HISTOGRAMS; h++) bucket_mass += mass[h * N_BUCKETS + b];
        if (above + bucket_mass >= target) break;
        above += bucket_mass;
    }
    if (b == 0) return 0; /* the lumped weights below 2^-OCTAVES: the reference */
    n = 0;
    for (int64_t start = 0; start < V; start += BLOCK) {
        int64_t end = start + BLOCK < V ? start + BLOCK : V;
        int hits = 0;
#pragma omp simd reduction(+ : hits)
        for (i = start; i < end; i++) hits += bucket_of(w[i]) == b;
        if (hits)
            for (i = start; i < end; i++)
                if (bucket_of(w[i]) == b) picked[n++] = (entry){x[i], w[i]};
    }
    return resolve(picked, n, above, target, margin, threshold);
}

/* rows (R,) indices into the (B, V) row-major x; w_rows (R,) the address of each listed row's V weights;
   m (B,) row max; big_p (B,) -> threshold (R,), clear (R,). Rows are shared among OpenMP threads (each row's
   result is its own: the same whatever the thread count), each thread with its own scratch. Returns 0, or -1
   when scratch memory could not be had (that thread's rows then not clear). */
int top_p_rows(const float *x, const float *const *w_rows, const float *m, const double *big_p, const int64_t *rows,
               int64_t n_rows, int64_t V, double band, float *threshold, uint8_t *clear) {
    int status = 0;
#pragma omp parallel if (n_rows > 1)
    {
        double *mass = malloc(HISTOGRAMS * N_BUCKETS * sizeof(double));
        entry *picked = malloc((size_t)V * sizeof(entry));
        if (!mass || !picked) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < n_rows; j++) {
            int64_t r = rows[j];
            clear[j] = mass && picked ? (uint8_t)row_threshold(x + r * V, w_rows[j], V, big_p[r], band, m[r], mass,
                                                                picked, &threshold[j])
                                      : 0;
        }
        free(mass);
        free(picked);
    }
    return status;
}
