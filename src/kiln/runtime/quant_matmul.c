/* Weight-only int8 / int4 matmul for the CPU: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]).
 *
 * Built and loaded by kiln/runtime/quant_matmul.py through kiln.runtime.paged_attention.build (the
 * one C builder; cached under the kernel directory). The activations are quantized per row in
 * blocks of 32 (symmetric int8, d = max|x| / 127 per block, as llama.cpp's Q8_0 does for its
 * activations), then each block's integer dot product with the weight block is scaled in float:
 *
 *   int8 (mode 8):  W[n, k] = q[n, k] * scale[n]; w: int8 [N, K]; scales: float [N]
 *   int4 (mode 4):  W[n, k] = (q - 8) * s[n, b] + z[n, b] for k in block b = k / 32; w: uint8
 *                   [N, K / 2], block b of row n at w[n * K / 2 + b * 16 ..]: byte j holds element
 *                   j in its low nibble and element j + 16 in its high nibble (codes 0..15);
 *                   scales: float [N, K / 32, 2] = (s, z). The zero's term uses the block's exact
 *                   float sum of x.
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
#define PAR_MIN_WORK (1L << 25)  /* M * N * K below this: one thread (see kiln_qmm) */

typedef struct {
    const float *x; int64_t m, k;      /* x [m, k] contiguous */
    const void *w; const float *scales; const float *bias;  /* bias: optional [n] */
    int64_t n; int32_t mode;           /* 8 or 4 */
    int32_t threads;                   /* OpenMP threads (<= 1: the calling thread only) */
    int32_t isa;  /* -1: the best this CPU runs; else force 0 portable, 1 avx2, 2 vnni, 3 vnni512 */
    float *out;                        /* [m, n] contiguous */
} kiln_qmm_args;

typedef struct {  /* the activations, quantized */
    const int8_t *q;   /* [m, k] */
    const float *d;    /* [m, k / 32] block scales */
    const float *s;    /* [m, k / 32] block sums of x (int4's zero term) */
    float *e;          /* [m, k / 32, 8] each block scale repeated 8 times (the 512-bit path only) */
} xquant;

typedef void (*row_fn)(const kiln_qmm_args *, const xquant *, int64_t n0, int64_t n1);

/* ---- activations ---------------------------------------------------------------------- */

static void quantize_x(const float *x, int64_t m, int64_t k, int8_t *q, float *d, float *s) {
    int64_t kb = k / QB;
    for (int64_t i = 0; i < m * kb; i++) {
        const float *xb = x + i * QB;
        float amax = 0.f, sum = 0.f;
        for (int j = 0; j < QB; j++) {
            float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
            sum += xb[j];
        }
        float dd = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int j = 0; j < QB; j++) q[i * QB + j] = (int8_t)lrintf(xb[j] * inv);
        d[i] = dd;
        s[i] = sum;
    }
}

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

static row_fn pick(int isa) {
#ifdef KILN_X86
    if (isa >= 3) return rows_v512;
    if (isa == 2) return rows_vnni;
    if (isa == 1) return rows_avx2;
#else
    (void)isa;
#endif
    return rows_portable;
}

int kiln_qmm(const kiln_qmm_args *a) {
    if (!a || !a->x || !a->w || !a->scales || !a->out || a->m < 0 || a->n <= 0 || a->k <= 0 || a->k % QB
        || (a->mode != 8 && a->mode != 4))
        return -2;
    int best = kiln_qmm_isa();
    if (a->isa > best) return -2;  /* a path this CPU cannot run */
    row_fn rows = pick(a->isa < 0 ? best : a->isa);  /* isa below: the same choice */
    if (a->m == 0) return 0;
    int64_t kb = a->k / QB;
    int8_t *q = malloc((size_t)(a->m * a->k));
    float *d = malloc(sizeof(float) * (size_t)(a->m * kb)), *s = malloc(sizeof(float) * (size_t)(a->m * kb));
    if (!q || !d || !s) {
        free(q); free(d); free(s);
        return -1;
    }
    quantize_x(a->x, a->m, a->k, q, d, s);
    xquant xq = {q, d, s, NULL};
    int isa = a->isa < 0 ? best : a->isa;
    if (isa >= 3) {
        xq.e = malloc(sizeof(float) * 8 * (size_t)(a->m * kb));
        if (!xq.e) {
            free(q); free(d); free(s);
            return -1;
        }
        for (int64_t i = 0; i < a->m * kb; i++)
            for (int j = 0; j < 8; j++) xq.e[i * 8 + j] = d[i];
    }
    /* Decode-sized calls stay on the calling thread: at c=8 on qwen3-31m (8 x 1536 x 512, ~0.1 ms of
     * work) a 2-thread region was 10-50x slower on a loaded 2-core machine (a barrier waits for a
     * descheduled thread); prompt chunks (many rows) split the output features. */
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
