// A grammar's token bitmask applied to logits in place (structured outputs): -inf at every token
// whose bit is 0. Reads one 32-bit word per 32 tokens and writes only the refused tokens: a word of
// ones (inside a JSON string: most of them) costs one compare, a word of zeros (a grammar's usual
// state: few tokens allowed) a run of 32 stores. The PyTorch version of the same (engine/
// grammar_masks.py apply_bitmask) needs a handful of nonzero/index ops and ~0.35 ms a row at 262k.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "simd.h"

namespace tandem {
namespace TANDEM_ISA {

void apply_token_bitmask(at::Tensor logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits: a float32 [N, V] tensor with contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows: int64 [n]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
              bitmask.size(0) == rows.size(0), "bitmask: int32 [n, W], one row per entry of rows");
  const int64_t n = rows.size(0), V = logits.size(1), W = bitmask.size(1), N = logits.size(0);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(0 <= r[i] && r[i] < N, "rows: index out of range");
  float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const uint32_t* words = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float refused = -INFINITY;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = base + r[i] * stride;
      const uint32_t* mask = words + i * W;
      const int64_t covered = std::min<int64_t>(W * 32, V);
      for (int64_t w = 0; w * 32 < covered; ++w) {
        const uint32_t x = mask[w];
        if (x == 0xFFFFFFFFu) continue;
        const int64_t first = w * 32, last = std::min<int64_t>(first + 32, covered);
        if (x == 0) {
          std::fill(row + first, row + last, refused);
          continue;
        }
        for (int64_t t = first; t < last; ++t)
          if (!((x >> (t - first)) & 1u)) row[t] = refused;
      }
      std::fill(row + covered, row + V, refused);  // tokens past the bitmask's bits: never allowed
    }
  });
}

}  // namespace TANDEM_ISA
}  // namespace tandem

TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, lib) {
  lib.def("apply_token_bitmask(Tensor(a!) logits, Tensor rows, Tensor bitmask) -> ()");
}

TANDEM_LIBRARY_IMPL(TANDEM_OPS, CPU, lib) {
  lib.impl("apply_token_bitmask", tandem::TANDEM_ISA::apply_token_bitmask);
}
