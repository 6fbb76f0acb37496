/* The int8 x int8 tile loop shared by W4A8 and W8A8: a tile of NR weight rows x NC positions keeps its
 * NR x NC float accumulators in registers over the whole sum; per 32-column block each row's weights are
 * unpacked once and each position's int8 values loaded once. */
#ifndef LLADA_INT8_MATMUL_H
#define LLADA_INT8_MATMUL_H

#include "kernels.h"
#include "pair_tiles.h"
#include "row_lanes.h"
#include "simd.h"
#include "stored_blocks.h"

#if defined(LLK_X86) && !defined(__AVX512VL__)
#define TILE_ROWS 2 /* AVX2 has 16 vector registers */
#else
#define TILE_ROWS 4
#endif
#define TILE_POSITIONS 4
#if defined(LLK_MMLA)
_Static_assert(TILE_ROWS == PAIR_TILE && TILE_POSITIONS == PAIR_TILE, "a pair tile is a whole tile");
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE void int8_tile(const llk_weights* w, const llk_int8_activations* a, float* out, int64_t o,
                             int64_t r, const int nr, const int nc, const int bits) {
  const int offset = bits == 4 ? W4_OFFSET : W8_OFFSET;
  int64_t blocks = w->columns / LLK_BLOCK, groups = w->columns / w->group, per_group = w->group / LLK_BLOCK;
  fvec acc[TILE_ROWS][TILE_POSITIONS];
  for (int i = 0; i < nr; i++)
    for (int j = 0; j < nc; j++) acc[i][j] = fzero();
  for (int64_t b = 0; b < blocks; b++) {
    wvec wv[TILE_ROWS];
    fvec ws[TILE_ROWS];
    for (int i = 0; i < nr; i++) {
      wv[i] = block_weights(w, o + i, b, bits);
      ws[i] = fsplat(scale_at(w->scales, (o + i) * groups + b / per_group, w->scale_bf16));
    }
    for (int j = 0; j < nc; j++) {
      int64_t at = llk_at(a, r + j, b);
      const int8_t* values = a->values + at * LLK_BLOCK;
      ivec init = init_lane(-offset * a->sums[at]);
      fvec as = fsplat(a->scales[at]);
      for (int i = 0; i < nr; i++) {
        ivec sum = bits == 4 ? dot4(init, wv[i], values) : dot8(init, wv[i], values);
        acc[i][j] = fmadd(fmul(ifloat(sum), as), ws[i], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < nr; i++)
    for (int j = 0; j < nc; j++) out[(r + j) * w->rows + o + i] = hsum(acc[i][j]);
}

/* Rows [o_begin, o_end) of every position: in lanes where the ISA has them (`row_lanes.h`), else in whole
 * tiles (of pairs with smmla, `pair_tiles.h`); then the rows' and positions' remainders. */
ALWAYS_INLINE void int8_matmul(const llk_weights* w, const llk_int8_activations* a, float* out,
                               int64_t o_begin, int64_t o_end, const int bits) {
#if defined(LLK_ROW_LANES)
  o_begin = lanes_matmul(w, a, out, o_begin, o_end, bits);
#endif
  int64_t whole_rows = o_begin + (o_end - o_begin) / TILE_ROWS * TILE_ROWS;
  int64_t whole_positions = a->positions / TILE_POSITIONS * TILE_POSITIONS;
  for (int64_t o = o_begin; o < whole_rows; o += TILE_ROWS) {
    for (int64_t r = 0; r < whole_positions; r += TILE_POSITIONS)
#if defined(LLK_MMLA)
      pair_tile(w, a, out, o, r, bits);
#else
      int8_tile(w, a, out, o, r, TILE_ROWS, TILE_POSITIONS, bits);
#endif
    for (int64_t r = whole_positions; r < a->positions; r++) int8_tile(w, a, out, o, r, TILE_ROWS, 1, bits);
  }
  for (int64_t o = whole_rows; o < o_end; o++) {
    for (int64_t r = 0; r < whole_positions; r += TILE_POSITIONS)
      int8_tile(w, a, out, o, r, 1, TILE_POSITIONS, bits);
    for (int64_t r = whole_positions; r < a->positions; r++) int8_tile(w, a, out, o, r, 1, 1, bits);
  }
}

#endif
