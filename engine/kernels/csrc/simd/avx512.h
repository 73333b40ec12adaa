// The vector layer on AVX-512 (F, BW, DQ, VL; + VNNI in the avx512_vnni target): 16 floats a register.
// See simd.h for what each function means; every target's header defines the same names.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace tandem {
namespace TANDEM_ISA {
namespace simd {

constexpr int64_t kLanes = 16;
constexpr int kRegisters = 32;
#ifdef __AVX512VNNI__
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

using F = __m512;
using I = __m512i;
using M = __mmask16;

inline F zero() { return _mm512_setzero_ps(); }
inline F set1(float v) { return _mm512_set1_ps(v); }
inline F loadu(const float* p) { return _mm512_loadu_ps(p); }
inline void storeu(float* p, F v) { _mm512_storeu_ps(p, v); }
inline M first(int64_t n) { return n >= kLanes ? (M)0xFFFF : n <= 0 ? (M)0 : (M)((1u << n) - 1); }
inline M lanes(int64_t from, int64_t to) { return (M)(first(to) & ~first(from)); }
inline F load(M m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline void store(M m, float* p, F v) { _mm512_mask_storeu_ps(p, m, v); }
inline F keep(M m, F v) { return _mm512_maskz_mov_ps(m, v); }

inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F div(F a, F b) { return _mm512_div_ps(a, b); }
inline F max(F a, F b) { return _mm512_max_ps(a, b); }
inline F min(F a, F b) { return _mm512_min_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
inline F abs(F v) { return _mm512_abs_ps(v); }
inline F round_even(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integral n in [-127, 128]
inline F scale_pow2(F p, F n) { return _mm512_scalef_ps(p, n); }
inline float reduce_add(F v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(F v) { return _mm512_reduce_max_ps(v); }

inline F from_half(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline F from_i8(const void* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
// kLanes bytes widened to int32 lanes, unsigned
inline I widen_u8(const void* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
// a float per lane from 4 byte planes (`stride` bytes apart; plane j holds each lane's byte j)
inline F from_byte_planes(const uint8_t* p, int64_t stride) {
  I v = widen_u8(p);
  v = _mm512_or_si512(v, _mm512_slli_epi32(widen_u8(p + stride), 8));
  v = _mm512_or_si512(v, _mm512_slli_epi32(widen_u8(p + 2 * stride), 16));
  v = _mm512_or_si512(v, _mm512_slli_epi32(widen_u8(p + 3 * stride), 24));
  return _mm512_castsi512_ps(v);
}
inline F to_float(I v) { return _mm512_cvtepi32_ps(v); }
inline void prefetch(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_T0); }

// The four horizontal sums of a, b, c, d, in a fixed order of additions.
inline __m128 reduce4(F a, F b, F c, F d) {
  // 128-bit quarters: ab = [a0+a2, a1+a3, b0+b2, b1+b3], cd likewise
  const F ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const F cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // quarters: [a, b, c, d], each 4 partial sums
  const F q = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  // within each quarter: [x0+x1, x0+x1, x2+x3, x2+x3], then add the swapped pair
  const F h = _mm512_add_ps(q, _mm512_permute_ps(q, 0xB1));
  const F t = _mm512_add_ps(h, _mm512_permute_ps(h, 0x4E));
  // lane 0 of each quarter
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), t));
}

// Lane l of the result: the sum of acc[l]'s lanes, each in the same tree (x[e] + x[e+2], then pairs, then
// 128-bit quarters), so a sum doesn't depend on the vectors beside it. ~2.5x fewer shuffles than 16
// horizontal sums.
inline F transpose_sums(const F* acc) {
  F pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit quarter: [a0+a2, b0+b2, a1+a3, b1+b3] of a = 2i, b = 2i+1
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]), _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per quarter: vectors 4i..4i+3, each its quarter's sum
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  const F u01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44), _mm512_shuffle_f32x4(quads[0], quads[1], 0xEE));
  const F u23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44), _mm512_shuffle_f32x4(quads[2], quads[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD));
}

// --- integer dot products (int8_linear.cpp) ---

inline I zero_i() { return _mm512_setzero_si512(); }
inline I set1_i(int32_t v) { return _mm512_set1_epi32(v); }
inline I loadu_i(const void* p) { return _mm512_loadu_si512(p); }
inline I add_i(I a, I b) { return _mm512_add_epi32(a, b); }
inline I low_nibbles(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline I high_nibbles(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }

// acc + the sums of 4 products of u's unsigned and x's signed bytes per int32 lane, exact where every
// u < 128 (without VNNI two products are first summed in int16: 2 * 127 * 127 fits)
inline I dot_u8s8(I acc, I u, I x) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(acc, u, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1)));
#endif
}

// The same for any u: with VNNI u * x exactly; without, (u - 128) * x (the caller adds 128 * sum(x)):
// |u - 128| times x with u's sign, as llama.cpp multiplies signed blocks, so no int16 sum saturates.
inline I dot_u8s8_wide(I acc, I u, I x) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(acc, u, x);
#else
  const I s = _mm512_xor_si512(u, _mm512_set1_epi8((char)0x80));  // u - 128 as a signed byte
  const I a = _mm512_abs_epi8(s);
  const I sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(s), _mm512_setzero_si512(), x);  // x with s's sign
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, sx), _mm512_set1_epi16(1)));
#endif
}

// The products of u's unsigned and x's signed bytes, summed in pairs into int16 (saturating: callers
// keep 2 * u * |x| and their int16 sums below 2^15), and int16 pairs summed into int32 lanes.
inline I pair_sums(I u, I x) { return _mm512_maddubs_epi16(u, x); }
inline I add_i16(I a, I b) { return _mm512_add_epi16(a, b); }
inline I widen_i16(I v) { return _mm512_madd_epi16(v, _mm512_set1_epi16(1)); }

// 32 floats, scaled by inv and rounded to the nearest integer (ties to even), into int8 (|v| <= 127)
// and their int32 values
inline void round_to_i8(const float* src, F inv, int8_t* dst, int32_t* vals) {
  const I i0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src), inv));
  const I i1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + 16), inv));
  _mm_storeu_si128((__m128i*)dst, _mm512_cvtsepi32_epi8(i0));
  _mm_storeu_si128((__m128i*)(dst + 16), _mm512_cvtsepi32_epi8(i1));
  _mm512_storeu_si512(vals, i0), _mm512_storeu_si512(vals + 16, i1);
}

}  // namespace simd
}  // namespace TANDEM_ISA
}  // namespace tandem
