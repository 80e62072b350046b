/* hetserve native CPU engine: the Llama forward pass over a ragged batch of tokens, INT8 weights and activations
   (hs_gemm.h), attention straight over each sequence's own KV buffer. Loaded by engines/native.py through ctypes;
   compiled once per ISA (-DHS_AVX512 with AVX-512 VNNI, else AVX2 + FMA + F16C).

   Why it exists: ONNX Runtime runs the INT8 graph op by op with its own buffers; here one call runs the whole
   step for any mix of decode rows (1 token each) and prefill rows (many), writing each token's K/V where the
   caller keeps that sequence's KV (the decode batch's rows, a prefill job's buffer): no feed copies, no padding.

   Math (the same model as engines/onnx_graph.py): h = embed[id]; per layer x = rms(h) * w_in;
   q|k|v = x Wqkv^T; RoPE (HF rotate_half, cos/sin tables from the caller) on q and k at the token's position;
   K, V stored at the position; causal attention of each query head over positions 0..pos of its sequence
   (kv head = head / (H / KVH)), or over the last `window` positions of a sliding-window layer; h += attn Wo^T;
   x = rms(h) * w_post; g|u = x Wgu^T; h += (silu(g) * u) Wdown^T; each GEMM adds its bias when the layer has one.
   logits = (rms(h) * w_norm) Wlm^T for the requested tokens. Norms, RoPE, softmax and attention in fp32.

   KV of sequence r: element (layer l, kv head g, position p, d) at kv_k[r][l * lstride[r] + (g * cap[r] + p) * D + d]
   (the wire layout [L, KVH, cap, D] when lstride = KVH * cap * D), fp32 or fp16 elements.

   The interface (structs, calls, return codes, buffer lengths) is hs_engine.h. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hs_engine.h"
#include "hs_gemm.h"
#include "hs_simd.h"

typedef hs_layer Layer;
typedef hs_model Model;

/* per-section time of the last calls (hs_profile): where a step goes, for loadtest/README.md */
enum { P_NORM, P_QUANT, P_QKV, P_ROPE_KV, P_ATTN, P_O, P_GATE_UP, P_SILU, P_DOWN, P_LM_HEAD, P_N };

struct hs_scratch {
    double t[P_N];
    size_t tokens, ctx;
    float *h, *x, *qkv, *gu, *act, *scores, *kb;
    int8_t* xq;
    float* xs;
    int32_t* xc;
};
typedef hs_scratch Scratch;

int hs_abi(void) { return HS_ABI; }

const char* hs_error(int code) {
    switch (code) {
        case HS_OK: return "ok";
        case HS_E_POSITION: return "a position outside the sequence's KV buffer or the model's max_position";
        case HS_E_TOKEN: return "a token id outside the vocabulary";
        case HS_E_NOMEM: return "out of memory";
        case HS_E_OUT_INDEX: return "an output index outside the tokens";
        case HS_E_ROW: return "a row outside the sequences";
        case HS_E_COUNT: return "a negative count, or arrays of one call whose lengths disagree";
        case HS_E_BUFFER: return "a buffer shorter than its shape needs (KV, logits, x or y), or a NULL one";
        case HS_E_SHAPE: return "head_dim / hidden / intermediate sizes this build cannot handle (head_dim must be "
                                "a multiple of the vector width and <= 256, at most 64 query heads per KV head)";
        case HS_E_MATRIX: return "a layer matrix or bias with the wrong shape, block size or buffer length";
        case HS_E_TENSOR: return "lm_head / embeddings / norms / RoPE tables / layers missing or misshaped";
        default: return "unknown error code";
    }
}

typedef void (*attend_fn)(const float*, int, const void*, const void*, int, int, float, float*, float*, float*,
                          const char*, const char*, size_t);
static attend_fn pick_attend(int D);

/* a buffer of exactly n elements (n > 0) */
static int f32_is(hs_f32 b, int64_t n) { return b.p && n > 0 && b.n == n; }
/* an optional bias: absent, or exactly n elements */
static int bias_ok(hs_f32 b, int64_t n) { return !b.p || b.n == n; }

