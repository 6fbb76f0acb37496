/* llada-jax quantized matmul micro-kernels: out[R, O] = x[R, I] @ W[O, I]^T with W stored quantized.
 *
 * Weights, as the checkpoint stores them (compressed-tensors, row-major):
 *   4-bit: bytes [O, I/2], value(o, 2j) = (b & 15) - 8, value(o, 2j+1) = (b >> 4) - 8;
 *   8-bit: bytes [O, I], value = b - 128 (`signed8` = 0) or the byte read as int8 (`signed8` = 1).
 *   Scales [O, I / group] float32 (`scale_bf16` = 0) or bfloat16 (1); group a multiple of 32.
 * Activations enter prepared in blocks of 32 columns (`activations.c`, its own call in the exported program):
 * for 4-bit weights each block's even columns first, then odd (the nibbles' order);
 *   int8 (W4A8, W8A8): per block q = rint(x * (1 / d)), d = max|x| * (1 / 127), and sum(q);
 *   float (W4A16): the values themselves.
 * Both block-major, [I/32, R, 32] (per-block scalars [I/32, R]): block b of every position is contiguous
 * (position-major rows, I bytes or I x 4 bytes apart, fall into the same few cache sets; docs/kernels.md).
 * Kernels write output rows [o_begin, o_end) of every position: callers split O over their threads.
 * No libc: these files link into IREE's dispatch executables as well as the XLA plugin. */
#ifndef LLADA_KERNELS_H
#define LLADA_KERNELS_H

#include <stdint.h>

#define LLK_BLOCK 32

typedef struct {
  const uint8_t* weights;  /* [O, I * bits / 8] */
  const void* scales;      /* [O, I / group] */
  int64_t rows;            /* O */
  int64_t columns;         /* I, a multiple of 32 */
  int64_t group;           /* columns per scale, a multiple of 32 (I for per-channel) */
  int32_t scale_bf16;
  int32_t signed8;
} llk_weights;

typedef struct {
  const int8_t* values;  /* [I/32, total, 32], per block in the weights' order */
  const float* scales;   /* [I/32, total] */
  const int32_t* sums;   /* [I/32, total] */
  int64_t positions;     /* R: the call computes positions [0, R) */
  int64_t total;         /* positions per block: a block's stride */
} llk_int8_activations;

/* Where block b of position p lies in the activations' per-block arrays (its values: that times 32). */
static inline int64_t llk_at(const llk_int8_activations* a, int64_t p, int64_t b) { return b * a->total + p; }

/* Float32 activations as a step holds them, to prepare for the kernels (`activations.c`). */
typedef struct {
  const float* x;        /* [R, I] position-major, or [I, R] feature-major */
  int64_t positions;     /* R */
  int64_t columns;       /* I, a multiple of 32 */
  int32_t feature_major;
  int32_t nibbles;       /* for 4-bit weights: each block's even columns first */
} llk_float_input;

/* Blocks [b_begin, b_end) of every position: float ones [I/32, R, 32], or int8 ones with their scales and sums
 * (`llk_int8_activations` with total = R). Callers split the blocks over their threads. */
void llk_float_blocks(const llk_float_input* in, float* blocks, int64_t b_begin, int64_t b_end);
void llk_int8_blocks(const llk_float_input* in, int8_t* values, float* scales, int32_t* sums, int64_t b_begin,
                     int64_t b_end);

/* Which instructions this build's kernels use (a static string naming the ISA path). */
const char* llk_isa(void);

void llk_w4a8(const llk_weights* w, const llk_int8_activations* a, float* out, int64_t o_begin, int64_t o_end);
void llk_w8a8(const llk_weights* w, const llk_int8_activations* a, float* out, int64_t o_begin, int64_t o_end);
/* `blocks` [I/32, total, 32]; the call computes its first `positions` positions. */
void llk_w4a16(const llk_weights* w, const float* blocks, int64_t positions, int64_t total, float* out,
               int64_t o_begin, int64_t o_end);

/* A sparse MoE's experts stacked (`routed.c`): `w` describes expert 0's matrix, the next expert's follows it (its
 * weights and its scales each); the activations' and out's rows [starts[e], starts[e + 1]) are expert e's. */
void llk_routed_int8(const llk_weights* w, int64_t bits, const int32_t* starts, int64_t experts,
                     const llk_int8_activations* a, float* out, int64_t o_begin, int64_t o_end);
void llk_routed_w4a16(const llk_weights* w, const int32_t* starts, int64_t experts, const float* blocks,
                      int64_t positions, float* out, int64_t o_begin, int64_t o_end);

#endif
