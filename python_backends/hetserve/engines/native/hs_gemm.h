/* INT8 x INT8 GEMM of the native engine:
     y[m, n] (+)= wd[n] * sum_b ws[n, b] * xs[m, b] * sum_{k in block b} w[n, k] x[m, k]
   Weights: symmetric int8 per block of `bs` (16 or 32) inputs, one uint8 scale per (output, block) times one
   float per output (8.5 bits per weight at blocks of 16, like Q8_0's at 32); activations:
   symmetric int8 per (row, block) quantized at run time (hs_quant_rows), one float scale each. This is
   llama.cpp's Q8_0 x Q8_0 scheme (bs 32) with an optional finer block.

   Packed weight layout (engines/native.py writes it; the same bytes for both ISA builds):
     q  uint8 [N/16][K/4][16][4]  w + 128: a 64-byte record holds 4 consecutive k of 16 consecutive outputs
     s  uint8 [N/16][K/bs][16]   block scales
     d  float [N]                row scales
   AVX-512 VNNI: one vpdpbusd multiplies the 64-byte record (unsigned) by 4 activation bytes broadcast to every
   lane (signed) into 16 int32 lanes (one per output). The +128 offset adds 128 * sum(x of the block), so each
   block's int32 accumulator starts at xc = -128 * sum(x) instead of 0. AVX2 (no VNNI): the record is two
   32-byte halves; w is recovered as signed (xor 0x80) and multiplied with maddubs(|w|, sign(x, w)) (no int16
   saturation: |product pair| <= 2 * 127 * 127), so xc is 0 there. */
#ifndef HS_GEMM_H
#define HS_GEMM_H
#include <stdint.h>
#include <string.h>
#include "hs_engine.h"
#include "hs_simd.h"

#define HS_MAX_K 65536

typedef hs_qmat QMat; /* hs_engine.h: q, s, d and their lengths (checked by hs_model_check) */

#if defined(HS_AVX512)
/* r[j] = op over the lanes of p[j] for 16 vectors (transpose-reduce network: 15 shuffle pairs, no per-vector
   horizontal reduction). OP: _mm512_add_ps or _mm512_max_ps */
#define HS_REDUCE16(OP, p, out)                                                                                   \
    do {                                                                                                          \
        __m512 x_[8], y_[4], z_[2];                                                                               \
        for (int j_ = 0; j_ < 8; j_++)                                                                            \
            x_[j_] = OP(_mm512_shuffle_f32x4(p[j_], p[j_ + 8], 0x44), _mm512_shuffle_f32x4(p[j_], p[j_ + 8], 0xEE));\
        for (int j_ = 0; j_ < 4; j_++)                                                                            \
            y_[j_] = OP(_mm512_shuffle_f32x4(x_[j_], x_[j_ + 4], 0x88), _mm512_shuffle_f32x4(x_[j_], x_[j_ + 4], 0xDD));\
        for (int j_ = 0; j_ < 2; j_++)                                                                            \
            z_[j_] = OP(_mm512_shuffle_ps(y_[j_], y_[j_ + 2], 0x44), _mm512_shuffle_ps(y_[j_], y_[j_ + 2], 0xEE));  \
        out = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15),       \
                                    OP(_mm512_shuffle_ps(z_[0], z_[1], 0x88), _mm512_shuffle_ps(z_[0], z_[1], 0xDD)));\
    } while (0)

/* 16 blocks of 16 at once: the block maxima and sums come out of two reduce networks instead of 32 horizontal
   reductions (same values as the one-block path below) */
