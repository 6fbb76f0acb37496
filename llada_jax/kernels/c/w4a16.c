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

ALWAYS_INLINE void float_tile(const llk_weights* w, const float* x, int64_t total, float* out, int64_t o,
                              int64_t r, const int nr, const int nc) {
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
        fvec xv = floadu(x + (b * total + r + j) * LLK_BLOCK + k * FLANES);
        for (int i = 0; i < nr; i++) acc[i][j] = fmadd(wf[i], xv, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < nr; i++)
    for (int j = 0; j < nc; j++) out[(r + j) * w->rows + o + i] = hsum(acc[i][j]);
}

#if defined(LLK_FLOAT_LANES)
/* Weight rows in the lanes of registers (`row_lanes.h`), ROW_VECTORS x LANES of them: per block the rows'
 * 4-byte groups are gathered and dequantized once into 32 column vectors each, which every position of a chunk
 * then multiplies by its broadcast values. The chunk's accumulators stay in L1 and come into registers GROUP
 * positions at a time (independent FMA chains; each broadcast feeds ROW_VECTORS FMAs), and the dequantization is
 * paid once per chunk of positions, not per register tile. */
#define ROW_VECTORS 2
/* Positions per register tile: 16 registers (AVX2) hold 6 x 2 accumulators beside the 2 weight vectors and the
 * broadcast (half of them, 8 FMA chains, are too few for two FMA pipes of 4-cycle latency); 32 hold 8 x 2. */
#define GROUP (LANE_REGISTERS == 16 ? 6 : 8)
#define CHUNK (16384 / (ROWS * 4)) /* positions whose accumulators take 16 KB of L1 */
#define ROWS (ROW_VECTORS * LANES)

/* Rows row..row+LANES-1 of block b as exact float32 (v - 8) x scale: block-order column 4g + t is the low
 * nibble of byte 4g + t, column 16 + 4g + t its high nibble. */
ALWAYS_INLINE void dequantized_block(const llk_weights* w, int64_t row, int64_t b, lane_floats out[LLK_BLOCK]) {
  int64_t stride = w->columns / 2;
  lane_floats scale = lane_scales(w, row, b * LLK_BLOCK / w->group), minus8scale = lane_mul(scale, lane_splat(-8));
  for (int g = 0; g < 4; g++) {
    lane_ints raw = lane_gather(w->weights + row * stride + b * (LLK_BLOCK / 2) + 4 * g, stride);
    for (int t = 0; t < 4; t++) {
      out[4 * g + t] = lane_fmadd(lane_nibble(raw, 8 * t), scale, minus8scale);
      out[16 + 4 * g + t] = lane_fmadd(lane_nibble(raw, 8 * t + 4), scale, minus8scale);
    }
  }
}

/* `acc[0..n)` += the block's weights times n consecutive positions' values of the block `x`, n <= GROUP. */
ALWAYS_INLINE void group_products(lane_floats wf[ROW_VECTORS][LLK_BLOCK], const float* x,
                                  lane_floats (*acc)[ROW_VECTORS], const int n) {
  lane_floats sums[GROUP][ROW_VECTORS];
  for (int p = 0; p < n; p++)
    for (int v = 0; v < ROW_VECTORS; v++) sums[p][v] = acc[p][v];
  for (int k = 0; k < LLK_BLOCK; k++)
    for (int p = 0; p < n; p++) {
      lane_floats value = lane_splat(x[p * LLK_BLOCK + k]);
      for (int v = 0; v < ROW_VECTORS; v++) sums[p][v] = lane_fmadd(wf[v][k], value, sums[p][v]);
    }
  for (int p = 0; p < n; p++)
    for (int v = 0; v < ROW_VECTORS; v++) acc[p][v] = sums[p][v];
}

/* n positions in ceil(n / GROUP) groups of nearly equal size: a short last group would leave the FMA pipes
 * waiting on too few chains. */
