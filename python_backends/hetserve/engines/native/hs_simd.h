/* Float vector helpers for the two builds of the native engine (engines/native.py compiles hs_engine.c once per
   ISA): HS_AVX512 (AVX-512 F/BW/VL + VNNI: 16 floats a vector) and the AVX2 + FMA baseline (8 floats).
   Everything ISA-specific outside the INT8 GEMM (hs_gemm.h) goes through these names. */
#ifndef HS_SIMD_H
#define HS_SIMD_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#if defined(HS_AVX512)
#define VW 16
typedef __m512 vf;
typedef __m512i vi;
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, x) _mm512_storeu_ps(p, x)
#define vset1(x) _mm512_set1_ps(x)
#define vzero() _mm512_setzero_ps()
#define vadd(a, b) _mm512_add_ps(a, b)
#define vsub(a, b) _mm512_sub_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vmax(a, b) _mm512_max_ps(a, b)
#define vmin(a, b) _mm512_min_ps(a, b)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vfnma(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define vround(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vcvt_i(x) _mm512_cvtps_epi32(x)
#define vi_add(a, b) _mm512_add_epi32(a, b)
#define vi_set1(x) _mm512_set1_epi32(x)
#define vi_sll(a, n) _mm512_slli_epi32(a, n)
#define vcast_f(x) _mm512_castsi512_ps(x)
static inline float vhsum(vf x) { return _mm512_reduce_add_ps(x); }
static inline float vhmax(vf x) { return _mm512_reduce_max_ps(x); }
/* 1 / x: 14-bit estimate + one Newton step (~23 bits, as a division; a zmm division is ~10x the cost) */
static inline vf vrcp(vf x) {
    const vf r = _mm512_rcp14_ps(x);
    return _mm512_mul_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(2.0f)));
}
#else
#define VW 8
typedef __m256 vf;
typedef __m256i vi;
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, x) _mm256_storeu_ps(p, x)
#define vset1(x) _mm256_set1_ps(x)
#define vzero() _mm256_setzero_ps()
#define vadd(a, b) _mm256_add_ps(a, b)
#define vsub(a, b) _mm256_sub_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vmax(a, b) _mm256_max_ps(a, b)
#define vmin(a, b) _mm256_min_ps(a, b)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vfnma(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define vround(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vcvt_i(x) _mm256_cvtps_epi32(x)
#define vi_add(a, b) _mm256_add_epi32(a, b)
#define vi_set1(x) _mm256_set1_epi32(x)
#define vi_sll(a, n) _mm256_slli_epi32(a, n)
#define vcast_f(x) _mm256_castsi256_ps(x)
static inline float vhsum(vf x) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
static inline float vhmax(vf x) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
/* 1 / x: 12-bit estimate + one Newton step (~22 bits) */
static inline vf vrcp(vf x) {
    const vf r = _mm256_rcp_ps(x);
    return _mm256_mul_ps(r, _mm256_fnmadd_ps(x, r, _mm256_set1_ps(2.0f)));
}
#endif

/* e^x, Cephes-style range reduction + degree-6 polynomial (|rel err| ~ 2e-7); x clamped to [-87.3, 88.3] */
static inline vf vexp(vf x) {
    x = vmin(vmax(x, vset1(-87.3f)), vset1(88.3f));
    vf n = vround(vmul(x, vset1(1.44269504088896341f)));
    vf r = vfnma(n, vset1(0.693359375f), x);
    r = vfnma(n, vset1(-2.12194440e-4f), r);
    vf p = vset1(1.9875691500E-4f);
    p = vfma(p, r, vset1(1.3981999507E-3f));
    p = vfma(p, r, vset1(8.3334519073E-3f));
    p = vfma(p, r, vset1(4.1665795894E-2f));
    p = vfma(p, r, vset1(1.6666665459E-1f));
    p = vfma(p, r, vset1(5.0000001201E-1f));
    p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
    vi e = vi_sll(vi_add(vcvt_i(n), vi_set1(127)), 23);
    return vmul(p, vcast_f(e));
}
#endif
