/* The instructions under the kernels, one set per ISA, chosen at compile time from the target's flags
 * (the build passes -march=native for this host, or the bundle target's CPU features):
 *   AVX-512 VNNI / AVX-VNNI: vpdpbusd (u8 x s8, 4-way sums into int32);
 *   AVX2: vpmaddubsw + vpmaddwd;
 *   arm64 +dotprod: sdot (s8 x s8); +i8mm: smmla (2 x 8 by 8 x 2 s8 products into a 2 x 2 int32 tile);
 *   anything else: plain C.
 * An int8 dot over one 32-column block returns `init` + its sum: x86 multiplies the weights unsigned (nibbles
 * 0..15; 8-bit as b + 128 with VNNI), so the kernels start each sum from -W4_OFFSET * sum(a) (W8_OFFSET). */
#ifndef LLADA_SIMD_H
#define LLADA_SIMD_H

#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LLK_X86 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LLK_ISA "x86 avx512-vnni (vpdpbusd)"
#define LLK_DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#elif defined(__AVXVNNI__)
#define LLK_ISA "x86 avx-vnni (vpdpbusd)"
#define LLK_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#else
#define LLK_ISA "x86 avx2 (vpmaddubsw)"
#endif
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#define LLK_NEON 1
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define LLK_MMLA 1
#define LLK_ISA "arm64 i8mm (smmla)"
#else
#define LLK_ISA "arm64 dotprod (sdot)"
#endif
#else
#define LLK_ISA "generic C"
#endif

#if defined(LLK_X86)
#define FLANES 8
typedef __m256i ivec;
typedef __m256 fvec;
typedef __m256i wvec; /* 32 weights of a block, as the dot product wants them */
#define W4_OFFSET 8
#if defined(LLK_DPBUSD)
#define W8_OFFSET 128
#else
#define W8_OFFSET 0
#endif

static inline wvec unpack4(const uint8_t* bytes) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m128i b = _mm_loadu_si128((const __m128i*)bytes);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low4), _mm_and_si128(b, low4));
}

/* 8-bit weights as the dot wants them: unsigned (offset 128) with VNNI, signed without. */
static inline wvec load8(const uint8_t* bytes, int signed8) {
  __m256i b = _mm256_loadu_si256((const __m256i*)bytes);
  return signed8 == (W8_OFFSET == 0) ? b : _mm256_xor_si256(b, _mm256_set1_epi8((char)0x80));
}

static inline ivec init_lane(int32_t v) { return _mm256_setr_epi32(v, 0, 0, 0, 0, 0, 0, 0); }

static inline ivec dot4(ivec init, wvec w, const int8_t* a) {
  __m256i av = _mm256_loadu_si256((const __m256i*)a);
#if defined(LLK_DPBUSD)
  return LLK_DPBUSD(init, w, av);
#else
  return _mm256_add_epi32(init, _mm256_madd_epi16(_mm256_maddubs_epi16(w, av), _mm256_set1_epi16(1)));
#endif
}

static inline ivec dot8(ivec init, wvec w, const int8_t* a) {
#if defined(LLK_DPBUSD)
  return dot4(init, w, a);
#else /* |w| x sign(a, w): vpmaddubsw's pairs stay under 2^15 (|w| <= 128, |a| <= 127) */
  __m256i av = _mm256_loadu_si256((const __m256i*)a);
  __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(av, w));
  return _mm256_add_epi32(init, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

static inline fvec fsplat(float v) { return _mm256_set1_ps(v); }
static inline fvec fzero(void) { return _mm256_setzero_ps(); }
static inline fvec fmul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
static inline fvec fmadd(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
static inline fvec floadu(const float* p) { return _mm256_loadu_ps(p); }
static inline fvec ifloat(ivec s) { return _mm256_cvtepi32_ps(s); }

static inline float hsum(fvec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The k-th 8 of a block's 32 4-bit values (even columns 0-7, 8-15, then odd), times `scale` (minus 8 x scale). */
static inline fvec nibble_floats(const uint8_t* bytes, int k, fvec scale, fvec minus8scale) {
  __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(bytes + 8 * (k & 1))));
  v = k < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(15)) : _mm256_srli_epi32(v, 4);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), scale, minus8scale);
}

#elif defined(LLK_NEON)
#define FLANES 4
typedef int32x4_t ivec;
typedef float32x4_t fvec;
typedef int8x16x2_t wvec;
#define W4_OFFSET 0
#define W8_OFFSET 0

