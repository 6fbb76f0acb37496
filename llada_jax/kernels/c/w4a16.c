/* W4A16: 4-bit group-wise weights x float activations, each weight dequantized in registers to exactly
 * its float32 value (v - 8) x scale; float32 products and sums. The accuracy reference for W4A8. */
#include "kernels.h"
#include "simd.h"

#if defined(LLK_X86) && !defined(__AVX512VL__)
#define TILE_ROWS 2
#else
#define TILE_ROWS 4
#endif
#define TILE_POSITIONS 4
#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE void float_tile(const llk_weights* w, const float* x, float* out, int64_t o, int64_t r,
                              const int nr, const int nc) {
  int64_t columns = w->columns, groups = w->columns / w->group;
  fvec acc[TILE_ROWS][TILE_POSITIONS];
  for (int i = 0; i < nr; i++)
    for (int j = 0; j < nc; j++) acc[i][j] = fzero();
  for (int64_t b = 0; b < columns / LLK_BLOCK; b++) {
    fvec scale[TILE_ROWS], minus8scale[TILE_ROWS];
    for (int i = 0; i < nr; i++) {
      float s = scale_at(w->scales, (o + i) * groups + b * LLK_BLOCK / w->group, w->scale_bf16);
      scale[i] = fsplat(s);
      minus8scale[i] = fsplat(-8.0f * s);
    }
    for (int k = 0; k < LLK_BLOCK / FLANES; k++) {
      fvec wf[TILE_ROWS];
      for (int i = 0; i < nr; i++)
        wf[i] = nibble_floats(w->weights + (o + i) * (columns / 2) + b * (LLK_BLOCK / 2), k, scale[i],
                              minus8scale[i]);
      for (int j = 0; j < nc; j++) {
        fvec xv = floadu(x + (r + j) * columns + b * LLK_BLOCK + k * FLANES);
        for (int i = 0; i < nr; i++) acc[i][j] = fmadd(wf[i], xv, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < nr; i++)
    for (int j = 0; j < nc; j++) out[(r + j) * w->rows + o + i] = hsum(acc[i][j]);
}

void llk_w4a16(const llk_weights* w, const float* ordered, int64_t positions, float* out, int64_t o_begin,
               int64_t o_end) {
  int64_t whole_rows = o_begin + (o_end - o_begin) / TILE_ROWS * TILE_ROWS;
  int64_t whole_positions = positions / TILE_POSITIONS * TILE_POSITIONS;
  for (int64_t o = o_begin; o < whole_rows; o += TILE_ROWS) {
    for (int64_t r = 0; r < whole_positions; r += TILE_POSITIONS)
      float_tile(w, ordered, out, o, r, TILE_ROWS, TILE_POSITIONS);
    for (int64_t r = whole_positions; r < positions; r++) float_tile(w, ordered, out, o, r, TILE_ROWS, 1);
  }
  for (int64_t o = whole_rows; o < o_end; o++) {
    for (int64_t r = 0; r < whole_positions; r += TILE_POSITIONS)
      float_tile(w, ordered, out, o, r, 1, TILE_POSITIONS);
    for (int64_t r = whole_positions; r < positions; r++) float_tile(w, ordered, out, o, r, 1, 1);
  }
}
