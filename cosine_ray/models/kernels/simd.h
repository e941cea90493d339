/* The vectors every kernel family computes in, and the instruction-set choice.
 *
 * vf: the widest register the CPU has, 16 fp32 lanes with AVX-512 and 8 otherwise (AVX2, or
 * plain C on GCC vectors), the unit of the fp32 tiles and of the attention; fmav its fused
 * multiply-add. v16: sixteen lanes (64 bytes), the unit of the GGUF tiles with AVX-512. A lane's
 * arithmetic is the same at either width, so the bits are too. A block is 32 output columns
 * (the weight layout of gemm.c and qgemm.c); store_rows and store_vrows write a tile's sums
 * into y. */
#ifndef CR_SIMD_H
#define CR_SIMD_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX__)
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

/* a * b + c rounded once, spelled out: a sum's bits must not depend on whether the compiler
 * fuses a multiply and an add (GCC's tuning for AMD CPUs splits some loop-carried 256-bit
 * chains into two instructions, so the 8-lane build would round twice where the 16-lane one
 * rounds once) */
static inline vf fmav(vf a, vf b, vf c) {
#if VL == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    vf r;
    for (int i = 0; i < VL; i++) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return r;
#endif
}

/* x in every lane (a broadcast, not the + 0 of ``(vf){0} + x``, which keeps -0 apart from +0:
 * a chain of fused multiply-adds from +0 ends the same either way) */
static inline vf splat(float x) {
#if VL == 16
    return (vf)_mm512_set1_ps(x);
#elif defined(__AVX__)
    return (vf)_mm256_set1_ps(x);
#else
    vf v;
    for (int i = 0; i < VL; i++) v[i] = x;
    return v;
#endif
}

/* store_rows for tiles in vf registers */
static inline void store_vrows(int rows, vf (*acc)[NV], const float *bias, float *y, int64_t ldy, int64_t cols) {
    for (int i = 0; i < rows; i++) {
        float out[BLOCK];
        for (int j = 0; j < NV; j++) storev(out + j * VL, bias ? acc[i][j] + loadv(bias + j * VL) : acc[i][j]);
        memcpy(y + i * ldy, out, (size_t)cols * sizeof(float));
    }
}
#endif
