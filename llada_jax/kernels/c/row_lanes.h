/* Weight rows in the lanes of a register (x86: 16 with AVX-512 VNNI, 8 with AVX2). Per 32-column block, each
 * row's 4-byte groups are gathered as stored so that lane k holds row k's; each position's 4 activation bytes are
 * broadcast to all lanes, and one integer dot-product instruction does LANES x 4 multiply-adds. The block's int32
 * sums land one per lane, so its scales apply as one vector of row scales (times the position's), not per row.
 * Positions go in chunks whose float accumulators stay in L1. Weights stay as stored: no repacked copy.
 * arm64 has the float lanes only (4 per register, W4A16's dequantized rows): its int8 products are sdot and
 * smmla tiles (`pair_tiles.h`), which need no gathers. */
#ifndef LLADA_ROW_LANES_H
#define LLADA_ROW_LANES_H

#include "kernels.h"
#include "simd.h"

#if defined(LLK_X86)
#define LLK_ROW_LANES 1
#define LLK_FLOAT_LANES 1
#define POSITION_CHUNK 64

#if defined(LLK_DPBUSD) && defined(__AVX512F__) && defined(__AVX512BW__)
#define LANES 16
#define LANE_REGISTERS 32
typedef __m512i lane_ints;
typedef __m512 lane_floats;

static inline lane_ints lane_gather(const uint8_t* base, int64_t stride) {
  __m512i rows = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_i32gather_epi32(_mm512_mullo_epi32(rows, _mm512_set1_epi32((int)stride)), base, 1);
}
static inline lane_ints lane_bytes(lane_ints v, char mask) { return _mm512_and_si512(v, _mm512_set1_epi8(mask)); }
static inline lane_ints lane_high(lane_ints v) { return _mm512_srli_epi16(v, 4); }
static inline lane_ints lane_xor(lane_ints v, char mask) { return _mm512_xor_si512(v, _mm512_set1_epi8(mask)); }
static inline lane_floats lane_zero(void) { return _mm512_setzero_ps(); }
static inline lane_floats lane_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void lane_store(float* p, lane_floats v) { _mm512_storeu_ps(p, v); }

/* `init` + the block's dot products of 8 weight registers with the position's values (4 bytes each). */
static inline lane_ints lane_dot(int32_t init, const lane_ints w[8], const int8_t* values, int bits) {
  (void)bits;
  __m512i sums[2] = {_mm512_set1_epi32(init), _mm512_setzero_si512()};  /* two chains: half the latency */
  for (int j = 0; j < 8; j++) {
    int32_t four;
    __builtin_memcpy(&four, values + 4 * j, 4);
    sums[j & 1] = _mm512_dpbusd_epi32(sums[j & 1], w[j], _mm512_set1_epi32(four));
  }
  return _mm512_add_epi32(sums[0], sums[1]);
}

static inline lane_floats lane_accumulate(lane_floats acc, lane_ints sum, lane_floats scales, float scale) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scales, _mm512_set1_ps(scale)), acc);
}
static inline lane_floats lane_fmadd(lane_floats a, lane_floats b, lane_floats c) { return _mm512_fmadd_ps(a, b, c); }
static inline lane_floats lane_splat(float v) { return _mm512_set1_ps(v); }
static inline lane_floats lane_mul(lane_floats a, lane_floats b) { return _mm512_mul_ps(a, b); }
/* The 4 bits at `shift` of each lane as a float. */
static inline lane_floats lane_nibble(lane_ints v, const int shift) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(15)));
}
#define LANE_WEIGHTS_UNSIGNED 1 /* vpdpbusd: unsigned weights (offset as stored), signed activations */

#else /* AVX2 */
#define LANES 8
#define LANE_REGISTERS 16
typedef __m256i lane_ints;
typedef __m256 lane_floats;

static inline lane_ints lane_gather(const uint8_t* base, int64_t stride) {
  __m256i rows = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_i32gather_epi32((const int*)base, _mm256_mullo_epi32(rows, _mm256_set1_epi32((int)stride)), 1);
}
static inline lane_ints lane_bytes(lane_ints v, char mask) { return _mm256_and_si256(v, _mm256_set1_epi8(mask)); }
static inline lane_ints lane_high(lane_ints v) { return _mm256_srli_epi16(v, 4); }
static inline lane_ints lane_xor(lane_ints v, char mask) { return _mm256_xor_si256(v, _mm256_set1_epi8(mask)); }
static inline lane_floats lane_zero(void) { return _mm256_setzero_ps(); }
static inline lane_floats lane_load(const float* p) { return _mm256_loadu_ps(p); }
static inline void lane_store(float* p, lane_floats v) { _mm256_storeu_ps(p, v); }

/* 4-bit: vpmaddubsw's 16-bit pair sums of all 8 groups stay below 2^15 (8 x 2 x 15 x 127) and add up before one
 * vpmaddwd. 8-bit (signed weights): |w| x sign(a, w) per group, each widened at once (a pair reaches 2 x 128 x 127). */
static inline lane_ints lane_dot(int32_t init, const lane_ints w[8], const int8_t* values, int bits) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i pairs = _mm256_setzero_si256(), sum = _mm256_set1_epi32(init);
  for (int j = 0; j < 8; j++) {
    int32_t four;
    __builtin_memcpy(&four, values + 4 * j, 4);
    __m256i a = _mm256_set1_epi32(four);
    if (bits == 4)
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[j], a));
    else
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(
                                      _mm256_maddubs_epi16(_mm256_abs_epi8(w[j]), _mm256_sign_epi8(a, w[j])), ones));
  }
  return bits == 4 ? _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones)) : sum;
}

