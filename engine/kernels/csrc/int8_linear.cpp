// y = x @ W^T + b with W in GGUF blocks and x quantized to int8 per 32 values of a row, on integer dot
// products, as llama.cpp multiplies its quantized matrices. Any number of rows.
//
// W = d * q + m per group of 16 or 32 weights of a row (gguf_blocks.py: every GGUF type we read), held
// as u = q - lo (lo: the tensor's smallest q), so u is unsigned: 4 bits where u < 16, else a byte. A
// row of x is cut into blocks of 32: s = max|x| / 127, xq = round(x / s). Then per group g of a row
//   sum_j W_j x_j ~ (d s) * sum_j u_j xq_j + (m + lo d) * (s * sum_j xq_j)
// where the first sum is exact in int32 (4 products of an unsigned and a signed byte per lane: one
// vpdpbusd with VNNI, else vpmaddubsw + vpmaddwd, as many products summed in int16 first as the codes'
// range allows (max_code: the largest u); codes of 128 and up by llama.cpp's sign trick) and the
// second is computed once per row of x and group. The weights are the file's own, exact;
// only x is rounded (~0.4% of a block's largest value per element).
//
// Layout: 16 rows of W side by side, one int32 lane each (one 512-bit register, two 256-bit ones), so a
// lane's 4 bytes are 4 consecutive k of its row and one broadcast of 4 bytes of xq serves all 16: no
// horizontal sums. u [N / 16, K / 4, 16,
// 4] bytes, or [N / 16, K / 8, 16, 4] of 4-bit pairs (byte b of a lane holds k = 8c + b in its low
// half, k = 8c + 4 + b in its high half); dm [N / 16, K / G, 2, 16] (d then m; [.., 1, 16]: d only,
// types without an offset) float32 or float16, or int8 in two levels, as the k-quants store them
// (Q4_K, Q5_K, Q6_K): d = D * c per group, c a small integer, D one float per 256 weights (m likewise),
// [N / 16, K / G + 4 * K / 256, 2 or 1, 16]: the groups' c, then each D as 4 byte planes (plane j: byte
// j of each lane's float). The kernel multiplies D * c in float32, as the file's dequantization does:
// the same scales, in 1.25 or 0.625 bits a weight instead of 2 (float32 d, m per 32) or 2 (d per 16).
//
// Every output is one lane accumulated over its groups in k order, whatever the number of rows or
// threads: a row's result never depends on the other rows (a 1-token decode and a K+1-token verify
// step agree bit for bit), and neither does a prefill chunk's on where it is cut. The integer sums are
// exact and each lane's float steps run in the same order on every target: every target computes
// the same bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <utility>

#include "kernels.h"

