/* Paged attention over a block-table KV pool, read in place (CPU, float32).
 *
 * Built and loaded by kiln/runtime/paged_attention.py (the C compiler at first use, cached
 * under $KILN_KERNEL_DIR, else $XDG_CACHE_HOME/kiln/kernels: ~/.cache/kiln/kernels). One call
 * computes one layer's attention for every query token of a forward; its arguments come by name
 * in a kiln_attention_args (below):
 *
 *   q      token i, query head j at q[i * q_token_stride + j * q_head_stride + c]
 *   k, v   the pool's layer tensors [blocks, block_size, kv_heads, head_dim], contiguous
 *   table  int64 [rows, table_width]: position p of row r lives in block table[r][p / block_size]
 *          at offset p % block_size
 *   row_of, pos_of  int64 [tokens]: token i belongs to row row_of[i] and sits at position
 *          pos_of[i]; it attends to that row's positions 0..pos_of[i] (the causal mask)
 *   out    [tokens, heads, head_dim], contiguous
 *   k_new, v_new  optional (NULL: none): the tokens' own keys and values, token i's KV head h at
 *          k_new[i * kn_token_stride + h * kn_head_stride + c] (v_new likewise); stored at the
 *          tokens' positions before any token attends
 *   q_norm_w, k_norm_w, eps  optional: per-head RMSNorm weights [head_dim] of the queries and the
 *          new keys (Qwen3's q_norm/k_norm), applied before RoPE
 *   cos_t, sin_t  optional: RoPE rows [tokens, head_dim] (transformers' rotary embedding for
 *          each token's position) applied to the queries and the new keys
 *
 * Query head j reads KV head j / (heads / kv_heads) (grouped-query attention as transformers'
 * repeat_kv). Softmax in float32 with the running maximum subtracted; the exponential is a
 * range-reduced polynomial (relative error below 1e-7 on the arguments it sees, all <= 0) so
 * that the loop vectorizes without -ffast-math (which, with GCC 12, would link crtfastmath
 * and set flush-to-zero for the whole process). No allocation but two scratch buffers per
 * call; no threads: the engine runs one torch thread and the call releases the GIL.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(KILN_BASELINE_ONLY)
#define KILN_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KILN_CLONES
#endif
#if defined(__GNUC__)
#define KILN_INLINE static inline __attribute__((always_inline)) /* inlined into each clone, so built for its ISA */
#else
#define KILN_INLINE static inline
#endif

KILN_INLINE float exp_nonpositive(float x) {
    /* e^x for x <= 0: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial */
    union { float f; int32_t i; } scale;
    x = x < -87.0f ? -87.0f : x;
    int32_t n = (int32_t)(x * 1.4426950408889634f - 0.5f); /* rounds to nearest for x <= 0 */
    float r = x - (float)n * 0.693145751953125f;
    r = r - (float)n * 1.4286067653301870e-06f;
    float p = 1.9841269841269841e-04f;
    p = p * r + 1.3888888888888889e-03f;
    p = p * r + 8.3333333333333333e-03f;
    p = p * r + 4.1666666666666667e-02f;
    p = p * r + 1.6666666666666667e-01f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    scale.i = (n + 127) << 23;
    return p * scale.f;
}

KILN_INLINE float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t c = 0; c < n; c++) acc += a[c] * b[c];
    return acc;
}

#define LANES 16 /* query (token, head) pairs a multi-token tile computes side by side */

/* Offset (in floats) of the block holding position t of a row whose block table is `tab`. */
KILN_INLINE int64_t block_at(const int64_t *tab, int64_t t, int64_t block_size, int64_t slot) {
    return tab[t / block_size] * block_size * slot;
}

/* Positions of the block starting at t0 that lie below len. */
KILN_INLINE int64_t block_fill(int64_t t0, int64_t len, int64_t block_size) {
    return len - t0 < block_size ? len - t0 : block_size;
}

/* The next block's slot at offset o (kv_heads x head_dim floats, elsewhere in memory) on its way
 * into the cache while this block is read; `next` is NULL past the row's last block. */
