/* Activations for the kernels: quantized to int8 per 32-column block (W4A8, W8A8; llama.cpp's Q8_0 rule),
 * or reordered as float (W4A16). A 4-bit block's values go even columns first, then odd: the order of the
 * nibbles the weights' bytes hold. */
#include "kernels.h"

/* Round to nearest, ties to even, for |v| < 2^22, without libm (a freestanding link has none). */
static inline float round_even(float v) {
  const float magic = 12582912.0f; /* 1.5 x 2^23 */
  return v >= 0.0f ? (v + magic) - magic : (v - magic) + magic;
}

static inline int64_t source_column(int64_t j, int32_t nibble_order) {
  return nibble_order ? (j < 16 ? 2 * j : 2 * (j - 16) + 1) : j;
}

void llk_quantize_activations(const float* x, int64_t positions, int64_t columns, int32_t nibble_order,
                              int8_t* values, float* scales, int32_t* sums) {
  int64_t blocks = columns / LLK_BLOCK;
  for (int64_t r = 0; r < positions; r++) {
    for (int64_t b = 0; b < blocks; b++) {
      const float* block = x + r * columns + b * LLK_BLOCK;
      float amax = 0.0f;
      for (int j = 0; j < LLK_BLOCK; j++) {
        float m = block[j] < 0.0f ? -block[j] : block[j];
        amax = m > amax ? m : amax;
      }
      float d = amax / 127.0f;
      float inverse = d > 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = values + r * columns + b * LLK_BLOCK;
      int32_t sum = 0;
      for (int64_t j = 0; j < LLK_BLOCK; j++) {
        q[j] = (int8_t)round_even(block[source_column(j, nibble_order)] * inverse);
        sum += q[j];
      }
      scales[r * blocks + b] = d;
      sums[r * blocks + b] = sum;
    }
  }
}

void llk_order_activations(const float* x, int64_t positions, int64_t columns, float* ordered) {
  for (int64_t r = 0; r < positions; r++)
    for (int64_t c = 0; c < columns; c += LLK_BLOCK)
      for (int64_t j = 0; j < LLK_BLOCK; j++)
        ordered[r * columns + c + j] = x[r * columns + c + source_column(j, 1)];
}
