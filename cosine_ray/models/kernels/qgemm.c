/* GGUF projections kept quantized: y = x W^T (+ b), W in groups of 32 along k (qgemm.py lays the
 * codes out, models.weights.quant reads them from the file).
 *
 * Each row of x is first rounded to 8 bits per group of 32 (qround.c: scale s, codes xq, their
 * sum T and the sum T0 of the first 16). Then, per group, with the integer sums S = sum_k q xq
 * (S0, S1: over the group's first and last 16 k):
 *
 *   Q8_0            y += s (d S)                    w = d q          (q stored + 128: S - 128 T)
 *   Q4_0, Q5_0      y += s (d (S - 8 T | - 16 T))   w = d (q - 8 | 16)
 *   Q4_1, Q5_1      y += s (d S + m T)              w = d q + m
 *   Q4_K, Q5_K      y += s (D S - M T)              w = D q - M,  D = d sc, M = dmin mn
 *   Q6_K            y += s (D0 (S0 - 32 T0) + D1 (S1 - 32 (T - T0)))   w = D (q - 32) per 16
 *
 * which is exactly the file's weights times the rounded x. The K formats' D and M are products
 * of the superblock's fp16 d and dmin with the group's 6-bit scales (Q6_K: int8, one a half),
 * exact in fp32. The integer sums are exact in any order (VNNI's vpdpbusd, AVX2's vpmaddubsw +
 * vpmaddwd, or plain C: the same integers), the fp32 operations on them are fused multiply-adds
 * spelled out (simd.h's fmav), and the groups go in order, so a row's result never depends on M,
 * the tile, the threads or the instruction set.
 *
 * Layout, per block of 32 columns (n = 32 t + 16 h + c) and group g, 64 bytes per (h, kk):
 *   4-bit (Q4_0, Q4_1, Q4_K)  [ceil(N / 32)][K / 32][2 h][4 kk][16 c][4 j]  (k = 8 kk + j) | (k = 8 kk + 4 + j) << 4
 *   bytes (the others)        [ceil(N / 32)][K / 32][2 h][8 kk][16 c][4 j]  the code of k = 4 kk + j (Q8_0: + 128)
 *   d, m  fp16 [ceil(N / 32)][K / 32][32] per group (m: Q4_1, Q5_1; NULL otherwise), or the K
 *         formats' d and dmin per superblock, [ceil(N / 32)][K / 256][32]
 *   sub   [ceil(N / 32)][K / 32][2][32] bytes, K formats only: sc then mn (Q4_K, Q5_K), or the
 *         int8 scales of the group's two halves (Q6_K)
 * Four consecutive k of one column share a 32-bit lane: one vpdpbusd takes 16 columns x 4 k.
 * scratch: [M][K / 32] floats x 11 (quant_scratch: the rounded rows, their scales and sums). */
#include <math.h>

#include "kernels.h"
#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define CR_VNNI 1
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__F16C__)
#define CR_QAVX2 1  /* 8-lane quarters: vpmaddubsw + vpmaddwd (no pair of products reaches 16 bits) */
#endif

enum { Q8_0 = 0, Q4_1 = 1, Q4_0 = 2, Q5_0 = 3, Q5_1 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7 };

static inline int four_bit(int kind) { return kind == Q4_0 || kind == Q4_1 || kind == Q4_K; }
static inline int k_format(int kind) { return kind >= Q4_K; }
static inline int32_t shift_of(int kind) {
    return kind == Q8_0 ? 128 : kind == Q4_0 ? 8 : kind == Q5_0 ? 16 : kind == Q6_K ? 32 : 0;
}

/* Column vectors a pass of a tile of R rows takes: the block's two with 16 lanes; with 8, all
 * four for one row, two for two and one for more, so that a tile's sums stay in 16 registers. */
#if VL == 16
#define PASSES(R) 2
#define QROWS 6  /* the widest tile: wider ones run out of vector registers */
#else
#define PASSES(R) ((R) == 1 ? 4 : (R) == 2 ? 2 : 1)
#define QROWS 4
#endif