KILN_INLINE void prefetch_slot(const float *next, int64_t o, int64_t slot) {
    if (next != NULL)
        for (int64_t c = 0; c < slot; c += 16) __builtin_prefetch(next + o * slot + c);
}

/* ONE query token (decode) against its row's keys, every head at once: the keys and values
 * are walked in memory order (a position's kv_heads x head_dim floats are contiguous), so the
 * reads stream through whole blocks as the hardware prefetcher expects; a walk per head would
 * stride by kv_heads x head_dim floats and cross a page every few keys. `scores` holds
 * heads x len floats (head-major), `acc` heads x head_dim. */
KILN_INLINE void attend_one(const float *qi, int64_t q_head_stride, const float *k, const float *v,
                              const int64_t *tab, int64_t len, int64_t heads, int64_t groups, int64_t slot,
                              int64_t head_dim, int64_t block_size, float scale, float *scores, float *acc,
                              float *dst) {
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t n = block_fill(t0, len, block_size);
        const float *kb = k + block_at(tab, t0, block_size, slot);
        const float *kn = t0 + block_size < len ? k + block_at(tab, t0 + block_size, block_size, slot) : NULL;
        for (int64_t o = 0; o < n; o++) {
            const float *kp = kb + o * slot;
            prefetch_slot(kn, o, slot);
            for (int64_t j = 0; j < heads; j++)
                scores[j * len + t0 + o] = dot(qi + j * q_head_stride, kp + (j / groups) * head_dim, head_dim) * scale;
        }
    }
    for (int64_t j = 0; j < heads; j++) {
        float *s = scores + j * len;
        float top = s[0];
        for (int64_t t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; t++) {
            float e = exp_nonpositive(s[t] - top);
            s[t] = e;
            total += e;
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * (size_t)(heads * head_dim));
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t n = block_fill(t0, len, block_size);
        const float *vb = v + block_at(tab, t0, block_size, slot);
        const float *vn = t0 + block_size < len ? v + block_at(tab, t0 + block_size, block_size, slot) : NULL;
        for (int64_t o = 0; o < n; o++) {
            const float *vp = vb + o * slot;
            prefetch_slot(vn, o, slot);
            for (int64_t j = 0; j < heads; j++) {
                const float p = scores[j * len + t0 + o];
                const float *vh = vp + (j / groups) * head_dim;
                float *a = acc + j * head_dim;
#pragma omp simd
                for (int64_t c = 0; c < head_dim; c++) a[c] += p * vh[c];
            }
        }
    }
    memcpy(dst, acc, sizeof(float) * (size_t)(heads * head_dim));
}

/* One KV head for a tile of consecutive query tokens of the same row (a prompt chunk): up to
 * LANES (token, query head) pairs computed side by side, each key loaded once for all of them
 * (an outer product over the head dimension instead of one dot product per pair). Scores are
 * key-major [key][lane]; lane l is token first + l / groups, query head h * groups + l % groups;
 * a lane sees keys 0..its position (padded lanes none). */
