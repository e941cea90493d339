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
#define BLOCK 32

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

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
    for (int i = 0; i < ROWS; i++) {                                                            \
        if (bias) { acc[i][0] += load16(bias); acc[i][1] += load16(bias + 16); }               \
        float out[BLOCK];                                                                       \
        store16(out, acc[i][0]);                                                                \
        store16(out + 16, acc[i][1]);                                                           \
        memcpy(y + i * ldy, out, (size_t)cols * sizeof(float));                                 \
    }                                                                                           \
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
