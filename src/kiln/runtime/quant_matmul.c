/* Weight-only int8 / int4 matmul for the CPU: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]).
 *
 * Built and loaded by kiln/runtime/quant_matmul.py through kiln.runtime.paged_attention.build (the
 * one C builder; cached under the kernel directory). The activations are quantized per row, one
 * scale per group of ``group`` elements (symmetric int8, d = max|x| / 127; a multiple of 32; the whole
 * row when <= 0), and a group's dot products add up in int32, converted to float once per group:
 *
 *   int8 (mode 8):  W[n, k] = q[n, k] * scale[n]; w: int8 [N, K]; scales: float [N].
 *   int4 (mode 4):  W[n, k] = (q - 8) * s[n, b] + z[n, b] for k in block b = k / 32; w: uint8
 *                   [N, K / 2], block b of row n at w[n * K / 2 + b * 16 ..]: byte j holds element
 *                   j in its low nibble and element j + 16 in its high nibble (codes 0..15);
 *                   scales: float [N, K / 32, 2] = (s, z); sub: int16 [N, K / 32] and rowscale: float
 *                   [N] with s[n, b] = rowscale[n] * sub[n, b], sub in 1..255 (the quantizer snaps
 *                   the block scales so). The integer part, sum_b sub[b] * dot(q_b, xq_b) over a group
 *                   (codes taken unsigned, 0..15), adds up in int32; the rest is activation-side
 *                   per block: -8 * d * sum(xq_b) (the codes' offset) and the float sum of x_b (the
 *                   zero), so it is one float dot of (s, z) with those pairs per output. A group is
 *                   at most INT4_MAX_GROUP elements (64 blocks x 255 x 15 x 127 x 32 < 2^31).
 *
 * Paths: AVX-512 VNNI with 512-bit vectors, the same with 256-bit ones, AVX2 + FMA, and portable C
 * (the only one compiled with -DKILN_BASELINE_ONLY), chosen once from the running CPU
 * (kiln_qmm_isa). All paths compute the same integer group sums; only the float accumulation
 * order differs. Output features are split across OpenMP threads (``threads`` per call) when
 * the matrix is large enough; the call holds no Python state (ctypes releases the GIL).
 * K must be a multiple of 32. Returns 0, -1 (out of memory) or -2 (bad arguments).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define QB 32                    /* block of K */
#define PF_ROWS 8  /* x86 paths: prefetch the weight row this many rows ahead (the first row tile does) */
#define PAR_MIN_WORK (1L << 31)  /* M * N * K below this: one thread (see kiln_qmm) */
#define INT4_MAX_GROUP 2048  /* int4: the int32 group sums' bound (see the top) */

typedef struct {
    const float *x; int64_t m, k;      /* x [m, k] contiguous */
    const void *w; const float *scales; const float *bias;  /* bias: optional [n] */
    int64_t n; int32_t mode;           /* 8 or 4 */
    int32_t threads;                   /* OpenMP threads (<= 1: the calling thread only) */
    int32_t isa;  /* -1: the best this CPU runs; else force 0 portable, 1 avx2, 2 vnni, 3 vnni512 */
    float *out;                        /* [m, n] contiguous */
    int64_t group;  /* activation elements per scale (a multiple of 32; <= 0 or >= k: the whole row) */
    const int16_t *sub;     /* int4: [n, k / 32] integer block scales */
    const float *rowscale;  /* int4: [n] */
} kiln_qmm_args;

typedef struct {  /* the activations, quantized */
    const int8_t *q;   /* [m, k]; int4 on the 512-bit path: each pair of blocks of a group by halves (interleave_pairs) */
    const float *d;    /* [m, ceil(k / group)] group scales */
    const float *ab;   /* int4: [m, k / 32, 2] = (-8 * d * sum(q_b), sum(x_b)) per block */
} xquant;

typedef void (*row_fn)(const kiln_qmm_args *, const xquant *, int64_t n0, int64_t n1);

/* ---- activations ---------------------------------------------------------------------- */

/* x [m, k] -> int8 q [m, k] and one scale d per group of g elements of a row ([m, ceil(k / g)]; the
 * last group of a row may be shorter). */