static int qmat_ok(const QMat* q, int N, int K) {
    if (q->N != N || q->K != K || N <= 0 || K <= 0 || N % 16 || (q->bs != 16 && q->bs != 32) || K % q->bs ||
        K > HS_MAX_K)
        return 0;
    return q->q && q->s && q->q_len == (int64_t)N * K && q->s_len == (int64_t)N * (K / q->bs) && f32_is(q->d, N);
}

int hs_model_check(const Model* m) {
    if (m->L < 0 || m->C <= 0 || m->H <= 0 || m->KVH <= 0 || m->D <= 0 || m->I <= 0 || m->V <= 0 || m->max_pos <= 0)
        return HS_E_SHAPE;
    if (m->D % VW || !pick_attend(m->D) || m->H % m->KVH || m->H / m->KVH > 64 || m->C % VW || m->I % VW)
        return HS_E_SHAPE;
    if (!m->layers || m->n_layers != m->L) return HS_E_TENSOR;
    const int qkvn = (m->H + 2 * m->KVH) * m->D;
    for (int l = 0; l < m->L; l++) {
        const Layer* y = &m->layers[l];
        if (!qmat_ok(&y->qkv, qkvn, m->C) || !qmat_ok(&y->o, m->C, m->H * m->D) ||
            !qmat_ok(&y->gate_up, 2 * m->I, m->C) || !qmat_ok(&y->down, m->C, m->I) || !f32_is(y->in_norm, m->C) ||
            !f32_is(y->post_norm, m->C) || y->window < 0 || !bias_ok(y->qkv_b, qkvn) || !bias_ok(y->o_b, m->C) ||
            !bias_ok(y->gate_up_b, 2 * (int64_t)m->I) || !bias_ok(y->down_b, m->C))
            return HS_E_MATRIX;
    }
    const int64_t rope_n = (int64_t)m->max_pos * (m->D / 2);
    if (!qmat_ok(&m->lm_head, m->V, m->C) || !f32_is(m->embed, (int64_t)m->V * m->C) ||
        !f32_is(m->final_norm, m->C) || !f32_is(m->rope_cos, rope_n) || !f32_is(m->rope_sin, rope_n))
        return HS_E_TENSOR;
    return HS_OK;
}

Scratch* hs_scratch_new(void) { return (Scratch*)calloc(1, sizeof(Scratch)); }

static void scratch_release(Scratch* s) {
    free(s->h); free(s->x); free(s->qkv); free(s->gu); free(s->act); free(s->scores); free(s->kb);
    free(s->xq); free(s->xs); free(s->xc);
    s->h = s->x = s->qkv = s->gu = s->act = s->scores = s->kb = s->xs = NULL;
    s->xq = NULL;
    s->xc = NULL;
    s->tokens = s->ctx = 0;
}

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int hs_profile(Scratch* s, double* out, int n) {
    if (n < P_N) return HS_E_BUFFER;
    memcpy(out, s->t, sizeof(s->t));
    memset(s->t, 0, sizeof(s->t));
    return P_N;
}

void hs_scratch_free(Scratch* s) {
    if (!s) return;
    scratch_release(s);
    free(s);
}

/* grow-only; 64-byte aligned so vector loads of a row never split more than they must */
static void* amalloc(size_t n) {
    void* p = NULL;
    return posix_memalign(&p, 64, n ? n : 64) ? NULL : p;
}

/* the widest GEMM input (K) of the model: sizes the activation scratch */
static size_t max_k(const Model* m) {
    size_t k = (size_t)(m->I > m->C ? m->I : m->C);
    return (size_t)m->H * m->D > k ? (size_t)m->H * m->D : k;
}

