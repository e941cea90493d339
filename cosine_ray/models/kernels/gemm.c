/* fp32 projections: y = x W^T (+ b) over weights packed in 32-column blocks (gemm.py packs them).
 *
 * wp  [ceil(N / 32)][K][32]  block t holds W[32 t : 32 t + 32, :] transposed, zero-padded
 * x   [M][ldx]               fp32 rows; y [M][ldy]
 *
 * Invariant: every y[m, n] is one lane's chain of fused multiply-adds over k = 0, 1, ..., K - 1
 * in that order, so a row's result never depends on M, on the tile that computed it, on the
 * thread count or on the vector width (row-invariant and deterministic). At M = 1 a block is one
 * contiguous stream, read at the memory bandwidth; wider tiles (2, 4, 8 rows with AVX-512, 2
 * without) reuse each loaded weight vector across the rows of a verify step or a prefill. */
#include "kernels.h"
#include "simd.h"

#if VL == 16
#define TILE_ROWS 8  /* the widest fp32 tile: 8 rows x 2 accumulators, in 32 registers */
#else
#define TILE_ROWS 2  /* 2 rows x 4 accumulators + 4 weight vectors + x, in 16 registers */
#endif

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
            vf xv = splat(x[i * ldx + k]);                                                      \
            for (int j = 0; j < NV; j++) acc[i][j] = fmav(xv, w[j], acc[i][j]);                 \
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