static void quantize_x(const float *x, int64_t m, int64_t k, int64_t g, int8_t *q, float *d) {
    int64_t ng = (k + g - 1) / g;
    for (int64_t i = 0; i < m; i++)
        for (int64_t t = 0; t < ng; t++) {
            int64_t k0 = t * g, len = k - k0 < g ? k - k0 : g;
            const float *xb = x + i * k + k0;
            float amax = 0.f;
            for (int64_t j = 0; j < len; j++) {
                float v = fabsf(xb[j]);
                amax = v > amax ? v : amax;
            }
            float inv = amax > 0.f ? 127.f / amax : 0.f;
            for (int64_t j = 0; j < len; j++) q[i * k + k0 + j] = (int8_t)lrintf(xb[j] * inv);
            d[i * ng + t] = amax / 127.f;
        }
}

/* The activation group: elements of a row that share one scale (their integer dots add up in int32). */
static inline int64_t xgroup(const kiln_qmm_args *a) {
    int64_t g = a->group > 0 && a->group < a->k ? a->group : a->k;
    return a->mode == 4 && g > INT4_MAX_GROUP ? INT4_MAX_GROUP : g;
}

/* int4's activation-side pairs per block (see the top): ab[i, b] = (-8 * d * sum(q_b), sum(x_b)). */
static void int4_terms(const float *x, int64_t m, int64_t k, int64_t g, const int8_t *q, const float *d, float *ab) {
    int64_t kb = k / QB, ng = (k + g - 1) / g;
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < kb; b++) {
            const float *xb = x + i * k + b * QB;
            const int8_t *qb = q + i * k + b * QB;
            float s = 0.f;
            int32_t sq = 0;
            for (int j = 0; j < QB; j++) { s += xb[j]; sq += qb[j]; }
            ab[(i * kb + b) * 2] = -8.f * d[i * ng + b * QB / g] * (float)sq;
            ab[(i * kb + b) * 2 + 1] = s;
        }
}

/* The 512-bit int4 layout of the activations: within each group, every whole pair of blocks (b, b + 1)
 * becomes b[0:16] b+1[0:16] b[16:32] b+1[16:32], the order in which one 32-byte load of the two
 * blocks' packed codes unpacks (low nibbles, then high); a group's odd last block stays as it is. */
static void interleave_pairs(int8_t *q, int64_t m, int64_t k, int64_t g) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t k0 = 0; k0 < k; k0 += g) {
            int64_t k1 = k0 + g < k ? k0 + g : k;
            for (int64_t kk = k0; kk + 2 * QB <= k1; kk += 2 * QB) {
                int8_t t[16], *p = q + i * k + kk;
                memcpy(t, p + 16, 16);
                memcpy(p + 16, p + 32, 16);
                memcpy(p + 32, t, 16);
            }
        }
}

/* ---- portable -------------------------------------------------------------------------- */

/* int4's float part of one output: the dot of its (s, z) pairs with the activations' (see the top). */
static float corr_portable(const float *sc, const float *ab, int64_t len) {
    float s = 0.f;
    for (int64_t j = 0; j < len; j++) s += sc[j] * ab[j];
    return s;
}

/* int4: per group, sum_b sub[b] * dot(codes_b, xq_b) in int32, converted to float once. */
static void rows4_portable(const kiln_qmm_args *a, const xquant *xq, int64_t n0, int64_t n1) {
    int64_t k = a->k, kb = k / QB, g = xgroup(a), ng = (k + g - 1) / g;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *w = (const uint8_t *)a->w + n * (k / 2);
        const int16_t *ls = a->sub + n * kb;
        for (int64_t i = 0; i < a->m; i++) {
            const int8_t *x = xq->q + i * k;
            float acc = 0.f;
            for (int64_t t = 0; t < ng; t++) {
                int64_t b1 = ((t + 1) * g < k ? (t + 1) * g : k) / QB;
                int32_t dot = 0;
                for (int64_t b = t * g / QB; b < b1; b++) {
                    const uint8_t *p = w + b * 16;
                    const int8_t *xb = x + b * QB;
                    int32_t bd = 0;
                    for (int j = 0; j < 16; j++) bd += (p[j] & 15) * xb[j] + (p[j] >> 4) * xb[j + 16];
                    dot += bd * ls[b];
                }
                acc += (float)dot * xq->d[i * ng + t];
            }
            a->out[i * a->n + n] = acc * a->rowscale[n] + corr_portable(a->scales + n * kb * 2, xq->ab + i * kb * 2, 2 * kb)
                                   + (a->bias ? a->bias[n] : 0.f);
        }
    }
}