static int scratch_fit(Scratch* s, const Model* m, size_t tokens, size_t ctx) {
    if (tokens <= s->tokens && ctx <= s->ctx) return 0;
    if (tokens < s->tokens) tokens = s->tokens;
    if (ctx < s->ctx) ctx = s->ctx;
    scratch_release(s);
    const size_t T = tokens, qkvw = (size_t)(m->H + 2 * m->KVH) * m->D;
    const size_t kmax = max_k(m);
    s->h = amalloc(T * m->C * 4);
    s->x = amalloc(T * kmax * 4);
    s->qkv = amalloc(T * qkvw * 4);
    s->gu = amalloc(T * 2 * m->I * 4);
    s->act = amalloc(T * m->I * 4);
    s->scores = amalloc((size_t)(m->H / m->KVH) * (ctx + VW) * 4);
    s->kb = amalloc((size_t)VW * m->D * 4);
    s->xq = amalloc(T * kmax);
    s->xs = amalloc(T * (kmax / 16) * 4);
    s->xc = amalloc(T * (kmax / 16) * 4);
    if (!s->h || !s->x || !s->qkv || !s->gu || !s->act || !s->scores || !s->kb || !s->xq || !s->xs || !s->xc) {
        scratch_release(s);
        return -1;
    }
    s->tokens = tokens;
    s->ctx = ctx;
    return 0;
}

static void rms_norm(const float* h, const float* w, float* out, int C, float eps) {
    vf acc = vzero();
    for (int i = 0; i < C; i += VW) {
        vf v = vload(h + i);
        acc = vfma(v, v, acc);
    }
    const vf inv = vset1(1.0f / sqrtf(vhsum(acc) / (float)C + eps));
    for (int i = 0; i < C; i += VW) vstore(out + i, vmul(vmul(vload(h + i), inv), vload(w + i)));
}

/* HF rotate_half: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) over the two halves of the head */
static void rope(float* v, const float* c, const float* s, int D) {
    const int half = D / 2;
    int i = 0;
    for (; i + VW <= half; i += VW) {
        vf a = vload(v + i), b = vload(v + half + i), cc = vload(c + i), sn = vload(s + i);
        vstore(v + i, vsub(vmul(a, cc), vmul(b, sn)));
        vstore(v + half + i, vfma(b, cc, vmul(a, sn)));
    }
    for (; i < half; i++) {
        const float a = v[i], b = v[half + i];
        v[i] = a * c[i] - b * s[i];
        v[half + i] = b * c[i] + a * s[i];
    }
}

/* ---- attention ---------------------------------------------------------------------------------------------
   One token's query heads of one KV head (a GQA group of G heads) over positions 0..n-1 of that KV head, KV fp32
   or fp16 (kv16). Scores of VW positions at a time: each position's D-long products stay in a vector and one
   transpose-add network (reduce_vw) turns VW such vectors into the VW scores, instead of a horizontal sum per
   score. Then softmax per head and the weighted sum of V, V rows converted once and shared by the heads. */

static inline void kv_row(const void* base, int fp16, size_t j, int D, float* out) {
    if (fp16) {
        const uint16_t* p = (const uint16_t*)base + j * D;
#if defined(HS_AVX512)
        for (int c = 0; c < D; c += 16) _mm512_storeu_ps(out + c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + c))));
#else
        for (int c = 0; c < D; c += 8) _mm256_storeu_ps(out + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + c))));
#endif
    } else {
        memcpy(out, (const float*)base + j * D, (size_t)D * 4);
    }
}

static inline void kv_store(void* base, int fp16, size_t j, int D, const float* in) {
    if (fp16) {
        uint16_t* p = (uint16_t*)base + j * D;
#if defined(HS_AVX512)
        for (int c = 0; c < D; c += 16)
            _mm256_storeu_si256((__m256i*)(p + c), _mm512_cvtps_ph(_mm512_loadu_ps(in + c), _MM_FROUND_TO_NEAREST_INT));
#else
        for (int c = 0; c < D; c += 8)
            _mm_storeu_si128((__m128i*)(p + c), _mm256_cvtps_ph(_mm256_loadu_ps(in + c), _MM_FROUND_TO_NEAREST_INT));
#endif
    } else {
        memcpy((float*)base + j * D, in, (size_t)D * 4);
    }
}

/* r[j] = sum of the lanes of p[j], j < VW */
static inline vf reduce_vw(vf* p) {
#if defined(HS_AVX512)
    __m512 x[8], y[4], z[2];
    for (int j = 0; j < 8; j++)
        x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(p[j], p[j + 8], 0x44), _mm512_shuffle_f32x4(p[j], p[j + 8], 0xEE));
    for (int j = 0; j < 4; j++)
        y[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x[j], x[j + 4], 0x88), _mm512_shuffle_f32x4(x[j], x[j + 4], 0xDD));
    for (int j = 0; j < 2; j++)
        z[j] = _mm512_add_ps(_mm512_shuffle_ps(y[j], y[j + 2], 0x44), _mm512_shuffle_ps(y[j], y[j + 2], 0xEE));
    const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), w);
