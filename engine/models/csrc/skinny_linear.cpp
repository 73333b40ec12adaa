// y = x @ W^T + b for the few rows of decode and verify steps (up to skinny.MAX_ROWS), AVX-512, with W
// either float32 or in int8 blocks (W = scale * q + offset, one (scale, offset) per `group` weights
// of a row: the exact form of every GGUF quantization we read, see gguf_blocks.py).
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
  static constexpr bool kPrefetchAlways = false;
  const float* rows[NR];
  int64_t k;
  __m512 load(int j, int64_t c) const { return _mm512_loadu_ps(rows[j] + c * LANES); }
  __m512 load_tail(int j, int64_t c, __mmask16 mask) const { return _mm512_maskz_loadu_ps(mask, rows[j] + c * LANES); }
  void prefetch_next(int j, int64_t c) const { _mm_prefetch((const char*)(rows[j] + NR * k + c * LANES), _MM_HINT_T0); }
};

// 16 weights of an int8 block: q widened to float32, times the group's scale, plus its offset (two
// roundings, as gguf-py dequantizes; -ffp-contract=off keeps the compiler from fusing them).
inline __m512 expand16(const int8_t* q, float scale, float offset) {
  const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
  return _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(scale), qf), _mm512_set1_ps(offset));
}

// Weight rows as int8 blocks.
struct Int8Rows {
  // A block's int8 rows are short streams (a quarter of float32's bytes), which the hardware
  // prefetcher picks up late: fetch the next block's lines at every row count.
  static constexpr bool kPrefetchAlways = true;
  const int8_t* rows[NR];
  const float* scale_offset[NR];  // [K / group, 2] per row
  int64_t k, group_shift;          // group = 1 << group_shift weights per (scale, offset)
  __m512 load(int j, int64_t c) const {
    const float* so = scale_offset[j] + 2 * ((c * LANES) >> group_shift);
    return expand16(rows[j] + c * LANES, so[0], so[1]);
  }
  __m512 load_tail(int j, int64_t c, __mmask16) const { return load(j, c); }  // K is a multiple of the group
  void prefetch_next(int j, int64_t c) const {
    if ((c & 3) == 0) {  // a line holds 4 chunks of q and 8 groups' (scale, offset) at 32 per group
      _mm_prefetch((const char*)(rows[j] + NR * k + c * LANES), _MM_HINT_T0);
      _mm_prefetch((const char*)(scale_offset[j] + NR * 2 * (k >> group_shift) + 2 * ((c * LANES) >> group_shift)), _MM_HINT_T0);
    }
  }
};

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
    if (R > 1 || Rows::kPrefetchAlways)
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
constexpr TileFn<Rows> kTiles[MR + 1] = {nullptr, tile<1, Rows>, tile<2, Rows>, tile<3, Rows>,
                                         tile<4, Rows>, tile<5, Rows>, tile<6, Rows>};

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
        kTiles<Rows>[r](xp + m0 * ldx, ldx, rows, k, b, yp + m0 * n, n, n0, n_valid);
      }
    }
  });
  return y;
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "skinny_linear: x must be a float32 [M, K] matrix with unit column stride");
}

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

// q [N, K] int8 with a (scale, offset) pair per `group` weights of a row.
void check_blocks(const char* op, const at::Tensor& q, const at::Tensor& scale_offset, int64_t group) {
  TORCH_CHECK(group >= LANES && (group & (group - 1)) == 0 && q.size(1) % group == 0,
              op, ": group must be a power of two >= 16 dividing K");
  TORCH_CHECK(scale_offset.scalar_type() == at::kFloat && scale_offset.is_contiguous() &&
                  scale_offset.numel() == q.size(0) * (q.size(1) / group) * 2,
              op, ": scale_offset must be a contiguous float32 [N, K / group, 2] tensor");
}

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale_offset, int64_t group,
                        const c10::optional<at::Tensor>& bias) {
  check_x(x);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(1) == x.size(1),
              "block_linear: q must be a contiguous int8 [N, K] matrix matching x");
  check_blocks("block_linear", q, scale_offset, group);
  const int64_t k = x.size(1), n = q.size(0);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale_offset.data_ptr<float>();
  const int64_t shift = __builtin_ctzll(group);
  return run<Int8Rows>(x, n, checked_bias(bias, n), [&](int64_t n0) {
    Int8Rows rows;
    rows.k = k;
    rows.group_shift = shift;
    for (int64_t j = 0; j < NR; ++j) {
      const int64_t row = std::min<int64_t>(n0 + j, n - 1);
      rows.rows[j] = qp + row * k;
      rows.scale_offset[j] = sp + row * (k / group) * 2;
    }
    return rows;
  });
}

// The float32 weights of int8 blocks (prefill: oneDNN reads them for one call), the same values
// the kernel expands in registers.
at::Tensor block_dequantize(const at::Tensor& q, const at::Tensor& scale_offset, int64_t group) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(), "block_dequantize: q must be int8 [N, K]");
  check_blocks("block_dequantize", q, scale_offset, group);
  const int64_t n = q.size(0), k = q.size(1);
  at::Tensor w = at::empty({n, k}, scale_offset.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale_offset.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      for (int64_t c = 0; c < k; c += LANES) {
        const float* so = sp + row * (k / group) * 2 + 2 * (c / group);
        _mm512_storeu_ps(wp + row * k + c, expand16(qp + row * k + c, so[0], so[1]));
      }
  });
  return w;
}

}  // namespace

TORCH_LIBRARY(tandem, lib) {
  lib.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  lib.def("block_linear(Tensor x, Tensor q, Tensor scale_offset, int group, Tensor? bias) -> Tensor");
  lib.def("block_dequantize(Tensor q, Tensor scale_offset, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, lib) {
  lib.impl("skinny_linear", skinny_linear);
  lib.impl("block_linear", block_linear);
  lib.impl("block_dequantize", block_dequantize);
}
