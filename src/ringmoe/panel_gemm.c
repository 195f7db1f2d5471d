/* Products of few rows by many weight matrices on x86-64 CPUs with AVX2 and FMA (see panel_gemm.py).
 *
 * A weight w (N, K) is stored once more as column panels: panel q holds the columns [16q, 16q + 16) of w.T as a
 * (K, 16) row-major block, so a product streams each panel front to back, one 64-byte line per k.  The last panel
 * of an N that is not a multiple of 16 is (K, N mod 16), compact: the copy has the weight's bytes exactly.
 *
 * The kernel keeps a (rows <= 6) x 16 block of the output in twelve AVX registers and, for each k, multiplies the
 * panel's 16 values by each row's x[m, k] (broadcast) and adds.  The sum over k runs in blocks of KB: each block's
 * sum is formed in the registers in order, then added to the output row, so a value's rounding error grows with
 * KB + K / KB terms rather than K (at K = 2048 a plain running sum was 3-5x torch's error; blocked, within it).
 * Every row takes the same order of additions whatever the number of rows beside it: batch invariant.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_exp.h"

#define PW 16      /* columns per panel */
#define KB 64      /* terms of the sum over k added in registers before they join the output */
#define CHUNK 4    /* panels per work item */
#define PARALLEL_MIN (1 << 17)  /* multiply-adds of a product worth more than one thread */

/* The 16 (or nc < 16) columns of a panel row; masked loads past the edge panel's nc columns read nothing. */
static inline __m256i lanes_below(int n) {
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), index);
}

/* y[0:nc] = (first ? 0 : y[0:nc]) + [lo, hi][0:nc] */
static inline void store_row(float *y, __m256 lo, __m256 hi, int nc, int first) {
    if (!first) {
        if (nc == PW) {
            lo = _mm256_add_ps(_mm256_loadu_ps(y), lo);
            hi = _mm256_add_ps(_mm256_loadu_ps(y + 8), hi);
        } else {
            lo = _mm256_add_ps(_mm256_maskload_ps(y, lanes_below(nc)), lo);
            hi = _mm256_add_ps(_mm256_maskload_ps(y + 8, lanes_below(nc - 8)), hi);
        }
    }
    if (nc == PW) {
        _mm256_storeu_ps(y, lo);
        _mm256_storeu_ps(y + 8, hi);
        return;
    }
    _mm256_maskstore_ps(y, lanes_below(nc), lo);
    _mm256_maskstore_ps(y + 8, lanes_below(nc - 8), hi);
}

/* One kernel per row count 1..6: x rows (stride ldx) by one panel p of nc columns (row stride nc) into y (ldy). */
#define ACC_DECL(j) __m256 lo##j = _mm256_setzero_ps(), hi##j = _mm256_setzero_ps();
#define ACC_STEP(j) { __m256 s = _mm256_broadcast_ss(x + (j) * ldx + k); \
                      lo##j = _mm256_fmadd_ps(w0, s, lo##j); hi##j = _mm256_fmadd_ps(w1, s, hi##j); }
#define ACC_STORE(j) store_row(y + (j) * ldy, lo##j, hi##j, nc, k0 == 0);
#define KERNEL(R, DECL, STEP, STORE)                                                                               \
    static void kernel##R(const float *x, int64_t ldx, const float *p, int64_t K, float *y, int64_t ldy, int nc) { \
        for (int64_t k0 = 0; k0 < K; k0 += KB) {                                                                   \
            int64_t k1 = k0 + KB < K ? k0 + KB : K;                                                                \
            DECL                                                                                                   \
            if (nc == PW) {                                                                                        \
                for (int64_t k = k0; k < k1; k++) {                                                                \
                    _mm_prefetch((const char *)(p + (k + 32) * PW), _MM_HINT_T0);                                  \
                    __m256 w0 = _mm256_loadu_ps(p + k * PW), w1 = _mm256_loadu_ps(p + k * PW + 8);                 \
                    STEP                                                                                           \
                }                                                                                                  \
            } else {                                                                                               \
                __m256i m0 = lanes_below(nc), m1 = lanes_below(nc - 8);                                            \
                for (int64_t k = k0; k < k1; k++) {                                                                \
                    __m256 w0 = _mm256_maskload_ps(p + k * nc, m0), w1 = _mm256_maskload_ps(p + k * nc + 8, m1);   \
                    STEP                                                                                           \
                }                                                                                                  \
            }                                                                                                      \
            STORE                                                                                                  \
        }                                                                                                          \
    }
KERNEL(1, ACC_DECL(0), ACC_STEP(0), ACC_STORE(0))
KERNEL(2, ACC_DECL(0) ACC_DECL(1), ACC_STEP(0) ACC_STEP(1), ACC_STORE(0) ACC_STORE(1))
KERNEL(3, ACC_DECL(0) ACC_DECL(1) ACC_DECL(2), ACC_STEP(0) ACC_STEP(1) ACC_STEP(2),
       ACC_STORE(0) ACC_STORE(1) ACC_STORE(2))
