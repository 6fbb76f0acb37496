/* W4A8: 4-bit group-wise weights x int8 activations (the Q4_0 x Q8_0 scheme), int32 sums per 32-column
 * block, scaled once per block. */
#include "int8_matmul.h"

const char* llk_isa(void) { return LLK_ISA; }

void llk_w4a8(const llk_weights* w, const llk_int8_activations* a, float* out, int64_t o_begin, int64_t o_end) {
  int8_matmul(w, a, out, o_begin, o_end, 4);
}