/* int8: one int32 dot per activation group, converted to float once per group. */
static void rows8_portable(const kiln_qmm_args *a, const xquant *xq, int64_t n0, int64_t n1) {
    int64_t k = a->k, g = xgroup(a), ng = (k + g - 1) / g;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *w = (const int8_t *)a->w + n * k;
        for (int64_t i = 0; i < a->m; i++) {
            const int8_t *x = xq->q + i * k;
            float acc = 0.f;
            for (int64_t t = 0; t < ng; t++) {
                int64_t k1 = (t + 1) * g < k ? (t + 1) * g : k;
                int32_t dot = 0;
                for (int64_t j = t * g; j < k1; j++) dot += (int32_t)w[j] * (int32_t)x[j];
                acc += (float)dot * xq->d[i * ng + t];
            }
            a->out[i * a->n + n] = acc * a->scales[n] + (a->bias ? a->bias[n] : 0.f);
        }
    }
}

/* ---- x86-64: AVX2 + FMA, AVX-512 VNNI -------------------------------------------------- */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(KILN_BASELINE_ONLY)
#include <immintrin.h>
#define KILN_X86 1
#define AVX2 __attribute__((target("avx2,fma")))
#define VNNI __attribute__((target("avx2,fma,avx512f,avx512vl,avx512vnni")))

AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static const int32_t lane_mask[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* The first ``len`` (1..8) floats at p, zeros after. */
AVX2 static inline __m256 load8_upto(const float *p, int64_t len) {
    if (len >= 8) return _mm256_loadu_ps(p);
    return _mm256_maskload_ps(p, _mm256_loadu_si256((const __m256i *)(lane_mask + 8 - len)));
}

/* 16 packed bytes -> the block's 32 codes (0..15) in element order. */
AVX2 static inline __m256i load_w4(const uint8_t *p) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    v = _mm256_blend_epi32(v, _mm256_srli_epi16(v, 4), 0xF0);
    return _mm256_and_si256(v, _mm256_set1_epi8(15));
}

/* int8, 256 bits: the block dots of an activation group add up in int32 registers (R x NW of them)
 * and are converted to float once per group. ``ACC`` adds a block's integer dot to an accumulator. */
#define TILE8_BODY(ACC)                                                                           \
    int64_t k = a->k, g = xgroup(a), ng = (k + g - 1) / g;                                        \
    __m256 acc[4][2];                                                                             \
    const int8_t *wp[2];                                                                          \
    for (int c = 0; c < NW; c++) wp[c] = (const int8_t *)a->w + (n + c) * k;                      \
    for (int j = 0; j < R; j++)                                                                   \
        for (int c = 0; c < NW; c++) acc[j][c] = _mm256_setzero_ps();                             \
    for (int64_t t = 0; t < ng; t++) {                                                            \
        int64_t k0 = t * g, k1 = k0 + g < k ? k0 + g : k;                                         \
        __m256i dot[4][2];                                                                        \
        for (int j = 0; j < R; j++)                                                               \
            for (int c = 0; c < NW; c++) dot[j][c] = _mm256_setzero_si256();                      \
        for (int64_t kk = k0; kk < k1; kk += QB) {                                                \
            __m256i w[2], aw[2];                                                                  \
            for (int c = 0; c < NW; c++) {                                                        \
                w[c] = _mm256_loadu_si256((const __m256i *)(wp[c] + kk));                         \
                aw[c] = _mm256_sign_epi8(w[c], w[c]);                                             \
                if (i0 == 0) _mm_prefetch((const char *)(wp[c] + PF_ROWS * k + kk), _MM_HINT_T0);   \
            }                                                                                     \
            for (int j = 0; j < R; j++) {                                                         \
                __m256i x = _mm256_loadu_si256((const __m256i *)(xq->q + (i0 + j) * k + kk));     \
                for (int c = 0; c < NW; c++) dot[j][c] = ACC(dot[j][c], aw[c], _mm256_sign_epi8(x, w[c])); \
            }                                                                                     \
        }                                                                                         \
        for (int j = 0; j < R; j++) {                                                             \
            __m256 xd = _mm256_set1_ps(xq->d[(i0 + j) * ng + t]);                                 \
            for (int c = 0; c < NW; c++) acc[j][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[j][c]), xd, acc[j][c]); \
        }                                                                                         \
    }                                                                                             \
    for (int j = 0; j < R; j++)                                                                   \
        for (int c = 0; c < NW; c++)                                                              \
            a->out[(i0 + j) * a->n + n + c] = hsum8(acc[j][c]) * a->scales[n + c]                 \
                                              + (a->bias ? a->bias[n + c] : 0.f);

