/* Weight-only int8 / int4 matmul for the CPU: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]).
 *
 * Built and loaded by kiln/runtime/quant_matmul.py through kiln.runtime.paged_attention.build (the
 * one C builder; cached under the kernel directory). The activations are quantized per row
 * (symmetric int8, d = max|x| / 127 per group of elements) and multiplied with the weights in integers:
 *
 *   int8 (mode 8):  W[n, k] = q[n, k] * scale[n]; w: int8 [N, K]; scales: float [N]. One activation
 *                   scale per group of ``group`` elements of a row (a multiple of 32; the whole row
 *                   when <= 0): a group's dot adds up in int32 and is converted to float once.
 *   int4 (mode 4):  W[n, k] = (q - 8) * s[n, b] + z[n, b] for k in block b = k / 32; w: uint8
 *                   [N, K / 2], block b of row n at w[n * K / 2 + b * 16 ..]: byte j holds element
 *                   j in its low nibble and element j + 16 in its high nibble (codes 0..15);
 *                   scales: float [N, K / 32, 2] = (s, z). Activations per block of 32 (as llama.cpp's
 *                   Q4_0 takes them); each block's dot is scaled in float. The zero's term uses the
 *                   block's exact float sum of x.
 *
 * Paths: AVX-512 VNNI with 512-bit vectors (two blocks a vpdpbusd) and with 256-bit ones, AVX2 +
 * FMA (vpmaddubsw / vpmaddwd), and portable C
 * (the only one compiled with -DKILN_BASELINE_ONLY), chosen once from the running CPU
 * (kiln_qmm_isa). All paths compute the same integer block sums; only the float accumulation
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

typedef struct {
    const float *x; int64_t m, k;      /* x [m, k] contiguous */
    const void *w; const float *scales; const float *bias;  /* bias: optional [n] */
    int64_t n; int32_t mode;           /* 8 or 4 */
    int32_t threads;                   /* OpenMP threads (<= 1: the calling thread only) */
    int32_t isa;  /* -1: the best this CPU runs; else force 0 portable, 1 avx2, 2 vnni, 3 vnni512 */
    float *out;                        /* [m, n] contiguous */
    int64_t group;  /* int8: activation elements per scale (a multiple of 32; <= 0 or >= k: the whole row) */
} kiln_qmm_args;

typedef struct {  /* the activations, quantized */
    const int8_t *q;   /* [m, k] */
    const float *d;    /* [m, k / 32] block scales */
    const float *s;    /* [m, k / 32] block sums of x (int4's zero term) */
    float *e;          /* [m, k / 32, 8] each block scale repeated 8 times (the 512-bit path only) */
} xquant;

typedef void (*row_fn)(const kiln_qmm_args *, const xquant *, int64_t n0, int64_t n1);

/* ---- activations ---------------------------------------------------------------------- */

/* x [m, k] -> int8 q [m, k] and one scale d per group of g elements of a row ([m, ceil(k / g)]; the
 * last group of a row may be shorter), plus each group's float sum in s where s is not NULL. */
static void quantize_x(const float *x, int64_t m, int64_t k, int64_t g, int8_t *q, float *d, float *s) {
    int64_t ng = (k + g - 1) / g;
    for (int64_t i = 0; i < m; i++)
        for (int64_t t = 0; t < ng; t++) {
            int64_t k0 = t * g, len = k - k0 < g ? k - k0 : g;
            const float *xb = x + i * k + k0;
            float amax = 0.f, sum = 0.f;
            for (int64_t j = 0; j < len; j++) {
                float v = fabsf(xb[j]);
                amax = v > amax ? v : amax;
                sum += xb[j];
            }
            float inv = amax > 0.f ? 127.f / amax : 0.f;
            for (int64_t j = 0; j < len; j++) q[i * k + k0 + j] = (int8_t)lrintf(xb[j] * inv);
            d[i * ng + t] = amax / 127.f;
            if (s) s[i * ng + t] = sum;
        }
}

/* int8's activation group: elements of a row that share one scale (their integer dots add up in int32). */
static inline int64_t xgroup(const kiln_qmm_args *a) { return a->group > 0 && a->group < a->k ? a->group : a->k; }

/* ---- portable -------------------------------------------------------------------------- */

static void unpack4(const uint8_t *p, int8_t *w) {  /* 16 bytes -> 32 signed codes (q - 8) */
    for (int j = 0; j < 16; j++) {
        w[j] = (int8_t)((p[j] & 15) - 8);
        w[j + 16] = (int8_t)((p[j] >> 4) - 8);
    }
}