KERNEL(4, ACC_DECL(0) ACC_DECL(1) ACC_DECL(2) ACC_DECL(3), ACC_STEP(0) ACC_STEP(1) ACC_STEP(2) ACC_STEP(3),
       ACC_STORE(0) ACC_STORE(1) ACC_STORE(2) ACC_STORE(3))
KERNEL(5, ACC_DECL(0) ACC_DECL(1) ACC_DECL(2) ACC_DECL(3) ACC_DECL(4),
       ACC_STEP(0) ACC_STEP(1) ACC_STEP(2) ACC_STEP(3) ACC_STEP(4),
       ACC_STORE(0) ACC_STORE(1) ACC_STORE(2) ACC_STORE(3) ACC_STORE(4))
KERNEL(6, ACC_DECL(0) ACC_DECL(1) ACC_DECL(2) ACC_DECL(3) ACC_DECL(4) ACC_DECL(5),
       ACC_STEP(0) ACC_STEP(1) ACC_STEP(2) ACC_STEP(3) ACC_STEP(4) ACC_STEP(5),
       ACC_STORE(0) ACC_STORE(1) ACC_STORE(2) ACC_STORE(3) ACC_STORE(4) ACC_STORE(5))

typedef void (*kernel_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int);
static const kernel_fn KERNELS[7] = {NULL, kernel1, kernel2, kernel3, kernel4, kernel5, kernel6};

/* M rows of x by panels [q0, q1) of one packed matrix (N, K) into y (M, N), row strides ldx and ldy. */
static void panels(const float *x, int64_t M, int64_t ldx, const float *packed, int64_t N, int64_t K,
                   int64_t q0, int64_t q1, float *y, int64_t ldy) {
    for (int64_t q = q0; q < q1; q++) {
        int64_t n0 = q * PW;
        int nc = (int)(N - n0 < PW ? N - n0 : PW);
        const float *p = packed + n0 * K;  /* the panels before q hold 16 columns each */
        for (int64_t m = 0; m < M; m += 6) {
            int rows = (int)(M - m < 6 ? M - m : 6);
            KERNELS[rows](x + m * ldx, ldx, p, K, y + m * ldy + n0, ldy, nc);
        }
    }
}

/* w (G, N, K) row-major -> out (G, N * K) in panel order. */
void panel_pack(const float *w, int64_t G, int64_t N, int64_t K, float *out) {
    for (int64_t g = 0; g < G; g++) {
        const float *wg = w + g * N * K;
        float *og = out + g * N * K;
        for (int64_t n0 = 0; n0 < N; n0 += PW) {
            int64_t nc = N - n0 < PW ? N - n0 : PW;
            float *p = og + n0 * K;
            for (int64_t k = 0; k < K; k++)
                for (int64_t c = 0; c < nc; c++) p[k * nc + c] = wg[(n0 + c) * K + k];
        }
    }
}

/* Grouped product: x (R, K) sorted by group, group g owning rows [offsets[g], offsets[g + 1]); packed weights
 * (G, N, K) in panel order; y (R, N) = each row times its group's w.T.  Work items are (group with rows, a run of
 * CHUNK panels), shared statically among `threads` OpenMP threads.  Returns 0, or -1 when out of memory. */
int panel_grouped(const float *x, const int64_t *offsets, int64_t G, const float *packed, int64_t N, int64_t K,
                  float *y, int threads) {
    int64_t per = ((N + PW - 1) / PW + CHUNK - 1) / CHUNK, panel_count = (N + PW - 1) / PW;
    int64_t *active = malloc(sizeof(int64_t) * (G > 0 ? G : 1));
    if (!active) return -1;
    int64_t used = 0;
    for (int64_t g = 0; g < G; g++)
        if (offsets[g + 1] > offsets[g]) active[used++] = g;
    int64_t items = used * per;
    /* a product too small to pay for waking the other threads (~1-3 us) runs on this one */
    int parallel = items > 1 && threads > 1 && (offsets[G] - offsets[0]) * N * K >= PARALLEL_MIN;
    #pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
    for (int64_t it = 0; it < items; it++) {
        int64_t g = active[it / per], q0 = (it % per) * CHUNK;
        int64_t q1 = q0 + CHUNK < panel_count ? q0 + CHUNK : panel_count;
        int64_t r0 = offsets[g];
        panels(x + r0 * K, offsets[g + 1] - r0, K, packed + g * N * K, N, K, q0, q1, y + r0 * N, N);
    }
    free(active);
    return 0;
}

/* ---- a MoE layer's routed experts in one call --------------------------------------------------------------- */

/* 1 / (1 + e^-z) */
static inline __m256 sigmoid8(__m256 z) {
    __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
}

/* One row of the activation: h = [gate | up] (2F,) -> a (F,).  limit < 0: silu(gate) * up; else gpt-oss's
 * g = min(gate, limit), u = clamp(up, -limit, limit), a = (u + 1) * g * sigmoid(alpha g). */