#define ACC_AVX2(acc, aw, sx) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1)))
#define ACC_VNNI(acc, aw, sx) _mm256_dpbusd_epi32(acc, aw, sx)

/* The loop over output pairs and 4-row tiles shared by every x86 path (TILE: one tile's code). */
#define DRIVE(NAME, TARGET, TILE)                                                                 \
    TARGET static void NAME(const kiln_qmm_args *a, const xquant *xq, int64_t n0, int64_t n1) {  \
        int64_t n = n0;                                                                           \
        for (; n + 2 <= n1; n += 2) {                                                             \
            int64_t i0 = 0;                                                                       \
            for (; i0 + 4 <= a->m; i0 += 4) TILE(a, xq, n, i0, 4, 2);                             \
            switch (a->m - i0) {                                                                  \
            case 3: TILE(a, xq, n, i0, 3, 2); break;                                              \
            case 2: TILE(a, xq, n, i0, 2, 2); break;                                              \
            case 1: TILE(a, xq, n, i0, 1, 2); break;                                              \
            default: break;                                                                       \
            }                                                                                     \
        }                                                                                         \
        for (; n < n1; n++)                                                                       \
            for (int64_t i0 = 0; i0 < a->m; i0++) TILE(a, xq, n, i0, 1, 1);                      \
    }