namespace tandem {
namespace TANDEM_ISA {
namespace {

using namespace simd;

constexpr int64_t TILE = 16;    // weight rows per tile: one int32 lane each
constexpr int64_t HALVES = TILE / kLanes;  // registers a tile's lanes take
constexpr int64_t XBLOCK = 32;  // values of x per int8 scale
// rows of x per register tile: 2 * HALVES * MR accumulators (float and int) and the weights fit
constexpr int64_t MR = kRegisters == 32 ? 8 : 3;

// x quantized: xq [M, K] int8, scale [M, K / 32], and per weight group the offset term's factor
// s * sum(xq) [M, K / G] and sum(xq) itself [M, K / G] (int32: the sign trick's correction)
struct QuantizedRows {
  at::Tensor xq, scale, sums, isums;
};

QuantizedRows quantize_rows(const at::Tensor& x, int64_t group) {
  const int64_t m = x.size(0), k = x.size(1), ldx = x.stride(0);
  QuantizedRows q{at::empty({m, k}, x.options().dtype(at::kChar)), at::empty({m, k / XBLOCK}, x.options()),
                  at::empty({m, k / group}, x.options()), at::empty({m, k / group}, x.options().dtype(at::kInt))};
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.xq.data_ptr<int8_t>();
  float* sp = q.scale.data_ptr<float>();
  float* gp = q.sums.data_ptr<float>();
  int32_t* ip = q.isums.data_ptr<int32_t>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < k / XBLOCK; ++b) {
        const float* src = xp + r * ldx + b * XBLOCK;
        F top = abs(loadu(src));
        for (int64_t i = kLanes; i < XBLOCK; i += kLanes) top = max(top, abs(loadu(src + i)));
        const float amax = reduce_max(top);
        const float s = amax / 127.0f;
        // round to nearest even (the default rounding mode), then narrow: |xq| <= 127
        alignas(64) int32_t vals[XBLOCK];
        round_to_i8(src, set1(amax > 0.0f ? 127.0f / amax : 0.0f), qp + r * k + b * XBLOCK, vals);
        sp[r * (k / XBLOCK) + b] = s;
        // per weight group: s times the sum of its xq (exact integers)
        for (int64_t g0 = 0; g0 < XBLOCK; g0 += group) {  // group: 16 or 32
          int32_t sum = 0;
          for (int64_t j = g0; j < g0 + group; ++j) sum += vals[j];
          gp[r * (k / group) + (b * XBLOCK + g0) / group] = s * (float)sum;
          ip[r * (k / group) + (b * XBLOCK + g0) / group] = sum;
        }
      }
  });
  return q;
}

struct Int8Args {
  int64_t n, k, group, lo, tile_bytes, tile_dm;  // bytes of one tile: u, dm
  bool nibbles, half, offset, wide, two_level;
};

inline I broadcast4(const int8_t* p) { return set1_i(*(const int32_t*)p); }

