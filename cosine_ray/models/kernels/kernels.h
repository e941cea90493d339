/* The library's entry points, one family a file, as ctypes calls them (build.py declares the
 * same signatures), and the structures that cross files: a layer's projection and a stage's layer.
 * Every entry point computes each row alone, in one fixed order: a row's result never depends on
 * the other rows of the call, the thread count or the instruction set. */
#ifndef CR_KERNELS_H
#define CR_KERNELS_H
#include <stdint.h>

#define MAX_HEAD_DIM 1024  /* kernels.layer.MAX_HEAD_DIM: a stage with wider heads is not fused */

/* A projection: kind 0 = fp32 blocks (cr_linear_f32), 1 + a GGUF format of qgemm.c = its codes
 * (cr_linear_q). Rows of different formats (a layer's q, k in one, v in another) are parts, one
 * after another in the output: ``next``, N output columns each (a multiple of 32 but the last). */
typedef struct cr_proj {
    int64_t kind, N, K;
    const void *weight;  /* fp32 blocks, or the codes */
    const uint16_t *d, *m;  /* GGUF only: fp16 scales and mins (qgemm.c's layout) */
    const uint8_t *sub;  /* GGUF K formats only: the groups' scales */
    const float *bias;
    const struct cr_proj *next;
} cr_proj;

/* a projection's output columns, all its parts' */
static inline int64_t cr_proj_width(const cr_proj *p) {
    int64_t n = 0;
    for (; p; p = p->next) n += p->N;
    return n;
}

/* one layer of a cr_stage_layers call */
typedef struct {
    const float *input_norm, *post_norm;
    const cr_proj *qkv, *o, *gate_up, *down;
} cr_layer;

/* gemm.c */
void cr_linear_f32(const float *x, int64_t ldx, const float *wp, const float *bias, float *y,
                   int64_t ldy, int64_t M, int64_t N, int64_t K, int threads);
/* qgemm.c */
void cr_linear_q(const float *x, int64_t ldx, const uint8_t *codes, int kind, const uint16_t *d, const uint16_t *m,
                 const uint8_t *sub, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                 float *scratch, int threads);
/* qround.c (qgemm.c's rounding of its rows) */
void cr_round_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *xq, float *sx, float *sq, float *sh,
                   int threads);
/* layer.c */
void cr_layer_pre(const float *x, int64_t M, int64_t H, const float *norm, float eps, const cr_proj *qkv,
                  const float *cos_t, const float *ssin_t, int64_t rot_heads, int64_t hd, float *h, float *out,
                  float *xsum, int threads);
void cr_layer_post(float *x, int64_t M, int64_t H, const float *attn, const cr_proj *o, const float *norm,
                   float eps, const cr_proj *gate_up, const cr_proj *down, float *h, float *gu, float *act,
                   float *xsum, int threads);
/* attention.c */
void cr_attend_rows(const float *q, int64_t ldq, const int64_t *rows, int64_t R, const int64_t *start,
                    const int64_t *count, const int64_t *keys, float *kpool, float *vpool, int64_t heads,
                    int64_t kv_heads, int64_t hd, float scale, float *out, int64_t ldo, float *scores,
                    int64_t max_keys, int threads, const float *k_new, int64_t ldk, const float *v_new, int64_t ldv,
                    int64_t n_new, const int64_t *new_slots);
/* stage.c */
void cr_stage_layers(float *x, int64_t M, int64_t H, const cr_layer *layers, int64_t L, float eps,
                     const float *cos_t, const float *ssin_t, int64_t heads, int64_t kv_heads, int64_t hd,
                     float scale, const int64_t *rows, int64_t R, const int64_t *start, const int64_t *count,
                     const int64_t *keys, int64_t max_keys, float *pool, int64_t pool_slots,
                     const int64_t *new_slots, float *h, float *qkv, float *gu, float *act, float *attn,
                     float *xsum, float *scores, int threads);
#endif
