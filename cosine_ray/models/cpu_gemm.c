/* cosine_ray's fp32 CPU projection kernel: y = x W^T (+ b) over weights packed in 32-column
 * blocks, built on the user's machine by cosine_ray.models.cpu_gemm (cc -O3 -march=native
 * -fopenmp, linked against PyTorch's own OpenMP runtime so the two share one thread pool).
 *
 * wp  [ceil(N / 32)][K][32]  block t holds W[32 t : 32 t + 32, :] transposed, zero-padded
 * x   [M][ldx]               fp32 rows; y [M][ldy]
 *
 * Every y[m, n] is one register lane summed over k = 0, 1, ..., K - 1 in that order: the result
 * of a row never depends on M, on the tile that computed it, or on the thread count (the kernel
 * is row-invariant and deterministic). At M = 1 a block is one contiguous stream: the step reads
 * the weights at the machine's memory bandwidth. Wider tiles (2, 4, 8 rows with AVX-512; 2
 * without) reuse each loaded weight vector across rows for the verify steps and prefills. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v16_alias __attribute__((vector_size(64), aligned(4), may_alias));
#define BLOCK 32

/* Direct unaligned 64-byte accesses, not memcpy: GCC (-march=native tuned for 256-bit moves)
 * expands that into two 32-byte loads, a store to the stack and a 64-byte reload, a
 * store-forwarding stall on every weight vector. */
static inline v16 load16(const float *p) { return *(const v16_alias *)p; }
static inline void store16(float *p, v16 v) { *(v16_alias *)p = v; }

/* a tile's sums (+ bias) into the first ``cols`` columns of its ``rows`` rows of y */
static inline void store_rows(int rows, v16 (*acc)[2], const float *bias, float *y, int64_t ldy,
                              int64_t cols) {
    for (int i = 0; i < rows; i++) {
        if (bias) { acc[i][0] += load16(bias); acc[i][1] += load16(bias + 16); }
        float out[BLOCK];
        store16(out, acc[i][0]);
        store16(out + 16, acc[i][1]);
        memcpy(y + i * ldy, out, (size_t)cols * sizeof(float));
    }
}

/* The fp32 tiles work in the widest vectors the CPU has: one 16-lane register per half block
 * with AVX-512, 8-lane ones otherwise. GCC holds a 64-byte vector in registers only where the
 * CPU has 64-byte registers; without AVX-512 it kept every v16 accumulator on the stack and
 * broadcast x through 16 scalar stores (4-9x slower than PyTorch on an AVX2 EPYC). Each lane's
 * arithmetic is the same at either width, so the bits are too. */
#if defined(__AVX512F__)
#define VL 16
#define TILE_ROWS 8  /* the widest fp32 tile: 8 rows x 2 accumulators, in 32 registers */
#else
#define VL 8
#define TILE_ROWS 2  /* 2 rows x 4 accumulators + 4 weight vectors + x, in 16 registers */
#endif
typedef float vf __attribute__((vector_size(VL * 4), aligned(4)));
typedef float vf_alias __attribute__((vector_size(VL * 4), aligned(4), may_alias));
#define NV (BLOCK / VL)
static inline vf loadv(const float *p) { return *(const vf_alias *)p; }
static inline void storev(float *p, vf v) { *(vf_alias *)p = v; }

/* store_rows for tiles in vf registers */
static inline void store_vrows(int rows, vf (*acc)[NV], const float *bias, float *y, int64_t ldy, int64_t cols) {
    for (int i = 0; i < rows; i++) {
        float out[BLOCK];
        for (int j = 0; j < NV; j++) storev(out + j * VL, bias ? acc[i][j] + loadv(bias + j * VL) : acc[i][j]);
        memcpy(y + i * ldy, out, (size_t)cols * sizeof(float));
    }
}

