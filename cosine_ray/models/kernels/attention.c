/* Attention of a step's query rows over the KV pool: every query row of a fused stage's step,
 * prefill chains, token trees and decodes alike. q, out: row stride ldq / ldo floats, heads * hd
 * each; kpool, vpool [slots][kv_heads][hd].
 *
 * One arithmetic for every row (cr_attend_rows states it), computed in blocked tiles: a tile of
 * query rows against a tile of keys for the scores, a tile of rows against the value vectors
 * for the output, each tile's sums held in registers. Which rows share a tile never changes
 * what a row computes, only how many loads serve it: a row's output depends only on its query
 * and its keys, never on the other rows of the call, on how a prompt was split into chunks, on
 * the thread count or on the vector width (16 lanes with AVX-512, 8 otherwise). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

typedef int32_t vi __attribute__((vector_size(VL * 4)));
#define NH (16 / VL)  /* vectors in a 16-lane chunk of a head */

/* A score is a 16-lane sum: lane l runs a chain of fused multiply-adds over the head's floats
 * l, 16 + l, 32 + l, ... (the first a plain product), and the 16 lanes are then added pairwise
 * (l + l + 8, then + 4, + 2, + 1): the order of hsum_lanes. A score tile reduces TP pairs (row,
 * key) at once, lane t of the result the pair t: 16 pairs in one transposing butterfly with
 * 16-lane registers, 4 pairs with 8-lane ones (there the lanes l and l + 8 live in two registers
 * and their sum is a vertical add). */
#if VL == 16
#define TP 16
#else
#define TP 4
#endif