/* VL fp16 values -> fp32, exactly (F16C, or by their bits) */
static inline vf halves_v(const uint16_t *p) {
#if VL == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf out;
    for (int i = 0; i < VL; i++) {
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

/* VL bytes (unsigned, or int8) -> fp32 */
static inline vf bytes_v(const uint8_t *p, int is_signed) {
#if VL == 16
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return (vf)_mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return (vf)_mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
    vf out;
    for (int i = 0; i < VL; i++) out[i] = is_signed ? (float)(int8_t)p[i] : (float)p[i];
    return out;
#endif
}

/* A group's integer sums for ``rows`` rows (xg: row 0's 32 codes, rows K apart) over the
 * columns of vectors cv0 .. cv0 + PASS - 1, as floats, the shift taken: S[i][p] (SPLIT, Q6_K:
 * over the first 16 k, S2[i][p] over the last 16). T[i * gs], T0[i * gs]: row i's sums of all
 * its codes and of the first 16. NIB: 4-bit codes (else bytes). Q8 (Q8_0, with AVX2): its codes
 * as signed bytes (the stored byte minus 128, so no shift), |code| times xq carrying the code's
 * sign; the other byte formats' codes (at most 63) as they are. */
static inline __attribute__((always_inline)) void group_sums(int rows, const int8_t *xg, int64_t K, const uint8_t *cg,
                                                             int kind, const int NIB, const int SPLIT, const int Q8, int cv0,
                                                             const int PASS, const float *T, const float *T0, int64_t gs,
                                                             vf (*S)[NV], vf (*S2)[NV]) {
    int32_t shift = shift_of(kind);
#if defined(CR_VNNI)
    __m512i s[QROWS][NV], s2[QROWS][NV];
    for (int i = 0; i < rows; i++) {
        int32_t t = (int32_t)T[i * gs], t0 = (int32_t)T0[i * gs];
        for (int p = 0; p < PASS; p++) {
            s[i][p] = _mm512_set1_epi32(-shift * (SPLIT ? t0 : t));
            if (SPLIT) s2[i][p] = _mm512_set1_epi32(-shift * (t - t0));
        }
    }
    if (NIB) {
        const __m512i low = _mm512_set1_epi8(15);
        for (int kk = 0; kk < 4; kk++) {
            __m512i lo[NV], hi[NV];
            for (int p = 0; p < PASS; p++) {
                __m512i v = _mm512_loadu_si512(cg + ((cv0 + p) * 4 + kk) * 64);
                lo[p] = _mm512_and_si512(v, low);
                hi[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            for (int i = 0; i < rows; i++) {
                int32_t a, b;
                memcpy(&a, xg + i * K + 8 * kk, 4);
                memcpy(&b, xg + i * K + 8 * kk + 4, 4);
                __m512i xa = _mm512_set1_epi32(a), xb = _mm512_set1_epi32(b);
                for (int p = 0; p < PASS; p++)
                    s[i][p] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[i][p], lo[p], xa), hi[p], xb);
            }
        }
    } else {
        for (int kk = 0; kk < 8; kk++) {
            __m512i v[NV];
            for (int p = 0; p < PASS; p++) v[p] = _mm512_loadu_si512(cg + ((cv0 + p) * 8 + kk) * 64);
            for (int i = 0; i < rows; i++) {
                int32_t a;
                memcpy(&a, xg + i * K + 4 * kk, 4);
                __m512i xa = _mm512_set1_epi32(a);
                for (int p = 0; p < PASS; p++) {
                    if (SPLIT && kk >= 4) s2[i][p] = _mm512_dpbusd_epi32(s2[i][p], v[p], xa);
                    else s[i][p] = _mm512_dpbusd_epi32(s[i][p], v[p], xa);
                }
            }
        }
    }
    for (int i = 0; i < rows; i++)
        for (int p = 0; p < PASS; p++) {
            S[i][p] = (vf)_mm512_cvtepi32_ps(s[i][p]);
            if (SPLIT) S2[i][p] = (vf)_mm512_cvtepi32_ps(s2[i][p]);
        }
#elif defined(CR_QAVX2)
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s[QROWS][NV], s2[QROWS][NV];
    for (int i = 0; i < rows; i++) {
        int32_t t = (int32_t)T[i * gs], t0 = (int32_t)T0[i * gs];
        for (int p = 0; p < PASS; p++) {
            s[i][p] = _mm256_set1_epi32(Q8 ? 0 : -shift * (SPLIT ? t0 : t));
            if (SPLIT) s2[i][p] = _mm256_set1_epi32(-shift * (t - t0));
        }
    }
    if (NIB) {
        const __m256i low = _mm256_set1_epi8(15);
        for (int kk = 0; kk < 4; kk++)
            for (int p = 0; p < PASS; p++) {
                int h = (cv0 + p) >> 1, half = (cv0 + p) & 1;
                __m256i v = _mm256_loadu_si256((const __m256i *)(cg + (h * 4 + kk) * 64 + 32 * half));
                __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                for (int i = 0; i < rows; i++) {
                    int32_t a, b;
                    memcpy(&a, xg + i * K + 8 * kk, 4);
                    memcpy(&b, xg + i * K + 8 * kk + 4, 4);
                    __m256i pa = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a));
                    __m256i pb = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(b));
                    s[i][p] = _mm256_add_epi32(s[i][p], _mm256_madd_epi16(_mm256_add_epi16(pa, pb), ones));
                }
            }
    } else {
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        for (int kk = 0; kk < 8; kk++)
            for (int p = 0; p < PASS; p++) {
                int h = (cv0 + p) >> 1, half = (cv0 + p) & 1;
                __m256i v = _mm256_loadu_si256((const __m256i *)(cg + (h * 8 + kk) * 64 + 32 * half));
                __m256i c = _mm256_xor_si256(v, flip), mag = Q8 ? _mm256_abs_epi8(c) : v;
                for (int i = 0; i < rows; i++) {
                    int32_t a;
                    memcpy(&a, xg + i * K + 4 * kk, 4);
                    __m256i x = _mm256_set1_epi32(a);
                    __m256i q = _mm256_madd_epi16(_mm256_maddubs_epi16(mag, Q8 ? _mm256_sign_epi8(x, c) : x), ones);
                    if (SPLIT && kk >= 4) s2[i][p] = _mm256_add_epi32(s2[i][p], q);
                    else s[i][p] = _mm256_add_epi32(s[i][p], q);
                }
            }
    }
    for (int i = 0; i < rows; i++)
        for (int p = 0; p < PASS; p++) {
            S[i][p] = (vf)_mm256_cvtepi32_ps(s[i][p]);
            if (SPLIT) S2[i][p] = (vf)_mm256_cvtepi32_ps(s2[i][p]);
        }
