/* The vectors every kernel family computes in, and the instruction-set choice.
 *
 * v16: sixteen fp32 lanes (64 bytes), the unit of the GGUF tiles and of the attention. vf: the
 * widest register the CPU has, 16 lanes with AVX-512 and 8 otherwise, the unit of the fp32
 * tiles. A lane's arithmetic is the same at either width, so the bits are too. A block is 32
 * output columns (the weight layout of gemm.c and qgemm.c); store_rows and store_vrows write a
 * tile's sums into y. */
#ifndef CR_SIMD_H
#define CR_SIMD_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

/* GCC holds a 64-byte vector in registers only where the CPU has 64-byte registers; without
 * AVX-512 it would keep every v16 accumulator on the stack and broadcast x through 16 scalar
 * stores, so the fp32 tiles use vf: one 16-lane register per half block with AVX-512, 8-lane
 * ones otherwise. */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
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
#endif