static inline void quant16x16(const float* p, int8_t* q, float* xs, int32_t* xc) {
    __m512 a[16], s[16], amax, sums;
    for (int j = 0; j < 16; j++) a[j] = _mm512_abs_ps(_mm512_loadu_ps(p + 16 * j));
    HS_REDUCE16(_mm512_max_ps, a, amax);
    const __m512 d = _mm512_div_ps(amax, _mm512_set1_ps(127.0f));
    const __mmask16 nz = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
    const __m512 id = _mm512_maskz_div_ps(nz, _mm512_set1_ps(127.0f), amax);
    _mm512_storeu_ps(xs, d);
    float idv[16];
    _mm512_storeu_ps(idv, id);
    for (int j = 0; j < 16; j++) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(p + 16 * j), _mm512_set1_ps(idv[j])));
        _mm_storeu_si128((__m128i*)(q + 16 * j), _mm512_cvtsepi32_epi8(v));
        s[j] = _mm512_cvtepi32_ps(v); /* exact: |block sum| <= 16 * 127 */
    }
    HS_REDUCE16(_mm512_add_ps, s, sums);
    _mm512_storeu_si512(xc, _mm512_mullo_epi32(_mm512_cvtps_epi32(sums), _mm512_set1_epi32(-128)));
}
#endif

/* x [M, K] floats (row stride ldx) -> xq int8 [M, K], xs [M, K/bs] scales, xc [M, K/bs] block offsets */
static void hs_quant_rows(const float* x, int ldx, int M, int K, int bs, int8_t* xq, float* xs, int32_t* xc) {
    const int nb = K / bs;
    for (int m = 0; m < M; m++) {
        const float* row = x + (size_t)m * ldx;
        int8_t* q = xq + (size_t)m * K;
        int b = 0;
#if defined(HS_AVX512)
        if (bs == 16)
            for (; b + 16 <= nb; b += 16)
                quant16x16(row + b * 16, q + b * 16, xs + (size_t)m * nb + b, xc + (size_t)m * nb + b);
#endif
        for (; b < nb; b++) {
            const float* p = row + b * bs;
            vf mx = vzero();
            for (int i = 0; i < bs; i += VW) mx = vmax(mx, vmax(vload(p + i), vsub(vzero(), vload(p + i))));
            const float amax = vhmax(mx);
            const float d = amax / 127.0f;
            const vf id = vset1(amax > 0.0f ? 127.0f / amax : 0.0f);
            xs[(size_t)m * nb + b] = d;
#if defined(HS_AVX512)
            int32_t sum = 0;
            for (int i = 0; i < bs; i += 16) {
                __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(p + i), id));
                _mm_storeu_si128((__m128i*)(q + b * bs + i), _mm512_cvtsepi32_epi8(v));
                sum += _mm512_reduce_add_epi32(v);
            }
            xc[(size_t)m * nb + b] = -128 * sum;
#else
            for (int i = 0; i < bs; i += 16) {
                __m256i v0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + i), id));
                __m256i v1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + i + 8), id));
                __m256i s16 = _mm256_packs_epi32(v0, v1);              /* [v0 lo, v1 lo | v0 hi, v1 hi] */
                s16 = _mm256_permute4x64_epi64(s16, 0xD8);             /* [v0 lo, v0 hi | v1 lo, v1 hi] */
                __m128i s8 = _mm_packs_epi16(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1));
                _mm_storeu_si128((__m128i*)(q + b * bs + i), s8);
            }
            xc[(size_t)m * nb + b] = 0; /* exact signed products here: no offset to cancel */
#endif
        }
    }
}

