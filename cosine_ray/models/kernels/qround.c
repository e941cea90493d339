/* The activations of the GGUF projections (qgemm.c) rounded to 8 bits per group of 32, as
 * llama.cpp does for its Q8 operands: s = max |x_g| / 127, xq = round-half-even(x / s) in
 * -127..127, and the group's sums of xq (all 32, and the first 16: Q6_K scales halves of a
 * group apart). Every path (AVX-512, AVX2, plain C) gives the same bytes: the maximum is exact in
 * any order, the products are the same fp32 products, and the conversion rounds half to even
 * (MXCSR's default, as nearbyintf's). */
#include <math.h>

#include "kernels.h"
#include "simd.h"

/* one group: q[0 .. 32) and (its sum, the sum of its first 16); returns s */
static inline float round_group(const float *xg, int8_t *q, int32_t *total, int32_t *first) {
    float amax = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
    amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    float s = amax / 127.0f, inv = s > 0 ? 1.0f / s : 0.0f;
    __m512 iv = _mm512_set1_ps(inv);
    __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, iv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, iv));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(qb));
    *first = _mm512_reduce_add_epi32(qa);
    *total = *first + _mm512_reduce_add_epi32(qb);
#elif defined(__AVX2__)
    /* in 8-lane quarters; the bytes packed within 128-bit halves, then put in order */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a[4], m;
    for (int j = 0; j < 4; j++) a[j] = _mm256_loadu_ps(xg + 8 * j);
    m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
                      _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    float s = amax / 127.0f, inv = s > 0 ? 1.0f / s : 0.0f;
    __m256 iv = _mm256_set1_ps(inv);
    __m256i c[4];
    for (int j = 0; j < 4; j++) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(a[j], iv));
    __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    int32_t part[2];
    for (int p = 0; p < 2; p++) {
        __m256i t = _mm256_add_epi32(c[2 * p], c[2 * p + 1]);
        __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4e));
        part[p] = _mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, 0xb1)));
    }
    *first = part[0];
    *total = part[0] + part[1];
#else
    for (int k = 0; k < 32; k++) {
        float a = fabsf(xg[k]);
        amax = a > amax ? a : amax;
    }
    float s = amax / 127.0f, inv = s > 0 ? 1.0f / s : 0.0f;
    *total = *first = 0;
    for (int k = 0; k < 32; k++) {
        int v = (int)nearbyintf(xg[k] * inv);
        q[k] = (int8_t)v;
        *total += v;
        if (k < 16) *first += v;
    }
#endif
    return s;
}

static void round_row(const float *x, int64_t K, int8_t *xq, float *sx, float *sq, float *sh) {
    for (int64_t g = 0; g < K / 32; g++) {
        int32_t total, first;
        sx[g] = round_group(x + g * 32, xq + g * 32, &total, &first);
        sq[g] = (float)total;
        sh[g] = (float)first;
    }
}

/* x [M][ldx] rounded: xq [M][K] int8; sx, sq (the sum of xq) and sh (the sum of its first 16)
 * [M][K / 32] */
void cr_round_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *xq, float *sx, float *sq, float *sh,
                   int threads) {
    int64_t groups = K / 32;
    if (M < 16) {  /* no parallel region: a step's few rows cost less than starting one */
        for (int64_t i = 0; i < M; i++)
            round_row(x + i * ldx, K, xq + i * K, sx + i * groups, sq + i * groups, sh + i * groups);
        return;
    }
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < M; i++)
        round_row(x + i * ldx, K, xq + i * K, sx + i * groups, sq + i * groups, sh + i * groups);
}
