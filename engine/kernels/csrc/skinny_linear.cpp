// y = x @ W^T + b for the few rows of decode and verify steps (up to kernels.MAX_ROWS), with W
// either float32 or in blocks (W = scale * q + offset, q int8 or 4-bit, one (scale, offset) per `group`
// weights of a row: the exact form of every GGUF quantization we read, see gguf_blocks.py).
//
// Why our own kernel: oneDNN's float32 GEMM at M=5 costs ~1.6x its M=1 path at these shapes, so a
// verify step of K+1 tokens cost far more than a decode step though both read the same weights.
// Here every weight vector loaded from memory is used by all rows of the step, so a 5-row step
// costs ~1.15-1.25x a 1-row step where the weights stream from memory.
//
// Every output element is one accumulator of kLanes lanes over k in order, then a fixed horizontal sum:
// a row's result does not depend on how many other rows are in the step, nor on the thread split.
// So a 1-token decode and a K+1-token verify get bit-identical linear outputs for the same input.
// (Across targets the lanes and the sum's tree differ: the last bits may too.)
// The int8 path expands each kLanes weights in registers to the very float32 values the dequantized
// copy holds (a multiply, then an add: built with -ffp-contract=off so they are never fused) and
// then runs the same accumulation: its outputs equal the float32 path's bit for bit.
//
// The weight stays in nn.Linear's [N, K] layout; NR rows are streamed side by side with software
// prefetch of the next block.
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

constexpr int64_t NR = 4;  // weight rows per block, streamed side by side (reduce4 sums 4)
constexpr int64_t LANES = kLanes;
// rows of x per register tile: MR * NR accumulators + NR weights + 1 fit the registers
constexpr int64_t MR = kRegisters == 32 ? 6 : 2;

// Weight rows as float32: kLanes weights are one load.
struct F32Rows {
  const float* rows[NR];
  int64_t k;
  F load(int j, int64_t c) const { return loadu(rows[j] + c * LANES); }
  F load_tail(int j, int64_t c, M mask) const { return simd::load(mask, rows[j] + c * LANES); }
  void prefetch_next(int j, int64_t c) const { prefetch(rows[j] + NR * k + c * LANES); }
};

constexpr int64_t SPAN = 32;  // block rows are read 32 weights at a time: every GGUF block is 32 or 256

// Block weights in the kernel's layout: q either int8 (one byte a weight) or 4-bit (Nibbles: q = nibble
// + zero; in every 32 weights, byte j holds weight j in its low half and weight j + 16 in its high
// half), and (scale, offset) pairs either float32 or float16 (Half: where every pair of the tensor is
// exact in it), or scales alone (!Offset: types without an offset; adding their -0.0 changes nothing).
//
// Rows are interleaved by NR: q [N / NR, K / 32, NR, bytes of 32 weights], scales [N / NR, K / group,
// NR, pair], so each block of NR rows is one sequential stream. Separate rows of K = 576-640 int8
// weights (10 cache lines each) streamed at half the rate of long rows: the prefetchers never settled.
//
// 4-bit weights on 512-bit registers: the group's 16 float32 weights are computed once into a
// register (scale * q, then + offset, each rounded: the values of the dequantized copy) and each weight
// is a lane lookup (vpermps): per 16 weights a widen and a permute instead of a widen, a convert, a
// multiply and an add. On 256-bit registers (8 lanes, no 16-entry lookup) the same two roundings per
// weight.
template <bool Nibbles, bool Half, bool Offset>
struct BlockRows {
  static constexpr int64_t kSpanBytes = Nibbles ? SPAN / 2 : SPAN;
  static constexpr int64_t kPairBytes = (Half ? 2 : 4) * (Offset ? 2 : 1);
  static constexpr int64_t kPieces = SPAN / LANES;  // registers a span of one row takes
  const uint8_t* q;   // this block's [K / 32, NR, kSpanBytes]
  const uint8_t* so;  // this block's [K / group, NR, pair]
  int64_t group_shift;  // group = 1 << group_shift weights per (scale, offset)
  int32_t zero;         // Nibbles: q = nibble + zero
  static void pair(const uint8_t* p, F& scale, F& offset) {
    if (Half) {
      const __m128 f = _mm_cvtph_ps(Offset ? _mm_cvtsi32_si128(*(const int32_t*)p) : _mm_cvtsi32_si128(*(const uint16_t*)p));
      scale = set1(_mm_cvtss_f32(f));
      if (Offset) offset = set1(_mm_cvtss_f32(_mm_movehdup_ps(f)));
    } else {
      scale = set1(((const float*)p)[0]);
      if (Offset) offset = set1(((const float*)p)[1]);
    }
  }
  static F expand(F q, F scale, F offset) {  // q as float32
    return Offset ? add(mul(scale, q), offset) : mul(scale, q);
  }
  // weights [32 s + LANES p, 32 s + LANES (p + 1)) of row j
  F load_piece(int j, int64_t s, int p) const {
    F scale, offset;
    pair(so + (((s * SPAN + p * LANES) >> group_shift) * NR + j) * kPairBytes, scale, offset);
    const uint8_t* qs = q + (s * NR + j) * kSpanBytes;
    if (!Nibbles) return expand(from_i8(qs + p * LANES), scale, offset);
    // byte b of a span: weight b in its low half, weight b + 16 in its high half
#if defined(__AVX512F__)
    // vpermps reads the low 4 bits of each index: the byte widened is the low nibble's index as it
    // is, shifted right by 4 the high one's (no masking)
    const __m512i i = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)qs));
    const F levels = _mm512_cvtepi32_ps(_mm512_add_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(zero)));
    return _mm512_permutexvar_ps(p == 0 ? i : _mm512_srli_epi32(i, 4), expand(levels, scale, offset));
