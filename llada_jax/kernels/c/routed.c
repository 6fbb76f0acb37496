/* A sparse MoE's routed products (llama.cpp's `mul_mat_id`): the experts' matrices stacked, the routed rows
 * sorted by expert, each expert's kernel run on its own run of rows. One call per matrix kind and layer, so a
 * compiled program holds no loop over experts and never copies an expert's weights out of the stack. */
#include "kernels.h"

/* Expert e's matrix: `w` describes expert 0's, the stack holds E alike, back to back. */
static llk_weights expert(const llk_weights* w, int64_t bits, int64_t e) {
  llk_weights x = *w;
  int64_t scale_bytes = w->scale_bf16 ? 2 : 4;
  x.weights = w->weights + e * (w->rows * w->columns * bits / 8);
  x.scales = (const char*)w->scales + e * (w->rows * (w->columns / w->group) * scale_bytes);
  return x;
}

void llk_routed_int8(const llk_weights* w, int64_t bits, const int32_t* starts, int64_t experts,
                     const llk_int8_activations* a, float* out, int64_t o_begin, int64_t o_end) {
  for (int64_t e = 0; e < experts; e++) {
    int64_t first = starts[e], count = starts[e + 1] - starts[e];
    if (count <= 0) continue;
    llk_weights x = expert(w, bits, e);
    llk_int8_activations rows = {a->values + first * LLK_BLOCK, a->scales + first, a->sums + first, count, a->total};
    if (bits == 4)
      llk_w4a8(&x, &rows, out + first * w->rows, o_begin, o_end);
    else
      llk_w8a8(&x, &rows, out + first * w->rows, o_begin, o_end);
  }
}

void llk_routed_w4a16(const llk_weights* w, const int32_t* starts, int64_t experts, const float* blocks,
                      int64_t positions, float* out, int64_t o_begin, int64_t o_end) {
  for (int64_t e = 0; e < experts; e++) {
    int64_t first = starts[e], count = starts[e + 1] - starts[e];
    if (count <= 0) continue;
    llk_weights x = expert(w, 4, e);
    llk_w4a16(&x, blocks + first * LLK_BLOCK, count, positions, out + first * w->rows, o_begin, o_end);
  }
}