#if defined(HS_AVX512)
/* one tile: MT rows x NT groups of 16 outputs, over all of K */
#define HS_TILE(MT, NT, BS)                                                                                       \
    static void tile_##MT##_##NT##_##BS(const int8_t* xq, int K, const float* xs, const int32_t* xc,               \
                                        const uint8_t* wq, const uint8_t* ws, const float* wd, float* y, int ldy,  \
                                        int accumulate, const uint8_t* pf) {                                       \
        const int bs = BS, nb = K / BS;                                                                           \
        const size_t wg = (size_t)K * 16, sg = (size_t)nb * 16;                                                   \
        __m512 acc[MT][NT];                                                                                       \
        for (int m = 0; m < MT; m++)                                                                              \
            for (int n = 0; n < NT; n++) acc[m][n] = _mm512_setzero_ps();                                         \
        for (int b = 0; b < nb; b++) {                                                                            \
            __m512i ia[MT][NT];                                                                                   \
            for (int m = 0; m < MT; m++) {                                                                        \
                __m512i c = _mm512_set1_epi32(xc[(size_t)m * nb + b]);                                            \
                for (int n = 0; n < NT; n++) ia[m][n] = c;                                                        \
            }                                                                                                     \
            const uint8_t* wb = wq + (size_t)b * bs * 16;                                                         \
            const int8_t* xb = xq + b * bs;                                                                       \
            _Pragma("GCC unroll 8") for (int qd = 0; qd < BS / 4; qd++) {                                         \
                __m512i w[NT];                                                                                    \
                for (int n = 0; n < NT; n++) w[n] = _mm512_loadu_si512(wb + n * wg + qd * 64);                    \
                if (pf)                                                                                           \
                    for (int n = 0; n < NT; n++)                                                                  \
                        _mm_prefetch((const char*)pf + n * wg + (size_t)b * bs * 16 + qd * 64, _MM_HINT_T1);      \
                for (int m = 0; m < MT; m++) {                                                                    \
                    int32_t x4;                                                                                   \
                    memcpy(&x4, xb + (size_t)m * K + qd * 4, 4);                                                  \
                    const __m512i xv = _mm512_set1_epi32(x4);                                                     \
                    for (int n = 0; n < NT; n++) ia[m][n] = _mm512_dpbusd_epi32(ia[m][n], w[n], xv);              \
                }                                                                                                 \
            }                                                                                                     \
            __m512 sc[NT];                                                                                        \
            for (int n = 0; n < NT; n++)                                                                          \
                sc[n] = _mm512_cvtepi32_ps(                                                                       \
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(ws + n * sg + (size_t)b * 16))));       \
            for (int m = 0; m < MT; m++) {                                                                        \
                const __m512 xm = _mm512_set1_ps(xs[(size_t)m * nb + b]);                                         \
                for (int n = 0; n < NT; n++)                                                                      \
                    acc[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[m][n]), _mm512_mul_ps(sc[n], xm), acc[m][n]);\
            }                                                                                                     \
        }                                                                                                         \
        for (int n = 0; n < NT; n++) {                                                                            \
            const __m512 dn = _mm512_loadu_ps(wd + n * 16);                                                       \
            for (int m = 0; m < MT; m++) {                                                                        \
                float* o = y + (size_t)m * ldy + n * 16;                                                          \
                /* one explicit FMA, not mul + add: gcc may contract those in some tiles only, and then a row's \
                   result would depend on the batch's tile shape (the exactness tests catch it) */                 \
                _mm512_storeu_ps(o, accumulate ? _mm512_fmadd_ps(acc[m][n], dn, _mm512_loadu_ps(o))               \
                                               : _mm512_mul_ps(acc[m][n], dn));                                   \
            }                                                                                                     \
        }                                                                                                         \
    }
