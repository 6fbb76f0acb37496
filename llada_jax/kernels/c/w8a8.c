/* W8A8: 8-bit weights (per channel or group-wise) x int8 activations, int32 sums per 32-column block. */
#include "int8_matmul.h"

void llk_w8a8(const llk_weights* w, const llk_int8_activations* a, float* out, int64_t o_begin, int64_t o_end) {
  int8_matmul(w, a, out, o_begin, o_end, 8);
}
