/* Decode attention over a paged K/V cache on x86-64 CPUs with AVX2 and FMA (see attention/paged_cpu.py).
 *
 * Each query row r reads the keys at positions [first[r], last[r]) of its sequence where they lie: position p is
 * slot p % bs of block tables[r][p / bs] of the cache (blocks, bs, kv_heads, D).  Torch's form of the same step
 * gathers every row's blocks into a contiguous copy (the cache read, written and read again) and runs the
 * softmax in several passes over the scores; here each (row, K/V head) pair is one work item that walks its blocks
 * once, for the G query heads sharing that K/V head, with the online softmax: per block, the scores of its visible
 * keys, the running maximum m raised to theirs, the running sum and output rescaled by e^(m_old - m_new), then
 * the block's weights e^(s - m) added in.  Where D is a multiple of 8 the scores of eight keys are computed side
 * by side (``dot8``) and the weighted values summed in registers, two heads and 32 columns at a time, over the
 * block's keys (``weigh32x2``): ~2-3x the key-by-key form's speed.  Results: out (n, heads, D) = softmax-weighted
 * values (0 where a row sees no key) and lse (n, heads) = log of the softmax's sum (-inf where it sees none), for
 * the caller's merge with keys not in the cache.  Keys outside [first, last) are never read (stale slots may hold
 * anything, NaN included).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd_exp.h"

/* the largest and the sum of 8 floats */
static inline float hmax(__m256 x) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

static inline float hsum(__m256 x) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
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

/* scale * (q . k_j) for the 8 keys k_0 .. k_7 at k + j * stride (D % 8 == 0): eight dot products side by side,
 * their lanes summed together at the end (two rounds of pairwise sums, then the two 128-bit halves added) */
static inline __m256 dot8(const float *q, const float *k, int64_t stride, int64_t D, __m256 scale) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + stride + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 2 * stride + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 3 * stride + d), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 4 * stride + d), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 5 * stride + d), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 6 * stride + d), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 7 * stride + d), a7);
    }
    /* hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | the same of the upper halves]: after two rounds lane i of the
     * lower half holds key i's lanes 0-3 (i < 4) and of u1 key 4 + i's; the upper halves their lanes 4-7 */
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    return _mm256_mul_ps(sums, scale);
}

/* o_g[c:c+32] = o_g * alpha_g + sum_j p_g[j] v_j[c:c+32] for two heads g = 0, 1 (o0, o1; weights p0, p1 of the
 * keys j < count, values at v + j * stride): eight accumulators in registers over the keys, each value vector
 * loaded once for both heads */
static inline void weigh32x2(float *o0, float *o1, float alpha0, float alpha1, const float *p0, const float *p1,
                             const float *v, int64_t stride, int64_t count) {
    const __m256 s0 = _mm256_set1_ps(alpha0), s1 = _mm256_set1_ps(alpha1);
    __m256 a0 = _mm256_mul_ps(s0, _mm256_loadu_ps(o0)), a1 = _mm256_mul_ps(s0, _mm256_loadu_ps(o0 + 8));
    __m256 a2 = _mm256_mul_ps(s0, _mm256_loadu_ps(o0 + 16)), a3 = _mm256_mul_ps(s0, _mm256_loadu_ps(o0 + 24));
    __m256 b0 = _mm256_mul_ps(s1, _mm256_loadu_ps(o1)), b1 = _mm256_mul_ps(s1, _mm256_loadu_ps(o1 + 8));
    __m256 b2 = _mm256_mul_ps(s1, _mm256_loadu_ps(o1 + 16)), b3 = _mm256_mul_ps(s1, _mm256_loadu_ps(o1 + 24));
    for (int64_t j = 0; j < count; j++) {
        const float *vj = v + j * stride;
        const __m256 w0 = _mm256_set1_ps(p0[j]), w1 = _mm256_set1_ps(p1[j]);
        const __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8);
        const __m256 v2 = _mm256_loadu_ps(vj + 16), v3 = _mm256_loadu_ps(vj + 24);
        a0 = _mm256_fmadd_ps(w0, v0, a0);
        a1 = _mm256_fmadd_ps(w0, v1, a1);
        a2 = _mm256_fmadd_ps(w0, v2, a2);
        a3 = _mm256_fmadd_ps(w0, v3, a3);
        b0 = _mm256_fmadd_ps(w1, v0, b0);
        b1 = _mm256_fmadd_ps(w1, v1, b1);
        b2 = _mm256_fmadd_ps(w1, v2, b2);
        b3 = _mm256_fmadd_ps(w1, v3, b3);
    }
    _mm256_storeu_ps(o0, a0);
    _mm256_storeu_ps(o0 + 8, a1);
    _mm256_storeu_ps(o0 + 16, a2);
    _mm256_storeu_ps(o0 + 24, a3);
    _mm256_storeu_ps(o1, b0);
    _mm256_storeu_ps(o1 + 8, b1);
    _mm256_storeu_ps(o1 + 16, b2);
    _mm256_storeu_ps(o1 + 24, b3);
}