KILN_INLINE void attend_tile(const float *q, int64_t q_token_stride, int64_t q_head_stride, const float *k,
                               const float *v, const int64_t *tab, const int64_t *pos, int64_t ntok, int64_t h,
                               int64_t groups, int64_t slot, int64_t head_dim, int64_t block_size, float scale,
                               float *qt, float *scores, float *acc, float *out, int64_t heads) {
    int64_t lim[LANES];
    float top[LANES], total[LANES], row[LANES];
    const int64_t lanes = ntok * groups;
    int64_t len = 0;
    for (int64_t l = 0; l < LANES; l++) {
        lim[l] = l < lanes ? pos[l / groups] + 1 : 0;
        len = lim[l] > len ? lim[l] : len;
        top[l] = -3.0e38f;
        total[l] = 0.0f;
    }
    for (int64_t c = 0; c < head_dim; c++)
        for (int64_t l = 0; l < LANES; l++)
            qt[c * LANES + l] = l < lanes
                ? q[(l / groups) * q_token_stride + (h * groups + l % groups) * q_head_stride + c] * scale : 0.0f;
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t n = block_fill(t0, len, block_size);
        const float *kb = k + block_at(tab, t0, block_size, slot);
        int64_t o = 0;
        for (; o + 4 <= n; o += 4) {  /* four keys at a time: four independent FMA chains */
            const float *k0 = kb + o * slot, *k1 = k0 + slot, *k2 = k1 + slot, *k3 = k2 + slot;
            float r0[LANES], r1[LANES], r2[LANES], r3[LANES];
#pragma omp simd
            for (int64_t l = 0; l < LANES; l++) r0[l] = r1[l] = r2[l] = r3[l] = 0.0f;
            for (int64_t c = 0; c < head_dim; c++) {
                const float *qc = qt + c * LANES;
                const float a0 = k0[c], a1 = k1[c], a2 = k2[c], a3 = k3[c];
#pragma omp simd
                for (int64_t l = 0; l < LANES; l++) {
                    r0[l] += qc[l] * a0;
                    r1[l] += qc[l] * a1;
                    r2[l] += qc[l] * a2;
                    r3[l] += qc[l] * a3;
                }
            }
            float *s = scores + (t0 + o) * LANES;
#pragma omp simd
            for (int64_t l = 0; l < LANES; l++) {
                s[l] = r0[l];
                s[LANES + l] = r1[l];
                s[2 * LANES + l] = r2[l];
                s[3 * LANES + l] = r3[l];
            }
        }
        for (; o < n; o++) {
            const float *kp = kb + o * slot;
            float *s = scores + (t0 + o) * LANES;
#pragma omp simd
            for (int64_t l = 0; l < LANES; l++) row[l] = 0.0f;
            for (int64_t c = 0; c < head_dim; c++) {
                const float kc = kp[c];
                const float *qc = qt + c * LANES;
#pragma omp simd
                for (int64_t l = 0; l < LANES; l++) row[l] += qc[l] * kc;
            }
#pragma omp simd
            for (int64_t l = 0; l < LANES; l++) s[l] = row[l];
        }
    }
    for (int64_t t = 0; t < len; t++) {  /* each lane's maximum over the keys it sees */
        const float *s = scores + t * LANES;
#pragma omp simd
        for (int64_t l = 0; l < LANES; l++) top[l] = (t < lim[l] && s[l] > top[l]) ? s[l] : top[l];
    }
    for (int64_t t = 0; t < len; t++) {
        float *s = scores + t * LANES;
#pragma omp simd
        for (int64_t l = 0; l < LANES; l++) {
            const float e = t < lim[l] ? exp_nonpositive(s[l] - top[l]) : 0.0f;
            s[l] = e;
            total[l] += e;
        }
    }
    memset(acc, 0, sizeof(float) * (size_t)(lanes * head_dim));
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t n = block_fill(t0, len, block_size);
        const float *vb = v + block_at(tab, t0, block_size, slot);
        int64_t o = 0;
        for (; o + 4 <= n; o += 4) {  /* four keys per pass over each lane's accumulator */
            const float *v0 = vb + o * slot, *v1 = v0 + slot, *v2 = v1 + slot, *v3 = v2 + slot;
            const float *s = scores + (t0 + o) * LANES;
            for (int64_t l = 0; l < lanes; l++) {
                const float p0 = s[l], p1 = s[LANES + l], p2 = s[2 * LANES + l], p3 = s[3 * LANES + l];
                float *a = acc + l * head_dim;
#pragma omp simd
                for (int64_t c = 0; c < head_dim; c++) a[c] += p0 * v0[c] + p1 * v1[c] + p2 * v2[c] + p3 * v3[c];
            }
        }
        for (; o < n; o++) {
            const float *vp = vb + o * slot;
            const float *s = scores + (t0 + o) * LANES;
            for (int64_t l = 0; l < lanes; l++) {
                const float p = s[l];
                float *a = acc + l * head_dim;
#pragma omp simd
                for (int64_t c = 0; c < head_dim; c++) a[c] += p * vp[c];
            }
        }
    }
    for (int64_t l = 0; l < lanes; l++) {
        const float inv = 1.0f / total[l];
        float *dst = out + ((l / groups) * heads + h * groups + l % groups) * head_dim;
        const float *a = acc + l * head_dim;
#pragma omp simd
        for (int64_t c = 0; c < head_dim; c++) dst[c] = a[c] * inv;
    }
}

