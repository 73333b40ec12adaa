// y = x @ W^T + b for the few rows of decode and verify steps (up to skinny.MAX_ROWS), AVX-512, with W
// either float32 or in blocks (W = scale * q + offset, q int8 or 4-bit, one (scale, offset) per `group`
// weights of a row: the exact form of every GGUF quantization we read, see gguf_blocks.py).
//
// Why our own kernel: oneDNN's float32 GEMM at M=5 costs ~1.6x its M=1 path at these shapes, so a
// verify step of K+1 tokens cost far more than a decode step though both read the same weights.
// Here every weight vector loaded from memory is used by all rows of the step, so a 5-row step
// costs ~1.15-1.25x a 1-row step where the weights stream from memory.
//
// Every output element is one 16-lane accumulator over k in order, then a fixed horizontal sum:
// a row's result does not depend on how many other rows are in the step, nor on the thread split.
// So a 1-token decode and a K+1-token verify get bit-identical linear outputs for the same input.
// The int8 path expands each 16 weights in registers to the very float32 values the dequantized
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
#include <immintrin.h>

#include "kernels.h"

namespace {

constexpr int64_t NR = 4;     // weight rows per block, streamed side by side (reduce4 assumes 4)
constexpr int64_t LANES = 16; // floats per zmm register
constexpr int64_t MR = 6;     // rows of x per register tile: MR*NR accumulators + NR + 1 <= 32 registers

// The four horizontal sums of a, b, c, d in one vector, in a fixed order of additions (a quarter
// of the shuffles and adds of four separate reductions; the tail of every tile runs this).
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // 128-bit quarters: ab = [a0+a2, a1+a3, b0+b2, b1+b3], cd likewise
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // quarters: [a, b, c, d], each 4 partial sums
  const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  // within each quarter: [x0+x1, x0+x1, x2+x3, x2+x3], then add the swapped pair
  const __m512 h = _mm512_add_ps(q, _mm512_permute_ps(q, 0xB1));
  const __m512 t = _mm512_add_ps(h, _mm512_permute_ps(h, 0x4E));
  // lane 0 of each quarter
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), t));
}

// Weight rows as float32: 16 weights are one load.
struct F32Rows {
  const float* rows[NR];
  int64_t k;
  __m512 load(int j, int64_t c) const { return _mm512_loadu_ps(rows[j] + c * LANES); }
  __m512 load_tail(int j, int64_t c, __mmask16 mask) const { return _mm512_maskz_loadu_ps(mask, rows[j] + c * LANES); }
  void prefetch_next(int j, int64_t c) const { _mm_prefetch((const char*)(rows[j] + NR * k + c * LANES), _MM_HINT_T0); }
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
// 4-bit weights take 16 values per group, so the group's 16 float32 weights are computed once into a
// register (scale * q, then + offset, each rounded: the values of the dequantized copy) and each
// weight is a lane lookup (vpermps): per 16 weights a widen and a permute instead of a widen, a
// convert, a multiply and an add.
template <bool Nibbles, bool Half, bool Offset>
struct BlockRows {
  static constexpr int64_t kSpanBytes = Nibbles ? SPAN / 2 : SPAN;
  static constexpr int64_t kPairBytes = (Half ? 2 : 4) * (Offset ? 2 : 1);
  const uint8_t* q;   // this block's [K / 32, NR, kSpanBytes]
  const uint8_t* so;  // this block's [K / group, NR, pair]
  int64_t group_shift;  // group = 1 << group_shift weights per (scale, offset)
  __m512 levels;        // Nibbles: the 16 values of q, as float32 (nibble + zero)
  static void pair(const uint8_t* p, __m512& scale, __m512& offset) {
    if (Half) {
      const __m128 f = _mm_cvtph_ps(Offset ? _mm_cvtsi32_si128(*(const int32_t*)p) : _mm_cvtsi32_si128(*(const uint16_t*)p));
      scale = _mm512_broadcastss_ps(f);
      if (Offset) offset = _mm512_broadcastss_ps(_mm_movehdup_ps(f));
    } else {
      scale = _mm512_set1_ps(((const float*)p)[0]);
      if (Offset) offset = _mm512_set1_ps(((const float*)p)[1]);
    }
  }
  static __m512 expand(__m512 q, __m512 scale, __m512 offset) {  // q as float32
    return Offset ? _mm512_add_ps(_mm512_mul_ps(scale, q), offset) : _mm512_mul_ps(scale, q);
  }
  // weights [32 s, 32 s + 32) of row j: two groups' pairs when the group is 16, else one
  void load_span(int j, int64_t s, __m512& w0, __m512& w1) const {
    const int64_t g0 = (s * SPAN) >> group_shift, g1 = (s * SPAN + LANES) >> group_shift;
    __m512 scale, offset;
    pair(so + (g0 * NR + j) * kPairBytes, scale, offset);
    const uint8_t* qs = q + (s * NR + j) * kSpanBytes;
    if (Nibbles) {
      // vpermps reads the low 4 bits of each index: the byte widened is the low nibble's index as
      // it is, shifted right by 4 the high one's (no masking)
      const __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)qs));
      const __m512i i1 = _mm512_srli_epi32(i0, 4);
      const __m512 table = expand(levels, scale, offset);
      w0 = _mm512_permutexvar_ps(i0, table);
      if (g1 != g0) {
        pair(so + (g1 * NR + j) * kPairBytes, scale, offset);
        w1 = _mm512_permutexvar_ps(i1, expand(levels, scale, offset));
      } else {
        w1 = _mm512_permutexvar_ps(i1, table);
      }
    } else {
      w0 = expand(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qs))), scale, offset);
      if (g1 != g0) pair(so + (g1 * NR + j) * kPairBytes, scale, offset);
      w1 = expand(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qs + LANES)))), scale, offset);
    }
  }
};