#else
    for (int i = 0; i < rows; i++) {
        int32_t t = (int32_t)T[i * gs], t0 = (int32_t)T0[i * gs];
        const int8_t *x = xg + i * K;
        for (int p = 0; p < PASS; p++)
            for (int l = 0; l < VL; l++) {
                int col = (cv0 + p) * VL + l, h = col >> 4, c = col & 15;
                int32_t a = -shift * (SPLIT ? t0 : t), b = -shift * (t - t0);
                if (NIB)
                    for (int kk = 0; kk < 4; kk++)
                        for (int j = 0; j < 4; j++) {
                            int code = cg[(h * 4 + kk) * 64 + c * 4 + j];
                            a += (code & 15) * x[8 * kk + j] + (code >> 4) * x[8 * kk + 4 + j];
                        }
                else
                    for (int kk = 0; kk < 8; kk++)
                        for (int j = 0; j < 4; j++) {
                            int32_t q = cg[(h * 8 + kk) * 64 + c * 4 + j] * x[4 * kk + j];
                            if (SPLIT && kk >= 4) b += q;
                            else a += q;
                        }
                S[i][p][l] = (float)a;
                if (SPLIT) S2[i][p][l] = (float)b;
            }
    }
#endif
}

/* a tile's sums for columns 32 t + VL cv0 ... (PASS vectors, + bias) into the first ``cols`` columns of its rows */
static inline void store_cols(int rows, vf (*acc)[NV], int cv0, const int PASS, const float *bias, float *y,
                              int64_t ldy, int64_t cols) {
    for (int p = 0; p < PASS; p++) {
        int64_t col = (int64_t)(cv0 + p) * VL, n = cols - col < VL ? cols - col : VL;
        if (n <= 0) return;
        for (int i = 0; i < rows; i++) {
            float out[VL];
            storev(out, bias ? acc[i][p] + loadv(bias + col) : acc[i][p]);
            memcpy(y + i * ldy + col, out, (size_t)n * sizeof(float));
        }
    }
}

/* A tile of ROWS rows over one block, for the formats of one code layout (NIB, SPLIT): for each
 * pass of column vectors, the groups in order; per group the integer sums, the scales (D, and M:
 * the mins, or Q6_K's second D), then per row t = D S (+ M T, or + M S2) and acc += s t. */