#define TILE(ROWS)                                                                              \
static inline void tile_##ROWS(const float *x, int64_t ldx, const float *blk, int64_t K,        \
                               const float *bias, float *y, int64_t ldy, int64_t cols) {       \
    vf acc[ROWS][NV];                                                                           \
    for (int i = 0; i < ROWS; i++)                                                              \
        for (int j = 0; j < NV; j++) acc[i][j] = (vf){0};                                       \
    for (int64_t k = 0; k < K; k++, blk += BLOCK) {                                             \
        vf w[NV];                                                                               \
        for (int j = 0; j < NV; j++) w[j] = loadv(blk + j * VL);                                \
        for (int i = 0; i < ROWS; i++) {                                                        \
            vf xv = (vf){0} + x[i * ldx + k];                                                   \
            for (int j = 0; j < NV; j++) acc[i][j] += xv * w[j];                                \
        }                                                                                       \
    }                                                                                           \
    store_vrows(ROWS, acc, bias, y, ldy, cols);                                                 \
}
TILE(1)
TILE(2)
#if TILE_ROWS == 8
TILE(4)
TILE(8)
#endif

/* bias: NULL or padded to a multiple of 32 */
void cr_linear_f32(const float *x, int64_t ldx, const float *wp, const float *bias, float *y,
                   int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    int64_t blocks = (N + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < blocks; t++) {
        int64_t n0 = t * BLOCK, cols = N - n0 < BLOCK ? N - n0 : BLOCK, m = 0;
        const float *blk = wp + n0 * K, *b = bias ? bias + n0 : 0;
#if TILE_ROWS == 8
        for (; m + 8 <= M; m += 8) tile_8(x + m * ldx, ldx, blk, K, b, y + m * ldy + n0, ldy, cols);
        if (m + 4 <= M) { tile_4(x + m * ldx, ldx, blk, K, b, y + m * ldy + n0, ldy, cols); m += 4; }
#endif
        for (; m + 2 <= M; m += 2) tile_2(x + m * ldx, ldx, blk, K, b, y + m * ldy + n0, ldy, cols);
        if (m < M) tile_1(x + m * ldx, ldx, blk, K, b, y + m * ldy + n0, ldy, cols);
    }
}

/* ---- GGUF blocks kept quantized: y = x W^T (+ b), W in groups of 32 along k ------------------
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
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
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

/* ---- a decoder layer's work around its attention, in two calls --------------------------------
 *
 * At one row a layer's projections take a few microseconds each, and the small operations
 * between them (two RMS norms, RoPE, two residual adds, SiLU * up) cost as much again as
 * separate PyTorch calls. ``cr_layer_pre`` and ``cr_layer_post`` run them here, around the
 * projections above, row by row: a row's result never depends on the other rows or on the
 * thread count, as with the kernels alone.
 *
 * A projection: kind 0 = fp32 blocks (``cr_linear_f32``), 1 + Q8_0 / Q4_1 / Q4_0 = GGUF codes. */
#include <math.h>

#define MAX_HEAD_DIM 1024  /* cpu_gemm.MAX_HEAD_DIM: a stage with wider heads is not fused */

typedef struct {
    int64_t kind, N, K;
    const void *weight;  /* fp32 blocks, or the codes */
    const uint16_t *d, *m;  /* GGUF only: fp16 scales and Q4_1's mins */
    const float *bias;
} cr_proj;

static void project(const cr_proj *p, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t M,
                    float *xsum, int threads) {
    if (p->kind == 0)
        cr_linear_f32(x, ldx, (const float *)p->weight, p->bias, y, ldy, M, p->N, p->K, threads);
    else
        cr_linear_q(x, ldx, (const uint8_t *)p->weight, (int)p->kind - 1, p->d, p->m, p->bias, y, ldy, M, p->N,
                    p->K, xsum, threads);
}

/* Rows past this many share the small operations' loops among the threads (each row is still
 * computed by one thread, in one order). */
#define PARALLEL_ROWS 4

/* out = w * (x / sqrt(mean(x^2) + eps)), row by row (transformers' LlamaRMSNorm in fp32) */
static void rms_norm_rows(const float *x, const float *w, float eps, float *out, int64_t M, int64_t H,
                          int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if(M >= PARALLEL_ROWS)
    for (int64_t i = 0; i < M; i++) {
        const float *r = x + i * H;
        float *o = out + i * H;
        float ss = 0;
        for (int64_t j = 0; j < H; j++) ss += r[j] * r[j];
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t j = 0; j < H; j++) o[j] = w[j] * (r[j] * inv);
    }
}

/* h = rms_norm(x); qkv = h Wqkv^T (+ b); then each of the first ``rot_heads`` heads of a row is
 * rotated: v * cos + roll(v, hd / 2) * ssin (``models.llama._apply_rope``), cos and ssin [M][hd].
 * x, h [M][H]; qkv [M][qkv->N] */
