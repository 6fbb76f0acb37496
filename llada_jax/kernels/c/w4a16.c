/* W4A16: 4-bit group-wise weights x float activations, each weight dequantized in registers to exactly
 * its float32 value (v - 8) x scale; float32 products and sums. The accuracy reference for W4A8. */
#include "kernels.h"
#include "row_lanes.h"
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

#if defined(LLK_ROW_LANES) && LANES == 16
/* 16 weight rows in the lanes of a register (`row_lanes.h`): per block each row's 4-byte groups are gathered,
 * and 8 columns at a time become 16-row float vectors, each multiplied by one broadcast activation for every
 * position of a chunk of 16, whose accumulators stay in registers. */
#define CHUNK 16

ALWAYS_INLINE void float_lanes(const llk_weights* w, const float* x, float* out, int64_t row, int64_t p0,
                               const int nc) {
  int64_t columns = w->columns, stride = columns / 2;
  const __m512i low4 = _mm512_set1_epi32(15);
  __m512 acc[CHUNK];
  for (int p = 0; p < nc; p++) acc[p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < columns / LLK_BLOCK; b++) {
    __m512 scale = lane_scales(w, row, b * LLK_BLOCK / w->group);
    __m512 minus8scale = _mm512_mul_ps(scale, _mm512_set1_ps(-8.0f));
    const uint8_t* base = w->weights + row * stride + b * (LLK_BLOCK / 2);
    for (int q = 0; q < 4; q++) { /* block-order columns 8q..8q+7: low nibbles of bytes 0-15, then high */
      __m512 wf[8];
      for (int half = 0; half < 2; half++) {
        __m512i raw = lane_gather(base + 8 * (q & 1) + 4 * half, stride);
        for (int t = 0; t < 4; t++) {
          __m512i v = _mm512_and_si512(_mm512_srli_epi32(raw, 8 * t + (q >= 2 ? 4 : 0)), low4);
          wf[4 * half + t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), scale, minus8scale);
        }
      }
      const float* xq = x + p0 * columns + b * LLK_BLOCK + 8 * q;
      for (int p = 0; p < nc; p++)
        for (int k = 0; k < 8; k++) acc[p] = _mm512_fmadd_ps(wf[k], _mm512_set1_ps(xq[p * columns + k]), acc[p]);
    }
  }
  for (int p = 0; p < nc; p++) _mm512_storeu_ps(out + (p0 + p) * w->rows + row, acc[p]);
}

/* Rows [o_begin, o_begin + 16k) in lanes; returns where they end. */
static int64_t lanes_w4a16(const llk_weights* w, const float* x, int64_t positions, float* out, int64_t o_begin,
                           int64_t o_end) {
  int64_t end = o_begin + (o_end - o_begin) / LANES * LANES, whole = positions / CHUNK * CHUNK;
  for (int64_t row = o_begin; row < end; row += LANES) {
    for (int64_t p = 0; p < whole; p += CHUNK) float_lanes(w, x, out, row, p, CHUNK);
    for (int64_t p = whole; p < positions; p++) float_lanes(w, x, out, row, p, 1);
  }
  return end;
}
#endif

void llk_w4a16(const llk_weights* w, const float* ordered, int64_t positions, float* out, int64_t o_begin,
               int64_t o_end) {
#if defined(LLK_ROW_LANES) && LANES == 16
  o_begin = lanes_w4a16(w, ordered, positions, out, o_begin, o_end);
#endif
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