#define QTILE(NAME, ROWS, NIB, SPLIT, Q8, KF)                                                   \
static inline void qtile_##NAME##ROWS(const int8_t *xq, int64_t K, const float *sx, const float *sq, const float *sh, \
                               int64_t groups, const uint8_t *codes, int kind, const uint16_t *d, \
                               const uint16_t *m, const uint8_t *sub, const float *bias, float *y, \
                               int64_t ldy, int64_t cols) {                                     \
    const int64_t group_bytes = NIB ? 512 : 1024, PASS = PASSES(ROWS);                          \
    for (int cv0 = 0; cv0 < NV; cv0 += PASS) {                                                  \
        vf acc[ROWS][NV];                                                                       \
        for (int i = 0; i < ROWS; i++)                                                          \
            for (int p = 0; p < PASS; p++) acc[i][p] = (vf){0};                                 \
        const uint8_t *cg = codes;                                                              \
        for (int64_t g = 0; g < groups; g++, cg += group_bytes) {                               \
            vf S[ROWS][NV], S2[ROWS][NV];                                                       \
            group_sums(ROWS, xq + g * 32, K, cg, kind, NIB, SPLIT, Q8, cv0, PASS, sq + g, sh + g, groups, S, S2); \
            for (int p = 0; p < PASS; p++) {                                                    \
                int cv = cv0 + p;                                                               \
                vf D, M = (vf){0};                                                              \
                if (KF) {                                                                       \
                    vf dd = halves_v(d + (g >> 3) * BLOCK + cv * VL);                           \
                    const uint8_t *sg = sub + g * 2 * BLOCK + cv * VL;                          \
                    D = dd * bytes_v(sg, SPLIT);                                                \
                    M = SPLIT ? dd * bytes_v(sg + BLOCK, 1)                                     \
                              : (vf){0} - halves_v(m + (g >> 3) * BLOCK + cv * VL) * bytes_v(sg + BLOCK, 0); \
                } else {                                                                        \
                    D = halves_v(d + g * BLOCK + cv * VL);                                      \
                    if (m) M = halves_v(m + g * BLOCK + cv * VL);                               \
                }                                                                               \
                if (SPLIT)                                                                      \
                    for (int i = 0; i < ROWS; i++)                                              \
                        acc[i][p] = fmav(splat(sx[i * groups + g]), fmav(M, S2[i][p], D * S[i][p]), acc[i][p]); \
                else if (KF)                                                                    \
                    for (int i = 0; i < ROWS; i++)                                              \
                        acc[i][p] = fmav(splat(sx[i * groups + g]), fmav(M, splat(sq[i * groups + g]), D * S[i][p]), \
                                         acc[i][p]);                                            \
                else if (m)                                                                     \
                    for (int i = 0; i < ROWS; i++)                                              \
                        acc[i][p] = fmav(splat(sx[i * groups + g]), fmav(D, S[i][p], M * splat(sq[i * groups + g])), \
                                         acc[i][p]);                                            \
                else                                                                            \
                    for (int i = 0; i < ROWS; i++)                                              \
                        acc[i][p] = fmav(splat(sx[i * groups + g]), D * S[i][p], acc[i][p]);    \
            }                                                                                   \
        }                                                                                       \
        store_cols(ROWS, acc, cv0, PASS, bias, y, ldy, cols);                                   \
    }                                                                                           \
}
#define QTILES(NAME, NIB, SPLIT, Q8, KF) QTILE(NAME, 1, NIB, SPLIT, Q8, KF) QTILE(NAME, 2, NIB, SPLIT, Q8, KF) \
    QTILE(NAME, 3, NIB, SPLIT, Q8, KF) QTILE(NAME, 4, NIB, SPLIT, Q8, KF)
#define WIDE(NAME, NIB, SPLIT, Q8, KF) QTILE(NAME, 5, NIB, SPLIT, Q8, KF) QTILE(NAME, 6, NIB, SPLIT, Q8, KF)
/* the families of layouts and scales, each its tiles: 4-bit codes (Q4_0, Q4_1; Q4_K); bytes at
 * most 63 (Q5_0, Q5_1; Q5_K); Q8_0's bytes; Q6_K's (two scales a group) */