static void rows_portable(const kiln_qmm_args *a, const xquant *xq, int64_t n0, int64_t n1) {
    int64_t k = a->k, kb = k / QB;
    int8_t wb[QB];
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t i = 0; i < a->m; i++) {
            float acc = 0.f, zacc = 0.f;
            for (int64_t b = 0; b < kb; b++) {
                const int8_t *w;
                float ws = 1.f;
                if (a->mode == 8) {
                    w = (const int8_t *)a->w + n * k + b * QB;
                } else {
                    unpack4((const uint8_t *)a->w + n * (k / 2) + b * 16, wb);
                    w = wb;
                    ws = a->scales[(n * kb + b) * 2];
                    zacc += a->scales[(n * kb + b) * 2 + 1] * xq->s[i * kb + b];
                }
                const int8_t *x = xq->q + i * k + b * QB;
                int32_t dot = 0;
                for (int j = 0; j < QB; j++) dot += (int32_t)w[j] * (int32_t)x[j];
                acc += (float)dot * xq->d[i * kb + b] * ws;
            }
            float v = a->mode == 8 ? acc * a->scales[n] : acc + zacc;
            a->out[i * a->n + n] = v + (a->bias ? a->bias[n] : 0.f);
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

AVX2 static inline __m256i load_w(const kiln_qmm_args *a, int64_t n, int64_t b) {
    if (a->mode == 8) return _mm256_loadu_si256((const __m256i *)((const int8_t *)a->w + n * a->k + b * QB));
    __m128i p = _mm_loadu_si128((const __m128i *)((const uint8_t *)a->w + n * (a->k / 2) + b * 16));
    __m128i lo = _mm_and_si128(p, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(p, 4), _mm_set1_epi8(15));
    return _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
}

/* R rows of x against weight rows n, n + 1 (NW = 2) or n alone (NW = 1): R x NW accumulators in
 * registers (R and NW are constants where this is inlined). ``DOT`` is the integer dot of a block. */
#define TILE_BODY(DOT)                                                                            \
    int64_t k = a->k, kb = k / QB;                                                                \
    __m256 acc[4][2];                                                                             \
    float zacc[4][2];                                                                             \
    for (int j = 0; j < R; j++)                                                                   \
        for (int c = 0; c < NW; c++) { acc[j][c] = _mm256_setzero_ps(); zacc[j][c] = 0.f; }       \
    for (int64_t b = 0; b < kb; b++) {                                                            \
        __m256i w[2], aw[2];                                                                      \
        float ws[2] = {1.f, 1.f}, z[2] = {0.f, 0.f};                                              \
        for (int c = 0; c < NW; c++) {                                                            \
            w[c] = load_w(a, n + c, b);                                                           \
            aw[c] = _mm256_sign_epi8(w[c], w[c]);                                                 \
            if (a->mode == 4) { ws[c] = a->scales[((n + c) * kb + b) * 2];                        \
                                z[c] = a->scales[((n + c) * kb + b) * 2 + 1]; }                   \
        }                                                                                         \
        for (int j = 0; j < R; j++) {                                                             \
            int64_t row = i0 + j;                                                                 \
            __m256i x = _mm256_loadu_si256((const __m256i *)(xq->q + row * k + b * QB));          \
            float xd = xq->d[row * kb + b], xs = xq->s[row * kb + b];                             \
            for (int c = 0; c < NW; c++) {                                                        \
                __m256i dot = DOT(aw[c], _mm256_sign_epi8(x, w[c]));                              \
                acc[j][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xd * ws[c]), acc[j][c]); \
                zacc[j][c] += z[c] * xs;                                                          \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    for (int j = 0; j < R; j++)                                                                   \
        for (int c = 0; c < NW; c++) {                                                            \
            float v = hsum8(acc[j][c]);                                                           \
            v = a->mode == 8 ? v * a->scales[n + c] : v + zacc[j][c];                             \
            a->out[(i0 + j) * a->n + n + c] = v + (a->bias ? a->bias[n + c] : 0.f);               \
        }

#define DOT_AVX2(aw, sx) _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1))
#define DOT_VNNI(aw, sx) _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx)

#define TILES(NAME, TARGET, DOT)                                                                  \
    TARGET static inline __attribute__((always_inline)) void NAME##_tile(                        \
            const kiln_qmm_args *a, const xquant *xq, int64_t n, int64_t i0, const int R, const int NW) { \
        TILE_BODY(DOT)                                                                            \
    }                                                                                             \
    TARGET static void NAME(const kiln_qmm_args *a, const xquant *xq, int64_t n0, int64_t n1) {  \
        int64_t n = n0;                                                                           \
        for (; n + 2 <= n1; n += 2) {                                                             \
            int64_t i0 = 0;                                                                       \
            for (; i0 + 4 <= a->m; i0 += 4) NAME##_tile(a, xq, n, i0, 4, 2);                      \
            switch (a->m - i0) {                                                                  \
            case 3: NAME##_tile(a, xq, n, i0, 3, 2); break;                                       \
            case 2: NAME##_tile(a, xq, n, i0, 2, 2); break;                                       \
            case 1: NAME##_tile(a, xq, n, i0, 1, 2); break;                                       \
            default: break;                                                                       \
            }                                                                                     \
        }                                                                                         \
        for (; n < n1; n++)                                                                       \
            for (int64_t i0 = 0; i0 < a->m; i0++) NAME##_tile(a, xq, n, i0, 1, 1);               \
    }

TILES(rows_avx2, AVX2, DOT_AVX2)
TILES(rows_vnni, VNNI, DOT_VNNI)

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

#define ACC_AVX2(acc, aw, sx) _mm256_add_epi32(acc, DOT_AVX2(aw, sx))
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

/* AVX-512 VNNI, 512 bits: two blocks a vector. ``xq->e`` holds each block's activation scale
 * repeated 8 times, so one load gives the two blocks' scales lane by lane. An odd last block
 * goes through the 256-bit code above. */
#define V512 __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))

V512 static inline __m512i load_w2(const kiln_qmm_args *a, int64_t n, int64_t b) {
    if (a->mode == 8) return _mm512_loadu_si512((const void *)((const int8_t *)a->w + n * a->k + b * QB));
    return _mm512_inserti64x4(_mm512_castsi256_si512(load_w(a, n, b)), load_w(a, n, b + 1), 1);
}

V512 static inline __attribute__((always_inline)) void v512_tile(
        const kiln_qmm_args *a, const xquant *xq, int64_t n, int64_t i0, const int R, const int NW) {
    int64_t k = a->k, kb = k / QB, pairs = kb / 2;
    __m512 acc[4][2];
    float zacc[4][2];
    for (int j = 0; j < R; j++)
        for (int c = 0; c < NW; c++) { acc[j][c] = _mm512_setzero_ps(); zacc[j][c] = 0.f; }
    for (int64_t p = 0; p < pairs; p++) {
        int64_t b = 2 * p;
        __m512i w[2], aw[2];
        __mmask64 neg[2];
        __m512 ws[2];
        float z0[2] = {0.f, 0.f}, z1[2] = {0.f, 0.f};
        for (int c = 0; c < NW; c++) {
            w[c] = load_w2(a, n + c, b);
            if (i0 == 0 && a->mode == 4) {  /* the packed codes and the scales, PF_ROWS rows ahead */
                _mm_prefetch((const char *)a->w + (n + c + PF_ROWS) * (k / 2) + b * 16, _MM_HINT_T0);
                _mm_prefetch((const char *)(a->scales + ((n + c + PF_ROWS) * kb + b) * 2), _MM_HINT_T0);
            }
            aw[c] = _mm512_abs_epi8(w[c]);
            neg[c] = _mm512_movepi8_mask(w[c]);
            if (a->mode == 4) {
                const float *sc = a->scales + ((n + c) * kb + b) * 2;
                ws[c] = _mm512_insertf32x8(_mm512_set1_ps(sc[0]), _mm256_set1_ps(sc[2]), 1);
                z0[c] = sc[1];
                z1[c] = sc[3];
            }
        }
        for (int j = 0; j < R; j++) {
            int64_t row = i0 + j;
            __m512i x = _mm512_loadu_si512((const void *)(xq->q + row * k + b * QB));
            __m512 xd = _mm512_loadu_ps(xq->e + (row * kb + b) * 8);
            for (int c = 0; c < NW; c++) {
                __m512i sx = _mm512_mask_sub_epi8(x, neg[c], _mm512_setzero_si512(), x);
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw[c], sx);
                __m512 sc = a->mode == 4 ? _mm512_mul_ps(xd, ws[c]) : xd;
                acc[j][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[j][c]);
                if (a->mode == 4) zacc[j][c] += z0[c] * xq->s[row * kb + b] + z1[c] * xq->s[row * kb + b + 1];
            }
        }
    }
    for (int j = 0; j < R; j++)
        for (int c = 0; c < NW; c++) {
            float v = _mm512_reduce_add_ps(acc[j][c]);
            if (kb % 2) {  /* the odd last block */
                int64_t row = i0 + j, b = kb - 1;
                __m256i w = load_w(a, n + c, b);
                __m256i x = _mm256_loadu_si256((const __m256i *)(xq->q + row * k + b * QB));
                __m256i dot = DOT_VNNI(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
                float ws = a->mode == 4 ? a->scales[((n + c) * kb + b) * 2] : 1.f;
                v += hsum8(_mm256_cvtepi32_ps(dot)) * xq->d[row * kb + b] * ws;
                if (a->mode == 4) zacc[j][c] += a->scales[((n + c) * kb + b) * 2 + 1] * xq->s[row * kb + b];
            }
            v = a->mode == 8 ? v * a->scales[n + c] : v + zacc[j][c];
            a->out[(i0 + j) * a->n + n + c] = v + (a->bias ? a->bias[n + c] : 0.f);
        }
}

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

/* quantize_x with 16-float vectors: the same codes and scales bit for bit (max is exact in any order,
 * the product is the same IEEE multiply, and vcvtps2dq rounds to nearest even as lrintf does); the
 * int4 sums stay in quantize_x's order. Scalar rounding of a decode row was most of a call's fixed cost. */
V512 static void quantize_x_v512(const float *x, int64_t m, int64_t k, int64_t g, int8_t *q, float *d, float *s) {
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
            if (s) {
                float sum = 0.f;
                for (int64_t j = 0; j < len; j++) sum += xb[j];
                s[i * ng + t] = sum;
            }
        }
}

V512 static void rows_v512(const kiln_qmm_args *a, const xquant *xq, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) {
        int64_t i0 = 0;
        for (; i0 + 4 <= a->m; i0 += 4) v512_tile(a, xq, n, i0, 4, 2);
        switch (a->m - i0) {
        case 3: v512_tile(a, xq, n, i0, 3, 2); break;
        case 2: v512_tile(a, xq, n, i0, 2, 2); break;
        case 1: v512_tile(a, xq, n, i0, 1, 2); break;
        default: break;
        }
    }
    for (; n < n1; n++)
        for (int64_t i0 = 0; i0 < a->m; i0++) v512_tile(a, xq, n, i0, 1, 1);
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
    if (isa >= 3) return mode == 8 ? rows8_v512 : rows_v512;
    if (isa == 2) return mode == 8 ? rows8_vnni : rows_vnni;
    if (isa == 1) return mode == 8 ? rows8_avx2 : rows_avx2;
#else
    (void)isa;
#endif
    return mode == 8 ? rows8_portable : rows_portable;
}