ALWAYS_INLINE void chunk_products(lane_floats wf[ROW_VECTORS][LLK_BLOCK], const float* x,
                                  lane_floats (*acc)[ROW_VECTORS], int64_t n) {
  int64_t groups = (n + GROUP - 1) / GROUP;
  for (int64_t g = 0, p = 0; g < groups; g++) {
    int64_t size = (n - p) / (groups - g);
    if (size == GROUP) {
      group_products(wf, x + p * LLK_BLOCK, acc + p, GROUP);
    } else if (size == GROUP - 1) {
      group_products(wf, x + p * LLK_BLOCK, acc + p, GROUP - 1);
    } else {
      int64_t q = p;
      if (size & 4) group_products(wf, x + q * LLK_BLOCK, acc + q, 4), q += 4;
      if (size & 2) group_products(wf, x + q * LLK_BLOCK, acc + q, 2), q += 2;
      if (size & 1) group_products(wf, x + q * LLK_BLOCK, acc + q, 1);
    }
    p += size;
  }
}

static void float_lanes(const llk_weights* w, const float* x, int64_t total, float* out, int64_t row, int64_t p0,
                        int64_t n) {
  int64_t columns = w->columns;
  lane_floats acc[CHUNK][ROW_VECTORS];
  for (int64_t p = 0; p < n; p++)
    for (int v = 0; v < ROW_VECTORS; v++) acc[p][v] = lane_zero();
  for (int64_t b = 0; b < columns / LLK_BLOCK; b++) {
    lane_floats wf[ROW_VECTORS][LLK_BLOCK];
    for (int v = 0; v < ROW_VECTORS; v++) dequantized_block(w, row + v * LANES, b, wf[v]);
    chunk_products(wf, x + (b * total + p0) * LLK_BLOCK, acc, n);
  }
  for (int64_t p = 0; p < n; p++)
    for (int v = 0; v < ROW_VECTORS; v++) lane_store(out + (p0 + p) * w->rows + row + v * LANES, acc[p][v]);
}

/* Rows [o_begin, o_begin + k ROWS) in lanes; returns where they end. */
static int64_t lanes_w4a16(const llk_weights* w, const float* x, int64_t positions, int64_t total, float* out,
                           int64_t o_begin, int64_t o_end) {
  int64_t end = o_begin + (o_end - o_begin) / ROWS * ROWS;
  for (int64_t row = o_begin; row < end; row += ROWS)
    for (int64_t p = 0; p < positions; p += CHUNK)
      float_lanes(w, x, total, out, row, p, positions - p < CHUNK ? positions - p : CHUNK);
  return end;
}
#endif

void llk_w4a16(const llk_weights* w, const float* blocks, int64_t positions, int64_t total, float* out,
               int64_t o_begin, int64_t o_end) {
#if defined(LLK_FLOAT_LANES)
  o_begin = lanes_w4a16(w, blocks, positions, total, out, o_begin, o_end);
#endif
  int64_t whole_rows = o_begin + (o_end - o_begin) / TILE_ROWS * TILE_ROWS;
  int64_t whole_positions = positions / TILE_POSITIONS * TILE_POSITIONS;
  for (int64_t o = o_begin; o < whole_rows; o += TILE_ROWS) {
    for (int64_t r = 0; r < whole_positions; r += TILE_POSITIONS)
      float_tile(w, blocks, total, out, o, r, TILE_ROWS, TILE_POSITIONS);
    for (int64_t r = whole_positions; r < positions; r++) float_tile(w, blocks, total, out, o, r, TILE_ROWS, 1);
  }
  for (int64_t o = whole_rows; o < o_end; o++) {
    for (int64_t r = 0; r < whole_positions; r += TILE_POSITIONS)
      float_tile(w, blocks, total, out, o, r, 1, TILE_POSITIONS);
    for (int64_t r = whole_positions; r < positions; r++) float_tile(w, blocks, total, out, o, r, 1, 1);
  }
}
