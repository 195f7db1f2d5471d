/* Decode attention over a paged K/V cache on x86-64 CPUs with AVX2 and FMA (see attention/paged_cpu.py).
 *
 * Each query row r reads the keys at positions [first[r], last[r]) of its sequence where they lie: position p is
 * slot p % bs of block tables[r][p / bs] of the cache (blocks, bs, kv_heads, D).  Torch's form of the same step
 * gathers every row's blocks into a contiguous copy (the cache read, written and read again) and runs the
 * softmax in several passes over the scores; here each (row, K/V head) pair is one work item that walks its blocks
 * once, for the G query heads sharing that K/V head, with the online softmax: per block, the scores of its visible
 * keys, the running maximum m raised to theirs, the running sum and output rescaled by e^(m_old - m_new), then
 * the block's weights e^(s - m) added in.  Results: out (n, heads, D) = softmax-weighted values (0 where a row sees
 * no key) and lse (n, heads) = log of the softmax's sum (-inf where it sees none), for the caller's merge with
 * keys not in the cache.  Keys outside [first, last) are never read (stale slots may hold anything, NaN included).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd_exp.h"

static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    float s = _mm_cvtss_f32(half);
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* y[0:n] = y * alpha + p * v */
static inline void scale_add(float *y, float alpha, float p, const float *v, int64_t n) {
    __m256 a = _mm256_set1_ps(alpha), w = _mm256_set1_ps(p);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(v + i), _mm256_mul_ps(a, _mm256_loadu_ps(y + i))));
    for (; i < n; i++)
        y[i] = y[i] * alpha + p * v[i];
}

/* q (n, heads, D), caches (blocks, bs, kv_heads, D), tables (n, width), first / last (n,): the visible positions;
 * out (n, heads, D), lse (n, heads).  heads a multiple of kv_heads; bs <= 1024.  Returns 0, or -1 when the scratch
 * memory cannot be had, -2 when a table entry or a range lies outside the cache or the table. */
int paged_cached_attention(const float *q, int64_t n, int64_t heads, int64_t D, const float *k_cache,
                           const float *v_cache, int64_t blocks, int64_t bs, int64_t kv_heads, const int64_t *tables,
                           int64_t width, const int64_t *first, const int64_t *last, float scale, float *out,
                           float *lse, int threads) {
    if (bs < 1 || bs > 1024 || kv_heads < 1 || heads % kv_heads)
        return -2;
    for (int64_t r = 0; r < n; r++) {
        if (first[r] < 0 || last[r] > width * bs)
            return -2;
        for (int64_t b = first[r] / bs; first[r] < last[r] && b <= (last[r] - 1) / bs; b++)
            if (tables[r * width + b] < 0 || tables[r * width + b] >= blocks)
                return -2;
    }
    const int64_t G = heads / kv_heads, items = n * kv_heads, row_stride = kv_heads * D;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* per thread: the scores of one block for the G heads (G, bs), running max, sum and NaN flag (G) */
        float *scores = malloc(sizeof(float) * (size_t)(G * bs + 3 * G + 8));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (scores == NULL)
                continue;
            const int64_t r = item / kv_heads, h = item % kv_heads;
            float *m = scores + G * bs, *l = m + G, *nan = l + G;
            float *o = out + (r * heads + h * G) * D;
            const float *qh = q + (r * heads + h * G) * D;
            for (int64_t g = 0; g < G; g++) {
                m[g] = -INFINITY;
                l[g] = nan[g] = 0.0f;
                for (int64_t d = 0; d < D; d++)
                    o[g * D + d] = 0.0f;
            }
            for (int64_t p0 = first[r]; p0 < last[r];) {
                const int64_t b = p0 / bs, j0 = p0 % bs;
                const int64_t j1 = (last[r] - b * bs < bs) ? last[r] - b * bs : bs;  /* keys [j0, j1) of block b */
                const float *kb = k_cache + tables[r * width + b] * bs * row_stride + h * D;
                const float *vb = v_cache + tables[r * width + b] * bs * row_stride + h * D;
                for (int64_t g = 0; g < G; g++) {
                    float *s = scores + g * bs, peak = m[g];
                    for (int64_t j = j0; j < j1; j++) {
                        s[j] = scale * dot(qh + g * D, kb + j * row_stride, D);
                        peak = s[j] > peak ? s[j] : peak;
                        if (s[j] != s[j])
                            nan[g] = 1.0f;  /* the exponential below would clamp it away: the row's result is NaN */
                    }
                    const float alpha = m[g] == -INFINITY ? 0.0f : expf(m[g] - peak);
                    int64_t j = j0;
                    float sum = 0.0f;
                    for (; j + 8 <= j1; j += 8) {
                        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(peak)));
                        _mm256_storeu_ps(s + j, e);
                    }
                    for (; j < j1; j++)
                        s[j] = expf(s[j] - peak);
                    float *og = o + g * D;
                    scale_add(og, alpha, s[j0], vb + j0 * row_stride, D);
                    sum = s[j0];
                    for (j = j0 + 1; j < j1; j++) {
                        scale_add(og, 1.0f, s[j], vb + j * row_stride, D);
                        sum += s[j];
                    }
                    l[g] = l[g] * alpha + sum;
                    m[g] = peak;
                }
                p0 = b * bs + j1;
            }
            for (int64_t g = 0; g < G; g++) {
                float *og = o + g * D;
                if (nan[g] != 0.0f || l[g] != l[g]) {  /* NaN in the keys, the query or the values: passed on */
                    for (int64_t d = 0; d < D; d++)
                        og[d] = NAN;
                    lse[r * heads + h * G + g] = NAN;
                } else if (l[g] > 0.0f) {
                    const float inv = 1.0f / l[g];
                    for (int64_t d = 0; d < D; d++)
                        og[d] *= inv;
                    lse[r * heads + h * G + g] = m[g] + logf(l[g]);
                } else {
                    lse[r * heads + h * G + g] = -INFINITY;
                }
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