#else
/* AVX2: a group of 16 outputs is two 8-lane halves */
#define HS_TILE(MT, NT, BS)                                                                                       \
    static void tile_##MT##_##NT##_##BS(const int8_t* xq, int K, const float* xs, const int32_t* xc,               \
                                        const uint8_t* wq, const uint8_t* ws, const float* wd, float* y, int ldy,  \
                                        int accumulate, const uint8_t* pf) {                                       \
        (void)xc;                                                                                                 \
        const int bs = BS, nb = K / BS;                                                                           \
        const size_t wg = (size_t)K * 16, sg = (size_t)nb * 16;                                                   \
        const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);                           \
        __m256 acc[MT][2 * NT];                                                                                   \
        for (int m = 0; m < MT; m++)                                                                              \
            for (int n = 0; n < 2 * NT; n++) acc[m][n] = _mm256_setzero_ps();                                     \
        for (int b = 0; b < nb; b++) {                                                                            \
            __m256i ia[MT][2 * NT];                                                                               \
            for (int m = 0; m < MT; m++)                                                                          \
                for (int n = 0; n < 2 * NT; n++) ia[m][n] = _mm256_setzero_si256();                               \
            const uint8_t* wb = wq + (size_t)b * bs * 16;                                                         \
            const int8_t* xb = xq + b * bs;                                                                       \
            _Pragma("GCC unroll 8") for (int qd = 0; qd < BS / 4; qd++) {                                         \
                if (pf)                                                                                           \
                    for (int n = 0; n < NT; n++)                                                                  \
                        _mm_prefetch((const char*)pf + n * wg + (size_t)b * bs * 16 + qd * 64, _MM_HINT_T1);      \
                __m256i wsg[2 * NT], wab[2 * NT];                                                                 \
                for (int n = 0; n < 2 * NT; n++) {                                                                \
                    wsg[n] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(wb + (n / 2) * wg + qd * 64 +   \
                                                                                  (n % 2) * 32)), flip);          \
                    wab[n] = _mm256_abs_epi8(wsg[n]);                                                             \
                }                                                                                                 \
                for (int m = 0; m < MT; m++) {                                                                    \
                    int32_t x4;                                                                                   \
                    memcpy(&x4, xb + (size_t)m * K + qd * 4, 4);                                                  \
                    const __m256i xv = _mm256_set1_epi32(x4);                                                     \
                    for (int n = 0; n < 2 * NT; n++) {                                                            \
                        __m256i p = _mm256_maddubs_epi16(wab[n], _mm256_sign_epi8(xv, wsg[n]));                   \
                        ia[m][n] = _mm256_add_epi32(ia[m][n], _mm256_madd_epi16(p, ones));                        \
                    }                                                                                             \
                }                                                                                                 \
            }                                                                                                     \
            __m256 sc[2 * NT];                                                                                    \
            for (int n = 0; n < 2 * NT; n++)                                                                      \
                sc[n] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(                                                  \
                    _mm_loadl_epi64((const __m128i*)(ws + (n / 2) * sg + (size_t)b * 16 + (n % 2) * 8))));         \
            for (int m = 0; m < MT; m++) {                                                                        \
                const __m256 xm = _mm256_set1_ps(xs[(size_t)m * nb + b]);                                         \
                for (int n = 0; n < 2 * NT; n++)                                                                  \
                    acc[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[m][n]), _mm256_mul_ps(sc[n], xm), acc[m][n]);\
            }                                                                                                     \
        }                                                                                                         \
        for (int n = 0; n < 2 * NT; n++) {                                                                        \
            const __m256 dn = _mm256_loadu_ps(wd + n * 8);                                                        \
            for (int m = 0; m < MT; m++) {                                                                        \
                float* o = y + (size_t)m * ldy + n * 8;                                                           \
                _mm256_storeu_ps(o, accumulate ? _mm256_fmadd_ps(acc[m][n], dn, _mm256_loadu_ps(o))               \
                                               : _mm256_mul_ps(acc[m][n], dn));                                   \
            }                                                                                                     \
        }                                                                                                         \
    }
#endif

typedef void (*tile_fn)(const int8_t*, int, const float*, const int32_t*, const uint8_t*, const uint8_t*,
                        const float*, float*, int, int, const uint8_t*);

/* AVX-512 tiles: MT x NT = 6 x 2 for batches (measured best of 2x4 .. 8x2 on Zen 4 at M = 16 and 608), 1 x 1 and
   2 x 1 for one and two rows (bandwidth-bound: one sequential stream, hs_gemm); the M tail uses smaller MT */
#define HS_TILES(BS)                                                                                              \
    HS_TILE(1, 1, BS) HS_TILE(1, 2, BS) HS_TILE(2, 1, BS) HS_TILE(2, 2, BS) HS_TILE(3, 1, BS) HS_TILE(3, 2, BS)   \
    HS_TILE(4, 1, BS) HS_TILE(4, 2, BS) HS_TILE(5, 1, BS) HS_TILE(5, 2, BS) HS_TILE(6, 1, BS) HS_TILE(6, 2, BS)