/* One head's vector as the attention sees it: RMS-normalised with `norm_w` when given (as
 * transformers' RMSNorm: x / sqrt(mean(x^2) + eps) * w, in float32), then rotated by RoPE with
 * this token's cos/sin rows when given (x * cos + rotate_half(x) * sin, rotate_half(x) =
 * [-x2, x1] over the two halves of the head). */
KILN_INLINE void prepare_head(const float *x, float *dst, int64_t head_dim, const float *norm_w, float eps,
                              const float *cos, const float *sin) {
    float tmp[512];
    const float *src = x;
    if (norm_w != NULL) {
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < head_dim; c++) ss += x[c] * x[c];
        const float r = 1.0f / sqrtf(ss / (float)head_dim + eps);
#pragma omp simd
        for (int64_t c = 0; c < head_dim; c++) tmp[c] = norm_w[c] * (x[c] * r);
        src = tmp;
    }
    if (cos != NULL) {
        const int64_t half = head_dim / 2;
#pragma omp simd
        for (int64_t c = 0; c < half; c++) dst[c] = src[c] * cos[c] - src[c + half] * sin[c];
#pragma omp simd
        for (int64_t c = half; c < head_dim; c++) dst[c] = src[c] * cos[c] + src[c - half] * sin[c];
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)head_dim);
    }
}

/* The arguments of one call, by name (kiln/runtime/paged_attention.py's AttentionArgs mirrors this layout). */
typedef struct kiln_attention_args {
    const float *q;
    int64_t q_token_stride, q_head_stride;
    float *k, *v;
    const int64_t *table;
    int64_t table_width;
    const int64_t *row_of, *pos_of;
    int64_t tokens, heads, kv_heads, head_dim, block_size;
    float scale;
    float *out;
    const float *k_new;
    int64_t kn_token_stride, kn_head_stride;
    const float *v_new;
    int64_t vn_token_stride, vn_head_stride;
    const float *q_norm_w, *k_norm_w;
    float eps;
    const float *cos_t, *sin_t;
} kiln_attention_args;

