/* AVX-512 VNNI: 16 weight rows in the 16 lanes of a register. Per 32-column block, each row's 4-byte groups are
 * gathered so that lane k holds row k's; every position's 4 activation bytes are then broadcast to all lanes,
 * and one vpdpbusd does 64 multiply-adds (16 rows x 4). The block's int32 sums land one per lane, so its scales
 * apply as one vector of 16 row scales (times the position's), not per row. Positions go in chunks whose float
 * accumulators stay in L1. Weights stay as stored: no repacked copy. */
#ifndef LLADA_ROW_LANES_H
#define LLADA_ROW_LANES_H

#include "kernels.h"
#include "simd.h"

#if defined(LLK_DPBUSD) && defined(__AVX512F__) && defined(__AVX512BW__)
#define LLK_ROW_LANES 1
#define LANES 16
#define POSITION_CHUNK 64

static inline __m512 lane_scales(const llk_weights* w, int64_t row, int64_t group) {
  int64_t groups = w->columns / w->group;
  float scales[LANES];
  for (int k = 0; k < LANES; k++) scales[k] = scale_at(w->scales, (row + k) * groups + group, w->scale_bf16);
  return _mm512_loadu_ps(scales);
}

/* The block's weights of rows row..row+15, as 4-byte groups, lane k = row k: 4-bit weights give 8 registers
 * (the low nibbles of byte groups 0-3, the even columns, then the high nibbles, the odd ones), 8-bit ones 8
 * (byte groups 0-7, unsigned: offset 128 as stored, or signed ones flipped). */
static inline void lane_weights(const llk_weights* w, int64_t row, int64_t block, int bits, __m512i out[8]) {
  int64_t stride = w->columns * bits / 8;
  __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                       _mm512_set1_epi32((int)stride));
  const uint8_t* base = w->weights + row * stride + block * (LLK_BLOCK * bits / 8);
  if (bits == 4) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
      __m512i raw = _mm512_i32gather_epi32(offsets, base + 4 * j, 1);
      out[j] = _mm512_and_si512(raw, low4);
      out[4 + j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
    }
    return;
  }
  __m512i flip = _mm512_set1_epi8(w->signed8 ? (char)0x80 : 0);
  for (int j = 0; j < 8; j++) out[j] = _mm512_xor_si512(_mm512_i32gather_epi32(offsets, base + 4 * j, 1), flip);
}

static inline __m512i broadcast4(const int8_t* bytes) {
  int32_t v;
  __builtin_memcpy(&v, bytes, 4);
  return _mm512_set1_epi32(v);
}

/* Rows [row, row + 16) of positions [p0, p1) (at most POSITION_CHUNK). Register j of the block's weights meets
 * the position's activation bytes 4j..4j+3: the block order (4-bit: even columns, then odd) makes them match. */
static inline __attribute__((always_inline)) void lane_chunk(const llk_weights* w, const llk_int8_activations* a,
                                                             float* out, int64_t row, int64_t p0, int64_t p1,
                                                             const int bits) {
  const int32_t offset = bits == 4 ? 8 : 128;
  int64_t blocks = w->columns / LLK_BLOCK, per_group = w->group / LLK_BLOCK;
  __m512 acc[POSITION_CHUNK];
  for (int64_t p = p0; p < p1; p++) acc[p - p0] = _mm512_setzero_ps();
  __m512 scales = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    __m512i wv[8];
    lane_weights(w, row, b, bits, wv);
    if (b % per_group == 0) scales = lane_scales(w, row, b / per_group);
    for (int64_t p = p0; p < p1; p++) {
      const int8_t* values = a->values + p * w->columns + b * LLK_BLOCK;
      __m512i sum = _mm512_set1_epi32(-offset * a->sums[p * blocks + b]);
      for (int j = 0; j < 8; j++) sum = _mm512_dpbusd_epi32(sum, wv[j], broadcast4(values + 4 * j));
      __m512 scale = _mm512_mul_ps(scales, _mm512_set1_ps(a->scales[p * blocks + b]));
      acc[p - p0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[p - p0]);
    }
  }
  for (int64_t p = p0; p < p1; p++) _mm512_storeu_ps(out + p * w->rows + row, acc[p - p0]);
}

/* Rows [o_begin, o_begin + 16k) in lanes; returns where they end (the rest is left to the caller). */
static inline __attribute__((always_inline)) int64_t lanes_matmul(const llk_weights* w,
                                                                  const llk_int8_activations* a, float* out,
                                                                  int64_t o_begin, int64_t o_end, const int bits) {
  int64_t end = o_begin + (o_end - o_begin) / LANES * LANES;
  for (int64_t row = o_begin; row < end; row += LANES)
    for (int64_t p = 0; p < a->positions; p += POSITION_CHUNK)
      lane_chunk(w, a, out, row, p, p + POSITION_CHUNK < a->positions ? p + POSITION_CHUNK : a->positions, bits);
  return end;
}
#endif

#endif