#else
    const I bytes = widen_u8(qs + (p % 2) * LANES);
    const I nibble = _mm256_and_si256(p < 2 ? bytes : _mm256_srli_epi32(bytes, 4), _mm256_set1_epi32(0x0F));
    return expand(to_float(_mm256_add_epi32(nibble, _mm256_set1_epi32(zero))), scale, offset);
#endif
  }
};

// The block tile: 32 weights of each of NR rows per iteration, accumulated piece by piece in the
// float32 tile's order (so its outputs equal the float32 kernel's on the dequantized weights).
template <int R, class Rows>
inline void block_tile(const float* x, int64_t ldx, const Rows& w_rows, int64_t k,
                       const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n_valid) {
  F acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = zero();
  for (int64_t s = 0; s < k / SPAN; ++s) {
    for (int p = 0; p < Rows::kPieces; ++p) {
      F w[NR];
      for (int j = 0; j < NR; ++j) w[j] = w_rows.load_piece(j, s, p);
      for (int r = 0; r < R; ++r) {
        F xv = loadu(x + r * ldx + s * SPAN + p * LANES);
        asm("" : "+v"(xv));
        for (int j = 0; j < NR; ++j) acc[r][j] = fmadd(xv, w[j], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(16) float sums[NR];
    _mm_store_ps(sums, reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    for (int j = 0; j < n_valid; ++j) y[r * ldy + n0 + j] = bias ? sums[j] + bias[n0 + j] : sums[j];
  }
}

template <int R, class Rows>
inline void tile(const float* x, int64_t ldx, const Rows& w_rows, int64_t k, const float* bias, float* y,
                 int64_t ldy, int64_t n0, int64_t n_valid) {
  F acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = zero();
  const int64_t full = k / LANES;
  for (int64_t c = 0; c < full; ++c) {
    // With several rows the loop runs long per weight line and the hardware prefetcher falls
    // behind; fetch the same lines of the next block (the next NR rows, which this thread reads
    // next). One row streams fine on its own.
    if (R > 1)
      for (int j = 0; j < NR; ++j) w_rows.prefetch_next(j, c);
    F w[NR];
    for (int j = 0; j < NR; ++j) w[j] = w_rows.load(j, c);
    for (int r = 0; r < R; ++r) {
      F xv = loadu(x + r * ldx + c * LANES);
      // Keep xv in a register: folded into each FMA as a memory operand it costs NR loads, and
      // the loop becomes load-bound (24 loads per 20 FMAs at R=5) instead of FMA-bound.
      asm("" : "+v"(xv));
      for (int j = 0; j < NR; ++j) acc[r][j] = fmadd(xv, w[j], acc[r][j]);
    }
  }
  if (full * LANES < k) {  // k tail: masked loads read zeros past the end
    const M mask = first(k - full * LANES);
    F w[NR];
    for (int j = 0; j < NR; ++j) w[j] = w_rows.load_tail(j, full, mask);
    for (int r = 0; r < R; ++r) {
      const F xv = simd::load(mask, x + r * ldx + full * LANES);
      for (int j = 0; j < NR; ++j) acc[r][j] = fmadd(xv, w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(16) float sums[NR];
    _mm_store_ps(sums, reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    for (int j = 0; j < n_valid; ++j) y[r * ldy + n0 + j] = bias ? sums[j] + bias[n0 + j] : sums[j];
  }
}

template <class Rows>
using TileFn = void (*)(const float*, int64_t, const Rows&, int64_t, const float*, float*, int64_t, int64_t, int64_t);
template <class Rows>
struct IsBlocks : std::false_type {};
template <bool Nibbles, bool Half, bool Offset>
struct IsBlocks<BlockRows<Nibbles, Half, Offset>> : std::true_type {};

// the tile of 1 ... MR rows of x, for float32 or block rows
template <class Rows, size_t... R>
constexpr std::array<TileFn<Rows>, MR + 1> tiles_of(std::index_sequence<R...>) {
  if constexpr (IsBlocks<Rows>::value) return {nullptr, block_tile<R + 1, Rows>...};
  else return {nullptr, tile<R + 1, Rows>...};
}
template <class Rows>
struct Tiles {
  static constexpr std::array<TileFn<Rows>, MR + 1> at = tiles_of<Rows>(std::make_index_sequence<MR>{});
};

const float* checked_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == at::kFloat,
              "skinny_linear: bias must be float32 [N]");
  return bias->data_ptr<float>();
}

// Split over weight blocks only: each thread streams its own share of W once, for all rows.
// make_rows(n0) gives the NR weight rows from n0 on (past N the last row repeats).
template <class Rows, class MakeRows>
at::Tensor run(const at::Tensor& x, int64_t n, const float* b, MakeRows make_rows) {
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), nblocks = (n + NR - 1) / NR;
  at::parallel_for(0, nblocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * NR, n_valid = std::min<int64_t>(NR, n - n0);
      const Rows rows = make_rows(n0);
      for (int64_t m0 = 0; m0 < m; m0 += MR) {
        const int64_t r = std::min<int64_t>(MR, m - m0);
        Tiles<Rows>::at[r](xp + m0 * ldx, ldx, rows, k, b, yp + m0 * n, n, n0, n_valid);
      }
    }
  });
  return y;
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "skinny_linear: x must be a float32 [M, K] matrix with unit column stride");
}

}  // namespace

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_x(x);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.size(1) == x.size(1),
              "skinny_linear: weight must be a contiguous float32 [N, K] matrix matching x");
  const int64_t k = x.size(1), n = weight.size(0);
  const float* wp = weight.data_ptr<float>();
  return run<F32Rows>(x, n, checked_bias(bias, n), [&](int64_t n0) {
    F32Rows rows;
    rows.k = k;
    for (int64_t j = 0; j < NR; ++j) rows.rows[j] = wp + std::min<int64_t>(n0 + j, n - 1) * k;
    return rows;
  });
}