// 16 weight rows x R rows of x, over all of k; acc lanes are the 16 outputs of each row of x.
// Wide: 8-bit codes of 128 and up, where dot_u8s8_wide without VNNI needs 128 * sum(xq) added back.
// S: without VNNI, chunks of 8-bit codes whose products are summed in int16 (1, 2, 4: the codes' range).
template <int R, bool Nibbles, bool Wide, int S, int G, bool Two>
inline void int8_tile(const Int8Args& a, const uint8_t* u, const uint8_t* dm, const int8_t* xq, const float* xs,
                      const float* xg, const int32_t* xi, int64_t ldq, int64_t lds, int64_t ldg, const float* bias,
                      float* y, int64_t ldy, int64_t n0) {
  F acc[R][HALVES];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < HALVES; ++h) acc[r][h] = zero();
  const F lo = set1((float)a.lo);
  const int64_t groups = a.k / G, pair = a.offset ? 2 : 1;
  F big_d[HALVES], big_m[HALVES];  // two levels: the 256-weight block's D and M, read once per block
  for (int64_t g = 0; g < groups; ++g) {
    if (Two && g % (256 / G) == 0) {
      const uint8_t* planes = dm + (groups + 4 * (g * G / 256)) * pair * TILE;
      for (int h = 0; h < HALVES; ++h) {
        big_d[h] = from_byte_planes(planes + h * kLanes, pair * TILE);
        big_m[h] = a.offset ? from_byte_planes(planes + TILE + h * kLanes, pair * TILE) : zero();
      }
    }
    I dot[R][HALVES];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < HALVES; ++h) dot[r][h] = zero_i();
    const int64_t k0 = g * G;
    if (Nibbles) {
      const uint8_t* ug = u + (k0 / 8) * TILE * 4;
      // without VNNI: the group's products summed in int16 (at most 2 * G / 4 pairs of 15 * 127: 30480 for
      // G = 32), widened to int32 once
      I sums[R][HALVES];
      if (!kVnni)
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < HALVES; ++h) sums[r][h] = zero_i();
      for (int64_t c = 0; c < G / 8; ++c) {
        // with several rows the hardware prefetcher falls behind: fetch the next tile's line
        if (R > 1) prefetch(ug + c * TILE * 4 + a.tile_bytes);
        for (int h = 0; h < HALVES; ++h) {
          const I v = loadu_i(ug + c * TILE * 4 + h * kLanes * 4);
          const I wl = low_nibbles(v), wh = high_nibbles(v);
          for (int r = 0; r < R; ++r) {
            const int8_t* xk = xq + r * ldq + k0 + c * 8;
            if (kVnni) {
              dot[r][h] = dot_u8s8(dot[r][h], wl, broadcast4(xk));
              dot[r][h] = dot_u8s8(dot[r][h], wh, broadcast4(xk + 4));
            } else {
              sums[r][h] = add_i16(sums[r][h], add_i16(pair_sums(wl, broadcast4(xk)), pair_sums(wh, broadcast4(xk + 4))));
            }
          }
        }
      }
      if (!kVnni)
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < HALVES; ++h) dot[r][h] = widen_i16(sums[r][h]);
    } else if (!kVnni && !Wide && S > 1) {
      // codes below 2^15 / (2 * 127 * S): S chunks' products summed in int16 before widening; each row
      // reloads the weights from L1 rather than hold S x HALVES of them in registers
      const uint8_t* ug = u + (k0 / 4) * TILE * 4;
      for (int64_t c = 0; c < G / 4; c += S) {
        if (R > 1)
          for (int s = 0; s < S; ++s) prefetch(ug + (c + s) * TILE * 4 + a.tile_bytes);
        for (int h = 0; h < HALVES; ++h)
          for (int r = 0; r < R; ++r) {
            const int8_t* xk = xq + r * ldq + k0 + c * 4;
            I t = pair_sums(loadu_i(ug + c * TILE * 4 + h * kLanes * 4), broadcast4(xk));
            for (int s = 1; s < S; ++s)
              t = add_i16(t, pair_sums(loadu_i(ug + (c + s) * TILE * 4 + h * kLanes * 4), broadcast4(xk + 4 * s)));
            dot[r][h] = add_i(dot[r][h], widen_i16(t));
          }
      }
    } else {
      const uint8_t* ug = u + (k0 / 4) * TILE * 4;
      for (int64_t c = 0; c < G / 4; ++c) {
        if (R > 1) prefetch(ug + c * TILE * 4 + a.tile_bytes);
        for (int h = 0; h < HALVES; ++h) {
          const I w = loadu_i(ug + c * TILE * 4 + h * kLanes * 4);
          for (int r = 0; r < R; ++r) {
            const I x4 = broadcast4(xq + r * ldq + k0 + c * 4);
            dot[r][h] = Wide ? dot_u8s8_wide(dot[r][h], w, x4) : dot_u8s8(dot[r][h], w, x4);
          }
        }
      }
      if (Wide && !kVnni)  // the sign trick summed (u - 128) * xq
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < HALVES; ++h) dot[r][h] = add_i(dot[r][h], set1_i(128 * xi[r * ldg + g]));
    }
    const int64_t b = k0 / XBLOCK;
    for (int h = 0; h < HALVES; ++h) {
      // the group's d and m + lo d for these rows
      F d, mp;
      if (Two) {  // the group's int8 codes times its block's D and M
        const int8_t* c = (const int8_t*)dm + g * pair * TILE + h * kLanes;
        d = mul(big_d[h], from_i8(c));
        mp = a.offset ? fmadd(lo, d, mul(big_m[h], from_i8(c + TILE))) : mul(lo, d);
      } else if (a.half) {
        const uint16_t* p = (const uint16_t*)(dm + g * pair * TILE * 2) + h * kLanes;
        d = from_half(p);
        mp = a.offset ? fmadd(lo, d, from_half(p + TILE)) : mul(lo, d);
      } else {
        const float* p = (const float*)(dm + g * pair * TILE * 4) + h * kLanes;
        d = loadu(p);
        mp = a.offset ? fmadd(lo, d, loadu(p + TILE)) : mul(lo, d);
      }
      for (int r = 0; r < R; ++r) {
        const F ds = mul(d, set1(xs[r * lds + b]));
        acc[r][h] = fmadd(ds, to_float(dot[r][h]), acc[r][h]);
        acc[r][h] = fmadd(mp, set1(xg[r * ldg + g]), acc[r][h]);
      }
    }
  }
  const int64_t valid = std::min<int64_t>(TILE, a.n - n0);
  for (int h = 0; h < HALVES; ++h) {
    const M mask = first(valid - h * kLanes);
    const F bv = bias ? load(mask, bias + n0 + h * kLanes) : zero();
    for (int r = 0; r < R; ++r) store(mask, y + r * ldy + n0 + h * kLanes, bias ? add(acc[r][h], bv) : acc[r][h]);
  }
}