#define TILES8(NAME, TARGET, ACC)                                                                 \
    TARGET static inline __attribute__((always_inline)) void NAME##_tile(                        \
            const kiln_qmm_args *a, const xquant *xq, int64_t n, int64_t i0, const int R, const int NW) { \
        TILE8_BODY(ACC)                                                                           \
    }                                                                                             \
    DRIVE(NAME, TARGET, NAME##_tile)

TILES8(rows8_avx2, AVX2, ACC_AVX2)
TILES8(rows8_vnni, VNNI, ACC_VNNI)

/* int4, 256 bits: one block a vector; the block's codes times the activations in int16 pairs
 * (vpmaddubsw: at most 2 * 15 * 127, exact), times the block's integer scale into the group's int32
 * accumulators (``ACC4``: vpmaddwd + add, or vpdpwssd). */
#define TILE4_BODY(ACC4)                                                                          \
    int64_t k = a->k, kb = k / QB, g = xgroup(a), ng = (k + g - 1) / g;                           \
    __m256 acc[4][2], inv[2];                                                                     \
    for (int c = 0; c < NW; c++) inv[c] = _mm256_set1_ps(1.f / a->rowscale[n + c]);               \
    const uint8_t *wp[2];                                                                         \
    const int16_t *lp[2];                                                                         \
    for (int c = 0; c < NW; c++) { wp[c] = (const uint8_t *)a->w + (n + c) * (k / 2); lp[c] = a->sub + (n + c) * kb; } \
    for (int j = 0; j < R; j++)                                                                   \
        for (int c = 0; c < NW; c++) acc[j][c] = _mm256_setzero_ps();                             \
    for (int64_t t = 0; t < ng; t++) {                                                            \
        int64_t b1 = ((t + 1) * g < k ? (t + 1) * g : k) / QB;                                    \
        __m256i dot[4][2];                                                                        \
        for (int j = 0; j < R; j++)                                                               \
            for (int c = 0; c < NW; c++) dot[j][c] = _mm256_setzero_si256();                      \
        for (int c = 0; c < NW && i0 == 0; c++) { /* scales and sub-scales, PF_ROWS rows ahead */ \
            _mm_prefetch((const char *)(a->scales + ((n + c + PF_ROWS) * kb + t * g / QB) * 2), _MM_HINT_T0); \
            _mm_prefetch((const char *)(lp[c] + PF_ROWS * kb + t * g / QB), _MM_HINT_T0);         \
        }                                                                                         \
        for (int64_t b = t * g / QB; b < b1; b++) {                                               \
            __m256i w[2], ls[2];                                                                  \
            for (int c = 0; c < NW; c++) {                                                        \
                w[c] = load_w4(wp[c] + b * 16);                                                   \
                ls[c] = _mm256_set1_epi16(lp[c][b]);                                              \
                if (i0 == 0 && !(b & 3)) _mm_prefetch((const char *)(wp[c] + PF_ROWS * (k / 2) + b * 16), _MM_HINT_T0); \
            }                                                                                     \
            for (int j = 0; j < R; j++) {                                                         \
                __m256i x = _mm256_loadu_si256((const __m256i *)(xq->q + (i0 + j) * k + b * QB)); \
                for (int c = 0; c < NW; c++) dot[j][c] = ACC4(dot[j][c], _mm256_maddubs_epi16(w[c], x), ls[c]); \
            }                                                                                     \
        }                                                                                         \
        for (int j = 0; j < R; j++) {                                                             \
            __m256 xd = _mm256_set1_ps(xq->d[(i0 + j) * ng + t]);                                 \
            for (int c = 0; c < NW; c++) acc[j][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[j][c]), xd, acc[j][c]); \
        }                                                                                         \
        /* the group's float part, (s, z) . (-8 d sum(q_b), sum(x_b)), in rowscale units */      \
        for (int64_t f = 2 * (t * g / QB); f < 2 * b1; f += 8) {                                  \
            __m256 sv[2];                                                                         \
            for (int c = 0; c < NW; c++)                                                          \
                sv[c] = _mm256_mul_ps(load8_upto(a->scales + (n + c) * kb * 2 + f, 2 * b1 - f), inv[c]); \
            for (int j = 0; j < R; j++) {                                                         \
                __m256 av = load8_upto(xq->ab + (i0 + j) * kb * 2 + f, 2 * b1 - f);               \
                for (int c = 0; c < NW; c++) acc[j][c] = _mm256_fmadd_ps(sv[c], av, acc[j][c]);   \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    for (int j = 0; j < R; j++)                                                                   \
        for (int c = 0; c < NW; c++)                                                              \
            a->out[(i0 + j) * a->n + n + c] = hsum8(acc[j][c]) * a->rowscale[n + c]               \
                + (a->bias ? a->bias[n + c] : 0.f);

#define ACC4_AVX2(acc, p, ls) _mm256_add_epi32(acc, _mm256_madd_epi16(p, ls))
#define ACC4_VNNI(acc, p, ls) _mm256_dpwssd_epi32(acc, p, ls)

#define TILES4(NAME, TARGET, ACC4)                                                                \
    TARGET static inline __attribute__((always_inline)) void NAME##_tile(                        \
            const kiln_qmm_args *a, const xquant *xq, int64_t n, int64_t i0, const int R, const int NW) { \
        TILE4_BODY(ACC4)                                                               \
    }                                                                                             \
    DRIVE(NAME, TARGET, NAME##_tile)

TILES4(rows4_avx2, AVX2, ACC4_AVX2)
TILES4(rows4_vnni, VNNI, ACC4_VNNI)

#define V512 __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))

/* int8, 512 bits: the activations offset to unsigned (x + 128, one xor) so that one vpdpbusd per
 * 64 elements takes the signed weights as they are; the offset's term 128 * sum(w) is accumulated
 * beside (one vpdpbusd per weight vector, shared by the tile's rows) and taken off once per group. */
V512 static inline __attribute__((always_inline)) void v512_tile8(
        const kiln_qmm_args *a, const xquant *xq, int64_t n, int64_t i0, const int R, const int NW) {
    int64_t k = a->k, g = xgroup(a), ng = (k + g - 1) / g;
    const __m512i flip = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(1);
    __m512 acc[4][2];
    const int8_t *wp[2];
    for (int c = 0; c < NW; c++) wp[c] = (const int8_t *)a->w + (n + c) * k;
    for (int j = 0; j < R; j++)
        for (int c = 0; c < NW; c++) acc[j][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < ng; t++) {
        int64_t k0 = t * g, k1 = k0 + g < k ? k0 + g : k;
        __m512i dot[4][2], ws[2];
        for (int c = 0; c < NW; c++) {
            ws[c] = _mm512_setzero_si512();
            for (int j = 0; j < R; j++) dot[j][c] = _mm512_setzero_si512();
        }
        for (int64_t kk = k0; kk < k1; kk += 2 * QB) {
            __mmask64 mk = kk + 2 * QB <= k1 ? ~(__mmask64)0 : (__mmask64)0xFFFFFFFFu;  /* 32 left */
            __m512i w[2];
            for (int c = 0; c < NW; c++) {
                w[c] = _mm512_maskz_loadu_epi8(mk, wp[c] + kk);
                ws[c] = _mm512_dpbusd_epi32(ws[c], ones, w[c]);
                if (i0 == 0) _mm_prefetch((const char *)(wp[c] + PF_ROWS * k + kk), _MM_HINT_T0);
            }
            for (int j = 0; j < R; j++) {
                __m512i xu = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mk, xq->q + (i0 + j) * k + kk), flip);
                for (int c = 0; c < NW; c++) dot[j][c] = _mm512_dpbusd_epi32(dot[j][c], xu, w[c]);
            }
        }
        for (int c = 0; c < NW; c++) ws[c] = _mm512_slli_epi32(ws[c], 7);
        for (int j = 0; j < R; j++) {
            __m512 xd = _mm512_set1_ps(xq->d[(i0 + j) * ng + t]);
            for (int c = 0; c < NW; c++)
                acc[j][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[j][c], ws[c])), xd, acc[j][c]);
        }
    }
    for (int j = 0; j < R; j++)
        for (int c = 0; c < NW; c++)
            a->out[(i0 + j) * a->n + n + c] = _mm512_reduce_add_ps(acc[j][c]) * a->scales[n + c]
                                              + (a->bias ? a->bias[n + c] : 0.f);
}