#else
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(p[4], p[5]), _mm256_hadd_ps(p[6], p[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#endif
}

/* NV = D / VW vectors a head; HG heads share one pass over V (HG * NV accumulators) */
#define HS_ATTEND(NV)                                                                                             \
    static void attend_##NV(const float* q, int G, const void* K, const void* V, int kv16, int n, float scale,   \
                            float* sc, float* kb, float* out, const char* pk, const char* pv, size_t pbytes) {    \
        const int D = NV * VW, npad = (n + VW - 1) / VW * VW;                                                     \
        const size_t rowb = (size_t)D * (kv16 ? 2 : 4);                                                           \
        for (int j0 = 0; j0 < n; j0 += VW) {                                                                      \
            const int cnt = n - j0 < VW ? n - j0 : VW;                                                            \
            for (size_t o = (size_t)j0 * rowb; o < (size_t)(j0 + cnt) * rowb && o < pbytes; o += 64)            \
                _mm_prefetch(pk + o, _MM_HINT_T0);                                                                \
            for (int jj = 0; jj < cnt; jj++) kv_row(K, kv16, (size_t)(j0 + jj), D, kb + (size_t)jj * D);          \
            for (int jj = cnt; jj < VW; jj++) memset(kb + (size_t)jj * D, 0, (size_t)D * 4);                      \
            for (int h = 0; h < G; h++) {                                                                         \
                vf qv[NV], p[VW];                                                                                 \
                for (int c = 0; c < NV; c++) qv[c] = vload(q + (size_t)h * D + c * VW);                           \
                for (int jj = 0; jj < VW; jj++) {                                                                 \
                    vf a = vmul(qv[0], vload(kb + (size_t)jj * D));                                               \
                    for (int c = 1; c < NV; c++) a = vfma(qv[c], vload(kb + (size_t)jj * D + c * VW), a);         \
                    p[jj] = a;                                                                                    \
                }                                                                                                 \
                vstore(sc + (size_t)h * npad + j0, vmul(reduce_vw(p), vset1(scale)));                             \
            }                                                                                                     \
        }                                                                                                         \
        float inv[64];                                                                                            \
        for (int h = 0; h < G; h++) { /* softmax; positions >= n are padding */                                   \
            float* s = sc + (size_t)h * npad;                                                                     \
            for (int j = n; j < npad; j++) s[j] = -INFINITY;                                                      \
            vf mx = vset1(-INFINITY);                                                                             \
            for (int j = 0; j < npad; j += VW) mx = vmax(mx, vload(s + j));                                       \
            const vf m = vset1(vhmax(mx));                                                                        \
            vf tot = vzero();                                                                                     \
            for (int j = 0; j < npad; j += VW) {                                                                  \
                const vf e = vexp(vsub(vload(s + j), m));                                                         \
                vstore(s + j, e);                                                                                 \
                tot = vadd(tot, e);                                                                               \
            }                                                                                                     \
            for (int j = n; j < npad; j++) s[j] = 0.0f;                                                           \
            inv[h] = 1.0f / vhsum(tot);                                                                           \
        }                                                                                                         \
        enum { HG = NV >= 16 ? 1 : 16 / NV };                                                                     \
        for (int h0 = 0; h0 < G; h0 += HG) {                                                                      \
            const int hn = G - h0 < HG ? G - h0 : HG;                                                             \
            vf acc[HG][NV];                                                                                       \
            for (int h = 0; h < HG; h++)                                                                          \
                for (int c = 0; c < NV; c++) acc[h][c] = vzero();                                                 \
            for (int j = 0; j < n; j++) {                                                                         \
                if (h0 == 0)                                                                                      \
                    for (size_t o = (size_t)j * rowb; o < (size_t)(j + 1) * rowb && o < pbytes; o += 64)         \
                        _mm_prefetch(pv + o, _MM_HINT_T0);                                                        \
                vf v[NV];                                                                                         \
                if (kv16) {                                                                                       \
                    const uint16_t* vp = (const uint16_t*)V + (size_t)j * D;                                      \
                    for (int c = 0; c < NV; c++) v[c] = HS_CVTPH(vp + c * VW);                                    \
                } else {                                                                                          \
                    for (int c = 0; c < NV; c++) v[c] = vload((const float*)V + (size_t)j * D + c * VW);          \
                }                                                                                                 \
                for (int h = 0; h < HG; h++) {                                                                    \
                    const vf pj = vset1(h < hn ? sc[(size_t)(h0 + h) * npad + j] : 0.0f);                         \
                    for (int c = 0; c < NV; c++) acc[h][c] = vfma(pj, v[c], acc[h][c]);                           \
                }                                                                                                 \
            }                                                                                                     \
            for (int h = 0; h < hn; h++)                                                                          \
                for (int c = 0; c < NV; c++)                                                                      \
                    vstore(out + (size_t)(h0 + h) * D + c * VW, vmul(acc[h][c], vset1(inv[h0 + h])));             \
        }                                                                                                         \
    }

