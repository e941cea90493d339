/* GGUF projections kept quantized: y = x W^T (+ b), W in groups of 32 along k (Q4_0, Q4_1, Q8_0;
 * qgemm.py lays the codes out).
 *
 * Each row of x is first rounded to 8 bits per group of 32 (as llama.cpp does for its Q8_0 / Q8_1
 * operands): s = max |x_g| / 127, xq = round-half-even(x / s) in -127..127. Then, per group,
 *
 *   y[m, n] += s (d (sum_k q xq) + m (sum_k xq))     (Q4_1: w = d q + m)
 *   y[m, n] += s (d (sum_k (q - 8) xq))               (Q4_0: w = d (q - 8))
 *   y[m, n] += s (d (sum_k q xq))                     (Q8_0: w = d q)
 *
 * which is exactly the file's weights times the rounded x. The inner sums are integers (exact,
 * in any order: VNNI's vpdpbusd where the CPU has it, plain C otherwise, the same result), and the
 * groups go in order in fp32, so a row's result never depends on M, the tile, the threads or the
 * instruction set.
 *
 * Layout, per block of 32 columns (n = 32 t + 16 h + c) and group g, 64 bytes per (h, kk):
 *   Q4_0, Q4_1  [ceil(N / 32)][K / 32][2 h][4 kk][16 c][4 j]   codes (k = 8 kk + j) | (k = 8 kk + 4 + j) << 4
 *   Q8_0        [ceil(N / 32)][K / 32][2 h][8 kk][16 c][4 j]   code (k = 4 kk + j) + 128, as uint8
 *   d, m        [ceil(N / 32)][K / 32][32] fp16, the file's own (m: Q4_1 only, NULL otherwise)
 * Four consecutive k of one column share a 32-bit lane: one vpdpbusd takes 16 columns x 4 k.
 * scratch: [M][K / 32] floats x 10 (the rounded rows, their scales and their group sums). */
#include <math.h>

#include "kernels.h"
#include "simd.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define CR_VNNI 1
#endif

enum { Q8_0 = 0, Q4_1 = 1, Q4_0 = 2 };

/* Without AVX-512 but with AVX2, F16C and FMA (most x86 CPUs of the last decade) the tiles below
 * work in 8-lane registers: a row's 32 columns are four quarters of 8, each quarter's integer
 * sums made with vpmaddubsw + vpmaddwd (exact: no pair of products reaches the 16-bit limit) */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define CR_QAVX2 1
#endif

/* the widest quant tile: wider ones run out of vector registers */
#ifdef CR_QAVX2
#define QROWS 2
#else
#define QROWS 6
#endif

/* 16 fp16 values -> fp32, exactly (F16C, or by their bits) */
static inline v16 halves(const uint16_t *p) {
#if defined(__AVX512F__)
    return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#else
    v16 out;
    for (int i = 0; i < 16; i++) {
        uint32_t h = p[i], sign = (h & 0x8000u) << 16, e = (h >> 10) & 31, f = h & 1023, bits;
        if (e == 31) bits = sign | 0x7f800000u | (f << 13);
        else if (e) bits = sign | ((e + 112) << 23) | (f << 13);
        else if (!f) bits = sign;
        else {  /* subnormal: normalise */
            e = 113;
            while (!(f & 1024)) { f <<= 1; e--; }
            bits = sign | (e << 23) | ((f & 1023) << 13);
        }
        memcpy(&out[i], &bits, 4);
    }
    return out;
#endif
}

/* the integer sums of one group for ``rows`` rows, as floats: out[i][h][c] = sum_k q(n = 16 h + c, k) xq[i][k]
 * (Q4_0: q - 8; Q8_0: the stored code minus 128). total[i]: sum_k xq[i][k]. */
