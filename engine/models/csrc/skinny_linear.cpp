// y = x @ W^T + b for the few rows of a decode or verify step (up to skinny.MAX_ROWS), float32, AVX-512.
//
// Why our own kernel: oneDNN's float32 GEMM at M=5 costs ~1.6x its M=1 path at these shapes, so a
// verify step of K+1 tokens cost far more than a decode step though both read the same weights.
// Here every weight vector loaded from memory is used by all rows of the step, so a 5-row step
// costs ~1.15-1.25x a 1-row step where the weights stream from memory.
//
// Every output element is one 16-lane accumulator over k in order, then a fixed horizontal sum:
// a row's result does not depend on how many other rows are in the step, nor on the thread split.
// So a 1-token decode and a K+1-token verify get bit-identical linear outputs for the same input.
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

template <int R>
inline void tile(const float* x, int64_t ldx, const float* const* wrows, int64_t k, const float* bias, float* y,
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
      for (int j = 0; j < NR; ++j) _mm_prefetch((const char*)(wrows[j] + NR * k + c * LANES), _MM_HINT_T0);
    __m512 w[NR];
    for (int j = 0; j < NR; ++j) w[j] = _mm512_loadu_ps(wrows[j] + c * LANES);
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
    for (int j = 0; j < NR; ++j) w[j] = _mm512_maskz_loadu_ps(mask, wrows[j] + full * LANES);
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

using TileFn = void (*)(const float*, int64_t, const float* const*, int64_t, const float*, float*, int64_t, int64_t,
                        int64_t);
constexpr TileFn kTiles[MR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "skinny_linear: x must be a float32 [M, K] matrix with unit column stride");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.size(1) == x.size(1),
              "skinny_linear: weight must be a contiguous float32 [N, K] matrix matching x");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == at::kFloat,
                "skinny_linear: bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), nblocks = (n + NR - 1) / NR;
  // Split over weight blocks only: each thread streams its own share of W once, for all rows.
  at::parallel_for(0, nblocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * NR, n_valid = std::min<int64_t>(NR, n - n0);
      const float* wrows[NR];
      for (int64_t j = 0; j < NR; ++j) wrows[j] = wp + std::min<int64_t>(n0 + j, n - 1) * k;  // tail repeats the last row
      for (int64_t m0 = 0; m0 < m; m0 += MR) {
        const int64_t rows = std::min<int64_t>(MR, m - m0);
        kTiles[rows](xp + m0 * ldx, ldx, wrows, k, b, yp + m0 * n, n, n0, n_valid);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(tandem, lib) {
  lib.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, lib) {
  lib.impl("skinny_linear", skinny_linear);
}