DRIVE(rows8_v512, V512, v512_tile8)


/* 32 packed bytes (blocks b, b + 1) -> 64 codes in interleave_pairs' order: low nibbles, then high. */
V512 static inline __m512i load_w4x2(const uint8_t *p) {
    __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
    v = _mm512_mask_srli_epi16(v, (__mmask32)0xFFFF0000u, v, 4);
    return _mm512_and_si512(v, _mm512_set1_epi8(15));
}

/* The integer scales of blocks b, b + 1 as int16 lanes matching load_w4x2's 128-bit quarters: b, b+1, b, b+1. */
V512 static inline __m512i load_ls2(const int16_t *ls) {
    int32_t pair;
    memcpy(&pair, ls, sizeof pair);
    const __m512i spread = _mm512_set_epi32(0x03020302, 0x03020302, 0x03020302, 0x03020302,
                                            0x01000100, 0x01000100, 0x01000100, 0x01000100,
                                            0x03020302, 0x03020302, 0x03020302, 0x03020302,
                                            0x01000100, 0x01000100, 0x01000100, 0x01000100);
    return _mm512_shuffle_epi8(_mm512_set1_epi32(pair), spread);
}

/* int4, 512 bits: two blocks a vector (vpmaddubsw, then vpdpwssd by the blocks' integer scales); a
 * group's odd last block in 256 bits. */