#if defined(HS_AVX512)
#define HS_CVTPH(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p)))
#else
#define HS_CVTPH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p)))
#endif
HS_ATTEND(1)
HS_ATTEND(2)
HS_ATTEND(4)
HS_ATTEND(8)
HS_ATTEND(16)
#if !defined(HS_AVX512)
HS_ATTEND(32)
#endif

static attend_fn pick_attend(int D) {
    switch (D / VW) {
        case 1: return attend_1;
        case 2: return attend_2;
        case 4: return attend_4;
        case 8: return attend_8;
        case 16: return attend_16;
#if !defined(HS_AVX512)
        case 32: return attend_32;
#endif
        default: return NULL;
    }
}

static void silu_mul(const float* gu, int I, float* out) {
    const float* u = gu + I;
    for (int i = 0; i < I; i += VW) {
        const vf g = vload(gu + i);
        const vf sg = vmul(g, vrcp(vadd(vset1(1.0f), vexp(vsub(vzero(), g)))));
        vstore(out + i, vmul(sg, vload(u + i)));
    }
}

/* y[i] += b for M rows of width N (ld apart) */
static void add_bias(float* y, int ld, int M, const float* b, int N) {
    if (!b) return;
    for (int i = 0; i < M; i++) {
        float* r = y + (size_t)i * ld;
        int j = 0;
        for (; j + VW <= N; j += VW) vstore(r + j, vadd(vload(r + j), vload(b + j)));
        for (; j < N; j++) r[j] += b[j];
    }
}

static double qgemm(Scratch* s, const float* x, int ldx, int M, const QMat* W, float* y, int ldy, int accumulate,
                    double t0, int section) {
    hs_quant_rows(x, ldx, M, W->K, W->bs, s->xq, s->xs, s->xc);
    const double t1 = now_s();
    s->t[P_QUANT] += t1 - t0;
    hs_gemm(s->xq, s->xs, s->xc, M, W, y, ldy, accumulate);
    const double t2 = now_s();
    s->t[section] += t2 - t1;
    return t2;
}

/* first position a token at `pos` attends to in this layer (sliding window) */
static inline int win_start(const Layer* y, int pos) { return y->window && pos + 1 > y->window ? pos + 1 - y->window : 0; }

/* One forward pass (hs_engine.h: hs_batch). Every count and buffer length is checked before anything is
   written, so a refused call leaves the KV buffers as they were. */