int kiln_qmm(const kiln_qmm_args *a) {
    if (!a || !a->x || !a->w || !a->scales || !a->out || a->m < 0 || a->n <= 0 || a->k <= 0 || a->k % QB
        || (a->mode != 8 && a->mode != 4) || (a->mode == 8 && a->group > 0 && a->group % QB))
        return -2;
    int best = kiln_qmm_isa();
    if (a->isa > best) return -2;  /* a path this CPU cannot run */
    int isa = a->isa < 0 ? best : a->isa;
    row_fn rows = pick(isa, a->mode);
    if (a->m == 0) return 0;
    int64_t g = a->mode == 8 ? xgroup(a) : QB, ng = (a->k + g - 1) / g;
    int8_t *q = malloc((size_t)(a->m * a->k));
    float *d = malloc(sizeof(float) * (size_t)(a->m * ng));
    float *s = a->mode == 4 ? malloc(sizeof(float) * (size_t)(a->m * ng)) : NULL;
    xquant xq = {q, d, s, NULL};
    if (isa >= 3 && a->mode == 4) xq.e = malloc(sizeof(float) * 8 * (size_t)(a->m * ng));
    if (!q || !d || (a->mode == 4 && (!s || (isa >= 3 && !xq.e)))) {
        free(q); free(d); free(s); free(xq.e);
        return -1;
    }
#ifdef KILN_X86
    if (isa >= 3) quantize_x_v512(a->x, a->m, a->k, g, q, d, s);
    else
#endif
        quantize_x(a->x, a->m, a->k, g, q, d, s);
    if (xq.e)
        for (int64_t i = 0; i < a->m * ng; i++)
            for (int j = 0; j < 8; j++) xq.e[i * 8 + j] = d[i];
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
    free(q); free(d); free(s); free(xq.e);
    return 0;
}
