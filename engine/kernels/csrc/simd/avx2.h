// The vector layer on AVX2 + FMA + F16C (x86-64-v3; + AVX-VNNI's 256-bit vpdpbusd in the avx_vnni
// target): 8 floats a register, 16 registers. See simd.h for what each function means.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace tandem {
namespace TANDEM_ISA {
namespace simd {

constexpr int64_t kLanes = 8;
constexpr int kRegisters = 16;
#ifdef __AVXVNNI__
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

using F = __m256;
using I = __m256i;
using M = __m256i;  // a lane is on where all its bits are

inline F zero() { return _mm256_setzero_ps(); }
inline F set1(float v) { return _mm256_set1_ps(v); }
inline F loadu(const float* p) { return _mm256_loadu_ps(p); }
inline void storeu(float* p, F v) { _mm256_storeu_ps(p, v); }
inline M first(int64_t n) {
  const int32_t c = n >= kLanes ? (int32_t)kLanes : n <= 0 ? 0 : (int32_t)n;
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline M lanes(int64_t from, int64_t to) { return _mm256_andnot_si256(first(from), first(to)); }
inline F load(M m, const float* p) { return _mm256_maskload_ps(p, m); }  // faults of masked lanes suppressed
inline void store(M m, float* p, F v) { _mm256_maskstore_ps(p, m, v); }
inline F keep(M m, F v) { return _mm256_and_ps(_mm256_castsi256_ps(m), v); }

inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F div(F a, F b) { return _mm256_div_ps(a, b); }
inline F max(F a, F b) { return _mm256_max_ps(a, b); }
inline F min(F a, F b) { return _mm256_min_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
inline F abs(F v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
inline F round_even(F v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integral n in [-127, 128], in two exact steps of 2^(n/2) (each a normal float)
inline F scale_pow2(F p, F n) {
  const I ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const auto pow2 = [](I e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); };
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(n1)), pow2(n2));
}
inline float reduce_add(F v) {  // (x[i] + x[i+4]), then pairs
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(F v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline F from_half(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline F from_i8(const void* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline I widen_u8(const void* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
// a float per lane from 4 byte planes (`stride` bytes apart; plane j holds each lane's byte j)
inline F from_byte_planes(const uint8_t* p, int64_t stride) {
  I v = widen_u8(p);
  v = _mm256_or_si256(v, _mm256_slli_epi32(widen_u8(p + stride), 8));
  v = _mm256_or_si256(v, _mm256_slli_epi32(widen_u8(p + 2 * stride), 16));
  v = _mm256_or_si256(v, _mm256_slli_epi32(widen_u8(p + 3 * stride), 24));
  return _mm256_castsi256_ps(v);
}
inline F to_float(I v) { return _mm256_cvtepi32_ps(v); }
inline void prefetch(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_T0); }

// The four horizontal sums of a, b, c, d, in a fixed order of additions.
inline __m128 reduce4(F a, F b, F c, F d) {
  const F ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // [a01 a23 b01 b23 | a45 a67 b45 b67], ...
  const F t = _mm256_hadd_ps(ab, cd);                             // [a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 ...]
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Lane l of the result: the sum of acc[l]'s lanes, each in the same tree, so a sum doesn't depend on
// the vectors beside it.
inline F transpose_sums(const F* acc) {
  const F t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  const F t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
  const F u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [s0..s3 low halves | s0..s3 high], ...
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// --- integer dot products (int8_linear.cpp) ---

inline I zero_i() { return _mm256_setzero_si256(); }
inline I set1_i(int32_t v) { return _mm256_set1_epi32(v); }
inline I loadu_i(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
inline I low_nibbles(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline I high_nibbles(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }

// acc + the sums of 4 products of u's unsigned and x's signed bytes per int32 lane, exact where every
// u < 128 (without VNNI two products are first summed in int16: 2 * 127 * 127 fits)
inline I dot_u8s8(I acc, I u, I x) {
#ifdef __AVXVNNI__
  return _mm256_dpbusd_avx_epi32(acc, u, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

// The same for any u: with VNNI u * x exactly; without, (u - 128) * x (the caller adds 128 * sum(x)):
// |u - 128| times x with u's sign (llama.cpp's sign trick for signed blocks), so no int16 sum saturates.
inline I dot_u8s8_wide(I acc, I u, I x) {
#ifdef __AVXVNNI__
  return _mm256_dpbusd_avx_epi32(acc, u, x);
#else
  const I s = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));  // u - 128 as a signed byte
  return _mm256_add_epi32(
      acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(s, s), _mm256_sign_epi8(x, s)), _mm256_set1_epi16(1)));
#endif
}

// The products of u's unsigned and x's signed bytes, summed in pairs into int16 (saturating: callers
// keep 2 * u * |x| and their int16 sums below 2^15), and int16 pairs summed into int32 lanes.
inline I pair_sums(I u, I x) { return _mm256_maddubs_epi16(u, x); }
inline I add_i16(I a, I b) { return _mm256_add_epi16(a, b); }
inline I widen_i16(I v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }

// 32 floats, scaled by inv and rounded to the nearest integer (ties to even), into int8 (|v| <= 127)
// and their int32 values
inline void round_to_i8(const float* src, F inv, int8_t* dst, int32_t* vals) {
  I v[4];
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + 8 * i), inv));
    _mm256_storeu_si256((__m256i*)(vals + 8 * i), v[i]);
  }
  // packs work per 128-bit half: [v0 0-3, v1 0-3, v2 0-3, v3 0-3 | v0 4-7, ...]; then 4-byte groups in order
  const I bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256((__m256i*)dst, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

}  // namespace simd
}  // namespace TANDEM_ISA
}  // namespace tandem
