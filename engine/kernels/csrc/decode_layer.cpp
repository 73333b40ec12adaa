// One decoder layer of a decode or verify step as a single call: the layer's ops (csrc/kernels.h) in the
// order transformer.py runs them, so outputs equal the per-op path bit for bit. From Python the layer
// costs one call instead of ~20 (each linear, norm and residual add a Python call and a dispatch), which
// at batch 1 on a 135M model was a quarter of the step.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "kernels.h"

namespace tandem {
namespace TANDEM_ISA {
namespace {

// A linear's weights: packed blocks (q, scales, zero, rows), int8-kernel blocks (u, dm, lo, rows) or a
// dense float32 matrix.
struct LinearWeights {
  at::Tensor q, scale_offset, dense, u, dm;
  int64_t zero = 0, rows = 0;
  int64_t max_code = 255;  // int8 blocks: the largest code of u
  c10::optional<at::Tensor> bias;
  at::Tensor operator()(const at::Tensor& x) const {
    if (dense.defined()) return skinny_linear(x, dense, bias);
    if (u.defined()) return int8_linear(x, u, dm, zero, rows, max_code, bias);
    return block_linear(x, q, scale_offset, zero, rows, bias);
  }
};

// dst += src, element by element (one rounding each, as torch.add)
void add_into(at::Tensor& dst, const at::Tensor& src) {
  float* d = dst.data_ptr<float>();
  const float* s = src.data_ptr<float>();
  const int64_t n = dst.numel();
  int64_t i = 0;
  for (; i + simd::kLanes <= n; i += simd::kLanes) simd::storeu(d + i, simd::add(simd::loadu(d + i), simd::loadu(s + i)));
  for (; i < n; ++i) d[i] += s[i];
}

}  // namespace

struct DecodeLayer : torch::CustomClassHolder {
  static constexpr int64_t QKV = 0, O = 1, GATE_UP = 2, DOWN = 3;
  LinearWeights linears[4];
  std::vector<at::Tensor> norms;  // input, post-attention (Gemma: + pre- and post-feedforward)
  c10::optional<at::Tensor> q_norm, k_norm;
  int64_t heads, window;
  double scale, eps, norm_offset;
  bool gelu;

  DecodeLayer(int64_t heads, double scale, int64_t window, double eps, double norm_offset, bool gelu)
      : heads(heads), window(window), scale(scale), eps(eps), norm_offset(norm_offset), gelu(gelu) {}

  void set_linear(int64_t which, const c10::optional<at::Tensor>& q, const c10::optional<at::Tensor>& scale_offset,
                  int64_t zero, int64_t rows, const c10::optional<at::Tensor>& dense, const c10::optional<at::Tensor>& bias) {
    TORCH_CHECK(which >= 0 && which < 4, "DecodeLayer: no linear ", which);
    TORCH_CHECK(dense.has_value() != q.has_value(), "DecodeLayer: a linear has blocks or a dense weight");
    LinearWeights& w = linears[which];
    w = LinearWeights();
    w.q = q.value_or(at::Tensor()), w.scale_offset = scale_offset.value_or(at::Tensor());
    w.dense = dense.value_or(at::Tensor());
    w.zero = zero, w.rows = rows, w.bias = bias;
  }

  // the int8 kernel's blocks (gguf_blocks.Int8Blocks)
  void set_int8_linear(int64_t which, const at::Tensor& u, const at::Tensor& dm, int64_t lo, int64_t rows, int64_t max_code,
                       const c10::optional<at::Tensor>& bias) {
    TORCH_CHECK(which >= 0 && which < 4, "DecodeLayer: no linear ", which);
    LinearWeights& w = linears[which];
    w = LinearWeights();
    w.u = u, w.dm = dm, w.zero = lo, w.rows = rows, w.max_code = max_code, w.bias = bias;
  }

  void set_norms(std::vector<at::Tensor> layer_norms, const c10::optional<at::Tensor>& q, const c10::optional<at::Tensor>& k) {
    TORCH_CHECK(layer_norms.size() == 2 || layer_norms.size() == 4, "DecodeLayer: 2 or 4 layer norms");
    norms = std::move(layer_norms), q_norm = q, k_norm = k;
  }

  // x [rows, hidden] float32 -> the layer's output; writes this step's keys and values into the caches.
  // row_seqs: each row's block table, for ragged rows (decode_attention)
  at::Tensor forward(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& tables, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin,
                     const c10::optional<at::Tensor>& row_seqs) {
    TORCH_CHECK(!norms.empty(), "DecodeLayer: set_norms first");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
                "DecodeLayer: x must be a contiguous float32 [rows, hidden] tensor");
    const bool sandwich = norms.size() == 4;
    const at::Tensor qkv = linears[QKV](rms_norm(x, norms[0], eps, norm_offset));
    const at::Tensor attn = decode_attention(qkv, positions, tables, k_cache, v_cache, cos, sin, q_norm, k_norm, eps,
                                             norm_offset, heads, scale, window, row_seqs);
    at::Tensor out = linears[O](attn);
    if (sandwich) out = rms_norm(out, norms[1], eps, norm_offset);
    TORCH_CHECK(out.sizes() == x.sizes(), "DecodeLayer: o_proj does not map back to the hidden size");
    add_into(out, x);  // x + attention (the same sum either way round)
    const at::Tensor h = rms_norm(out, norms[sandwich ? 2 : 1], eps, norm_offset);
    at::Tensor mlp = linears[DOWN](gated_act(linears[GATE_UP](h), gelu));
    if (sandwich) mlp = rms_norm(mlp, norms[3], eps, norm_offset);
    add_into(out, mlp);
    return out;
  }
};

}  // namespace TANDEM_ISA
}  // namespace tandem

TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, lib) {
  using tandem::TANDEM_ISA::DecodeLayer;
  lib.class_<DecodeLayer>("DecodeLayer")
      .def(torch::init<int64_t, double, int64_t, double, double, bool>())
      .def("set_linear", &DecodeLayer::set_linear)
      .def("set_int8_linear", &DecodeLayer::set_int8_linear)
      .def("set_norms", &DecodeLayer::set_norms)
      .def("forward", &DecodeLayer::forward);
}