// q [ceil(N / NR), K / 32, NR, 32] int8, or [.., 16] uint8 of 4-bit pairs; scale_offset [ceil(N / NR),
// K / group, NR, 2] (or [.., 1]: no offsets) float32 or float16; `rows` = N (the rest is padding).
struct BlockArgs {
  int64_t n, k, group;
  bool nibbles, half, offset;
};

BlockArgs check_blocks(const char* op, const at::Tensor& q, const at::Tensor& scale_offset, int64_t rows) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous() && q.size(2) == NR &&
                  ((q.scalar_type() == at::kChar && q.size(3) == SPAN) || (q.scalar_type() == at::kByte && q.size(3) == SPAN / 2)),
              op, ": q must be a contiguous int8 [N / 4, K / 32, 4, 32] or uint8 (4-bit pairs) [N / 4, K / 32, 4, 16] tensor");
  const int64_t k = q.size(1) * SPAN;
  TORCH_CHECK(rows > (q.size(0) - 1) * NR && rows <= q.size(0) * NR, op, ": rows does not match q");
  TORCH_CHECK((scale_offset.scalar_type() == at::kFloat || scale_offset.scalar_type() == at::kHalf) &&
                  scale_offset.is_contiguous() && scale_offset.dim() == 4 && scale_offset.size(0) == q.size(0) &&
                  scale_offset.size(1) > 0 && k % scale_offset.size(1) == 0 && scale_offset.size(2) == NR &&
                  (scale_offset.size(3) == 1 || scale_offset.size(3) == 2),
              op, ": scale_offset must be a contiguous float32 or float16 [N / 4, K / group, 4, 2] (or [.., 1]: no offsets) tensor");
  const int64_t group = k / scale_offset.size(1);
  TORCH_CHECK(group >= 16 && (group & (group - 1)) == 0, op, ": group must be a power of two >= 16");
  return {rows, k, group, q.scalar_type() == at::kByte, scale_offset.scalar_type() == at::kHalf, scale_offset.size(3) == 2};
}