template <bool Nibbles, bool Wide, int S, int G, bool Two>
using Int8TileFn = void (*)(const Int8Args&, const uint8_t*, const uint8_t*, const int8_t*, const float*, const float*,
                            const int32_t*, int64_t, int64_t, int64_t, const float*, float*, int64_t, int64_t);

template <bool Nibbles, bool Wide, int S, int G, bool Two, size_t... R>
constexpr std::array<Int8TileFn<Nibbles, Wide, S, G, Two>, MR + 1> int8_tiles(std::index_sequence<R...>) {
  return {nullptr, int8_tile<R + 1, Nibbles, Wide, S, G, Two>...};
}

template <bool Nibbles, bool Wide, int S, int G, bool Two>
void run_int8(const Int8Args& a, const at::Tensor& u, const at::Tensor& dm, const QuantizedRows& xr,
              const float* bias, at::Tensor& y) {
  static constexpr auto tiles_of = int8_tiles<Nibbles, Wide, S, G, Two>(std::make_index_sequence<MR>{});
  const int64_t m = y.size(0), tiles = (a.n + TILE - 1) / TILE;
  const int64_t tile_u = a.tile_bytes, tile_dm = a.tile_dm;
  const uint8_t* up = (const uint8_t*)u.data_ptr();
  const uint8_t* dp = (const uint8_t*)dm.data_ptr();
  const int8_t* xq = xr.xq.data_ptr<int8_t>();
  const float* xs = xr.scale.data_ptr<float>();
  const float* xg = xr.sums.data_ptr<float>();
  const int32_t* xi = xr.isums.data_ptr<int32_t>();
  const int64_t ldq = a.k, lds = a.k / XBLOCK, ldg = a.k / G;
  float* yp = y.data_ptr<float>();
  // Split over weight tiles: each thread reads its share of W once per MR rows of x (from cache
  // after the first: a tile is 16 rows of K bytes).
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t m0 = 0; m0 < m; m0 += MR) {
        const int64_t r = std::min<int64_t>(MR, m - m0);
        tiles_of[r](a, up + t * tile_u, dp + t * tile_dm, xq + m0 * ldq, xs + m0 * lds, xg + m0 * ldg, xi + m0 * ldg,
                    ldq, lds, ldg, bias, yp + m0 * a.n, a.n, t * TILE);
      }
  });
}

}  // namespace

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& u, const at::Tensor& dm, int64_t lo, int64_t rows,
                       int64_t max_code, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "int8_linear: x must be a float32 [M, K] matrix with unit column stride");
  TORCH_CHECK(u.dim() == 4 && u.is_contiguous() && u.scalar_type() == at::kByte && u.size(2) == TILE && u.size(3) == 4,
              "int8_linear: u must be a contiguous uint8 [N / 16, K / 4 or K / 8, 16, 4] tensor");
  TORCH_CHECK(dm.dim() == 4 && dm.is_contiguous() && dm.size(0) == u.size(0) && dm.size(3) == TILE &&
                  (dm.size(2) == 1 || dm.size(2) == 2) &&
                  (dm.scalar_type() == at::kFloat || dm.scalar_type() == at::kHalf || dm.scalar_type() == at::kChar),
              "int8_linear: dm must be a contiguous float32, float16 or int8 (two-level) [N / 16, K / group, 2 or 1, 16] tensor");
  const int64_t k = x.size(1);
  const bool nibbles = u.size(1) * 8 == k;
  TORCH_CHECK(nibbles || u.size(1) * 4 == k, "int8_linear: u does not match x");
  const bool two_level = dm.scalar_type() == at::kChar;
  // two levels: K / G groups' codes and 4 byte planes per 256 weights
  const int64_t group_rows = two_level ? dm.size(1) - 4 * (k / 256) : dm.size(1);
  TORCH_CHECK(!two_level || k % 256 == 0, "int8_linear: two-level scales need K a multiple of 256");
  TORCH_CHECK(k % XBLOCK == 0 && group_rows > 0 && k % group_rows == 0,
              "int8_linear: K must be a multiple of 32 and of the group");
  const int64_t group = k / group_rows;
  TORCH_CHECK(group == 16 || group == 32, "int8_linear: groups of 16 or 32 weights");
  TORCH_CHECK(rows > (u.size(0) - 1) * TILE && rows <= u.size(0) * TILE, "int8_linear: rows does not match u");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == rows && bias->scalar_type() == at::kFloat,
                "int8_linear: bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  TORCH_CHECK(max_code >= 0 && max_code <= 255 && (!nibbles || max_code <= 15),
              "int8_linear: max_code is the largest code of u (4-bit: at most 15, else 255)");
  const bool wide = max_code > 127;
  const Int8Args a{rows, k, group, lo, k * TILE / (nibbles ? 2 : 1), dm.size(1) * dm.size(2) * TILE * (int64_t)dm.element_size(),
                   nibbles, dm.scalar_type() == at::kHalf, dm.size(2) == 2, wide, two_level};
  const at::Tensor xc = x.stride(0) == k ? x : x.contiguous();
  const QuantizedRows xr = quantize_rows(xc, group);
  at::Tensor y = at::empty({x.size(0), rows}, x.options());
  if (x.size(0) == 0) return y;
  // without VNNI: how many chunks of 8-bit codes may sum in int16 (each pair of products is at most
  // 2 * max_code * 127); with VNNI every product goes to int32 at once
  const int64_t fits = kVnni || max_code <= 0 ? 1 : 32767 / (254 * max_code);
  const auto by_group = [&](auto nibbles_, auto wide_, auto s_) {
    constexpr bool N = decltype(nibbles_)::value, W = decltype(wide_)::value;
    constexpr int S = decltype(s_)::value;
    // two-level scales (a compile-time form: its per-group product is the hot loop's) where the
    // k-quants have them: Q4_K (4-bit, groups of 32), Q5_K (8-bit, 32), Q6_K (8-bit, 16)
    if (two_level)
      group == 16 ? run_int8<N, W, S, 16, true>(a, u, dm, xr, b, y) : run_int8<N, W, S, 32, true>(a, u, dm, xr, b, y);
    else
      group == 16 ? run_int8<N, W, S, 16, false>(a, u, dm, xr, b, y) : run_int8<N, W, S, 32, false>(a, u, dm, xr, b, y);
  };
  using yes = std::true_type;
  using no = std::false_type;
  if (nibbles) by_group(yes{}, no{}, std::integral_constant<int, 1>{});
  else if (wide) by_group(no{}, yes{}, std::integral_constant<int, 1>{});
  else if (fits >= 4) by_group(no{}, no{}, std::integral_constant<int, 4>{});
  else if (fits >= 2) by_group(no{}, no{}, std::integral_constant<int, 2>{});
  else by_group(no{}, no{}, std::integral_constant<int, 1>{});
  return y;
}

}  // namespace TANDEM_ISA
}  // namespace tandem

TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, lib) {
  lib.def("int8_linear(Tensor x, Tensor u, Tensor dm, int lo, int rows, int max_code, Tensor? bias) -> Tensor");
}

TANDEM_LIBRARY_IMPL(TANDEM_OPS, CPU, lib) { lib.impl("int8_linear", tandem::TANDEM_ISA::int8_linear); }
