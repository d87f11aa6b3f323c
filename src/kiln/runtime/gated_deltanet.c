/* Gated DeltaNet decode step (Qwen3.5 linear-attention layers), CPU, float32.
 *
 * Built and loaded by kiln/runtime/gated_deltanet.py through paged_attention.build (one builder for
 * every Kiln kernel). One call runs one layer's step for every decoding row, reading and writing each
 * row's state where it lies in the linear-state pool (kiln.runtime.linear_state), no gather or scatter:
 *
 *   mixed  [rows, conv_dim]   the in_proj_qkv output of each row's token (q | k | v channels)
 *   a, b   [rows, v_heads]    the in_proj_a / in_proj_b outputs
 *   z      [rows, v_heads * v_dim]  the in_proj_z output (the output gate)
 *   conv   the pool's conv windows [slots, conv_dim, kernel]; row r uses slot slots[r]
 *   state  the pool's recurrent matrices [slots, v_heads, k_dim, v_dim]
 *   out    [rows, v_heads * v_dim]: the gated, normalised output (the out_proj input)
 *
 * Per row: the window shifts by one and takes the new input; the depthwise convolution over it and a
 * SiLU give q | k | v; q and k are L2-normalised per head (eps 1e-6) and q scaled by k_dim^-1/2; per
 * value head h (key head h / (v_heads / k_heads)): decay = exp(-exp(A_log) * softplus(a + dt_bias)),
 * beta = sigmoid(b); S *= decay; delta = (v - S^T k) * beta; S += k delta^T; o = S^T q; then
 * o = rmsnorm(o) * norm_w * silu(z). The same order of operations as transformers' torch path.
 * Rows within a call must use distinct slots.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(KILN_BASELINE_ONLY)
#define KILN_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KILN_CLONES
#endif

typedef struct {
    const float *mixed, *a, *b, *z;
    float *conv, *state;
    const int64_t *slots;
    const float *conv_w, *a_log, *dt_bias, *norm_w;
    float eps;
    int64_t rows, conv_dim, kernel, k_heads, v_heads, k_dim, v_dim;
    float *out;
} kiln_gdn_args;

static float silu(float x) { return x / (1.0f + expf(-x)); }

static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static void l2norm(float *x, int64_t n, float scale) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += x[i] * x[i];
    float inv = scale / sqrtf(acc + 1e-6f);
    for (int64_t i = 0; i < n; i++) x[i] *= inv;
}

/* The window shift, convolution and SiLU of one row: y[c] for every channel. */
static void conv_row(const kiln_gdn_args *p, const float *x, float *win_all, float *y) {
    const int64_t K = p->kernel;
    for (int64_t c = 0; c < p->conv_dim; c++) {
        float *win = win_all + c * K;
        const float *w = p->conv_w + c * K;
        for (int64_t j = 0; j + 1 < K; j++) win[j] = win[j + 1];
        win[K - 1] = x[c];
        float acc = 0.0f;
        for (int64_t j = 0; j < K; j++) acc += w[j] * win[j];
        y[c] = silu(acc);
    }
}

/* One value head's delta-rule update and read-out (S: [k_dim, v_dim], in place); o gets S^T q. */
static void delta_head(float *restrict S, const float *restrict q, const float *restrict k,
                       const float *restrict v, float decay, float beta, int64_t dk, int64_t dv,
                       float *restrict kv, float *restrict o) {
    for (int64_t j = 0; j < dv; j++) kv[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *s = S + i * dv;
        const float ki = k[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) {
            s[j] *= decay;
            kv[j] += s[j] * ki;
        }
    }
    for (int64_t j = 0; j < dv; j++) {
        kv[j] = (v[j] - kv[j]) * beta; /* delta */
        o[j] = 0.0f;
    }
    for (int64_t i = 0; i < dk; i++) {
        float *s = S + i * dv;
        const float ki = k[i], qi = q[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) {
            s[j] += ki * kv[j];
            o[j] += s[j] * qi;
        }
    }
}

KILN_CLONES int kiln_gdn_decode(const kiln_gdn_args *p) {
    const int64_t key_dim = p->k_heads * p->k_dim, dv = p->v_dim, dk = p->k_dim;
    const int64_t group = p->v_heads / p->k_heads;
    if (p->k_heads < 1 || p->v_heads % p->k_heads != 0 || p->conv_dim != 2 * key_dim + p->v_heads * dv
        || p->kernel < 1)
        return -2;
    float *y = malloc(sizeof(float) * (size_t)(p->conv_dim + 2 * dv));
    if (!y) return -1;
    float *kv = y + p->conv_dim, *o = kv + dv;
    const float qscale = 1.0f / sqrtf((float)dk);
    for (int64_t r = 0; r < p->rows; r++) {
        const int64_t slot = p->slots[r];
        conv_row(p, p->mixed + r * p->conv_dim, p->conv + slot * p->conv_dim * p->kernel, y);
        for (int64_t h = 0; h < p->k_heads; h++) {
            l2norm(y + h * dk, dk, qscale);
            l2norm(y + key_dim + h * dk, dk, 1.0f);
        }
        for (int64_t h = 0; h < p->v_heads; h++) {
            const int64_t kh = h / group;
            const float g = -expf(p->a_log[h]) * softplus(p->a[r * p->v_heads + h] + p->dt_bias[h]);
            const float beta = 1.0f / (1.0f + expf(-p->b[r * p->v_heads + h]));
            float *S = p->state + (slot * p->v_heads + h) * dk * dv;
            delta_head(S, y + kh * dk, y + key_dim + kh * dk, y + 2 * key_dim + h * dv, expf(g), beta, dk, dv,
                       kv, o);
            float var = 0.0f;
            for (int64_t j = 0; j < dv; j++) var += o[j] * o[j];
            const float inv = 1.0f / sqrtf(var / (float)dv + p->eps);
            const float *zr = p->z + r * p->v_heads * dv + h * dv;
            float *dst = p->out + r * p->v_heads * dv + h * dv;
            for (int64_t j = 0; j < dv; j++) dst[j] = p->norm_w[j] * (o[j] * inv) * silu(zr[j]);
        }
    }
    free(y);
    return 0;
}