static inline lane_floats lane_accumulate(lane_floats acc, lane_ints sum, lane_floats scales, float scale) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scales, _mm256_set1_ps(scale)), acc);
}
static inline lane_floats lane_fmadd(lane_floats a, lane_floats b, lane_floats c) { return _mm256_fmadd_ps(a, b, c); }
static inline lane_floats lane_splat(float v) { return _mm256_set1_ps(v); }
static inline lane_floats lane_mul(lane_floats a, lane_floats b) { return _mm256_mul_ps(a, b); }
static inline lane_floats lane_nibble(lane_ints v, const int shift) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(15)));
}
#define LANE_WEIGHTS_UNSIGNED 0 /* 8-bit weights signed for the sign trick; nibbles unsigned as stored */
#endif

#elif defined(LLK_NEON)
#define LLK_FLOAT_LANES 1
#define LANES 4
#define LANE_REGISTERS 32
typedef uint32x4_t lane_ints;
typedef float32x4_t lane_floats;

static inline lane_ints lane_gather(const uint8_t* base, int64_t stride) {
  uint32_t four[LANES];
  for (int k = 0; k < LANES; k++) __builtin_memcpy(&four[k], base + k * stride, 4);
  return vld1q_u32(four);
}
static inline lane_floats lane_zero(void) { return vdupq_n_f32(0.0f); }
static inline lane_floats lane_load(const float* p) { return vld1q_f32(p); }
static inline void lane_store(float* p, lane_floats v) { vst1q_f32(p, v); }
static inline lane_floats lane_fmadd(lane_floats a, lane_floats b, lane_floats c) { return vfmaq_f32(c, a, b); }
static inline lane_floats lane_splat(float v) { return vdupq_n_f32(v); }
static inline lane_floats lane_mul(lane_floats a, lane_floats b) { return vmulq_f32(a, b); }
static inline lane_floats lane_nibble(lane_ints v, const int shift) {
  return vcvtq_f32_u32(vandq_u32(vshlq_u32(v, vdupq_n_s32(-shift)), vdupq_n_u32(15)));
}
#endif

#if defined(LLK_FLOAT_LANES)
static inline lane_floats lane_scales(const llk_weights* w, int64_t row, int64_t group) {
  int64_t groups = w->columns / w->group;
  float scales[LANES];
  for (int k = 0; k < LANES; k++) scales[k] = scale_at(w->scales, (row + k) * groups + group, w->scale_bf16);
  return lane_load(scales);
}
#endif

#if defined(LLK_ROW_LANES)
/* The block's weights of rows row..row+LANES-1 as 4-byte groups, lane k = row k: 4-bit weights give the low nibbles
 * of byte groups 0-3 (the even columns), then the high ones (the odd columns); 8-bit ones byte groups 0-7. */
static inline void lane_weights(const llk_weights* w, int64_t row, int64_t block, int bits, lane_ints out[8]) {
  int64_t stride = w->columns * bits / 8;
  const uint8_t* base = w->weights + row * stride + block * (LLK_BLOCK * bits / 8);
  if (bits == 4) {
    for (int j = 0; j < 4; j++) {
      lane_ints raw = lane_gather(base + 4 * j, stride);
      out[j] = lane_bytes(raw, 0x0F);
      out[4 + j] = lane_bytes(lane_high(raw), 0x0F);
    }
    return;
  }
  int flip = w->signed8 == LANE_WEIGHTS_UNSIGNED; /* stored signed but wanted unsigned, or the reverse */
  for (int j = 0; j < 8; j++) {
    lane_ints raw = lane_gather(base + 4 * j, stride);
    out[j] = flip ? lane_xor(raw, (char)0x80) : raw;
  }
}

/* Rows [row, row + LANES) of positions [p0, p1) (at most POSITION_CHUNK). Weight register j meets the position's
 * activation bytes 4j..4j+3: the block order (4-bit: even columns, then odd) makes them match. */
static inline __attribute__((always_inline)) void lane_chunk(const llk_weights* w, const llk_int8_activations* a,
                                                             float* out, int64_t row, int64_t p0, int64_t p1,
                                                             const int bits) {
  const int32_t offset = bits == 4 ? 8 : (LANE_WEIGHTS_UNSIGNED ? 128 : 0);
  int64_t blocks = w->columns / LLK_BLOCK, per_group = w->group / LLK_BLOCK;
  lane_floats acc[POSITION_CHUNK];
  for (int64_t p = p0; p < p1; p++) acc[p - p0] = lane_zero();
  lane_floats scales = lane_zero();
  const int64_t stride = w->columns * bits / 8, ahead = 256; /* bytes of each row fetched ahead of the gathers */
  for (int64_t b = 0; b < blocks; b++) {
    lane_ints wv[8];
    const uint8_t* next = w->weights + row * stride + b * (LLK_BLOCK * bits / 8) + ahead;
    if ((b * LLK_BLOCK * bits / 8) % 64 == 0 && b * (LLK_BLOCK * bits / 8) + ahead < stride)
      for (int k = 0; k < LANES; k++) __builtin_prefetch(next + k * stride);
    lane_weights(w, row, b, bits, wv);
    if (b % per_group == 0) scales = lane_scales(w, row, b / per_group);
    for (int64_t p = p0; p < p1; p++) {
      int64_t at = llk_at(a, p, b);
      lane_ints sum = lane_dot(-offset * a->sums[at], wv, a->values + at * LLK_BLOCK, bits);
      acc[p - p0] = lane_accumulate(acc[p - p0], sum, scales, a->scales[at]);
    }
  }
  for (int64_t p = p0; p < p1; p++) lane_store(out + p * w->rows + row, acc[p - p0]);
}

/* Rows [o_begin, o_begin + k LANES) in lanes; returns where they end (the rest is left to the caller). */
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
