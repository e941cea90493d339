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
 * the weights at the machine's memory bandwidth. Wider tiles (2, 4, 8 rows) reuse each loaded
 * weight vector across rows for the verify steps and prefills. */
#include <stdint.h>
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

#define TILE(ROWS)                                                                              \
static inline void tile_##ROWS(const float *x, int64_t ldx, const float *blk, int64_t K,        \
                               const float *bias, float *y, int64_t ldy, int64_t cols) {       \
    v16 acc[ROWS][2];                                                                           \
    for (int i = 0; i < ROWS; i++) acc[i][0] = acc[i][1] = (v16){0};                           \
    for (int64_t k = 0; k < K; k++, blk += BLOCK) {                                             \
        v16 w0 = load16(blk), w1 = load16(blk + 16);                                            \
        for (int i = 0; i < ROWS; i++) {                                                        \
            v16 xv = (v16){0} + x[i * ldx + k];                                                 \
            acc[i][0] += xv * w0;                                                               \
            acc[i][1] += xv * w1;                                                               \
        }                                                                                       \
    }                                                                                           \
    store_rows(ROWS, acc, bias, y, ldy, cols);                                                  \
}
TILE(1)
TILE(2)
TILE(4)
TILE(8)

/* bias: NULL or padded to a multiple of 32 */
void cr_linear_f32(const float *x, int64_t ldx, const float *wp, const float *bias, float *y,
                   int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    int64_t blocks = (N + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < blocks; t++) {
        int64_t n0 = t * BLOCK, cols = N - n0 < BLOCK ? N - n0 : BLOCK, m = 0;
        const float *blk = wp + n0 * K, *b = bias ? bias + n0 : 0;
        for (; m + 8 <= M; m += 8) tile_8(x + m * ldx, ldx, blk, K, b, y + m * ldy + n0, ldy, cols);
        if (m + 4 <= M) { tile_4(x + m * ldx, ldx, blk, K, b, y + m * ldy + n0, ldy, cols); m += 4; }
        if (m + 2 <= M) { tile_2(x + m * ldx, ldx, blk, K, b, y + m * ldy + n0, ldy, cols); m += 2; }
        if (m < M) tile_1(x + m * ldx, ldx, blk, K, b, y + m * ldy + n0, ldy, cols);
    }
}

/* ---- GGUF blocks kept quantized: y = x W^T (+ b), W in groups of 32 along k ------------------
 *
 * Q4_0 and Q4_1 (w = d q + m, q in 0..15; Q4_0's m is -8 d):
 *   codes [ceil(N / 32)][K / 2][32] uint8, code k in the low nibble and k + 1 in the high one
 * Q8_0 (w = d q, q int8):
 *   codes [ceil(N / 32)][K][32] int8
 * d, m    [ceil(N / 32)][K / 32][32] fp16, the file's own values (m NULL for Q8_0)
 * xsum    [M][K / 32] scratch: x summed over each group (with m)
 *
 * Per group, y[m, n] += d (sum_k x q) + m (sum_k x): the inner sum is one register lane over the
 * group's k in order and the groups go in order, so again a row's result never depends on M,
 * the tile or the threads. x stays fp32. */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
static inline v16 from_m512(__m512 v) { return (v16)v; }
#else
static inline v16 from_m512(const void *v) { v16 out; memcpy(&out, v, sizeof out); return out; }
#endif

/* 16 int8 codes -> floats (GCC 12 turns its own vector conversion of int8 into scalar code) */
static inline v16 widen_i8(const int8_t *p) {
#if defined(__AVX512F__)
    return from_m512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))));
#elif defined(__AVX2__)
    __m128i c = _mm_loadu_si128((const __m128i *)p);
    __m256 h[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)),
                   _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)))};
    return from_m512(h);
#else
    v16 out;
    for (int i = 0; i < 16; i++) out[i] = (float)p[i];
    return out;
#endif
}

/* 16 bytes of nibbles -> the low codes (shift 0) or the high ones (shift 4) as floats */
static inline v16 widen_u4(const uint8_t *p, int shift) {
#if defined(__AVX512F__)
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return from_m512(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(c, (unsigned)shift), _mm512_set1_epi32(15))));
#elif defined(__AVX2__)
    __m128i c = _mm_loadu_si128((const __m128i *)p);
    __m256i lo = _mm256_cvtepu8_epi32(c), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(c, 8));
    __m256i mask = _mm256_set1_epi32(15);
    __m256 h[2] = {_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(lo, shift), mask)),
                   _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(hi, shift), mask))};
    return from_m512(h);