int hs_forward(const Model* m, Scratch* s, const hs_batch* b) {
    const int64_t M64 = b->ids.n, n_out64 = b->out_idx.n, R = b->n_rows;
    if (M64 < 0 || n_out64 < 0 || R < 0 || M64 > INT32_MAX || n_out64 > INT32_MAX) return HS_E_COUNT;
    if (b->pos.n != M64 || b->row.n != M64) return HS_E_COUNT;
    const int32_t M = (int32_t)M64, n_out = (int32_t)n_out64;
    const int64_t* ids = b->ids.p;
    const int32_t *pos = b->pos.p, *row = b->row.p, *out_idx = b->out_idx.p, *cap = b->cap;
    void* const* kv_k = b->kv_k;
    void* const* kv_v = b->kv_v;
    const int64_t* lstride = b->lstride;
    const int kv16 = b->kv16 != 0;
    float* logits = b->logits;
    if ((M && (!ids || !pos || !row)) || (n_out && (!out_idx || !logits))) return HS_E_BUFFER;
    if (R && (!kv_k || !kv_v || !lstride || !cap || !b->kv_len)) return HS_E_BUFFER;
    if (b->logits_len < n_out64 * m->V) return HS_E_BUFFER;
    const int C = m->C, H = m->H, KVH = m->KVH, D = m->D, I = m->I;
    const int qw = H * D, kvw = KVH * D, qkvw = qw + 2 * kvw, group = H / KVH;
    const size_t esz = kv16 ? 2 : 4;
    for (int64_t r = 0; r < R; r++) { /* each sequence's buffers hold every (layer, head, position < cap) */
        if (cap[r] < 0 || lstride[r] < 0) return HS_E_COUNT;
        const int64_t need = (int64_t)(m->L - 1) * lstride[r] + (int64_t)KVH * cap[r] * D;
        if (cap[r] && (!kv_k[r] || !kv_v[r] || b->kv_len[r] < need)) return HS_E_BUFFER;
    }
    int maxpos = 0;
    for (int t = 0; t < M; t++) {
        if (row[t] < 0 || row[t] >= R) return HS_E_ROW;
        if (pos[t] < 0 || pos[t] >= cap[row[t]] || pos[t] >= m->max_pos) return HS_E_POSITION;
        if (ids[t] < 0 || ids[t] >= m->V) return HS_E_TOKEN;
        if (pos[t] > maxpos) maxpos = pos[t];
    }
    for (int i = 0; i < n_out; i++)
        if (out_idx[i] < 0 || out_idx[i] >= M) return HS_E_OUT_INDEX;
    if (M == 0) return 0;
    if (scratch_fit(s, m, (size_t)(M > n_out ? M : n_out), (size_t)maxpos + 1)) return HS_E_NOMEM;
    const attend_fn attend = pick_attend(D);
    const float scale = 1.0f / sqrtf((float)D);
    float* h = s->h;
    double t = now_s(), u;
    for (int i = 0; i < M; i++) memcpy(h + (size_t)i * C, m->embed.p + (size_t)ids[i] * C, (size_t)C * 4);
    for (int l = 0; l < m->L; l++) {
        const Layer* y = &m->layers[l];
        for (int i = 0; i < M; i++) rms_norm(h + (size_t)i * C, y->in_norm.p, s->x + (size_t)i * C, C, m->eps);
        u = now_s(); s->t[P_NORM] += u - t;
        t = qgemm(s, s->x, C, M, &y->qkv, s->qkv, qkvw, 0, u, P_QKV);
        add_bias(s->qkv, qkvw, M, y->qkv_b.p, qkvw);
        for (int i = 0; i < M; i++) { /* RoPE on q and k, then K/V into the sequence's buffer */
            float* q = s->qkv + (size_t)i * qkvw;
            const float* c = m->rope_cos.p + (size_t)pos[i] * (D / 2);
            const float* sn = m->rope_sin.p + (size_t)pos[i] * (D / 2);
            for (int hh = 0; hh < H + KVH; hh++) rope(q + (size_t)hh * D, c, sn, D);
            const int r = row[i];
            char* kl = (char*)kv_k[r] + (size_t)l * lstride[r] * esz;
            char* vl = (char*)kv_v[r] + (size_t)l * lstride[r] * esz;
            for (int g = 0; g < KVH; g++) {
                const size_t head = (size_t)g * cap[r] * D * esz;
                kv_store(kl + head, kv16, (size_t)pos[i], D, q + qw + (size_t)g * D);
                kv_store(vl + head, kv16, (size_t)pos[i], D, q + qw + kvw + (size_t)g * D);
            }
        }
        u = now_s(); s->t[P_ROPE_KV] += u - t; t = u;
        /* (token, kv head) items in order; each prefetches the next one's K/V while it computes (the streams are
           short and scattered, so the hardware prefetcher alone leaves the core waiting on memory) */
        for (int it = 0, n_items = M * KVH; it < n_items; it++) {
            const int i = it / KVH, g = it % KVH, r = row[i];
            const float* q = s->qkv + (size_t)i * qkvw;
            const char* kl = (const char*)kv_k[r] + (size_t)l * lstride[r] * esz + (size_t)g * cap[r] * D * esz;
            const char* vl = (const char*)kv_v[r] + (size_t)l * lstride[r] * esz + (size_t)g * cap[r] * D * esz;
            const char *pk = NULL, *pv = NULL;
            size_t pbytes = 0;
            if (it + 1 < n_items) {
                const int i2 = (it + 1) / KVH, g2 = (it + 1) % KVH, r2 = row[i2], st2 = win_start(y, pos[i2]);
                const size_t off = (size_t)l * lstride[r2] * esz + ((size_t)g2 * cap[r2] + st2) * D * esz;
                pk = (const char*)kv_k[r2] + off;
                pv = (const char*)kv_v[r2] + off;
                pbytes = (size_t)(pos[i2] + 1 - st2) * D * esz;
            }
            const int st = win_start(y, pos[i]);
            attend(q + (size_t)g * group * D, group, kl + (size_t)st * D * esz, vl + (size_t)st * D * esz, kv16,
                   pos[i] + 1 - st, scale, s->scores, s->kb, s->x + (size_t)i * qw + (size_t)g * group * D, pk, pv,
                   pbytes);
        }
        u = now_s(); s->t[P_ATTN] += u - t;
        t = qgemm(s, s->x, qw, M, &y->o, h, C, 1, u, P_O);
        add_bias(h, C, M, y->o_b.p, C);
        for (int i = 0; i < M; i++) rms_norm(h + (size_t)i * C, y->post_norm.p, s->x + (size_t)i * C, C, m->eps);
        u = now_s(); s->t[P_NORM] += u - t;
        t = qgemm(s, s->x, C, M, &y->gate_up, s->gu, 2 * I, 0, u, P_GATE_UP);
        add_bias(s->gu, 2 * I, M, y->gate_up_b.p, 2 * I);
        for (int i = 0; i < M; i++) silu_mul(s->gu + (size_t)i * 2 * I, I, s->act + (size_t)i * I);
        u = now_s(); s->t[P_SILU] += u - t;
        t = qgemm(s, s->act, I, M, &y->down, h, C, 1, u, P_DOWN);
        add_bias(h, C, M, y->down_b.p, C);
    }
    if (n_out == 0) return 0;
    for (int i = 0; i < n_out; i++)
        rms_norm(h + (size_t)out_idx[i] * C, m->final_norm.p, s->x + (size_t)i * C, C, m->eps);
    u = now_s(); s->t[P_NORM] += u - t;
    qgemm(s, s->x, C, n_out, &m->lm_head, logits, m->V, 0, u, P_LM_HEAD);
    return 0;
}

int hs_qgemm(Scratch* s, const Model* m, const QMat* W, int32_t M, hs_f32 x, float* y, int64_t y_len) {
    if (M < 0 || W->K > HS_MAX_K || W->N <= 0 || W->N % 16 || (W->bs != 16 && W->bs != 32) || W->K % W->bs)
        return HS_E_COUNT;
    if ((size_t)W->K > max_k(m)) return HS_E_COUNT;
    if (!W->q || !W->s || !W->d.p || W->q_len != (int64_t)W->N * W->K || W->s_len != (int64_t)W->N * (W->K / W->bs) ||
        W->d.n != W->N)
        return HS_E_MATRIX;
    if (!x.p || !y || x.n != (int64_t)M * W->K || y_len < (int64_t)M * W->N) return HS_E_BUFFER;
    if (scratch_fit(s, m, (size_t)M, 1)) return HS_E_NOMEM;
    hs_quant_rows(x.p, W->K, M, W->K, W->bs, s->xq, s->xs, s->xc);
    hs_gemm(s->xq, s->xs, s->xc, M, W, y, W->N, 0);
    return HS_OK;
}

#include "hs_pack.h"