static inline void qsums(int rows, const int8_t *xq, int64_t K, const uint8_t *codes, int kind,
                         const int32_t *total, v16 (*out)[2]) {
    int32_t shift = kind == Q8_0 ? 128 : kind == Q4_0 ? 8 : 0;
#ifdef CR_VNNI
    __m512i s[QROWS][2];
    for (int i = 0; i < rows; i++) s[i][0] = s[i][1] = _mm512_set1_epi32(-shift * total[i]);
    if (kind != Q8_0) {
        const __m512i low = _mm512_set1_epi8(15);
        for (int kk = 0; kk < 4; kk++)
            for (int h = 0; h < 2; h++) {
                __m512i v = _mm512_loadu_si512(codes + (h * 4 + kk) * 64);
                __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int i = 0; i < rows; i++) {
                    int32_t a, b;
                    memcpy(&a, xq + i * K + 8 * kk, 4);
                    memcpy(&b, xq + i * K + 8 * kk + 4, 4);
                    s[i][h] = _mm512_dpbusd_epi32(s[i][h], lo, _mm512_set1_epi32(a));
                    s[i][h] = _mm512_dpbusd_epi32(s[i][h], hi, _mm512_set1_epi32(b));
                }
            }
    } else {
        for (int kk = 0; kk < 8; kk++)
            for (int h = 0; h < 2; h++) {
                __m512i v = _mm512_loadu_si512(codes + (h * 8 + kk) * 64);
                for (int i = 0; i < rows; i++) {
                    int32_t a;
                    memcpy(&a, xq + i * K + 4 * kk, 4);
                    s[i][h] = _mm512_dpbusd_epi32(s[i][h], v, _mm512_set1_epi32(a));
                }
            }
    }
    for (int i = 0; i < rows; i++) {
        out[i][0] = (v16)_mm512_cvtepi32_ps(s[i][0]);
        out[i][1] = (v16)_mm512_cvtepi32_ps(s[i][1]);
    }
#else
    for (int i = 0; i < rows; i++)
        for (int h = 0; h < 2; h++)
            for (int c = 0; c < 16; c++) {
                int32_t acc = -shift * total[i];
                if (kind != Q8_0)
                    for (int kk = 0; kk < 4; kk++)
                        for (int j = 0; j < 4; j++) {
                            int code = codes[(h * 4 + kk) * 64 + c * 4 + j];
                            acc += (code & 15) * xq[i * K + 8 * kk + j] + (code >> 4) * xq[i * K + 8 * kk + 4 + j];
                        }
                else
                    for (int kk = 0; kk < 8; kk++)
                        for (int j = 0; j < 4; j++)
                            acc += codes[(h * 8 + kk) * 64 + c * 4 + j] * xq[i * K + 4 * kk + j];
                out[i][h][c] = (float)acc;
            }
#endif
}

/* a quant tile's signature (QTILE, QTILE8): what cr_linear_q's switch calls */
#define QTILE_HEAD(ROWS)                                                                        \
static inline void qtile_##ROWS(const int8_t *xq, int64_t K, const float *sx, const float *sq,  \
                                int64_t groups, const uint8_t *codes, int kind, const uint16_t *d, \
                                const uint16_t *mins, const float *bias, float *y, int64_t ldy,  \
                                int64_t cols)