// f(BlockRows<...>{}) for the block format of `a`
template <class F>
auto with_rows(const BlockArgs& a, F f) {
  if (a.nibbles) {
    if (a.half) return a.offset ? f(BlockRows<true, true, true>{}) : f(BlockRows<true, true, false>{});
    return a.offset ? f(BlockRows<true, false, true>{}) : f(BlockRows<true, false, false>{});
  }
  if (a.half) return a.offset ? f(BlockRows<false, true, true>{}) : f(BlockRows<false, true, false>{});
  return a.offset ? f(BlockRows<false, false, true>{}) : f(BlockRows<false, false, false>{});
}

// The rows of block `blk` (rows blk * NR ...) of q and scale_offset.
template <class Rows>
Rows block_rows(const BlockArgs& a, const at::Tensor& q, const at::Tensor& scale_offset, int64_t zero, int64_t blk) {
  Rows rows;
  rows.q = (const uint8_t*)q.data_ptr() + blk * (a.k / SPAN) * NR * Rows::kSpanBytes;
  rows.so = (const uint8_t*)scale_offset.data_ptr() + blk * (a.k / a.group) * NR * Rows::kPairBytes;
  rows.group_shift = __builtin_ctzll(a.group);
  rows.zero = (int32_t)zero;
  return rows;
}

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale_offset, int64_t zero,
                        int64_t rows, const c10::optional<at::Tensor>& bias) {
  check_x(x);
  const BlockArgs a = check_blocks("block_linear", q, scale_offset, rows);
  TORCH_CHECK(a.k == x.size(1), "block_linear: q does not match x");
  const float* b = checked_bias(bias, a.n);
  return with_rows(a, [&](auto tag) {
    using Rows = decltype(tag);
    return run<Rows>(x, a.n, b, [&](int64_t n0) { return block_rows<Rows>(a, q, scale_offset, zero, n0 / NR); });
  });
}

// The float32 weights [N, K] of blocks (prefill: oneDNN reads them for one call), the same values the
// kernel expands in registers.
at::Tensor block_dequantize(const at::Tensor& q, const at::Tensor& scale_offset, int64_t zero, int64_t rows) {
  const BlockArgs a = check_blocks("block_dequantize", q, scale_offset, rows);
  const int64_t k = a.k;
  at::Tensor w = at::empty({a.n, k}, scale_offset.options().dtype(at::kFloat));
  float* wp = w.data_ptr<float>();
  with_rows(a, [&](auto tag) {
    using Rows = decltype(tag);
    at::parallel_for(0, q.size(0), 4, [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; ++blk) {
        const Rows br = block_rows<Rows>(a, q, scale_offset, zero, blk);
        for (int64_t j = 0; j < NR && blk * NR + j < a.n; ++j)
          for (int64_t s = 0; s < k / SPAN; ++s)
            for (int p = 0; p < Rows::kPieces; ++p) storeu(wp + (blk * NR + j) * k + s * SPAN + p * LANES, br.load_piece(j, s, p));
      }
    });
    return 0;
  });
  return w;
}

}  // namespace TANDEM_ISA
}  // namespace tandem

TANDEM_LIBRARY(TANDEM_OPS, lib) {
  lib.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  lib.def("block_linear(Tensor x, Tensor q, Tensor scale_offset, int zero, int rows, Tensor? bias) -> Tensor");
  lib.def("block_dequantize(Tensor q, Tensor scale_offset, int zero, int rows) -> Tensor");
}

TANDEM_LIBRARY_IMPL(TANDEM_OPS, CPU, lib) {
  lib.impl("skinny_linear", tandem::TANDEM_ISA::skinny_linear);
  lib.impl("block_linear", tandem::TANDEM_ISA::block_linear);
  lib.impl("block_dequantize", tandem::TANDEM_ISA::block_dequantize);
}
