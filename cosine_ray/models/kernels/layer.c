/* A decoder layer's work around its attention, in two calls: the two RMS norms, RoPE, the
 * residual adds and SiLU * up, around the layer's projections (gemm.c, qgemm.c).
 *
 * cr_layer_pre and cr_layer_post run row by row: a row's result never depends on the other rows
 * or on the thread count, as with the projections alone. */
#include <math.h>
#include <string.h>

#include "kernels.h"

static void project(const cr_proj *p, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t M,
                    float *xsum, int threads) {
    for (; p; y += p->N, p = p->next)
        if (p->kind == 0)
            cr_linear_f32(x, ldx, (const float *)p->weight, p->bias, y, ldy, M, p->N, p->K, threads);
        else
            cr_linear_q(x, ldx, (const uint8_t *)p->weight, (int)p->kind - 1, p->d, p->m, p->sub, p->bias, y, ldy,
                        M, p->N, p->K, xsum, threads);
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
 * x, h [M][H]; out [M][the qkv projection's width] */
void cr_layer_pre(const float *x, int64_t M, int64_t H, const float *norm, float eps, const cr_proj *qkv,
                  const float *cos_t, const float *ssin_t, int64_t rot_heads, int64_t hd, float *h, float *out,
                  float *xsum, int threads) {
    int64_t width = cr_proj_width(qkv), half = hd / 2;
    rms_norm_rows(x, norm, eps, h, M, H, threads);
    project(qkv, h, H, out, width, M, xsum, threads);
    #pragma omp parallel for schedule(static) num_threads(threads) if(M >= PARALLEL_ROWS)
    for (int64_t i = 0; i < M; i++) {
        float tmp[MAX_HEAD_DIM];
        const float *c = cos_t + i * hd, *s = ssin_t + i * hd;
        for (int64_t hh = 0; hh < rot_heads; hh++) {
            float *v = out + i * width + hh * hd;
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
