/* hs_engine.h: the native engine's C interface, the one definition of its structs and calls. hs_engine.c is
   compiled against it and engines/native.py builds its binding from it (cffi reads the part between the cdef
   markers), so no struct layout is written twice.

   Every buffer travels with its length in elements (hs_f32, hs_i32, ... and the *_len fields), and the engine
   checks each one against the shape the model or the call implies before it touches memory: a buffer of the wrong
   size at a new model size is a negative return code with a name (hs_error), never a read or write past its end.

   Lifecycle: hs_model_check once per hs_model (the binding refuses a model it fails), hs_scratch_new per thread
   of calls, hs_forward / hs_qgemm any number of times on that scratch, hs_scratch_free. Calls on one scratch
   must not overlap; the model is read-only and can be shared. */
#ifndef HS_ENGINE_H
#define HS_ENGINE_H
#include <stddef.h>
#include <stdint.h>

/* cdef begin (plain declarations only: no #if, no macros other than integer constants) */
#define HS_ABI 6

/* a buffer and its length in elements */
typedef struct { const float* p; int64_t n; } hs_f32;
typedef struct { const int32_t* p; int64_t n; } hs_i32;
typedef struct { const int64_t* p; int64_t n; } hs_i64;

/* One INT8 matrix W [N, K] (hs_gemm.h has the packed layout and the math) */
typedef struct {
    const uint8_t* q; int64_t q_len; /* [N/16][K/4][16][4] = N * K bytes */
    const uint8_t* s; int64_t s_len; /* [N/16][K/bs][16] = N * K / bs bytes */
    hs_f32 d;                        /* [N] row scales */
    int32_t N, K, bs, pad_;
} hs_qmat;

typedef struct {
    hs_f32 in_norm, post_norm; /* [C] each */
    hs_qmat qkv, o, gate_up, down;
    /* biases added after each GEMM (p NULL: none): [qkv N], [C], [2 I], [C] */
    hs_f32 qkv_b, o_b, gate_up_b, down_b;
    int32_t window; /* attend to the last `window` positions, the token's own included; 0: all */
    int32_t pad_;
} hs_layer;

typedef struct {
    int32_t L, C, H, KVH, D, I, V, max_pos;
    float eps;
    int32_t pad_;
    hs_f32 embed;              /* [V, C] */
    hs_f32 final_norm;         /* [C] */
    hs_f32 rope_cos, rope_sin; /* [max_pos, D / 2] each */
    hs_qmat lm_head;           /* [V, C] */
    const hs_layer* layers;
    int64_t n_layers; /* == L */
} hs_model;

/* One hs_forward call: token t (of n = ids.n) is at position pos.p[t] of sequence row.p[t]; its K/V are written
   there and it attends to positions 0..pos of that sequence (the last `window` of them in a sliding-window
   layer), so a sequence's earlier positions must hold KV already or be tokens of this call. Sequence r (of
   n_rows) keeps KV element (layer l, kv head g, position p, d) at kv_k[r][l * lstride[r] + (g * cap[r] + p) * D
   + d] (and kv_v alike), fp32 or fp16 (kv16); kv_len[r] is how many elements its buffers hold from those
   pointers. Logits of the tokens out_idx go to logits [out_idx.n, V]. */
typedef struct {
    hs_i64 ids;
    hs_i32 pos, row; /* ids.n each */
    int32_t n_rows, kv16;
    void* const* kv_k;
    void* const* kv_v;
    const int64_t* lstride;
    const int32_t* cap;
    const int64_t* kv_len; /* the five above: n_rows each */
    hs_i32 out_idx;
    float* logits;
    int64_t logits_len; /* >= out_idx.n * V */
} hs_batch;

typedef struct hs_scratch hs_scratch;

/* return codes: 0, or one of these (hs_error names them) */
enum {
    HS_OK = 0,
    HS_E_POSITION = -1,  /* a position outside [0, cap) of its sequence or [0, max_pos) */
    HS_E_TOKEN = -2,     /* a token id outside [0, V) */
    HS_E_NOMEM = -3,     /* scratch allocation failed */
    HS_E_OUT_INDEX = -4, /* an out_idx outside [0, ids.n) */
    HS_E_ROW = -5,       /* a row outside [0, n_rows) */
    HS_E_COUNT = -6,     /* a negative count, or arrays of one call whose lengths disagree */
    HS_E_BUFFER = -7,    /* a buffer shorter than its shape needs (KV, logits, x, y) or a NULL one */
    HS_E_SHAPE = -8,     /* model dims this build cannot run (head_dim, group, vector width) */
    HS_E_MATRIX = -9,    /* a layer matrix or bias whose shape, block size or length is wrong */
    HS_E_TENSOR = -10    /* embeddings, norms, RoPE tables, lm_head or the layer array missing or misshaped */
};

int hs_abi(void);
const char* hs_error(int code);
/* HS_OK when this build runs the model and every buffer has the length its shape needs */
int hs_model_check(const hs_model* m);
hs_scratch* hs_scratch_new(void);
void hs_scratch_free(hs_scratch* s);
/* seconds per section of hs_forward summed since the last read, into out [n] (n >= the count returned); resets */
int hs_profile(hs_scratch* s, double* out, int n);
int hs_forward(const hs_model* m, hs_scratch* s, const hs_batch* b);
/* y [M, W.N] = x W^T for a float x [M, W.K]: the GEMM alone (activation quantization included), for unit tests */
int hs_qgemm(hs_scratch* s, const hs_model* m, const hs_qmat* W, int32_t M, hs_f32 x, float* y, int64_t y_len);
/* Pack rows of a float32 matrix w [N, K] into an hs_qmat's q / s / d (the scheme: engines/native.py
   quantize_matrix, whose numpy arithmetic this repeats step for step in float32, so either writes the same bytes).
   Rows n0..n1 only (n0, n1 multiples of 16), so threads can share a matrix. HS_E_MATRIX: N not a multiple of 16, K
   not of bs, or bs outside 1..128; HS_E_BUFFER: a buffer shorter than the whole matrix needs. */
int hs_pack_rows(hs_f32 w, int32_t N, int32_t K, int32_t bs, int32_t n0, int32_t n1, uint8_t* q, int64_t q_len,
                 uint8_t* s, int64_t s_len, float* d, int64_t d_len);
/* cdef end */

#endif