enum { NIB, NIB_K, BYTE, BYTE_K, Q8, SPLIT, FAMILIES };
static inline int family_of(int kind) {
    return kind == Q4_0 || kind == Q4_1 ? NIB : kind == Q4_K ? NIB_K : kind == Q8_0 ? Q8 : kind == Q5_K ? BYTE_K
           : kind == Q6_K ? SPLIT : BYTE;
}
QTILES(nib, 1, 0, 0, 0)
QTILES(nibk, 1, 0, 0, 1)
QTILES(byte, 0, 0, 0, 0)
QTILES(bytek, 0, 0, 0, 1)
QTILES(q8, 0, 0, 1, 0)
#define CASE(FAMILY, NAME, ROWS) case FAMILY * 8 + ROWS: qtile_##NAME##ROWS(TILE_ARGS); break;
#define CASES(FAMILY, NAME) CASE(FAMILY, NAME, 1) CASE(FAMILY, NAME, 2) CASE(FAMILY, NAME, 3) CASE(FAMILY, NAME, 4)
#if QROWS == 6
QTILES(split, 0, 1, 0, 1)
WIDE(nib, 1, 0, 0, 0) WIDE(nibk, 1, 0, 0, 1) WIDE(byte, 0, 0, 0, 0) WIDE(bytek, 0, 0, 0, 1) WIDE(q8, 0, 0, 1, 0)
#define WIDE_CASES(FAMILY, NAME) CASE(FAMILY, NAME, 5) CASE(FAMILY, NAME, 6)
#define SPLIT_ROWS 4  /* Q6_K's tiles hold twice the integer sums */
#define ALL_CASES CASES(NIB, nib) CASES(NIB_K, nibk) CASES(BYTE, byte) CASES(BYTE_K, bytek) CASES(Q8, q8) \
    CASES(SPLIT, split) WIDE_CASES(NIB, nib) WIDE_CASES(NIB_K, nibk) WIDE_CASES(BYTE, byte) WIDE_CASES(BYTE_K, bytek) \
    WIDE_CASES(Q8, q8)
#else
QTILE(split, 1, 0, 1, 0, 1) QTILE(split, 2, 0, 1, 0, 1)
#define SPLIT_ROWS 2
#define ALL_CASES CASES(NIB, nib) CASES(NIB_K, nibk) CASES(BYTE, byte) CASES(BYTE_K, bytek) CASES(Q8, q8) \
    CASE(SPLIT, split, 1) CASE(SPLIT, split, 2)
#endif

/* M rows in tiles of at most QROWS rows, as even as possible (9 rows: 5 + 4, not 4 + 4 + 1: a
 * one-row tile unpacks every code of the block again for a single row) */
static inline int64_t tiles_for(int64_t M, int64_t widest) { return (M + widest - 1) / widest; }
static inline int tile_rows(int64_t M, int64_t n, int64_t i) { return (int)(M / n + (i < M % n)); }

/* kind: the enum above; d, m, sub as the layout above says */
void cr_linear_q(const float *x, int64_t ldx, const uint8_t *codes, int kind, const uint16_t *d, const uint16_t *m,
                 const uint8_t *sub, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                 float *scratch, int threads) {
    int64_t blocks = (N + BLOCK - 1) / BLOCK, groups = K / 32, scales = k_format(kind) ? K / 256 : groups;
    int64_t block_bytes = four_bit(kind) ? K / 2 * BLOCK : K * BLOCK;
    float *sx = scratch, *sq = scratch + M * groups, *sh = scratch + 10 * M * groups;
    int8_t *xq = (int8_t *)(scratch + 2 * M * groups);
    cr_round_rows(x, ldx, M, K, xq, sx, sq, sh, threads);
    int family = family_of(kind), widest = family == SPLIT ? SPLIT_ROWS : QROWS;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < blocks; t++) {
        int64_t n0 = t * BLOCK, cols = N - n0 < BLOCK ? N - n0 : BLOCK, r = 0, n = tiles_for(M, widest);
        const uint8_t *c = codes + t * block_bytes, *sb = sub ? sub + n0 * groups * 2 : 0;
        const uint16_t *dd = d + n0 * scales, *mm = m ? m + n0 * scales : 0;
        const float *b = bias ? bias + n0 : 0;
        for (int64_t i = 0; i < n; i++) {
            int rows = tile_rows(M, n, i);
#define TILE_ARGS xq + r * K, K, sx + r * groups, sq + r * groups, sh + r * groups, groups, c, kind, dd, mm, sb, b, \
                  y + r * ldy + n0, ldy, cols
            switch (family * 8 + rows) { ALL_CASES }
#undef TILE_ARGS
            r += rows;
        }
    }
}