void cr_layer_pre(const float *x, int64_t M, int64_t H, const float *norm, float eps, const cr_proj *qkv,
                  const float *cos_t, const float *ssin_t, int64_t rot_heads, int64_t hd, float *h, float *out,
                  float *xsum, int threads) {
    rms_norm_rows(x, norm, eps, h, M, H, threads);
    project(qkv, h, H, out, qkv->N, M, xsum, threads);
    int64_t half = hd / 2;
    #pragma omp parallel for schedule(static) num_threads(threads) if(M >= PARALLEL_ROWS)
    for (int64_t i = 0; i < M; i++) {
        float tmp[MAX_HEAD_DIM];
        const float *c = cos_t + i * hd, *s = ssin_t + i * hd;
        for (int64_t hh = 0; hh < rot_heads; hh++) {
            float *v = out + i * qkv->N + hh * hd;
            memcpy(tmp, v, (size_t)hd * sizeof(float));
            for (int64_t j = 0; j < half; j++) v[j] = tmp[j] * c[j] + tmp[j + half] * s[j];
            for (int64_t j = half; j < hd; j++) v[j] = tmp[j] * c[j] + tmp[j - half] * s[j];
        }
    }
}

/* x += attn Wo^T; h = rms_norm(x); gu = h Wgu^T; act = silu(gate) * up; x += act Wdown^T.
 * x, h [M][H]; attn [M][o->K]; gu [M][2 I]; act [M][I] */
void cr_layer_post(float *x, int64_t M, int64_t H, const float *attn, const cr_proj *o, const float *norm,
                   float eps, const cr_proj *gate_up, const cr_proj *down, float *h, float *gu, float *act,
                   float *xsum, int threads) {
    int64_t inter = down->K;
    project(o, attn, o->K, h, H, M, xsum, threads);
    for (int64_t i = 0; i < M * H; i++) x[i] += h[i];
    rms_norm_rows(x, norm, eps, h, M, H, threads);
    project(gate_up, h, H, gu, 2 * inter, M, xsum, threads);
    #pragma omp parallel for schedule(static) num_threads(threads) if(M >= PARALLEL_ROWS)
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < inter; j++) {
            float g = gu[i * 2 * inter + j];
            act[i * inter + j] = g / (1.0f + expf(-g)) * gu[i * 2 * inter + inter + j];
        }
    project(down, act, inter, h, H, M, xsum, threads);
    for (int64_t i = 0; i < M * H; i++) x[i] += h[i];
}

/* ---- attention of a step's query rows over the KV pool -------------------------------------
 *
 * Every query row of a fused stage's step, prefill chains included (``cr_attend_rows`` below says
 * how a row is computed). q, out: row stride ldq / ldo floats, heads * hd each; kpool, vpool
 * [slots][kv_heads][hd]. */
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t vi16 __attribute__((vector_size(64)));

/* the 16 lanes' sum, halves added pairwise: one fixed order */
static inline float hsum16(v16 v) {
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* a . b over n floats, serially (heads whose width is not a multiple of 16) */
static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0;
    for (int64_t j = 0; j < n; j++) s += a[j] * b[j];
    return s;
}

/* e^x for 16 lanes of x <= 0 (x below -87 gives e^-87): Cephes' expf, a degree-6 polynomial
 * on x - n ln 2 and 2^n from the exponent bits; within 2 ulp of expf, the same bits for a lane
 * whatever its neighbours */
static inline v16 exp16(v16 x) {
    const v16 lo = (v16){} - 87.0f, log2e = (v16){} + 1.44269504088896341f, magic = (v16){} + 12582912.0f;
    vi16 low = x < lo;
    x = (v16)(((vi16)lo & low) | ((vi16)x & ~low));
    v16 n = (x * log2e + magic) - magic;  /* round to nearest */
    v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = (v16){} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    return p * (v16)((__builtin_convertvector(n, vi16) + 127) << 23);
}

/* 16 keys' dot products at once: acc[k] holds key k's 16 lane partials; the result's lane k is
 * their sum, halves added pairwise (the same order as hsum16), whichever keys share the call */