static inline wvec unpack4(const uint8_t* bytes) {
  uint8x16_t b = vld1q_u8(bytes);
  int8x16_t eight = vdupq_n_s8(8);
  wvec w = {{vsubq_s8(vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(15))), eight),
             vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(b, 4)), eight)}};
  return w;
}

static inline wvec load8(const uint8_t* bytes, int signed8) {
  uint8x16x2_t b = vld1q_u8_x2(bytes);
  uint8x16_t flip = vdupq_n_u8(signed8 ? 0 : 0x80);
  wvec w = {{vreinterpretq_s8_u8(veorq_u8(b.val[0], flip)), vreinterpretq_s8_u8(veorq_u8(b.val[1], flip))}};
  return w;
}

static inline ivec init_lane(int32_t v) { return vsetq_lane_s32(v, vdupq_n_s32(0), 0); }

static inline ivec dot4(ivec init, wvec w, const int8_t* a) {
  return vdotq_s32(vdotq_s32(init, w.val[0], vld1q_s8(a)), w.val[1], vld1q_s8(a + 16));
}

static inline ivec dot8(ivec init, wvec w, const int8_t* a) { return dot4(init, w, a); }

static inline fvec fsplat(float v) { return vdupq_n_f32(v); }
static inline fvec fzero(void) { return vdupq_n_f32(0.0f); }
static inline fvec fmul(fvec a, fvec b) { return vmulq_f32(a, b); }
static inline fvec fmadd(fvec a, fvec b, fvec c) { return vfmaq_f32(c, a, b); }
static inline fvec floadu(const float* p) { return vld1q_f32(p); }
static inline fvec ifloat(ivec s) { return vcvtq_f32_s32(s); }
static inline float hsum(fvec v) { return vaddvq_f32(v); }

/* The k-th 4 of a block's 32 4-bit values (even columns first), times `scale` (minus 8 x scale). */
static inline fvec nibble_floats(const uint8_t* bytes, int k, fvec scale, fvec minus8scale) {
  const uint8_t* p = bytes + 4 * (k & 3);
  uint32x4_t v = {p[0], p[1], p[2], p[3]};
  v = k < 4 ? vandq_u32(v, vdupq_n_u32(15)) : vshrq_n_u32(v, 4);
  return vfmaq_f32(minus8scale, vcvtq_f32_u32(v), scale);
}

#else /* plain C: one lane */
#define FLANES 1
typedef int32_t ivec;
typedef float fvec;
typedef struct { int8_t v[32]; } wvec; /* signed values */
#define W4_OFFSET 0
#define W8_OFFSET 0

static inline wvec unpack4(const uint8_t* bytes) {
  wvec w;
  for (int j = 0; j < 16; j++) {
    w.v[j] = (int8_t)((bytes[j] & 15) - 8);
    w.v[16 + j] = (int8_t)((bytes[j] >> 4) - 8);
  }
  return w;
}

static inline wvec load8(const uint8_t* bytes, int signed8) {
  wvec w;
  for (int j = 0; j < 32; j++) w.v[j] = (int8_t)(signed8 ? bytes[j] : bytes[j] ^ 0x80);
  return w;
}

static inline ivec init_lane(int32_t v) { return v; }

static inline ivec dot4(ivec init, wvec w, const int8_t* a) {
  for (int j = 0; j < 32; j++) init += (int32_t)w.v[j] * a[j];
  return init;
}

static inline ivec dot8(ivec init, wvec w, const int8_t* a) { return dot4(init, w, a); }

static inline fvec fsplat(float v) { return v; }
static inline fvec fzero(void) { return 0.0f; }
static inline fvec fmul(fvec a, fvec b) { return a * b; }
static inline fvec fmadd(fvec a, fvec b, fvec c) { return a * b + c; }
static inline fvec floadu(const float* p) { return *p; }
static inline fvec ifloat(ivec s) { return (float)s; }
static inline float hsum(fvec v) { return v; }

static inline fvec nibble_floats(const uint8_t* bytes, int k, fvec scale, fvec minus8scale) {
  int b = bytes[k & 15];
  return (float)(k < 16 ? b & 15 : b >> 4) * scale + minus8scale;
}
#endif

/* A scale as stored: float32, or bfloat16 (its 16 high bits). */
static inline float scale_at(const void* scales, int64_t index, int bf16) {
  if (!bf16) return ((const float*)scales)[index];
  union { uint32_t bits; float value; } u = {(uint32_t)((const uint16_t*)scales)[index] << 16};
  return u.value;
}

#endif
