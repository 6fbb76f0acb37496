/* arm64 +i8mm: a tile of 4 weight rows x 4 positions as 2 x 2 pairs. smmla multiplies two rows' 8 values by
 * two positions' 8 values into the 4 int32 sums of that pair of pairs (lanes: row 0 with positions 0 and 1,
 * then row 1), so a 32-column block takes 4 smmla per pair of pairs: twice sdot's products per instruction,
 * and the sums land in the lanes their float accumulators keep (no horizontal sum at the end). */
#ifndef LLADA_PAIR_TILES_H
#define LLADA_PAIR_TILES_H

#include "stored_blocks.h"

#if defined(LLK_MMLA)
#define PAIR_TILE 4 /* rows and positions per tile */

/* Two 32-value blocks as smmla's 4 operands: values 8k..8k+7 of `first`, then of `second`. */
static inline void pair_operands(wvec first, wvec second, int8x16_t out[4]) {
  for (int half = 0; half < 2; half++) {
    int64x2_t a = vreinterpretq_s64_s8(first.val[half]), b = vreinterpretq_s64_s8(second.val[half]);
    out[2 * half] = vreinterpretq_s8_s64(vzip1q_s64(a, b));
    out[2 * half + 1] = vreinterpretq_s8_s64(vzip2q_s64(a, b));
  }
}

static inline wvec position_block(const int8_t* values) {
  wvec v = {{vld1q_s8(values), vld1q_s8(values + 16)}};
  return v;
}

/* (first, first, second, second) and (first, second, first, second): the lanes' row and position scales. */
static inline float32x4_t row_pair(float first, float second) {
  float32x4_t v = {first, first, second, second};
  return v;
}
static inline float32x4_t position_pair(float first, float second) {
  float32x4_t v = {first, second, first, second};
  return v;
}

/* Rows o..o+3 of positions r..r+3 (NEON's weights are signed values: no offset to take off the sums). */
static inline __attribute__((always_inline)) void pair_tile(const llk_weights* w, const llk_int8_activations* a,
                                                            float* out, int64_t o, int64_t r, const int bits) {
  int64_t blocks = w->columns / LLK_BLOCK, groups = w->columns / w->group, per_group = w->group / LLK_BLOCK;
  float32x4_t acc[2][2];
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 2; j++) acc[i][j] = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < blocks; b++) {
    int8x16_t rows[2][4], positions[2][4];
    float32x4_t row_scales[2], position_scales[2];
    for (int i = 0; i < 2; i++) {
      int64_t row = o + 2 * i, at = r + 2 * i, group = b / per_group;
      pair_operands(block_weights(w, row, b, bits), block_weights(w, row + 1, b, bits), rows[i]);
      row_scales[i] = row_pair(scale_at(w->scales, row * groups + group, w->scale_bf16),
                               scale_at(w->scales, (row + 1) * groups + group, w->scale_bf16));
      int64_t first = llk_at(a, at, b), second = llk_at(a, at + 1, b);
      pair_operands(position_block(a->values + first * LLK_BLOCK), position_block(a->values + second * LLK_BLOCK),
                    positions[i]);
      position_scales[i] = position_pair(a->scales[first], a->scales[second]);
    }
    for (int i = 0; i < 2; i++)
      for (int j = 0; j < 2; j++) {
        int32x4_t sum = vdupq_n_s32(0);
        for (int k = 0; k < 4; k++) sum = vmmlaq_s32(sum, rows[i][k], positions[j][k]);
        acc[i][j] = vfmaq_f32(acc[i][j], vcvtq_f32_s32(sum), vmulq_f32(row_scales[i], position_scales[j]));
      }
  }
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 2; j++) {
      float lanes[4];
      vst1q_f32(lanes, acc[i][j]);
      for (int k = 0; k < 4; k++) out[(r + 2 * j + (k & 1)) * w->rows + o + 2 * i + (k >> 1)] = lanes[k];
    }
}
#endif

#endif
