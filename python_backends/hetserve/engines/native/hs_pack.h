/* hs_pack_rows (hs_engine.h): the build's INT8 packing in C, 10x+ numpy's speed at a 1B model.

   It must write the bytes numpy's quantize_matrix writes (engines/native.py; tests/test_native.py compares them),
   so every step is the same float32 operation in the same order: no FMA contraction (the pragma below), and the
   squared error of a block summed the way numpy's add.reduce sums a contiguous row (pairwise: 8 partial sums, then
   the tail). Included once, from hs_engine.c. */
#include <math.h>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

/* numpy's float32 pairwise sum of n <= 128 contiguous values (numpy/_core/src/umath/loops_utils.h.src) */
static float np_sum(const float* a, int n) {
    if (n < 8) {
        float r = 0.0f;  /* numpy starts from -0.0 only for n == 0; a sum of squares is never -0 */
        for (int i = 0; i < n; i++) r += a[i];
        return r;
    }
    float r[8];
    for (int j = 0; j < 8; j++) r[j] = a[j];
    int i = 8;
    for (; i < n - n % 8; i += 8)
        for (int j = 0; j < 8; j++) r[j] += a[i + j];
    float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; i++) res += a[i];
    return res;
}

static inline float clampf(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

int hs_pack_rows(hs_f32 w, int32_t N, int32_t K, int32_t bs, int32_t n0, int32_t n1, uint8_t* q, int64_t q_len,
                 uint8_t* s, int64_t s_len, float* d, int64_t d_len) {
    if (N <= 0 || K <= 0 || N % 16 || bs < 1 || bs > 128 || K % bs || n0 < 0 || n1 > N || n0 > n1 || n0 % 16 ||
        n1 % 16)
        return HS_E_MATRIX;
    const int nb = K / bs;
    if (!w.p || !q || !s || !d || w.n != (int64_t)N * K || q_len < (int64_t)N * K || s_len < (int64_t)N * nb ||
        d_len < N)
        return HS_E_BUFFER;
    float sq[128], qv[128];
    int8_t best_q[128];
    for (int n = n0; n < n1; n++) {
        const float* row = w.p + (size_t)n * K;
        float dmax = 0.0f;  /* the row's largest block absmax = its largest |w| */
        for (int k = 0; k < K; k++) dmax = fmaxf(dmax, fabsf(row[k]));
        const float dn = dmax / (127.0f * 255.0f);
        const float dsafe = dn > 0.0f ? dn : 1.0f;
        d[n] = dn;
        uint8_t* qrow = q + (size_t)(n / 16) * K * 16 + (n % 16) * 4;  /* [N/16][K/4][16][4] */
        uint8_t* srow = s + (size_t)(n / 16) * nb * 16 + (n % 16);      /* [N/16][K/bs][16] */
        for (int b = 0; b < nb; b++) {
            const float* x = row + b * bs;
            float amax = 0.0f;
            for (int i = 0; i < bs; i++) amax = fmaxf(amax, fabsf(x[i]));
            const float ideal = amax / 127.0f / dsafe;
            float best_e = 0.0f, best_u = 0.0f;
            for (int c = 0; c < 3; c++) {  /* ceil, floor, nearest: numpy's order, first best wins */
                float r = c == 0 ? ceilf(ideal) : (c == 1 ? floorf(ideal) : rintf(ideal));
                float u = amax > 0.0f ? clampf(r, 1.0f, 255.0f) : 0.0f;
                float sc = u * dn;
                float div = sc > 0.0f ? sc : 1.0f;
                for (int i = 0; i < bs; i++) {
                    qv[i] = clampf(rintf(x[i] / div), -127.0f, 127.0f);
                    float t = qv[i] * sc - x[i];
                    sq[i] = t * t;
                }
                float e = np_sum(sq, bs);
                if (c == 0 || e < best_e) {
                    best_e = e;
                    best_u = u;
                    for (int i = 0; i < bs; i++) best_q[i] = (int8_t)qv[i];
                }
            }
            srow[(size_t)b * 16] = (uint8_t)best_u;
            for (int i = 0; i < bs; i++) {
                int k = b * bs + i;
                qrow[(size_t)(k / 4) * 64 + k % 4] = (uint8_t)(best_q[i] + 128);
            }
        }
    }
    return HS_OK;
}

#pragma GCC pop_options
