// y = x @ W^T + b with W in GGUF blocks and x quantized to int8 per 32 values of a row, on integer dot
// products (AVX-512 VNNI), as llama.cpp multiplies its quantized matrices. Any number of rows.
//
// W = d * q + m per group of 16 or 32 weights of a row (gguf_blocks.py: every GGUF type we read), held
// as u = q - lo (lo: the tensor's smallest q), so u is unsigned: 4 bits where u < 16, else a byte. A
// row of x is cut into blocks of 32: s = max|x| / 127, xq = round(x / s). Then per group g of a row
//   sum_j W_j x_j ~ (d s) * sum_j u_j xq_j + (m + lo d) * (s * sum_j xq_j)
// where the first sum is exact in int32 (vpdpbusd: 4 products of an unsigned and a signed byte per
// lane) and the second is computed once per row of x and group. The weights are the file's own, exact;
// only x is rounded (~0.4% of a block's largest value per element).
//
// Layout: 16 rows of W side by side, one int32 lane each, so a lane's 4 bytes are 4 consecutive k of
// its row and one broadcast of 4 bytes of xq serves all 16: no horizontal sums. u [N / 16, K / 4, 16,
// 4] bytes, or [N / 16, K / 8, 16, 4] of 4-bit pairs (byte b of a lane holds k = 8c + b in its low
// half, k = 8c + 4 + b in its high half); dm [N / 16, K / G, 2, 16] (d then m; [.., 1, 16]: d only,
// types without an offset) float32 or float16.
//
// Every output is one lane accumulated over its groups in k order, whatever the number of rows or
// threads: a row's result never depends on the other rows (a 1-token decode and a K+1-token verify
// step agree bit for bit), and neither does a prefill chunk's on where it is cut.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>
#include <immintrin.h>

#include "kernels.h"

// Only this file's code may use VNNI (the rest of the library runs on any AVX-512 CPU); callers check
// int8_kernel_runs() first.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vnni,fma,f16c")

namespace {

constexpr int64_t TILE = 16;  // weight rows per tile: one int32 lane each
constexpr int64_t XBLOCK = 32;  // values of x per int8 scale
constexpr int64_t MR = 8;       // rows of x per register tile: 2 * MR accumulators

// x quantized: xq [M, K] int8, scale [M, K / 32], and per weight group the offset term's
// factor s * sum(xq) [M, K / G]
struct QuantizedRows {
  at::Tensor xq, scale, sums;
};

QuantizedRows quantize_rows(const at::Tensor& x, int64_t group) {
  const int64_t m = x.size(0), k = x.size(1), ldx = x.stride(0);
  QuantizedRows q{at::empty({m, k}, x.options().dtype(at::kChar)), at::empty({m, k / XBLOCK}, x.options()),
                  at::empty({m, k / group}, x.options())};
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.xq.data_ptr<int8_t>();
  float* sp = q.scale.data_ptr<float>();
  float* gp = q.sums.data_ptr<float>();
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < k / XBLOCK; ++b) {
        const float* src = xp + r * ldx + b * XBLOCK;
        const __m512 v0 = _mm512_loadu_ps(src), v1 = _mm512_loadu_ps(src + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, abs_mask), _mm512_and_ps(v1, abs_mask)));
        const float s = amax / 127.0f;
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        // round to nearest even (the default rounding mode), then narrow: |xq| <= 127
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        int8_t* dst = qp + r * k + b * XBLOCK;
        _mm_storeu_si128((__m128i*)dst, _mm512_cvtsepi32_epi8(i0));
        _mm_storeu_si128((__m128i*)(dst + 16), _mm512_cvtsepi32_epi8(i1));
        sp[r * (k / XBLOCK) + b] = s;
        // per weight group: s times the sum of its xq (exact integers)
        alignas(64) int32_t vals[32];
        _mm512_store_si512(vals, i0), _mm512_store_si512(vals + 16, i1);
        for (int64_t g0 = 0; g0 < XBLOCK; g0 += group) {  // group: 16 or 32
          int32_t sum = 0;
          for (int64_t j = g0; j < g0 + group; ++j) sum += vals[j];
          gp[r * (k / group) + (b * XBLOCK + g0) / group] = s * (float)sum;
        }
      }
  });
  return q;
}

struct Int8Args {
  int64_t n, k, group, lo, tile_bytes;  // tile_bytes: u of one tile
  bool nibbles, half, offset;
};

