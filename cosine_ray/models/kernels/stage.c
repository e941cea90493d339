/* A stage's decoder layers in one call: cr_layer_pre, cr_attend_rows and cr_layer_post for every
 * layer, in order, the same calls with the same arguments as one per layer from Python (so the
 * same bits), with no Python between the layers. */
#include "kernels.h"

/* x [M][H] in place. The KV pool: [layers][2][pool_slots][kv_heads][hd] fp32 (``models.kv_cache``);
 * the rows' keys as for ``cr_attend_rows``; new_slots [M]: each row's own pool slot. Scratch: h
 * [M][H], qkv [M][the qkv projection's width], gu [M][2 I], act [M][I], attn [M][heads * hd],
 * xsum (``quant_scratch``), scores as ``cr_attend_rows`` takes it. */
void cr_stage_layers(float *x, int64_t M, int64_t H, const cr_layer *layers, int64_t L, float eps,
                     const float *cos_t, const float *ssin_t, int64_t heads, int64_t kv_heads, int64_t hd,
                     float scale, const int64_t *rows, int64_t R, const int64_t *start, const int64_t *count,
                     const int64_t *keys, int64_t max_keys, float *pool, int64_t pool_slots,
                     const int64_t *new_slots, float *h, float *qkv, float *gu, float *act, float *attn,
                     float *xsum, float *scores, int threads) {
    int64_t plane = pool_slots * kv_heads * hd;
    for (int64_t l = 0; l < L; l++) {
        const cr_layer *y = layers + l;
        int64_t n = cr_proj_width(y->qkv);
        float *kpool = pool + 2 * l * plane;
        cr_layer_pre(x, M, H, y->input_norm, eps, y->qkv, cos_t, ssin_t, heads + kv_heads, hd, h, qkv, xsum,
                     threads);
        cr_attend_rows(qkv, n, rows, R, start, count, keys, kpool, kpool + plane, heads, kv_heads, hd, scale,
                       attn, heads * hd, scores, max_keys, threads, qkv + heads * hd, n,
                       qkv + (heads + kv_heads) * hd, n, M, new_slots);
        cr_layer_post(x, M, H, attn, y->o, y->post_norm, eps, y->gate_up, y->down, h, gu, act, xsum, threads);
    }
}