static inline v16 hsum16x16(const v16 *acc) {
    v16 r[8], u[4], w[2];
    for (int p = 0; p < 8; p++)
        r[p] = __builtin_shufflevector(acc[2 * p], acc[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(acc[2 * p], acc[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int p = 0; p < 4; p++)
        u[p] = __builtin_shufflevector(r[2 * p], r[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(r[2 * p], r[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int p = 0; p < 2; p++)
        w[p] = __builtin_shufflevector(u[2 * p], u[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(u[2 * p], u[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

static const float zero_key[MAX_HEAD_DIM];

#define ROW_TILE 8  /* rows of one key list attended together: each key and value read once for them */

/* o += sum over k < nk of p[k] * v[k] (hd floats), k in order: each float a chain of fused
 * multiply-adds, held in a register across the nk keys (v16 lanes when hd % 16 == 0) */
static inline void add_scaled(float *o, const float *p, const float *const *v, int nk, int64_t hd) {
    if (hd % 16) {
        for (int k = 0; k < nk; k++)
            for (int64_t j = 0; j < hd; j++) o[j] += p[k] * v[k][j];
        return;
    }
    int64_t j = 0;
    for (; j + 64 <= hd; j += 64) {  /* four chains in flight, k outermost: each float's chain still runs k in order */
        v16 a0 = load16(o + j), a1 = load16(o + j + 16), a2 = load16(o + j + 32), a3 = load16(o + j + 48);
        for (int k = 0; k < nk; k++) {
            const float *vk = v[k] + j;
            a0 += p[k] * load16(vk);
            a1 += p[k] * load16(vk + 16);
            a2 += p[k] * load16(vk + 32);
            a3 += p[k] * load16(vk + 48);
        }
        store16(o + j, a0);
        store16(o + j + 16, a1);
        store16(o + j + 32, a2);
        store16(o + j + 48, a3);
    }
    for (; j < hd; j += 16) {
        v16 acc = load16(o + j);
        for (int k = 0; k < nk; k++) acc += p[k] * load16(v[k] + j);
        store16(o + j, acc);
    }
}

/* add_scaled for two rows over the same 16 value vectors (hd % 16 == 0): each vector loaded
 * serves both, every float's chain over k in order as alone */
static inline void add_scaled2(float *oa, float *ob, const float *pa, const float *pb, const float *const *v,
                               int64_t hd) {
    int64_t j = 0;
    for (; j + 64 <= hd; j += 64) {
        v16 a0 = load16(oa + j), a1 = load16(oa + j + 16), a2 = load16(oa + j + 32), a3 = load16(oa + j + 48);
        v16 b0 = load16(ob + j), b1 = load16(ob + j + 16), b2 = load16(ob + j + 32), b3 = load16(ob + j + 48);
        for (int k = 0; k < 16; k++) {
            const float *vk = v[k] + j;
            v16 v0 = load16(vk), v1 = load16(vk + 16), v2 = load16(vk + 32), v3 = load16(vk + 48);
            a0 += pa[k] * v0;
            a1 += pa[k] * v1;
            a2 += pa[k] * v2;
            a3 += pa[k] * v3;
            b0 += pb[k] * v0;
            b1 += pb[k] * v1;
            b2 += pb[k] * v2;
            b3 += pb[k] * v3;
        }
        store16(oa + j, a0);
        store16(oa + j + 16, a1);
        store16(oa + j + 32, a2);
        store16(oa + j + 48, a3);
        store16(ob + j, b0);
        store16(ob + j + 16, b1);
        store16(ob + j + 32, b2);
        store16(ob + j + 48, b3);
    }
    for (; j < hd; j += 16) {
        v16 a = load16(oa + j), b = load16(ob + j);
        for (int k = 0; k < 16; k++) {
            v16 x = load16(v[k] + j);
            a += pa[k] * x;
            b += pb[k] * x;
        }
        store16(oa + j, a);
        store16(ob + j, b);
    }
}

/* the largest of s[0 .. n), n >= 1 */
static inline float max_of(const float *s, int64_t n) {
    v16 m = (v16){} - INFINITY;
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        v16 x = load16(s + c);
        vi16 more = x > m;
        m = (v16)(((vi16)x & more) | ((vi16)m & ~more));
    }
    float best = -INFINITY;
    for (int l = 0; l < 16; l++) best = m[l] > best ? m[l] : best;
    for (; c < n; c++) best = s[c] > best ? s[c] : best;
    return best;
}

/* k and v of T new tokens (rows of ldk / ldv floats, width floats each) into pool slots ``slots`` */
static void write_kv(const float *k, int64_t ldk, const float *v, int64_t ldv, int64_t T, const int64_t *slots,
                     float *kpool, float *vpool, int64_t width) {
    for (int64_t t = 0; t < T; t++) {
        memcpy(kpool + slots[t] * width, k + t * ldk, (size_t)width * sizeof(float));
        memcpy(vpool + slots[t] * width, v + t * ldv, (size_t)width * sizeof(float));
    }
}

/* the 16 pool vectors of a row's keys c0 .. c0 + 15 (its list ks, n keys; zeros past them) */
static inline void chunk_ptrs(const float **p, const float *pool, const int64_t *ks, int64_t n, int64_t c0,
                              int64_t stride, int64_t offset) {
    for (int k = 0; k < 16; k++) p[k] = c0 + k < n ? pool + ks[c0 + k] * stride + offset : zero_key;
}

/* whether two rows' chunks read the same vectors wherever both have keys (k < both) */
static inline int same_ptrs(const float *const *a, const float *const *b, int64_t both) {
    for (int64_t k = 0; k < both && k < 16; k++)
        if (a[k] != b[k]) return 0;
    return 1;
}

/* Attention of R query rows, each over its own list of pool slots: row ``rows[r]`` of q sees
 * keys[start[r] : start[r] + count[r]] in that order. Every row's arithmetic is the same, alone
 * or beside others: each score one 16-lane sum over the head's vectors in order, reduced as
 * ``hsum16x16`` does; their maximum; e^(score - max) 16 lanes at a time summed into 16 lanes then
 * ``hsum16``; the output a fused multiply-add chain over the keys in order. So a row's output
 * depends only on its query and its keys, never on the other rows of the call, on how a prompt
 * was split into chunks or on the thread count. Up to ROW_TILE consecutive rows whose lists begin
 * with the same slot (a prefill chain's rows, each seeing a prefix of one list; a token tree's
 * rows, each seeing the committed keys then its own branch) share a task per head, and are taken
 * two at a time wherever both read the same 16 keys, so each key and value vector loaded there
 * serves two rows. scores: [threads][ROW_TILE][max_keys rounded up to 16] floats, a buffer per
 * thread. The step's n_new new keys and values (k_new, v_new rows of ldk / ldv floats) are first
 * written to their pool slots new_slots. */
void cr_attend_rows(const float *q, int64_t ldq, const int64_t *rows, int64_t R, const int64_t *start,
                    const int64_t *count, const int64_t *keys, float *kpool, float *vpool, int64_t heads,
                    int64_t kv_heads, int64_t hd, float scale, float *out, int64_t ldo, float *scores,
                    int64_t max_keys, int threads, const float *k_new, int64_t ldk, const float *v_new, int64_t ldv,
                    int64_t n_new, const int64_t *new_slots) {
    write_kv(k_new, ldk, v_new, ldv, n_new, new_slots, kpool, vpool, kv_heads * hd);
    int64_t group = heads / kv_heads, stride = kv_heads * hd, width = (max_keys + 15) / 16 * 16;
    /* tile i: rows tiles[i] .. tiles[i + 1] - 1; cost[i]: the keys its rows read, and all tiles' before it */
    int64_t *tiles = malloc((size_t)(2 * R + 2) * sizeof *tiles), *cost = tiles + R + 1, T = 0;
    for (int64_t r = 0; r < R; r++)
        if (r == 0 || keys[start[r]] != keys[start[tiles[T - 1]]] || r - tiles[T - 1] == ROW_TILE)
            tiles[T++] = r;
    tiles[T] = R;
    cost[0] = 0;
    for (int64_t i = 0; i < T; i++) {
        cost[i + 1] = cost[i] + 16;  /* a task's fixed work */
        for (int64_t r = tiles[i]; r < tiles[i + 1]; r++) cost[i + 1] += count[r];
    }
    /* a task per tile and head, tile-major; each thread takes a run of consecutive tasks of about
     * equal cost (a task goes to the thread whose share holds its midpoint), so the heads of one
     * KV head and the tiles of one request stay on one thread and read their keys once */
    int64_t tasks = T * heads, parts = tasks >= 4 ? threads : 1, total = 2 * cost[T] * heads;
    #pragma omp parallel for schedule(static, 1) num_threads(threads) if(parts > 1)
    for (int64_t part = 0; part < parts; part++)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t tile = t / heads, own = cost[tile + 1] - cost[tile];
        if ((2 * (cost[tile] * heads + t % heads * own) + own) * parts / total != part) continue;
        int64_t first = tiles[tile], rn = tiles[tile + 1] - first, h = t % heads, kvh = h / group;
        float *buf = scores + (int64_t)omp_get_thread_num() * ROW_TILE * width, m[ROW_TILE];
        const int64_t *ks[ROW_TILE];
        const float *qr[ROW_TILE], *p[ROW_TILE][16];
        int64_t n[ROW_TILE], most = 0;
        for (int64_t i = 0; i < rn; i++) {
            n[i] = count[first + i];
            ks[i] = keys + start[first + i];
            qr[i] = q + rows[first + i] * ldq + h * hd;
            most = n[i] > most ? n[i] : most;
        }
        for (int64_t c0 = 0; c0 < most; c0 += 16) {
            for (int64_t i = 0; i < rn; i++)
                if (c0 < n[i]) chunk_ptrs(p[i], kpool, ks[i], n[i], c0, stride, kvh * hd);
            if (hd % 16) {
                for (int64_t i = 0; i < rn; i++)
                    for (int k = 0; k < 16 && c0 + k < n[i]; k++) buf[i * width + c0 + k] = scale * dot(qr[i], p[i][k], hd);
                continue;
            }
            for (int64_t i = 0; i < rn;) {
                if (c0 >= n[i]) {
                    i++;
                    continue;
                }
                int64_t both = i + 1 < rn ? (n[i] < n[i + 1] ? n[i] : n[i + 1]) - c0 : 0;
                if (both > 0 && same_ptrs(p[i], p[i + 1], both)) {  /* two rows: each key vector serves both */
                    const float *kv[16];  /* past one row's keys, the other's (the first's scores there are ignored) */
                    for (int k = 0; k < 16; k++) kv[k] = c0 + k < n[i] ? p[i][k] : p[i + 1][k];
                    const float *qa = qr[i], *qb = qr[i + 1];
                    for (int half = 0; half < 16; half += 8) {
                        v16 acc[16];  /* 0-7: row i's keys c0 + half + 0..7; 8-15: row i + 1's */
                        for (int k = 0; k < 8; k++) {
                            v16 kk = load16(kv[half + k]);
                            acc[k] = load16(qa) * kk;
                            acc[8 + k] = load16(qb) * kk;
                        }
                        for (int64_t j = 16; j < hd; j += 16) {
                            v16 a = load16(qa + j), b = load16(qb + j);
                            for (int k = 0; k < 8; k++) {
                                v16 kk = load16(kv[half + k] + j);
                                acc[k] += a * kk;
                                acc[8 + k] += b * kk;
                            }
                        }
                        v16 sc = hsum16x16(acc) * scale;
                        memcpy(buf + i * width + c0 + half, &sc, 8 * sizeof(float));
                        memcpy(buf + (i + 1) * width + c0 + half, (float *)&sc + 8, 8 * sizeof(float));
                    }
                    i += 2;
                    continue;
                }
                v16 acc[16];
                for (int k = 0; k < 16; k++) acc[k] = load16(qr[i]) * load16(p[i][k]);
                for (int64_t j = 16; j < hd; j += 16) {
                    v16 qj = load16(qr[i] + j);
                    for (int k = 0; k < 16; k++) acc[k] += qj * load16(p[i][k] + j);
                }
                store16(buf + i * width + c0, hsum16x16(acc) * scale);
                i++;
            }
        }
        for (int64_t i = 0; i < rn; i++) m[i] = max_of(buf + i * width, n[i]);
        float inv[ROW_TILE];
        for (int64_t i = 0; i < rn; i++) {
            float *s = buf + i * width;
            v16 sums = {};
            int64_t c = 0;
            for (; c + 16 <= n[i]; c += 16) {
                v16 e = exp16(load16(s + c) - m[i]);
                store16(s + c, e);
                sums += e;
            }
            if (c < n[i]) {  /* the lanes past the row's keys count as zero */
                v16 x = load16(s + c) - m[i], e;
                for (int64_t l = n[i] - c; l < 16; l++) x[l] = 0;
                e = exp16(x);
                for (int64_t l = n[i] - c; l < 16; l++) e[l] = 0;
                store16(s + c, e);
                sums += e;
            }
            inv[i] = 1.0f / hsum16(sums);
            float *o = out + rows[first + i] * ldo + h * hd;
            for (int64_t j = 0; j < hd; j++) o[j] = 0;
        }
        for (int64_t c0 = 0; c0 < most; c0 += 16) {  /* 16 keys' values at a time */
            for (int64_t i = 0; i < rn; i++)
                if (c0 < n[i]) chunk_ptrs(p[i], vpool, ks[i], n[i], c0, stride, kvh * hd);
            for (int64_t i = 0; i < rn;) {
                if (c0 >= n[i]) {
                    i++;
                    continue;
                }
                float *oa = out + rows[first + i] * ldo + h * hd;
                if (hd % 16 == 0 && i + 1 < rn && n[i] - c0 >= 16 && n[i + 1] - c0 >= 16 &&
                    same_ptrs(p[i], p[i + 1], 16)) {  /* two rows with 16 keys each here: each value vector serves both */
                    float *ob = out + rows[first + i + 1] * ldo + h * hd;
                    add_scaled2(oa, ob, buf + i * width + c0, buf + (i + 1) * width + c0, p[i], hd);
                    i += 2;
                    continue;
                }
                int64_t nk = n[i] - c0 < 16 ? n[i] - c0 : 16;
                add_scaled(oa, buf + i * width + c0, p[i], (int)nk, hd);
                i++;
            }
        }
        for (int64_t i = 0; i < rn; i++) {
            float *o = out + rows[first + i] * ldo + h * hd;
            for (int64_t j = 0; j < hd; j++) o[j] *= inv[i];
        }
    }
    free(tiles);
}

/* ---- a stage's decoder layers in one call -------------------------------------------------------
 *
 * ``cr_layer_pre``, ``cr_attend_rows`` and ``cr_layer_post`` for every layer of a stage, in order,
 * the same calls with the same arguments as one per layer from Python (so the same bits), with no
 * Python between the layers. */
typedef struct {
    const float *input_norm, *post_norm;
    const cr_proj *qkv, *o, *gate_up, *down;
} cr_layer;

/* x [M][H] in place. The KV pool: [layers][2][pool_slots][kv_heads][hd] fp32 (``models.kv_cache``);
 * the rows' keys as for ``cr_attend_rows``; new_slots [M]: each row's own pool slot. Scratch: h [M][H],
 * qkv [M][qkv->N], gu [M][2 I], act [M][I], attn [M][heads * hd], xsum (``quant_scratch``), scores
 * as ``cr_attend_rows`` takes it. */
void cr_stage_layers(float *x, int64_t M, int64_t H, const cr_layer *layers, int64_t L, float eps,
                     const float *cos_t, const float *ssin_t, int64_t heads, int64_t kv_heads, int64_t hd,
                     float scale, const int64_t *rows, int64_t R, const int64_t *start, const int64_t *count,
                     const int64_t *keys, int64_t max_keys, float *pool, int64_t pool_slots,
                     const int64_t *new_slots, float *h, float *qkv, float *gu, float *act, float *attn,
                     float *xsum, float *scores, int threads) {
    int64_t plane = pool_slots * kv_heads * hd;
    for (int64_t l = 0; l < L; l++) {
        const cr_layer *y = layers + l;
        int64_t n = y->qkv->N;
        float *kpool = pool + 2 * l * plane;
        cr_layer_pre(x, M, H, y->input_norm, eps, y->qkv, cos_t, ssin_t, heads + kv_heads, hd, h, qkv, xsum,
                     threads);
        cr_attend_rows(qkv, n, rows, R, start, count, keys, kpool, kpool + plane, heads, kv_heads, hd, scale,
                       attn, heads * hd, scores, max_keys, threads, qkv + heads * hd, n,
                       qkv + (heads + kv_heads) * hd, n, M, new_slots);
        cr_layer_post(x, M, H, attn, y->o, y->post_norm, eps, y->gate_up, y->down, h, gu, act, xsum, threads);
    }
}