// 16 weight rows x R rows of x, over all of k; acc lanes are the 16 outputs of each row of x
template <int R, bool Nibbles, int G>
inline void int8_tile(const Int8Args& a, const uint8_t* u, const uint8_t* dm, const QuantizedRows& xr,
                           const int8_t* xq, const float* xs, const float* xg, int64_t ldq, int64_t lds, int64_t ldg,
                           const float* bias, float* y, int64_t ldy, int64_t n0) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512 lo = _mm512_set1_ps((float)a.lo);
  const int64_t groups = a.k / G, pair = a.offset ? 2 : 1;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    const int64_t k0 = g * G;
    if (Nibbles) {
      const uint8_t* ug = u + (k0 / 8) * TILE * 4;
      for (int64_t c = 0; c < G / 8; ++c) {
        const __m512i v = _mm512_loadu_si512(ug + c * TILE * 4);
        if (R > 1) _mm_prefetch((const char*)(ug + c * TILE * 4 + a.tile_bytes), _MM_HINT_T0);
        const __m512i wl = _mm512_and_si512(v, low4), wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int r = 0; r < R; ++r) {
          const int8_t* xk = xq + r * ldq + k0 + c * 8;
          dot[r] = _mm512_dpbusd_epi32(dot[r], wl, _mm512_set1_epi32(*(const int32_t*)xk));
          dot[r] = _mm512_dpbusd_epi32(dot[r], wh, _mm512_set1_epi32(*(const int32_t*)(xk + 4)));
        }
      }
    } else {
      const uint8_t* ug = u + (k0 / 4) * TILE * 4;
      for (int64_t c = 0; c < G / 4; ++c) {
        const __m512i w = _mm512_loadu_si512(ug + c * TILE * 4);
        // with several rows the hardware prefetcher falls behind: fetch the next tile's line
        if (R > 1) _mm_prefetch((const char*)(ug + c * TILE * 4 + a.tile_bytes), _MM_HINT_T0);
        for (int r = 0; r < R; ++r)
          dot[r] = _mm512_dpbusd_epi32(dot[r], w, _mm512_set1_epi32(*(const int32_t*)(xq + r * ldq + k0 + c * 4)));
      }
    }
    // the group's d and m + lo d for the 16 rows
    __m512 d, mp;
    if (a.half) {
      const __m256i* p = (const __m256i*)(dm + g * pair * TILE * 2);
      d = _mm512_cvtph_ps(_mm256_loadu_si256(p));
      mp = a.offset ? _mm512_fmadd_ps(lo, d, _mm512_cvtph_ps(_mm256_loadu_si256(p + 1))) : _mm512_mul_ps(lo, d);
    } else {
      const float* p = (const float*)(dm + g * pair * TILE * 4);
      d = _mm512_loadu_ps(p);
      mp = a.offset ? _mm512_fmadd_ps(lo, d, _mm512_loadu_ps(p + TILE)) : _mm512_mul_ps(lo, d);
    }
    const int64_t b = k0 / XBLOCK;
    for (int r = 0; r < R; ++r) {
      const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(xs[r * lds + b]));
      acc[r] = _mm512_fmadd_ps(ds, _mm512_cvtepi32_ps(dot[r]), acc[r]);
      acc[r] = _mm512_fmadd_ps(mp, _mm512_set1_ps(xg[r * ldg + g]), acc[r]);
    }
  }
  const int64_t valid = std::min<int64_t>(TILE, a.n - n0);
  const __mmask16 mask = (__mmask16)((1u << valid) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + n0, mask, bias ? _mm512_add_ps(acc[r], bv) : acc[r]);
}

template <bool Nibbles, int G>
using Int8TileFn = void (*)(const Int8Args&, const uint8_t*, const uint8_t*, const QuantizedRows&, const int8_t*,
                            const float*, const float*, int64_t, int64_t, int64_t, const float*, float*, int64_t, int64_t);
template <bool Nibbles, int G>
struct Int8Tiles {
  static constexpr Int8TileFn<Nibbles, G> at[MR + 1] = {
      nullptr, int8_tile<1, Nibbles, G>, int8_tile<2, Nibbles, G>, int8_tile<3, Nibbles, G>, int8_tile<4, Nibbles, G>,
      int8_tile<5, Nibbles, G>, int8_tile<6, Nibbles, G>, int8_tile<7, Nibbles, G>, int8_tile<8, Nibbles, G>};
};