KILN_CLONES
int kiln_paged_attention(const kiln_attention_args *args) {
    const float *q = args->q;
    int64_t q_token_stride = args->q_token_stride, q_head_stride = args->q_head_stride;
    float *const k = args->k, *const v = args->v, *const out = args->out;
    const int64_t *const table = args->table, *const row_of = args->row_of, *const pos_of = args->pos_of;
    const int64_t table_width = args->table_width, tokens = args->tokens, heads = args->heads;
    const int64_t kv_heads = args->kv_heads, head_dim = args->head_dim, block_size = args->block_size;
    const float scale = args->scale, eps = args->eps;
    const float *const k_new = args->k_new, *const v_new = args->v_new;
    const int64_t kn_token_stride = args->kn_token_stride, kn_head_stride = args->kn_head_stride;
    const int64_t vn_token_stride = args->vn_token_stride, vn_head_stride = args->vn_head_stride;
    const float *const q_norm_w = args->q_norm_w, *const k_norm_w = args->k_norm_w;
    const float *const cos_t = args->cos_t, *const sin_t = args->sin_t;
    if (tokens <= 0) return 0;
    if (kv_heads <= 0 || heads % kv_heads != 0 || block_size <= 0 || head_dim <= 0) return -2;
    if ((q_norm_w != NULL || k_norm_w != NULL || cos_t != NULL) && (head_dim > 512 || head_dim % 2 != 0)) return -2;
    const int64_t groups = heads / kv_heads;
    const int64_t slot = kv_heads * head_dim;   /* floats between consecutive offsets of a block */
    if (k_new != NULL && v_new != NULL) {  /* store the tokens' own keys and values first: a prompt
                                              chunk's tokens attend to each other */
        for (int64_t i = 0; i < tokens; i++) {
            const int64_t p = pos_of[i];
            const int64_t at = block_at(table + row_of[i] * table_width, p, block_size, slot) + p % block_size * slot;
            const float *ci = cos_t != NULL ? cos_t + i * head_dim : NULL;
            const float *si = sin_t != NULL ? sin_t + i * head_dim : NULL;
            for (int64_t h = 0; h < kv_heads; h++) {
                prepare_head(k_new + i * kn_token_stride + h * kn_head_stride, k + at + h * head_dim, head_dim,
                             k_norm_w, eps, ci, si);
                memcpy(v + at + h * head_dim, v_new + i * vn_token_stride + h * vn_head_stride,
                       sizeof(float) * (size_t)head_dim);
            }
        }
    }
    float *qbuf = NULL;
    if (q_norm_w != NULL || cos_t != NULL) {  /* the queries normalised and rotated, [tokens, heads, head_dim] */
        qbuf = (float *)malloc(sizeof(float) * (size_t)(tokens * heads * head_dim));
        if (qbuf == NULL) return -1;
        for (int64_t i = 0; i < tokens; i++)
            for (int64_t j = 0; j < heads; j++)
                prepare_head(q + i * q_token_stride + j * q_head_stride, qbuf + (i * heads + j) * head_dim, head_dim,
                             q_norm_w, eps, cos_t != NULL ? cos_t + i * head_dim : NULL,
                             sin_t != NULL ? sin_t + i * head_dim : NULL);
        q = qbuf;
        q_token_stride = heads * head_dim;
        q_head_stride = head_dim;
    }
    const int64_t tile = groups <= LANES ? LANES / groups : 1;  /* tokens per multi-token tile */
    int64_t longest = 0;
    for (int64_t i = 0; i < tokens; i++)
        if (pos_of[i] + 1 > longest) longest = pos_of[i] + 1;
    const int64_t width = heads > LANES ? heads : LANES;
    float *scores = (float *)malloc(sizeof(float) * (size_t)(width * longest));
    float *acc = (float *)malloc(sizeof(float) * (size_t)(width * head_dim));
    float *qt = (float *)malloc(sizeof(float) * (size_t)(LANES * head_dim));
    if (scores == NULL || acc == NULL || qt == NULL) {
        free(scores);
        free(acc);
        free(qt);
        free(qbuf);
        return -1;
    }
    int64_t i = 0;
    while (i < tokens) {
        int64_t j = i + 1;  /* the tile: consecutive tokens of one row */
        while (j < tokens && j - i < tile && row_of[j] == row_of[i]) j++;
        const int64_t *tab = table + row_of[i] * table_width;
        if (j - i == 1 || groups > LANES) {
            for (int64_t x = i; x < j; x++)
                attend_one(q + x * q_token_stride, q_head_stride, k, v, tab, pos_of[x] + 1, heads, groups, slot,
                           head_dim, block_size, scale, scores, acc, out + x * heads * head_dim);
        } else {
            for (int64_t h = 0; h < kv_heads; h++)
                attend_tile(q + i * q_token_stride, q_token_stride, q_head_stride, k + h * head_dim,
                            v + h * head_dim, tab, pos_of + i, j - i, h, groups, slot, head_dim, block_size, scale,
                            qt, scores, acc, out + i * heads * head_dim, heads);
        }
        i = j;
    }
    free(scores);
    free(acc);
    free(qt);
    free(qbuf);
    return 0;
}

/* The decoder's residual add and RMSNorm in one pass: h += delta (when given), then
 * out = w * (h / sqrt(mean(h^2) + eps)) per row of `dim` floats; h, delta, out contiguous. */
KILN_CLONES
void kiln_add_rms_norm(float *h, const float *delta, const float *w, float eps, int64_t rows, int64_t dim,
                       float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float *hr = h + r * dim;
        float *o = out + r * dim;
        if (delta != NULL) {
            const float *dr = delta + r * dim;
#pragma omp simd
            for (int64_t c = 0; c < dim; c++) hr[c] += dr[c];
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < dim; c++) ss += hr[c] * hr[c];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t c = 0; c < dim; c++) o[c] = w[c] * (hr[c] * inv);
    }
}