/* o[c:c+8] = o * alpha + sum_j p[j] v_j[c:c+8] (one head, one vector of columns: the remainder of weigh32x2's) */
static inline void weigh8(float *o, float alpha, const float *p, const float *v, int64_t stride, int64_t count) {
    __m256 a = _mm256_mul_ps(_mm256_set1_ps(alpha), _mm256_loadu_ps(o));
    for (int64_t j = 0; j < count; j++)
        a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v + j * stride), a);
    _mm256_storeu_ps(o, a);
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
    const int blocked = D % 8 == 0;  /* eight keys' scores at a time, values weighed in registers (else key by key) */
    const __m256 scale8 = _mm256_set1_ps(scale);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* per thread: the weights of one block's keys for the G heads (G, bs), running max, sum, NaN flag and the
         * block's rescaling factor (G each) */
        float *scores = malloc(sizeof(float) * (size_t)(G * bs + 4 * G + 8));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (scores == NULL)
                continue;
            const int64_t r = item / kv_heads, h = item % kv_heads;
            float *m = scores + G * bs, *l = m + G, *nan = l + G, *alpha = nan + G;
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
                const int64_t count = j1 - j0;
                const float *kb = k_cache + (tables[r * width + b] * bs + j0) * row_stride + h * D;
                const float *vb = v_cache + (tables[r * width + b] * bs + j0) * row_stride + h * D;
                for (int64_t g = 0; g < G; g++) {  /* head g: the block's scores, their maximum and NaN flag */
                    float *s = scores + g * bs;
                    __m256 peak8 = _mm256_set1_ps(m[g]), unordered = _mm256_setzero_ps();
                    int64_t j = 0;
                    if (blocked)
                        for (; j + 8 <= count; j += 8) {
                            const __m256 s8 = dot8(qh + g * D, kb + j * row_stride, row_stride, D, scale8);
                            _mm256_storeu_ps(s + j, s8);
                            peak8 = _mm256_max_ps(peak8, s8);
                            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(s8, s8, _CMP_UNORD_Q));
                        }
                    float peak = hmax(peak8);
                    for (; j < count; j++) {
                        s[j] = scale * dot(qh + g * D, kb + j * row_stride, D);
                        peak = s[j] > peak ? s[j] : peak;
                        if (s[j] != s[j])
                            nan[g] = 1.0f;
                    }
                    if (_mm256_movemask_ps(unordered))
                        nan[g] = 1.0f;  /* the exponential below would clamp it away: the row's result is NaN */
                    /* the block's weights e^(s - m_new), the sum and output rescaled by e^(m_old - m_new) */
                    alpha[g] = m[g] == -INFINITY ? 0.0f : expf(m[g] - peak);
                    __m256 sum8 = _mm256_setzero_ps();
                    for (j = 0; j + 8 <= count; j += 8) {
                        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(peak)));
                        _mm256_storeu_ps(s + j, e);
                        sum8 = _mm256_add_ps(sum8, e);
                    }
                    float sum = hsum(sum8);
                    for (; j < count; j++) {
                        s[j] = expf(s[j] - peak);
                        sum += s[j];
                    }
                    l[g] = l[g] * alpha[g] + sum;
                    m[g] = peak;
                }
                if (blocked) {  /* o_g = o_g alpha_g + sum_j w_gj v_j, two heads and 32 columns at a time */
                    int64_t g = 0;
                    for (; g + 2 <= G; g += 2) {
                        int64_t c = 0;
                        for (; c + 32 <= D; c += 32)
                            weigh32x2(o + g * D + c, o + (g + 1) * D + c, alpha[g], alpha[g + 1], scores + g * bs,
                                      scores + (g + 1) * bs, vb + c, row_stride, count);
                        for (; c < D; c += 8) {
                            weigh8(o + g * D + c, alpha[g], scores + g * bs, vb + c, row_stride, count);
                            weigh8(o + (g + 1) * D + c, alpha[g + 1], scores + (g + 1) * bs, vb + c, row_stride, count);
                        }
                    }
                    for (; g < G; g++)
                        for (int64_t c = 0; c < D; c += 8)
                            weigh8(o + g * D + c, alpha[g], scores + g * bs, vb + c, row_stride, count);
                } else {
                    for (int64_t g = 0; g < G; g++) {
                        const float *w = scores + g * bs;
                        scale_add(o + g * D, alpha[g], w[0], vb, D);
                        for (int64_t j = 1; j < count; j++)
                            scale_add(o + g * D, 1.0f, w[j], vb + j * row_stride, D);
                    }
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