#define QTILE(ROWS)                                                                             \
QTILE_HEAD(ROWS) {                                                                              \
    v16 acc[ROWS][2];                                                                           \
    for (int i = 0; i < ROWS; i++) acc[i][0] = acc[i][1] = (v16){0};                           \
    int64_t group_bytes = kind == Q8_0 ? 1024 : 512;                                            \
    for (int64_t g = 0; g < groups; g++, codes += group_bytes) {                                \
        v16 isum[ROWS][2];                                                                      \
        int32_t total[ROWS];                                                                    \
        for (int i = 0; i < ROWS; i++) total[i] = (int32_t)sq[i * groups + g];                  \
        qsums(ROWS, xq + g * 32, K, codes, kind, total, isum);                                  \
        for (int h = 0; h < 2; h++) {                                                           \
            v16 dh = halves(d + g * BLOCK + 16 * h);                                            \
            v16 mh = kind == Q4_1 ? halves(mins + g * BLOCK + 16 * h) : (v16){0};               \
            for (int i = 0; i < ROWS; i++) {                                                    \
                v16 t = dh * isum[i][h];                                                        \
                if (kind == Q4_1) t += mh * ((v16){0} + sq[i * groups + g]);                    \
                acc[i][h] += ((v16){0} + sx[i * groups + g]) * t;                               \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    store_rows(ROWS, acc, bias, y, ldy, cols);                                                  \
}
#ifndef CR_QAVX2
QTILE(1)
QTILE(2)
QTILE(3)
QTILE(4)
QTILE(5)
QTILE(6)
#else
/* 8 fp16 values -> fp32, exactly */
static inline vf halves8(const uint16_t *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* qsums for one row and one quarter q of the block (columns 8 q .. 8 q + 7), the same integers:
 * Q4 codes (0..15) times xq in pairs by vpmaddubsw; Q8_0 codes as signed bytes (the stored byte
 * minus 128), |code| times xq carrying the code's sign, so a pair stays within 2 x 128 x 127 */
static inline __m256i qsum8(const int8_t *xr, const uint8_t *codes, int kind, int q, int32_t total) {
    const __m256i ones = _mm256_set1_epi16(1);
    int h = q >> 1, half = q & 1;
    __m256i s = _mm256_set1_epi32(kind == Q4_0 ? -8 * total : 0);
    if (kind != Q8_0) {
        const __m256i low = _mm256_set1_epi8(15);
        for (int kk = 0; kk < 4; kk++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(codes + (h * 4 + kk) * 64 + 32 * half));
            __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            int32_t a, b;
            memcpy(&a, xr + 8 * kk, 4);
            memcpy(&b, xr + 8 * kk + 4, 4);
            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)), ones));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_set1_epi32(b)), ones));
        }
    } else {
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        for (int kk = 0; kk < 8; kk++) {
            __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(codes + (h * 8 + kk) * 64 + 32 * half)), flip);
            int32_t a;
            memcpy(&a, xr + 4 * kk, 4);
            __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(_mm256_set1_epi32(a), v));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
        }
    }
    return s;
}

/* QTILE in quarters: each lane's fp32 operations are QTILE's, in the same order */
#define QTILE8(ROWS)                                                                            \
QTILE_HEAD(ROWS) {                                                                              \
    vf acc[ROWS][4];                                                                            \
    for (int i = 0; i < ROWS; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = (vf){0};    \
    int64_t group_bytes = kind == Q8_0 ? 1024 : 512;                                            \
    for (int64_t g = 0; g < groups; g++, codes += group_bytes)                                  \
        for (int q = 0; q < 4; q++) {                                                           \
            vf dq = halves8(d + g * BLOCK + 8 * q);                                             \
            vf mq = kind == Q4_1 ? halves8(mins + g * BLOCK + 8 * q) : (vf){0};                 \
            for (int i = 0; i < ROWS; i++) {                                                    \
                __m256i s = qsum8(xq + i * K + g * 32, codes, kind, q, (int32_t)sq[i * groups + g]); \
                vf t = dq * (vf)_mm256_cvtepi32_ps(s);                                          \
                if (kind == Q4_1) t += mq * ((vf){0} + sq[i * groups + g]);                     \
                acc[i][q] += ((vf){0} + sx[i * groups + g]) * t;                                \
            }                                                                                   \
        }                                                                                       \
    store_vrows(ROWS, acc, bias, y, ldy, cols);  /* NV is 4 here: 8-lane vf */                  \
}
QTILE8(1)
QTILE8(2)
QTILE8(3)
QTILE8(4)
QTILE8(5)
QTILE8(6)
#endif

/* M rows in tiles of at most QROWS rows, as even as possible (9 rows: 5 + 4, not 4 + 4 + 1: a
 * one-row tile unpacks every code of the block again for a single row) */
static inline int64_t tiles_for(int64_t M, int64_t widest) { return (M + widest - 1) / widest; }
static inline int tile_rows(int64_t M, int64_t n, int64_t i) { return (int)(M / n + (i < M % n)); }

/* x rounded to 8 bits per group of 32: xq [M][K] int8, sx and sq (the sum of xq) [M][K / 32] */
static void round_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *xq, float *sx, float *sq) {
    int64_t groups = K / 32;
    for (int64_t i = 0; i < M; i++)
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + i * ldx + g * 32;
            int8_t *q = xq + i * K + g * 32;
            float amax = 0;
            int32_t total = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
            /* the scalar loop's operations sixteen lanes at a time: the maximum is exact in any
             * order, the products are the same fp32 products, and the conversion rounds half to
             * even (MXCSR's default, as nearbyintf's) */
            __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
            amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            float s = amax / 127.0f, inv = s > 0 ? 1.0f / s : 0.0f;
            __m512 iv = _mm512_set1_ps(inv);
            __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, iv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, iv));
            _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(qa));
            _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(qb));
            total = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#else
            for (int k = 0; k < 32; k++) {
                float a = fabsf(xg[k]);
                amax = a > amax ? a : amax;
            }
            float s = amax / 127.0f, inv = s > 0 ? 1.0f / s : 0.0f;
            for (int k = 0; k < 32; k++) {
                int v = (int)nearbyintf(xg[k] * inv);
                q[k] = (int8_t)v;
                total += v;
            }