#define HS_TILE_TABLE(BS)                                                                                         \
    {{0, 0, 0},                                                                                                   \
     {0, tile_1_1_##BS, tile_1_2_##BS},                                                                           \
     {0, tile_2_1_##BS, tile_2_2_##BS},                                                                           \
     {0, tile_3_1_##BS, tile_3_2_##BS},                                                                           \
     {0, tile_4_1_##BS, tile_4_2_##BS},                                                                           \
     {0, tile_5_1_##BS, tile_5_2_##BS},                                                                           \
     {0, tile_6_1_##BS, tile_6_2_##BS}}
#if defined(HS_AVX512)
HS_TILES(16)
HS_TILES(32)
#else
HS_TILE(1, 1, 16) HS_TILE(2, 1, 16) HS_TILE(1, 1, 32) HS_TILE(2, 1, 32)
#endif
#if defined(HS_AVX512)
static const tile_fn hs_tiles16[7][3] = HS_TILE_TABLE(16);
static const tile_fn hs_tiles32[7][3] = HS_TILE_TABLE(32);
#define HS_MT 6
#define HS_NT 2
#else
static const tile_fn hs_tiles16[3][3] = {{0}, {0, tile_1_1_16}, {0, tile_2_1_16}};
static const tile_fn hs_tiles32[3][3] = {{0}, {0, tile_1_1_32}, {0, tile_2_1_32}};
#define HS_MT 2
#define HS_NT 1
#endif

/* y [M, N] (row stride ldy) = or += x W^T, x already quantized (hs_quant_rows with W's block size). Output
   groups outer, rows inner: a group's weights are read from memory once and stay in L1/L2 for the other row
   tiles; the first row tile prefetches the next group's into L2. With AVX-512 at one or two rows the matrix is
   instead read as one sequential stream (one group per tile, groups are contiguous) with no software prefetch:
   the hardware prefetcher alone keeps up there, and a whole decode step at batch 1 fell from 6.8 to 5.2 ms
   (batch 2: 7.2 -> 5.8; 3 rows and up unchanged; AVX2 at 1-2 rows is slower without the prefetch: 6.1 -> 6.3,
   6.3 -> 7.6). Zen 4, 2026-12-05, medians of 9 interleaved rounds, loadtest/README.md "native INT8 engine". */
static void hs_gemm(const int8_t* xq, const float* xs, const int32_t* xc, int M, const QMat* W, float* y, int ldy,
                    int accumulate) {
    const int K = W->K, G = W->N / 16, nb = K / W->bs;
    const size_t wg = (size_t)K * 16, sg = (size_t)nb * 16;
#if defined(HS_AVX512)
    const int stream = M <= 2;
#else
    const int stream = 0;
#endif
    const int NT = stream ? 1 : HS_NT, MT = HS_MT;
    for (int g = 0; g < G;) {
        const int nt = G - g >= NT ? NT : 1; /* the last G % NT groups one at a time */
        const uint8_t* next = g + nt < G ? W->q + (size_t)(g + nt) * wg : NULL;
        for (int m0 = 0; m0 < M; m0 += MT) {
            const int mt = M - m0 < MT ? M - m0 : MT;
            const uint8_t* pf = !stream && m0 == 0 && next && g + 2 * nt <= G ? next : NULL;
            (W->bs == 16 ? hs_tiles16 : hs_tiles32)[mt][nt](xq + (size_t)m0 * K, K, xs + (size_t)m0 * nb,
                                                            xc + (size_t)m0 * nb, W->q + (size_t)g * wg,
                                                            W->s + (size_t)g * sg, W->d.p + (size_t)g * 16,
                                                            y + (size_t)m0 * ldy + g * 16, ldy, accumulate, pf);
        }
        g += nt;
    }
}
#endif