#else
    v16 out;
    for (int i = 0; i < 16; i++) out[i] = (float)((p[i] >> shift) & 15);
    return out;
#endif
}

/* 16 fp16 scales -> fp32, exactly (F16C, or by their bits) */
static inline v16 halves(const uint16_t *p) {
#if defined(__AVX512F__)
    return from_m512(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)));
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

#define QACCUMULATE(ROWS, W0, W1, K)                                                            \
    for (int i = 0; i < ROWS; i++) {                                                            \
        v16 xv = (v16){0} + xg[i * ldx + (K)];                                                  \
        part[i][0] += xv * (W0);                                                                \
        part[i][1] += xv * (W1);                                                                \
    }

#define QTILE(ROWS)                                                                             \
static inline void qtile_##ROWS(const float *x, int64_t ldx, const float *xsum, int64_t groups, \
                                const uint8_t *codes, int nibbles, const uint16_t *d,           \
                                const uint16_t *mins, const float *bias, float *y, int64_t ldy, \
                                int64_t cols) {                                                 \
    v16 acc[ROWS][2];                                                                           \
    for (int i = 0; i < ROWS; i++) acc[i][0] = acc[i][1] = (v16){0};                           \
    for (int64_t g = 0; g < groups; g++) {                                                      \
        v16 part[ROWS][2];                                                                      \
        for (int i = 0; i < ROWS; i++) part[i][0] = part[i][1] = (v16){0};                     \
        const float *xg = x + g * 32;                                                           \
        if (nibbles) {                                                                          \
            for (int k = 0; k < 32; k += 2, codes += BLOCK) {                                   \
                v16 a0 = widen_u4(codes, 0), a1 = widen_u4(codes + 16, 0);                      \
                QACCUMULATE(ROWS, a0, a1, k)                                                    \
                v16 b0 = widen_u4(codes, 4), b1 = widen_u4(codes + 16, 4);                      \
                QACCUMULATE(ROWS, b0, b1, k + 1)                                                \
            }                                                                                   \
        } else {                                                                                \
            for (int k = 0; k < 32; k++, codes += BLOCK) {                                      \
                v16 w0 = widen_i8((const int8_t *)codes), w1 = widen_i8((const int8_t *)codes + 16); \
                QACCUMULATE(ROWS, w0, w1, k)                                                    \
            }                                                                                   \
        }                                                                                       \
        v16 d0 = halves(d + g * BLOCK), d1 = halves(d + g * BLOCK + 16);                        \
        for (int i = 0; i < ROWS; i++) {                                                        \
            acc[i][0] += d0 * part[i][0];                                                       \
            acc[i][1] += d1 * part[i][1];                                                       \
        }                                                                                       \
        if (mins) {                                                                             \
            v16 m0 = halves(mins + g * BLOCK), m1 = halves(mins + g * BLOCK + 16);              \
            for (int i = 0; i < ROWS; i++) {                                                    \
                v16 s = (v16){0} + xsum[i * groups + g];                                        \
                acc[i][0] += m0 * s;                                                            \
                acc[i][1] += m1 * s;                                                            \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    store_rows(ROWS, acc, bias, y, ldy, cols);                                                  \
}
QTILE(1)
QTILE(2)
QTILE(4)

/* nibbles: 1 for the Q4 layout, 0 for Q8_0's int8 codes; mins NULL for Q8_0 */
void cr_linear_q(const float *x, int64_t ldx, const uint8_t *codes, int nibbles, const uint16_t *d,
                 const uint16_t *mins, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N,
                 int64_t K, float *xsum, int threads) {
    int64_t blocks = (N + BLOCK - 1) / BLOCK, groups = K / 32;
    int64_t block_bytes = nibbles ? K / 2 * BLOCK : K * BLOCK;
    if (mins)
        for (int64_t i = 0; i < M; i++)
            for (int64_t g = 0; g < groups; g++) {
                float s = 0;
                for (int k = 0; k < 32; k++) s += x[i * ldx + g * 32 + k];
                xsum[i * groups + g] = s;
            }
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < blocks; t++) {
        int64_t n0 = t * BLOCK, cols = N - n0 < BLOCK ? N - n0 : BLOCK, m = 0;
        const uint8_t *c = codes + t * block_bytes;
        const uint16_t *dd = d + n0 * groups, *mm = mins ? mins + n0 * groups : 0;
        const float *b = bias ? bias + n0 : 0;
        for (; m + 4 <= M; m += 4)
            qtile_4(x + m * ldx, ldx, xsum + m * groups, groups, c, nibbles, dd, mm, b, y + m * ldy + n0, ldy, cols);
        if (m + 2 <= M) {
            qtile_2(x + m * ldx, ldx, xsum + m * groups, groups, c, nibbles, dd, mm, b, y + m * ldy + n0, ldy, cols);
            m += 2;
        }
        if (m < M)
            qtile_1(x + m * ldx, ldx, xsum + m * groups, groups, c, nibbles, dd, mm, b, y + m * ldy + n0, ldy, cols);
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
 * A projection: kind 0 = fp32 blocks (``cr_linear_f32``), 1 = 4-bit codes, 2 = Q8_0 codes. */
#include <math.h>

#define MAX_HEAD_DIM 1024  /* cpu_gemm.MAX_HEAD_DIM: a stage with wider heads is not fused */

typedef struct {
    int64_t kind, N, K;
    const void *weight;  /* fp32 blocks, or the codes */
    const uint16_t *d, *m;  /* GGUF only: fp16 scales and mins */
    const float *bias;
} cr_proj;

static void project(const cr_proj *p, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t M,
                    float *xsum, int threads) {
    if (p->kind == 0)
        cr_linear_f32(x, ldx, (const float *)p->weight, p->bias, y, ldy, M, p->N, p->K, threads);
    else
        cr_linear_q(x, ldx, (const uint8_t *)p->weight, p->kind == 1, p->d, p->m, p->bias, y, ldy, M, p->N, p->K,
                    xsum, threads);
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

/* ---- attention of a step's short query rows over the KV pool -------------------------------
 *
 * Query row r (``rows[r]`` of q and out) attends to the pool slots keys[ptr[r] .. ptr[r + 1]), in
 * that order: its committed slots, then what its tree mask lets it see. Per head: scores
 * s = scale (q . k), p = exp(s - max s), out = sum p v / sum p, each sum in key order and each
 * dot product in one fixed order: a row's result depends only on its own query and keys, not
 * on the other rows of the step (what makes a speculative verify row equal to the decode row).
 * q, out: row stride ldq / ldo floats, heads * hd each; kpool, vpool [slots][kv_heads][hd]. */
static inline float dot(const float *a, const float *b, int64_t n) {
    float lanes[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; l++) lanes[l] += a[j + l] * b[j + l];
    float s = 0;
    for (int l = 0; l < 16; l++) s += lanes[l];
    for (; j < n; j++) s += a[j] * b[j];
    return s;
}

void cr_attend_rows(const float *q, int64_t ldq, const int64_t *rows, int64_t R, const int64_t *ptr,
                    const int64_t *keys, const float *kpool, const float *vpool, int64_t heads, int64_t kv_heads,
                    int64_t hd, float scale, float *out, int64_t ldo, float *scores, int64_t max_keys, int threads) {
    int64_t group = heads / kv_heads, stride = kv_heads * hd;
    #pragma omp parallel for schedule(static) num_threads(threads) if(R * heads >= 4)
    for (int64_t t = 0; t < R * heads; t++) {
        int64_t r = t / heads, h = t % heads, kvh = h / group;
        const float *qv = q + rows[r] * ldq + h * hd;
        float *o = out + rows[r] * ldo + h * hd;
        float *s = scores + t * max_keys;
        int64_t n = ptr[r + 1] - ptr[r];
        const int64_t *ks = keys + ptr[r];
        float m = -INFINITY;
        for (int64_t c = 0; c < n; c++) {
            s[c] = scale * dot(qv, kpool + ks[c] * stride + kvh * hd, hd);
            if (s[c] > m) m = s[c];
        }
        float sum = 0;
        for (int64_t c = 0; c < n; c++) { s[c] = expf(s[c] - m); sum += s[c]; }
        for (int64_t j = 0; j < hd; j++) o[j] = 0;
        for (int64_t c = 0; c < n; c++) {
            const float *vv = vpool + ks[c] * stride + kvh * hd;
            float p = s[c];
            for (int64_t j = 0; j < hd; j++) o[j] += p * vv[j];
        }
        float inv = 1.0f / sum;
        for (int64_t j = 0; j < hd; j++) o[j] *= inv;
    }
}

/* k and v of T new tokens (rows of ldk / ldv floats, width floats each) into pool slots ``slots`` */
void cr_write_kv(const float *k, int64_t ldk, const float *v, int64_t ldv, int64_t T, const int64_t *slots,
                 float *kpool, float *vpool, int64_t width) {
    for (int64_t t = 0; t < T; t++) {
        memcpy(kpool + slots[t] * width, k + t * ldk, (size_t)width * sizeof(float));
        memcpy(vpool + slots[t] * width, v + t * ldv, (size_t)width * sizeof(float));
    }
}
