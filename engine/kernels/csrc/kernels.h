// The CPU kernels one file of csrc/ calls from another (each is also an op of torch.ops.tandem_<target>).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "simd.h"

namespace tandem {
namespace TANDEM_ISA {

// skinny_linear.cpp: y = x @ W^T + b for up to 64 rows; W float32 [N, K] or packed blocks
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale_offset, int64_t zero,
                        int64_t rows, const c10::optional<at::Tensor>& bias);

// int8_linear.cpp: y = x @ W^T + b for any rows, W in blocks, x rounded to int8 per 32 values
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& u, const at::Tensor& dm, int64_t lo, int64_t rows,
                       int64_t max_code, const c10::optional<at::Tensor>& bias);

// decode_ops.cpp: the rest of a decode step's layer
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset);
at::Tensor gated_act(const at::Tensor& gate_up, bool gelu);
at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& tables,
                            at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& cos, const at::Tensor& sin,
                            const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                            double eps, double norm_offset, int64_t num_heads, double scale, int64_t window,
                            const c10::optional<at::Tensor>& row_seqs = c10::nullopt);

}  // namespace TANDEM_ISA
}  // namespace tandem