/* the 16 lanes of a chunk's sums (NH vectors) added in the fixed order */
static inline float hsum_lanes(const vf *s) {
#if VL == 16
    v16 v = s[0];
    typedef float v8 __attribute__((vector_size(32)));
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    vf a = s[0] + s[1];
#endif
    typedef float v4 __attribute__((vector_size(16)));
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* TP pairs' lane partials -> their sums, lane t for pair t (hsum_lanes' order for each) */
static inline vf reduce_pairs(vf (*acc)[NH]) {
#if VL == 16
    v16 r[8], u[4], w[2];
    for (int p = 0; p < 8; p++)
        r[p] = __builtin_shufflevector(acc[2 * p][0], acc[2 * p + 1][0], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(acc[2 * p][0], acc[2 * p + 1][0], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int p = 0; p < 4; p++)
        u[p] = __builtin_shufflevector(r[2 * p], r[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(r[2 * p], r[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int p = 0; p < 2; p++)
        w[p] = __builtin_shufflevector(u[2 * p], u[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(u[2 * p], u[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    vf a[4];
    for (int t = 0; t < 4; t++) a[t] = acc[t][0] + acc[t][1];  /* lanes l + l + 8 */
    vf r0 = __builtin_shufflevector(a[0], a[1], 0, 1, 2, 3, 8, 9, 10, 11) +
            __builtin_shufflevector(a[0], a[1], 4, 5, 6, 7, 12, 13, 14, 15);
    vf r1 = __builtin_shufflevector(a[2], a[3], 0, 1, 2, 3, 8, 9, 10, 11) +
            __builtin_shufflevector(a[2], a[3], 4, 5, 6, 7, 12, 13, 14, 15);
    vf u = __builtin_shufflevector(r0, r1, 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(r0, r1, 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(u, u, 0, 2, 4, 6, 0, 2, 4, 6) + __builtin_shufflevector(u, u, 1, 3, 5, 7, 1, 3, 5, 7);
#endif
}

/* a . b over n floats, serially (heads whose width is not a multiple of 16) */
static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0;
    for (int64_t j = 0; j < n; j++) s = __builtin_fmaf(a[j], b[j], s);
    return s;
}

/* e^x for each lane of x <= 0 (x below -87 gives e^-87): Cephes' expf, a degree-6 polynomial
 * on x - n ln 2 and 2^n from the exponent bits; within 2 ulp of expf, the same bits for a lane
 * whatever its neighbours and the vector width */
static inline vf expv(vf x) {
    const vf lo = (vf){} - 87.0f, log2e = (vf){} + 1.44269504088896341f, magic = (vf){} + 12582912.0f;
    vi low = x < lo;
    x = (vf)(((vi)lo & low) | ((vi)x & ~low));
    vf n = fmav(x, log2e, magic) - magic;  /* round to nearest */
    vf r = fmav(n, (vf){} + 2.12194440e-4f, fmav(n, (vf){} - 0.693359375f, x));
    vf p = (vf){} + 1.9875691500e-4f;
    p = fmav(p, r, (vf){} + 1.3981999507e-3f);
    p = fmav(p, r, (vf){} + 8.3334519073e-3f);
    p = fmav(p, r, (vf){} + 4.1665795894e-2f);
    p = fmav(p, r, (vf){} + 1.6666665459e-1f);
    p = fmav(p, r, (vf){} + 5.0000001201e-1f);
    p = fmav(p, r * r, r) + 1.0f;
    return p * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
}

/* Score tiles: R rows (queries q[r]) x K keys (k[c]), R K = TP, each a head's hd floats: the
 * pairs' scaled scores into dst[r][c]. Every pair's sum is the one hsum_lanes describes. */
#define SCORE_TILE(R, K)                                                                        \
static inline void score_##R##x##K(const float *const *q, const float *const *k, int64_t hd,  \
                                   float scale, float *const *dst) {                           \
    vf acc[TP][NH];                                                                             \
    for (int r = 0; r < R; r++)                                                                 \
        for (int c = 0; c < K; c++)                                                             \
            for (int h = 0; h < NH; h++) acc[r * K + c][h] = loadv(q[r] + h * VL) * loadv(k[c] + h * VL); \
    for (int64_t j = 16; j < hd; j += 16)                                                       \
        for (int r = 0; r < R; r++)                                                             \
            for (int c = 0; c < K; c++)                                                         \
                for (int h = 0; h < NH; h++)                                                    \
                    acc[r * K + c][h] = fmav(loadv(q[r] + j + h * VL), loadv(k[c] + j + h * VL), acc[r * K + c][h]); \
    float s[VL];                                                                                \
    storev(s, reduce_pairs(acc) * scale);                                                       \
    for (int r = 0; r < R; r++) memcpy(dst[r], s + r * K, K * sizeof(float));                   \
}
#if VL == 16
SCORE_TILE(4, 4)
SCORE_TILE(2, 8)
SCORE_TILE(1, 16)
#define WIDE_ROWS 4  /* rows of the widest score tile */
#else
SCORE_TILE(2, 2)
SCORE_TILE(1, 4)
#define WIDE_ROWS 2
#endif

/* the scores of rows idx[0 .. nr) of a tile against 16 keys k[0 .. 16), one key list: row i's
 * into buf[i * width + c0 ...]; rows taken WIDE_ROWS, then 2, then 1 at a time */
static void score_chunk(int nr, const int *idx, const float *const *qr, const float *const *k, int64_t hd,
                        float scale, float *buf, int64_t width, int64_t c0) {
    int i = 0;
    for (; i + WIDE_ROWS <= nr; i += WIDE_ROWS) {
        const float *q[WIDE_ROWS];
        float *dst[WIDE_ROWS];
        for (int r = 0; r < WIDE_ROWS; r++) q[r] = qr[idx[i + r]];
#if VL == 16
        for (int c = 0; c < 16; c += 4) {
            for (int r = 0; r < 4; r++) dst[r] = buf + idx[i + r] * width + c0 + c;
            score_4x4(q, k + c, hd, scale, dst);
        }
#else
        for (int c = 0; c < 16; c += 2) {
            for (int r = 0; r < 2; r++) dst[r] = buf + idx[i + r] * width + c0 + c;
            score_2x2(q, k + c, hd, scale, dst);
        }
#endif
    }
#if VL == 16
    if (i + 2 <= nr) {
        const float *q[2] = {qr[idx[i]], qr[idx[i + 1]]};
        for (int c = 0; c < 16; c += 8) {
            float *dst[2] = {buf + idx[i] * width + c0 + c, buf + idx[i + 1] * width + c0 + c};
            score_2x8(q, k + c, hd, scale, dst);
        }
        i += 2;
    }
#endif
    for (; i < nr; i++) {
        const float *q[1] = {qr[idx[i]]};
#if VL == 16
        float *dst[1] = {buf + idx[i] * width + c0};
        score_1x16(q, k, hd, scale, dst);
#else
        for (int c = 0; c < 16; c += 4) {
            float *dst[1] = {buf + idx[i] * width + c0 + c};
            score_1x4(q, k + c, hd, scale, dst);
        }
#endif
    }
}

/* Value tiles: o[r][0 .. NB VL) += p[r][k] * v_k[0 .. NB VL) for k = k0 .. k1 - 1 in order, v_k =
 * base + ks[k] * stride: each float a chain of fused multiply-adds over the keys in order, held
 * in a register (fresh: from +0, else from what o holds). */
#define VALUE_TILE(R, NB)                                                                       \
static inline void value_##R##x##NB(float *const *o, const float *const *p, const int64_t *ks,  \
                                    int64_t k0, int64_t k1, const float *base, int64_t stride,  \
                                    int fresh) {                                                \
    vf acc[R][NB];                                                                              \
    for (int r = 0; r < R; r++)                                                                 \
        for (int b = 0; b < NB; b++) acc[r][b] = fresh ? (vf){0} : loadv(o[r] + b * VL);       \
    for (int64_t k = k0; k < k1; k++) {                                                         \
        const float *v = base + ks[k] * stride;                                                 \
        vf x[NB];                                                                               \
        for (int b = 0; b < NB; b++) x[b] = loadv(v + b * VL);                                  \
        for (int r = 0; r < R; r++) {                                                           \
            vf pr = splat(p[r][k]);                                                             \
            for (int b = 0; b < NB; b++) acc[r][b] = fmav(pr, x[b], acc[r][b]);                 \
        }                                                                                       \
    }                                                                                           \
    for (int r = 0; r < R; r++)                                                                 \
        for (int b = 0; b < NB; b++) storev(o[r] + b * VL, acc[r][b]);                          \
}
VALUE_TILE(1, 1)
VALUE_TILE(1, 4)
VALUE_TILE(2, 1)
VALUE_TILE(2, 4)
#if VL == 16
VALUE_TILE(4, 1)
VALUE_TILE(4, 4)
#endif

/* value tiles over a head's hd floats (a multiple of 16): nr rows (1, 2 or WIDE_ROWS), their
 * outputs o[r] and weights p[r], keys k0 .. k1 - 1 of the list ks */
static void value_rows(int nr, float *const *o, const float *const *p, const int64_t *ks, int64_t k0, int64_t k1,
                       const float *base, int64_t stride, int64_t hd, int fresh) {
    for (int64_t j = 0; j < hd;) {
        float *oj[WIDE_ROWS];
        for (int r = 0; r < WIDE_ROWS; r++) oj[r] = o[r < nr ? r : 0] + j;
        int wide = j + 4 * VL <= hd;
        switch (nr * 2 + wide) {
        case 3: value_1x4(oj, p, ks, k0, k1, base + j, stride, fresh); break;
        case 2: value_1x1(oj, p, ks, k0, k1, base + j, stride, fresh); break;
        case 5: value_2x4(oj, p, ks, k0, k1, base + j, stride, fresh); break;
        case 4: value_2x1(oj, p, ks, k0, k1, base + j, stride, fresh); break;
#if VL == 16
        case 9: value_4x4(oj, p, ks, k0, k1, base + j, stride, fresh); break;
        case 8: value_4x1(oj, p, ks, k0, k1, base + j, stride, fresh); break;
#endif
        }
        j += wide ? 4 * VL : VL;
    }
}

/* the largest of s[0 .. n), n >= 1 */
static inline float max_of(const float *s, int64_t n) {
    vf m = (vf){} - INFINITY;
    int64_t c = 0;
    for (; c + VL <= n; c += VL) {
        vf x = loadv(s + c);
        vi more = x > m;
        m = (vf)(((vi)x & more) | ((vi)m & ~more));
    }
    float best = -INFINITY;
    for (int l = 0; l < VL; l++) best = m[l] > best ? m[l] : best;
    for (; c < n; c++) best = s[c] > best ? s[c] : best;
    return best;
}

/* s[0 .. n) <- e^(s - max), the lanes past n of the last 16 <- 0; returns 1 / their sum: each
 * lane of a 16-lane sum runs over the chunks in order, then hsum_lanes */
static float softmax_weights(float *s, int64_t n) {
    float m = max_of(s, n);
    vf sums[NH];
    for (int h = 0; h < NH; h++) sums[h] = (vf){0};
    for (int64_t c = 0; c < n; c += 16)
        for (int h = 0; h < NH; h++) {
            int64_t at = c + h * VL;
            vf x = loadv(s + at) - m, e;
            if (at + VL <= n) {
                e = expv(x);
            } else {  /* the lanes past the row's keys count as zero */
                for (int l = 0; l < VL; l++)
                    if (at + l >= n) x[l] = 0;
                e = expv(x);
                for (int l = 0; l < VL; l++)
                    if (at + l >= n) e[l] = 0;
            }
            storev(s + at, e);
            sums[h] += e;
        }
    return 1.0f / hsum_lanes(sums);
}

/* k and v of T new tokens (rows of ldk / ldv floats, width floats each) into pool slots ``slots`` */
static void write_kv(const float *k, int64_t ldk, const float *v, int64_t ldv, int64_t T, const int64_t *slots,
                     float *kpool, float *vpool, int64_t width) {
    for (int64_t t = 0; t < T; t++) {
        memcpy(kpool + slots[t] * width, k + t * ldk, (size_t)width * sizeof(float));
        memcpy(vpool + slots[t] * width, v + t * ldv, (size_t)width * sizeof(float));
    }
}

static const float zero_key[MAX_HEAD_DIM];

/* the 16 pool vectors of a list's keys c0 .. c0 + 15 (its n keys; zeros past them) */
static inline void chunk_ptrs(const float **p, const float *pool, const int64_t *ks, int64_t n, int64_t c0,
                              int64_t stride) {
    for (int k = 0; k < 16; k++) p[k] = c0 + k < n ? pool + ks[c0 + k] * stride : zero_key;
}

#define TILE_VECTORS 24  /* query vectors (rows x the heads of one KV head) of a task, at least one row's */

/* One task: the rows first .. first + rn - 1 of a tile, for the ``group`` heads of KV head kvh,
 * as rn x group query vectors (vector v: row v / group, head kvh group + v % group) over the
 * same keys. lead: the tile's row with the most keys; shared[r]: how many of row r's keys begin
 * the lead's list too (all of them for a chain, the committed ones for a token tree). Vectors
 * read the lead's keys together where theirs are the lead's, their own apart. */
static void attend_tile(const float *q, int64_t ldq, const int64_t *rows, const int64_t *start, const int64_t *count,
                        const int64_t *keys, const float *kpool, const float *vpool, int64_t kvh, int64_t group,
                        int64_t hd, int64_t stride, float scale, float *out, int64_t ldo, float *buf, int64_t width,
                        int64_t first, int64_t rn, int64_t lead, const int64_t *shared) {
    int64_t nv = rn * group, most = count[lead];
    const float *qr[nv], *kb = kpool + kvh * hd, *vb = vpool + kvh * hd;
    const int64_t *ks[nv], *lead_keys = keys + start[lead];
    int64_t n[nv], common[nv];
    float *o[nv], *e[nv], inv[nv];
    int together[nv], self[group];
    for (int64_t v = 0; v < nv; v++) {
        int64_t r = first + v / group, h = kvh * group + v % group;
        n[v] = count[r];
        common[v] = shared[r];
        ks[v] = keys + start[r];
        qr[v] = q + rows[r] * ldq + h * hd;
        o[v] = out + rows[r] * ldo + h * hd;
        e[v] = buf + v * width;
    }
    for (int64_t c0 = 0; c0 < most; c0 += 16) {  /* scores, 16 keys at a time */
        const float *kp[16];
        int nt = 0;
        chunk_ptrs(kp, kb, lead_keys, most, c0, stride);
        for (int64_t v = 0; v < nv; v += group) {  /* a row's heads, together */
            if (c0 >= n[v]) continue;
            const float *own[16];
            if (hd % 16) {
                chunk_ptrs(own, kb, ks[v], n[v], c0, stride);
                for (int64_t g = v; g < v + group; g++)
                    for (int k = 0; k < 16 && c0 + k < n[v]; k++) e[g][c0 + k] = scale * dot(qr[g], own[k], hd);
            } else if (common[v] >= (n[v] < c0 + 16 ? n[v] : c0 + 16)) {
                for (int64_t g = v; g < v + group; g++) together[nt++] = (int)g;  /* its keys here are the lead's */
            } else {
                chunk_ptrs(own, kb, ks[v], n[v], c0, stride);
                for (int g = 0; g < group; g++) self[g] = (int)v + g;
                score_chunk((int)group, self, qr, own, hd, scale, buf, width, c0);
            }
        }
        score_chunk(nt, together, qr, kp, hd, scale, buf, width, c0);
    }
    for (int64_t v = 0; v < nv; v++) inv[v] = softmax_weights(e[v], n[v]);
    if (hd % 16) {
        for (int64_t v = 0; v < nv; v++) {
            for (int64_t j = 0; j < hd; j++) o[v][j] = 0;
            for (int64_t k = 0; k < n[v]; k++) {
                const float *x = vb + ks[v][k] * stride;
                for (int64_t j = 0; j < hd; j++) o[v][j] = __builtin_fmaf(e[v][k], x[j], o[v][j]);
            }
        }
    } else {
        for (int64_t v = 0; v < nv;) {  /* values: vectors together over their common keys, then each alone */
            int nr = nv - v >= WIDE_ROWS ? WIDE_ROWS : nv - v >= 2 ? 2 : 1;
            int64_t both = common[v];
            for (int r = 1; r < nr; r++) both = common[v + r] < both ? common[v + r] : both;
            value_rows(nr, o + v, (const float *const *)(e + v), lead_keys, 0, both, vb, stride, hd, 1);
            for (int r = 0; r < nr; r++)
                if (n[v + r] > both)
                    value_rows(1, o + v + r, (const float *const *)(e + v + r), ks[v + r], both, n[v + r], vb,
                               stride, hd, 0);
            v += nr;
        }
    }
    for (int64_t v = 0; v < nv; v++)
        for (int64_t j = 0; j < hd; j++) o[v][j] *= inv[v];
}

/* Attention of R query rows, each over its own list of pool slots: row ``rows[r]`` of q sees
 * keys[start[r] : start[r] + count[r]] in that order. Every row's arithmetic is the same, alone
 * or beside others: each score a 16-lane sum over the head's floats (hsum_lanes' order), times
 * scale; their maximum; e^(score - max) (expv) summed 16 lanes at a time over the keys in order,
 * then hsum_lanes; the output a fused multiply-add chain over the keys in order from +0, times
 * 1 / the sum. (Heads whose width is not a multiple of 16 take serial scores and chains.) So a
 * row's output depends only on its query and its keys. Consecutive rows whose lists begin with
 * the same slot (a prefill chain's rows, each seeing a prefix of one list; a token tree's rows,
 * each seeing the committed keys then its own branch) make a tile of up to TILE_VECTORS query
 * vectors with the heads of one KV head: a task per tile and KV head, its vectors scored and
 * summed together over the keys they share, each key and value vector loaded once for them.
 * scores: [threads][max(TILE_VECTORS, heads / kv_heads)][max_keys rounded up to 16] floats, a
 * buffer per thread. The step's n_new new keys and values (k_new, v_new rows of ldk / ldv
 * floats) are first written to their pool slots new_slots. */
void cr_attend_rows(const float *q, int64_t ldq, const int64_t *rows, int64_t R, const int64_t *start,
                    const int64_t *count, const int64_t *keys, float *kpool, float *vpool, int64_t heads,
                    int64_t kv_heads, int64_t hd, float scale, float *out, int64_t ldo, float *scores,
                    int64_t max_keys, int threads, const float *k_new, int64_t ldk, const float *v_new, int64_t ldv,
                    int64_t n_new, const int64_t *new_slots) {
    write_kv(k_new, ldk, v_new, ldv, n_new, new_slots, kpool, vpool, kv_heads * hd);
    int64_t group = heads / kv_heads, stride = kv_heads * hd, width = (max_keys + 15) / 16 * 16;
    int64_t tile_rows = TILE_VECTORS / group > 1 ? TILE_VECTORS / group : 1;
    /* tile i: rows tiles[i] .. tiles[i + 1] - 1, lead[i] its row with the most keys; cost[i]: the
     * keys its rows read, and all tiles' before it; shared[r]: row r's keys that are its lead's */
    int64_t *tiles = malloc((size_t)(4 * R + 3) * sizeof *tiles), *cost = tiles + R + 1, *lead = cost + R + 1,
            *shared = lead + R + 1, T = 0;
    for (int64_t r = 0; r < R; r++)
        if (r == 0 || keys[start[r]] != keys[start[tiles[T - 1]]] || r - tiles[T - 1] == tile_rows)
            tiles[T++] = r;
    tiles[T] = R;
    cost[0] = 0;
    for (int64_t i = 0; i < T; i++) {
        cost[i + 1] = cost[i] + 16;  /* a task's fixed work */
        lead[i] = tiles[i];
        for (int64_t r = tiles[i]; r < tiles[i + 1]; r++) {
            cost[i + 1] += count[r];
            lead[i] = count[r] > count[lead[i]] ? r : lead[i];
        }
        const int64_t *mine = keys + start[lead[i]];
        for (int64_t r = tiles[i]; r < tiles[i + 1]; r++) {
            int64_t s = 0;
            if (start[r] == start[lead[i]]) s = count[r];
            else
                while (s < count[r] && keys[start[r] + s] == mine[s]) s++;
            shared[r] = s;
        }
    }
    /* a task per tile and KV head, tile-major; each thread takes a run of consecutive tasks of
     * about equal cost (a task goes to the thread whose share holds its midpoint), so the tiles
     * of one request stay on one thread */
    int64_t tasks = T * kv_heads, parts = tasks >= 2 ? threads : 1, total = 2 * cost[T] * kv_heads;
    #pragma omp parallel for schedule(static, 1) num_threads(threads) if(parts > 1)
    for (int64_t part = 0; part < parts; part++)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t tile = t / kv_heads, own = cost[tile + 1] - cost[tile];
        if ((2 * (cost[tile] * kv_heads + t % kv_heads * own) + own) * parts / total != part) continue;
        attend_tile(q, ldq, rows, start, count, keys, kpool, vpool, t % kv_heads, group, hd, stride, scale, out, ldo,
                    scores + (int64_t)omp_get_thread_num() * (TILE_VECTORS > group ? TILE_VECTORS : group) * width, width, tiles[tile],
                    tiles[tile + 1] - tiles[tile], lead[tile], shared);
    }
    free(tiles);
}