V512 static inline __attribute__((always_inline)) void v512_tile4(
        const kiln_qmm_args *a, const xquant *xq, int64_t n, int64_t i0, const int R, const int NW) {
    int64_t k = a->k, kb = k / QB, g = xgroup(a), ng = (k + g - 1) / g;
    __m512 acc[4][2], inv[2];
    const uint8_t *wp[2];
    const int16_t *lp[2];
    for (int c = 0; c < NW; c++) {
        wp[c] = (const uint8_t *)a->w + (n + c) * (k / 2);
        lp[c] = a->sub + (n + c) * kb;
        inv[c] = _mm512_set1_ps(1.f / a->rowscale[n + c]);
    }
    for (int j = 0; j < R; j++)
        for (int c = 0; c < NW; c++) acc[j][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < ng; t++) {
        int64_t b = t * g / QB, b1 = ((t + 1) * g < k ? (t + 1) * g : k) / QB, f0 = 2 * b;
        __m512i dot[4][2];
        for (int j = 0; j < R; j++)
            for (int c = 0; c < NW; c++) dot[j][c] = _mm512_setzero_si512();
        if (i0 == 0)  /* the group's (scale, zero) pairs and sub-scales, PF_ROWS rows ahead */
            for (int c = 0; c < NW; c++) {
                _mm_prefetch((const char *)(a->scales + (n + c + PF_ROWS) * kb * 2 + f0), _MM_HINT_T0);
                _mm_prefetch((const char *)(lp[c] + PF_ROWS * kb + b), _MM_HINT_T0);
            }
        for (; b + 2 <= b1; b += 2) {
            __m512i w[2], ls[2];
            for (int c = 0; c < NW; c++) {
                w[c] = load_w4x2(wp[c] + b * 16);
                ls[c] = load_ls2(lp[c] + b);
                if (i0 == 0 && !(b & 3)) _mm_prefetch((const char *)(wp[c] + PF_ROWS * (k / 2) + b * 16), _MM_HINT_T0);
            }
            for (int j = 0; j < R; j++) {
                __m512i x = _mm512_loadu_si512((const void *)(xq->q + (i0 + j) * k + b * QB));
                for (int c = 0; c < NW; c++) dot[j][c] = _mm512_dpwssd_epi32(dot[j][c], _mm512_maddubs_epi16(w[c], x), ls[c]);
            }
        }
        if (b < b1)  /* the group's odd last block, in element order */
            for (int c = 0; c < NW; c++) {
                __m256i w = load_w4(wp[c] + b * 16), ls = _mm256_set1_epi16(lp[c][b]);
                for (int j = 0; j < R; j++) {
                    __m256i x = _mm256_loadu_si256((const __m256i *)(xq->q + (i0 + j) * k + b * QB));
                    __m256i d = _mm256_dpwssd_epi32(_mm256_setzero_si256(), _mm256_maddubs_epi16(w, x), ls);
                    dot[j][c] = _mm512_add_epi32(dot[j][c], _mm512_zextsi256_si512(d));
                }
            }
        for (int j = 0; j < R; j++) {
            __m512 xd = _mm512_set1_ps(xq->d[(i0 + j) * ng + t]);
            for (int c = 0; c < NW; c++) acc[j][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j][c]), xd, acc[j][c]);
        }
        for (int64_t f = f0; f < 2 * b1; f += 16) {  /* the group's float part (see TILE4_BODY) */
            __mmask16 mk = 2 * b1 - f >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (2 * b1 - f)) - 1);
            __m512 sv[2];
            for (int c = 0; c < NW; c++) sv[c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, a->scales + (n + c) * kb * 2 + f), inv[c]);
            for (int j = 0; j < R; j++) {
                __m512 av = _mm512_maskz_loadu_ps(mk, xq->ab + (i0 + j) * kb * 2 + f);
                for (int c = 0; c < NW; c++) acc[j][c] = _mm512_fmadd_ps(sv[c], av, acc[j][c]);
            }
        }
    }
    for (int j = 0; j < R; j++)
        for (int c = 0; c < NW; c++)
            a->out[(i0 + j) * a->n + n + c] = _mm512_reduce_add_ps(acc[j][c]) * a->rowscale[n + c]
                + (a->bias ? a->bias[n + c] : 0.f);
}

DRIVE(rows4_v512, V512, v512_tile4)

/* quantize_x with 16-float vectors: the same codes and scales bit for bit (max is exact in any order,
 * the product is the same IEEE multiply, and vcvtps2dq rounds to nearest even as lrintf does).
 * Scalar rounding of a decode row was most of a call's fixed cost. */