static void activate_row(const float *h, int64_t F, float limit, float alpha, float *a) {
    int64_t f = 0;
    for (; f + 8 <= F; f += 8) {
        __m256 g = _mm256_loadu_ps(h + f), u = _mm256_loadu_ps(h + F + f);
        if (limit < 0) {
            _mm256_storeu_ps(a + f, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid8(g)), u));
        } else {
            __m256 lim = _mm256_set1_ps(limit);
            g = _mm256_min_ps(g, lim);
            u = _mm256_min_ps(_mm256_max_ps(u, _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim);
            __m256 s = sigmoid8(_mm256_mul_ps(g, _mm256_set1_ps(alpha)));
            _mm256_storeu_ps(a + f, _mm256_mul_ps(_mm256_mul_ps(_mm256_add_ps(u, _mm256_set1_ps(1.0f)), g), s));
        }
    }
    if (f < F) {  /* the row's last F mod 8 values, through a zero-padded vector */
        float gt[8] = {0}, ut[8] = {0}, at[8], ht[16];
        memcpy(gt, h + f, sizeof(float) * (F - f));
        memcpy(ut, h + F + f, sizeof(float) * (F - f));
        memcpy(ht, gt, sizeof gt);
        memcpy(ht + 8, ut, sizeof ut);
        activate_row(ht, 8, limit, alpha, at);
        memcpy(a + f, at, sizeof(float) * (F - f));
    }
}

/* A MoE layer's routed output, dropless, for T tokens x (T, H) with their top-k experts topk_idx (T, k) and
 * combine weights topk_weight (T, k): the T k assignments are sorted by expert (stably: token order within an
 * expert), their rows gathered, multiplied by the experts' gate_up (E, 2F, H) and down (E, H, F) stacks in panel
 * order (biases (E, 2F), (E, H) or NULL) with the activation between, and each token's outputs summed with its
 * weights in that sorted order: y (T, H) = sum over the token's assignments of w (down(act(gate_up x))).  counts
 * (E,) receives the assignments per expert.  Returns 0; -1 when out of memory; -2 for an expert index outside
 * [0, E) (y is then unwritten). */
int panel_moe(const float *x, int64_t T, int64_t H, const int64_t *topk_idx, const float *topk_weight, int64_t k,
              int64_t E, const float *gate_up, const float *gate_up_bias, const float *down, const float *down_bias,
              int64_t F, float limit, float alpha, float *y, int64_t *counts, int threads) {
    int64_t N = T * k;
    for (int64_t i = 0; i < N; i++)
        if (topk_idx[i] < 0 || topk_idx[i] >= E) return -2;
    int64_t *offsets = calloc((size_t)E + 1, sizeof(int64_t)), *fill = malloc(sizeof(int64_t) * (E + 1));
    int64_t *token = malloc(sizeof(int64_t) * (N + 1));
    float *weight = malloc(sizeof(float) * (N + 1)), *rows = malloc(sizeof(float) * (N * H + 1));
    float *h = malloc(sizeof(float) * (N * 2 * F + 1)), *a = malloc(sizeof(float) * (N * F + 1));
    float *out = malloc(sizeof(float) * (N * H + 1));
    int status = 0;
    if (!offsets || !fill || !token || !weight || !rows || !h || !a || !out) {
        status = -1;
        goto done;
    }
    for (int64_t i = 0; i < N; i++) offsets[topk_idx[i] + 1]++;
    for (int64_t e = 0; e < E; e++) {
        counts[e] = offsets[e + 1];
        offsets[e + 1] += offsets[e];
    }
    memcpy(fill, offsets, sizeof(int64_t) * (E + 1));
    for (int64_t i = 0; i < N; i++) {
        int64_t r = fill[topk_idx[i]]++;
        token[r] = i / k;
        weight[r] = topk_weight[i];
        memcpy(rows + r * H, x + (i / k) * H, sizeof(float) * H);
    }
    if (panel_grouped(rows, offsets, E, gate_up, 2 * F, H, h, threads) != 0) { status = -1; goto done; }
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = offsets[e]; r < offsets[e + 1]; r++) {
            float *hr = h + r * 2 * F;
            if (gate_up_bias)
                for (int64_t c = 0; c < 2 * F; c++) hr[c] += gate_up_bias[e * 2 * F + c];
            activate_row(hr, F, limit, alpha, a + r * F);
        }
    if (panel_grouped(a, offsets, E, down, H, F, out, threads) != 0) { status = -1; goto done; }
    memset(y, 0, sizeof(float) * T * H);
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = offsets[e]; r < offsets[e + 1]; r++) {
            float *yt = y + token[r] * H;
            const float *o = out + r * H;
            for (int64_t c = 0; c < H; c++) {
                float v = down_bias ? o[c] + down_bias[e * H + c] : o[c];
                float term = weight[r] * v;  /* rounded apart, then added (no fused multiply-add): torch's order */
                yt[c] += term;
            }
        }
done:
    free(offsets); free(fill); free(token); free(weight); free(rows); free(h); free(a); free(out);
    return status;
}