// The block tile: 32 weights of each of NR rows per iteration, accumulated chunk by chunk in the
// float32 tile's order (so its outputs equal the float32 kernel's on the dequantized weights).
template <int R, class Rows>
inline void block_tile(const float* x, int64_t ldx, const Rows& w_rows, int64_t k,
                       const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n_valid) {
  __m512 acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < k / SPAN; ++s) {
    __m512 w0[NR], w1[NR];
    for (int j = 0; j < NR; ++j) w_rows.load_span(j, s, w0[j], w1[j]);
    for (int r = 0; r < R; ++r) {
      __m512 xv = _mm512_loadu_ps(x + r * ldx + s * SPAN);
      asm("" : "+v"(xv));
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w0[j], acc[r][j]);
    }
    for (int r = 0; r < R; ++r) {
      __m512 xv = _mm512_loadu_ps(x + r * ldx + s * SPAN + LANES);
      asm("" : "+v"(xv));
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w1[j], acc[r][j]);
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
  __m512 acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t full = k / LANES;
  for (int64_t c = 0; c < full; ++c) {
    // With several rows the loop runs long per weight line and the hardware prefetcher falls
    // behind; fetch the same lines of the next block (the next NR rows, which this thread reads
    // next). One row streams fine on its own.
    if (R > 1)
      for (int j = 0; j < NR; ++j) w_rows.prefetch_next(j, c);
    __m512 w[NR];
    for (int j = 0; j < NR; ++j) w[j] = w_rows.load(j, c);
    for (int r = 0; r < R; ++r) {
      __m512 xv = _mm512_loadu_ps(x + r * ldx + c * LANES);
      // Keep xv in a register: folded into each FMA as a memory operand it costs NR loads, and
      // the loop becomes load-bound (24 loads per 20 FMAs at R=5) instead of FMA-bound.
      asm("" : "+v"(xv));
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
  if (full * LANES < k) {  // k tail: masked loads read zeros past the end
    const __mmask16 mask = (__mmask16)((1u << (k - full * LANES)) - 1);
    __m512 w[NR];
    for (int j = 0; j < NR; ++j) w[j] = w_rows.load_tail(j, full, mask);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * ldx + full * LANES);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
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
struct Tiles {
  static constexpr TileFn<Rows> at[MR + 1] = {nullptr, tile<1, Rows>, tile<2, Rows>, tile<3, Rows>,
                                              tile<4, Rows>, tile<5, Rows>, tile<6, Rows>};
};
template <bool Nibbles, bool Half, bool Offset>
struct Tiles<BlockRows<Nibbles, Half, Offset>> {
  using Rows = BlockRows<Nibbles, Half, Offset>;
  static constexpr TileFn<Rows> at[MR + 1] = {nullptr, block_tile<1, Rows>, block_tile<2, Rows>, block_tile<3, Rows>,
                                              block_tile<4, Rows>, block_tile<5, Rows>, block_tile<6, Rows>};
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

namespace tandem {

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
  TORCH_CHECK(group >= LANES && (group & (group - 1)) == 0, op, ": group must be a power of two >= 16");
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
  rows.levels = _mm512_cvtepi32_ps(_mm512_add_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32((int32_t)zero)));
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
          for (int64_t s = 0; s < k / SPAN; ++s) {
            __m512 w0, w1;
            br.load_span(j, s, w0, w1);
            _mm512_storeu_ps(wp + (blk * NR + j) * k + s * SPAN, w0);
            _mm512_storeu_ps(wp + (blk * NR + j) * k + s * SPAN + LANES, w1);
          }
      }
    });
    return 0;
  });
  return w;
}

}  // namespace tandem

TORCH_LIBRARY(tandem, lib) {
  lib.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  lib.def("block_linear(Tensor x, Tensor q, Tensor scale_offset, int zero, int rows, Tensor? bias) -> Tensor");
  lib.def("block_dequantize(Tensor q, Tensor scale_offset, int zero, int rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, lib) {
  lib.impl("skinny_linear", tandem::skinny_linear);
  lib.impl("block_linear", tandem::block_linear);
  lib.impl("block_dequantize", tandem::block_dequantize);
}