V512 static void quantize_x_v512(const float *x, int64_t m, int64_t k, int64_t g, int8_t *q, float *d) {
    int64_t ng = (k + g - 1) / g;
    for (int64_t i = 0; i < m; i++)
        for (int64_t t = 0; t < ng; t++) {
            int64_t k0 = t * g, len = k - k0 < g ? k - k0 : g;  /* a multiple of 32 */
            const float *xb = x + i * k + k0;
            __m512 vmax = _mm512_setzero_ps();
            for (int64_t j = 0; j < len; j += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xb + j)));
            float amax = _mm512_reduce_max_ps(vmax);
            float inv = amax > 0.f ? 127.f / amax : 0.f;
            __m512 vinv = _mm512_set1_ps(inv);
            for (int64_t j = 0; j < len; j += 16)
                _mm_storeu_si128((__m128i *)(q + i * k + k0 + j),
                                 _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + j), vinv))));
            d[i * ng + t] = amax / 127.f;
        }
}
#endif

/* ---- dispatch --------------------------------------------------------------------------- */

/* The best path this CPU runs: 3 AVX-512 VNNI 512-bit, 2 its 256-bit form, 1 AVX2 + FMA, 0 portable. */
int kiln_qmm_isa(void) {
#ifdef KILN_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return 3;
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2")
        && __builtin_cpu_supports("fma"))
        return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
    return 0;
}

static row_fn pick(int isa, int mode) {
#ifdef KILN_X86
    if (isa >= 3) return mode == 8 ? rows8_v512 : rows4_v512;
    if (isa == 2) return mode == 8 ? rows8_vnni : rows4_vnni;
    if (isa == 1) return mode == 8 ? rows8_avx2 : rows4_avx2;
#else
    (void)isa;
#endif
    return mode == 8 ? rows8_portable : rows4_portable;
}

int kiln_qmm(const kiln_qmm_args *a) {
    if (!a || !a->x || !a->w || !a->scales || !a->out || a->m < 0 || a->n <= 0 || a->k <= 0 || a->k % QB
        || (a->mode != 8 && a->mode != 4) || (a->group > 0 && a->group % QB)
        || (a->mode == 4 && (!a->sub || !a->rowscale)))
        return -2;
    int best = kiln_qmm_isa();
    if (a->isa > best) return -2;  /* a path this CPU cannot run */
    int isa = a->isa < 0 ? best : a->isa;
    row_fn rows = pick(isa, a->mode);
    if (a->m == 0) return 0;
    int64_t g = xgroup(a), ng = (a->k + g - 1) / g;
    int8_t *q = malloc((size_t)(a->m * a->k));
    float *d = malloc(sizeof(float) * (size_t)(a->m * ng));
    float *ab = a->mode == 4 ? malloc(sizeof(float) * 2 * (size_t)(a->m * (a->k / QB))) : NULL;
    if (!q || !d || (a->mode == 4 && !ab)) {
        free(q); free(d); free(ab);
        return -1;
    }
#ifdef KILN_X86
    if (isa >= 3) quantize_x_v512(a->x, a->m, a->k, g, q, d);
    else
#endif
        quantize_x(a->x, a->m, a->k, g, q, d);
    if (a->mode == 4) {
        int4_terms(a->x, a->m, a->k, g, q, d, ab);
        if (isa >= 3) interleave_pairs(q, a->m, a->k, g);
    }
    xquant xq = {q, d, ab};
    /* Only very large calls split the output features over OpenMP threads: inside a torch process
     * an OpenMP region here cost about 8 ms more than its work (2 threads, load ~1: 8 x 8,192 x 512,
     * the qwen3-31m head at c=8, 0.7 -> 8.0 ms; 64 x 1,536 x 512 0.5 -> 8.0 ms; 2,048 rows 27.5 ->
     * 24 ms), so below ~1,200 rows of a 1,536 x 512 matrix one thread is faster: 2^31 keeps twice that. */
    int threads = a->threads > 1 && a->m * a->n * a->k >= PAR_MIN_WORK ? a->threads : 1;
    if (threads == 1) {
        rows(a, &xq, 0, a->n);
    } else {
        int64_t chunk = 8, chunks = (a->n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            int64_t n1 = (c + 1) * chunk;
            rows(a, &xq, c * chunk, n1 < a->n ? n1 : a->n);
        }
    }
    free(q); free(d); free(ab);
    return 0;
}