template <bool Nibbles, int G>
void run_int8(const Int8Args& a, const at::Tensor& u, const at::Tensor& dm, const QuantizedRows& xr,
                   const float* bias, at::Tensor& y) {
  const int64_t m = y.size(0), tiles = (a.n + TILE - 1) / TILE;
  const int64_t tile_u = a.tile_bytes, tile_dm = (a.k / G) * (a.offset ? 2 : 1) * TILE * (a.half ? 2 : 4);
  const uint8_t* up = (const uint8_t*)u.data_ptr();
  const uint8_t* dp = (const uint8_t*)dm.data_ptr();
  const int8_t* xq = xr.xq.data_ptr<int8_t>();
  const float* xs = xr.scale.data_ptr<float>();
  const float* xg = xr.sums.data_ptr<float>();
  const int64_t ldq = a.k, lds = a.k / XBLOCK, ldg = a.k / G;
  float* yp = y.data_ptr<float>();
  // Split over weight tiles: each thread reads its share of W once per MR rows of x (from cache
  // after the first: a tile is 16 rows of K bytes).
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t m0 = 0; m0 < m; m0 += MR) {
        const int64_t r = std::min<int64_t>(MR, m - m0);
        Int8Tiles<Nibbles, G>::at[r](a, up + t * tile_u, dp + t * tile_dm, xr, xq + m0 * ldq, xs + m0 * lds,
                                     xg + m0 * ldg, ldq, lds, ldg, bias, yp + m0 * a.n, a.n, t * TILE);
      }
  });
}

}  // namespace

namespace tandem {

bool int8_kernel_runs() { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"); }

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& u, const at::Tensor& dm, int64_t lo, int64_t rows,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(int8_kernel_runs(), "int8_linear: this CPU has no AVX-512 VNNI");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "int8_linear: x must be a float32 [M, K] matrix with unit column stride");
  TORCH_CHECK(u.dim() == 4 && u.is_contiguous() && u.scalar_type() == at::kByte && u.size(2) == TILE && u.size(3) == 4,
              "int8_linear: u must be a contiguous uint8 [N / 16, K / 4 or K / 8, 16, 4] tensor");
  TORCH_CHECK(dm.dim() == 4 && dm.is_contiguous() && dm.size(0) == u.size(0) && dm.size(3) == TILE &&
                  (dm.size(2) == 1 || dm.size(2) == 2) && (dm.scalar_type() == at::kFloat || dm.scalar_type() == at::kHalf),
              "int8_linear: dm must be a contiguous float32 or float16 [N / 16, K / group, 2 or 1, 16] tensor");
  const int64_t k = x.size(1);
  const bool nibbles = u.size(1) * 8 == k;
  TORCH_CHECK(nibbles || u.size(1) * 4 == k, "int8_linear: u does not match x");
  TORCH_CHECK(k % XBLOCK == 0 && k % dm.size(1) == 0, "int8_linear: K must be a multiple of 32 and of the group");
  const int64_t group = k / dm.size(1);
  TORCH_CHECK(group == 16 || group == 32, "int8_linear: groups of 16 or 32 weights");
  TORCH_CHECK(rows > (u.size(0) - 1) * TILE && rows <= u.size(0) * TILE, "int8_linear: rows does not match u");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == rows && bias->scalar_type() == at::kFloat,
                "int8_linear: bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  const Int8Args a{rows, k, group, lo, k * TILE / (nibbles ? 2 : 1), nibbles, dm.scalar_type() == at::kHalf, dm.size(2) == 2};
  const at::Tensor xc = x.stride(0) == k ? x : x.contiguous();
  const QuantizedRows xr = quantize_rows(xc, group);
  at::Tensor y = at::empty({x.size(0), rows}, x.options());
  if (x.size(0) == 0) return y;
  if (nibbles) {
    group == 16 ? run_int8<true, 16>(a, u, dm, xr, b, y) : run_int8<true, 32>(a, u, dm, xr, b, y);
  } else {
    group == 16 ? run_int8<false, 16>(a, u, dm, xr, b, y) : run_int8<false, 32>(a, u, dm, xr, b, y);
  }
  return y;
}

}  // namespace tandem

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(tandem, lib) {
  lib.def("int8_linear(Tensor x, Tensor u, Tensor dm, int lo, int rows, Tensor? bias) -> Tensor");
  lib.def("int8_kernel_runs", &tandem::int8_kernel_runs);
}

TORCH_LIBRARY_IMPL(tandem, CPU, lib) { lib.impl("int8_linear", tandem::int8_linear); }
