/* The kernels' activations (`kernels.h`) from float32 x, one pass over memory: the gather into blocks, the
 * 4-bit weights' column order, the transpose to block-major and the int8 quantization, which the compilers'
 * own code ran at a fraction of memory speed (docs/kernels.md). Both XLA and IREE bundles call it, so they
 * hand the kernels the same values. */
#include "kernels.h"

#define TILE 16 /* positions gathered at once */
/* Adding then subtracting 1.5 x 2^23 rounds a float of magnitude below 2^22 to an integer, half to even (rint,
 * without libm). */
#define RINT_SHIFT 12582912.0f

typedef union {
  float f;
  uint32_t u;
} float_bits;

/* Where column k of a block goes: the 4-bit weights' order puts a block's even columns first. */
static inline int64_t slot(int64_t k, int32_t nibbles) { return nibbles ? (k & 1) * (LLK_BLOCK / 2) + (k >> 1) : k; }

/* Block b of positions [p, p + n) in the kernels' column order. */
static void gather(const llk_float_input* in, int64_t b, int64_t p, int64_t n, float tile[TILE][LLK_BLOCK]) {
  const float* x = in->x + (in->feature_major ? b * LLK_BLOCK * in->positions + p : p * in->columns + b * LLK_BLOCK);
  if (in->feature_major) { /* column k of the block is a row of x: contiguous in positions */
    for (int64_t k = 0; k < LLK_BLOCK; k++)
      for (int64_t j = 0; j < n; j++) tile[j][slot(k, in->nibbles)] = x[k * in->positions + j];
  } else {
    for (int64_t j = 0; j < n; j++)
      for (int64_t k = 0; k < LLK_BLOCK; k++) tile[j][slot(k, in->nibbles)] = x[j * in->columns + k];
  }
}

/* q = rint(v x inverse) with d = max|v| x float32(1 / 127), inverse = 1 / d where d > 0 and that is finite,
 * else 0 (then every q is 0); the block's scale d and sum of q. */
static void quantize(const float v[LLK_BLOCK], int8_t* q, float* scale, int32_t* sum) {
  uint32_t top = 0; /* max |v| by its bits, which order non-negative floats (a NaN above them all) */
  for (int64_t k = 0; k < LLK_BLOCK; k++) {
    float_bits c = {v[k]};
    uint32_t magnitude = c.u & 0x7fffffffu;
    top = magnitude > top ? magnitude : top;
  }
  float_bits largest = {.u = top};
  float d = largest.f * (1.0f / 127.0f), inverse = d > 0 ? 1.0f / d : 0.0f;
  if (!(inverse <= 3.4028235e38f)) inverse = 0.0f;
  int32_t total = 0;
  for (int64_t k = 0; k < LLK_BLOCK; k++) {
    float product = v[k] * inverse; /* its own statement: rounded to float32 before the rint, never an FMA */
    float shifted = product + RINT_SHIFT;
    q[k] = inverse > 0 ? (int8_t)(int32_t)(shifted - RINT_SHIFT) : 0;
    total += q[k];
  }
  *scale = d;
  *sum = total;
}

/* Visits every (block, tile of positions) of blocks [b_begin, b_end): position-major x a run of RUN blocks per
 * tile, so the reads advance along RUN x 128 contiguous bytes of each of TILE rows (one block per tile read
 * 160 rows at a time, I x 4 bytes apart, more streams than a core prefetches); feature-major x one block per
 * pass, its 32 rows read along the positions. */
#define RUN 16
#define EACH_TILE(in, b_begin, b_end, body)                                                      \
  for (int64_t first = b_begin, run = (in)->feature_major ? 1 : RUN; first < b_end; first += run) \
    for (int64_t p = 0; p < (in)->positions; p += TILE)                                          \
      for (int64_t b = first, n = (in)->positions - p < TILE ? (in)->positions - p : TILE;        \
           b < first + run && b < b_end; b++) {                                                  \
        body                                                                                     \
      }

void llk_float_blocks(const llk_float_input* in, float* blocks, int64_t b_begin, int64_t b_end) {
  float tile[TILE][LLK_BLOCK];
  EACH_TILE(in, b_begin, b_end, {
    gather(in, b, p, n, tile);
    float* out = blocks + (b * in->positions + p) * LLK_BLOCK;
    for (int64_t j = 0; j < n; j++)
      for (int64_t k = 0; k < LLK_BLOCK; k++) out[j * LLK_BLOCK + k] = tile[j][k];
  })
}

void llk_int8_blocks(const llk_float_input* in, int8_t* values, float* scales, int32_t* sums, int64_t b_begin,
                     int64_t b_end) {
  float tile[TILE][LLK_BLOCK];
  EACH_TILE(in, b_begin, b_end, {
    gather(in, b, p, n, tile);
    for (int64_t j = 0, at = b * in->positions + p; j < n; j++, at++)
      quantize(tile[j], values + at * LLK_BLOCK, scales + at, sums + at);
  })
}
