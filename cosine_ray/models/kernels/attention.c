/* Attention of a step's query rows over the KV pool: every query row of a fused stage's step,
 * prefill chains included (cr_attend_rows says how a row is computed). q, out: row stride ldq /
 * ldo floats, heads * hd each; kpool, vpool [slots][kv_heads][hd].
 *
 * Invariant: a row's output depends only on its query and its keys, never on the other rows of
 * the call, on how a prompt was split into chunks or on the thread count. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

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