#endif
            sx[i * groups + g] = s;
            sq[i * groups + g] = (float)total;
        }
}

/* kind: Q8_0, Q4_1 or Q4_0 (the enum above); mins: Q4_1's, NULL otherwise */
void cr_linear_q(const float *x, int64_t ldx, const uint8_t *codes, int kind, const uint16_t *d,
                 const uint16_t *mins, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N,
                 int64_t K, float *scratch, int threads) {
    int64_t blocks = (N + BLOCK - 1) / BLOCK, groups = K / 32;
    int64_t block_bytes = kind == Q8_0 ? K * BLOCK : K / 2 * BLOCK;
    float *sx = scratch, *sq = scratch + M * groups;
    int8_t *xq = (int8_t *)(scratch + 2 * M * groups);
    round_rows(x, ldx, M, K, xq, sx, sq);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < blocks; t++) {
        int64_t n0 = t * BLOCK, cols = N - n0 < BLOCK ? N - n0 : BLOCK, m = 0, n = tiles_for(M, QROWS);
        const uint8_t *c = codes + t * block_bytes;
        const uint16_t *dd = d + n0 * groups, *mm = mins ? mins + n0 * groups : 0;
        const float *b = bias ? bias + n0 : 0;
        for (int64_t i = 0; i < n; i++) {
            int rows = tile_rows(M, n, i);
            const int8_t *xm = xq + m * K;
            const float *sxm = sx + m * groups, *sqm = sq + m * groups;
            float *ym = y + m * ldy + n0;
            switch (rows) {
            case 6: qtile_6(xm, K, sxm, sqm, groups, c, kind, dd, mm, b, ym, ldy, cols); break;
            case 5: qtile_5(xm, K, sxm, sqm, groups, c, kind, dd, mm, b, ym, ldy, cols); break;
            case 4: qtile_4(xm, K, sxm, sqm, groups, c, kind, dd, mm, b, ym, ldy, cols); break;
            case 3: qtile_3(xm, K, sxm, sqm, groups, c, kind, dd, mm, b, ym, ldy, cols); break;
            case 2: qtile_2(xm, K, sxm, sqm, groups, c, kind, dd, mm, b, ym, ldy, cols); break;
            default: qtile_1(xm, K, sxm, sqm, groups, c, kind, dd, mm, b, ym, ldy, cols); break;
            }
            m += rows;
        }
    }
}
