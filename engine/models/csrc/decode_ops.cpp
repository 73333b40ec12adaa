// The parts of a decoder layer between its linears, for the few query rows of decode and verify steps:
// RMSNorm, rotary embedding + KV-cache write + attention, and the gated activation. In PyTorch these
// are ~60 small ops a layer, each a Python call and a dispatch; at batch 1 on a small model that
// overhead was as large as the linears themselves (benchmarks/decode_step.py).
//
// Every output row is computed on its own, in a fixed order that does not depend on how many rows the
// step has, so a 1-token decode and a K+1-token verify still agree bit for bit.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Optional.h>
#include <torch/library.h>
#include <immintrin.h>

#include "kernels.h"

#include <cmath>
#include <vector>

namespace {

constexpr int64_t LANES = 16;

// e^x for 16 floats: x = n ln2 + r, |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (< 2 ulp),
// times 2^n by scalef. Below -87.3 the result is 0, above 88.7 +inf.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 split in two: exact first part
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail_mask(int64_t left) { return left >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += LANES) {
    const __mmask16 m = tail_mask(n - i);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// y = x * rsqrt(mean(x^2) + eps) * (offset + w): Llama's norm (offset 0) and Gemma's (offset 1).
inline void rms_norm_row(const float* x, const float* w, float eps, float offset, int64_t n, float* y) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  const __m512 rv = _mm512_set1_ps(r), off = _mm512_set1_ps(offset);
  for (int64_t i = 0; i < n; i += LANES) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 h = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), rv);
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(h, _mm512_add_ps(off, _mm512_maskz_loadu_ps(m, w + i))));
  }
}

}  // namespace

namespace tandem {

void check_rows(const char* op, const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.is_contiguous(),
              op, ": expected a contiguous float32 [rows, features] tensor");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  check_rows("rms_norm", x);
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == n,
              "rms_norm: weight must be float32 [features]");
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) rms_norm_row(xp + r * n, wp, (float)eps, (float)offset, n, yp + r * n);
  return y;
}

// gate_up [rows, 2I] (gate | up) -> act(gate) * up [rows, I]; act is SiLU or tanh-approximated GELU.
at::Tensor gated_act(const at::Tensor& gate_up, bool gelu) {
  check_rows("gated_act", gate_up);
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * n, "gated_act: gate_up must have an even number of features");
  at::Tensor y = at::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float *g = gp + r * 2 * n, *u = g + n;
    for (int64_t i = 0; i < n; i += LANES) {
      const __mmask16 m = tail_mask(n - i);
      const __m512 x = _mm512_maskz_loadu_ps(m, g + i);
      // SiLU: x / (1 + e^-x). GELU (tanh form): 0.5 x (1 + tanh(y)) = x / (1 + e^-2y), which has no
      // cancellation where tanh(y) nears -1.
      __m512 z = _mm512_sub_ps(_mm512_setzero_ps(), x);
      if (gelu) {
        const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
        z = _mm512_mul_ps(_mm512_set1_ps(-2.0f * 0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
      }
      const __m512 a = _mm512_div_ps(x, _mm512_add_ps(one, exp16(z)));
      _mm512_mask_storeu_ps(yp + r * n + i, m, _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, u + i)));
    }
  }
  return y;
}

// Rotate-half rotary embedding of one head vector in place: x' = x * cos + rotate_half(x) * sin.
inline void rope(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// One step's attention for rows of B sequences x T new tokens, from the fused q|k|v projection.
// Writes each new token's key (normed, rotated) and value into the paged cache first (position p of
// row b: block tables[b][p / block_size], offset p % block_size), then each query reads keys [lo, pos]
// of its row, lo = pos - window + 1 for a sliding window layer (window 0: none). cos, sin: [B, T, D]
// rotary tables at those positions. The arithmetic does not depend on where a block lives.
at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& tables,
                            at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& cos, const at::Tensor& sin,
                            const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                            double eps, double norm_offset, int64_t num_heads, double scale, int64_t window) {
  check_rows("decode_attention", qkv);
  TORCH_CHECK(positions.dim() == 2 && positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "decode_attention: positions must be int64 [B, T]");
  const int64_t B = positions.size(0), T = positions.size(1);
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.size(0) == B,
              "decode_attention: block tables must be int64 [B, blocks]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "decode_attention: caches must be contiguous float32 [blocks, kv_heads, block_size, head_dim]");
  const int64_t num_blocks = k_cache.size(0), Hkv = k_cache.size(1), BS = k_cache.size(2), D = k_cache.size(3);
  const int64_t H = num_heads, NB = tables.size(1);
  TORCH_CHECK(BS > 0 && (BS & (BS - 1)) == 0, "decode_attention: block size must be a power of two");
  const int shift = __builtin_ctzll(static_cast<unsigned long long>(BS));
  TORCH_CHECK(H % Hkv == 0 && qkv.size(0) == B * T && qkv.size(1) == (H + 2 * Hkv) * D,
              "decode_attention: qkv must be [B * T, (heads + 2 kv_heads) * head_dim]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.numel() == B * T * D &&
                  sin.scalar_type() == at::kFloat && sin.is_contiguous() && sin.numel() == B * T * D,
              "decode_attention: cos and sin must be contiguous float32 [B, T, head_dim]");
  const float* qn = nullptr;
  const float* kn = nullptr;
  if (q_norm.has_value() && q_norm->defined()) {
    TORCH_CHECK(k_norm.has_value() && k_norm->defined() && q_norm->numel() == D && k_norm->numel() == D &&
                    q_norm->is_contiguous() && k_norm->is_contiguous(),
                "decode_attention: q_norm and k_norm come together, float32 [head_dim]");
    qn = q_norm->data_ptr<float>();
    kn = k_norm->data_ptr<float>();
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* table = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * NB; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "decode_attention: block id out of range");
  for (int64_t i = 0; i < B * T; ++i)
    TORCH_CHECK(pos[i] >= 0 && (pos[i] >> shift) < NB, "decode_attention: position outside its block table");
  const float *qkvp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  auto cache_at = [&](float* c, int64_t b, int64_t g, int64_t p) {
    return c + ((table[b * NB + (p >> shift)] * Hkv + g) * BS + (p & (BS - 1))) * D;
  };
  const int64_t width = qkv.size(1);

  for (int64_t row = 0; row < B * T; ++row) {  // this step's keys and values into the cache
    const int64_t b = row / T;
    const float* src = qkvp + row * width + H * D;
    for (int64_t g = 0; g < Hkv; ++g) {
      float* k = cache_at(kc, b, g, pos[row]);
      if (kn) rms_norm_row(src + g * D, kn, (float)eps, (float)norm_offset, D, k);
      else std::copy(src + g * D, src + (g + 1) * D, k);
      rope(k, cp + row * D, sp + row * D, D);
      std::copy(src + (Hkv + g) * D, src + (Hkv + g + 1) * D, cache_at(vc, b, g, pos[row]));
    }
  }

  at::Tensor out = at::empty({B * T, H * D}, qkv.options());
  float* op = out.data_ptr<float>();
  int64_t longest = 0;
  for (int64_t i = 0; i < B * T; ++i) longest = std::max(longest, pos[i] + 1);
  // one work item = one query row and head; split across threads only when there is enough of it
  const int64_t items = B * T * H, grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, longest * D));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> q(D), scores(longest);
    std::vector<const float*> keys(longest), values(longest);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / H, h = item % H, b = row / T, g = h / (H / Hkv);
      const float* src = qkvp + row * width + h * D;
      if (qn) rms_norm_row(src, qn, (float)eps, (float)norm_offset, D, q.data());
      else std::copy(src, src + D, q.data());
      rope(q.data(), cp + row * D, sp + row * D, D);
      const int64_t p = pos[row], lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0, n = p + 1 - lo;
      for (int64_t s = 0; s < n; ++s) {  // each position's key and value rows, through the block table
        keys[s] = cache_at(kc, b, g, lo + s);
        values[s] = cache_at(vc, b, g, lo + s);
      }
      float top = -INFINITY;
      for (int64_t s = 0; s < n; ++s) {
        scores[s] = dot(q.data(), keys[s], D) * (float)scale;
        top = std::max(top, scores[s]);
      }
      __m512 total = _mm512_setzero_ps();
      for (int64_t s = 0; s < n; s += LANES) {
        const __mmask16 m = tail_mask(n - s);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores.data() + s), _mm512_set1_ps(top)));
        _mm512_mask_storeu_ps(scores.data() + s, m, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
      }
      const float inv = 1.0f / _mm512_reduce_add_ps(total);
      float* o = op + row * H * D + h * D;
      for (int64_t i = 0; i < D; i += LANES) {  // D is a multiple of 16 in every model we serve
        const __mmask16 m = tail_mask(D - i);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t s = 0; s < n; ++s)
          acc = _mm512_fmadd_ps(_mm512_set1_ps(scores[s]), _mm512_maskz_loadu_ps(m, values[s] + i), acc);
        _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(acc, _mm512_set1_ps(inv)));
      }
    }
  });
  return out;
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem, lib) {
  lib.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor");
  lib.def("gated_act(Tensor gate_up, bool gelu) -> Tensor");
  lib.def("decode_attention(Tensor qkv, Tensor positions, Tensor tables, Tensor(a!) k_cache, Tensor(b!) v_cache, "
          "Tensor cos, Tensor sin, Tensor? q_norm, Tensor? k_norm, float eps, float norm_offset, int num_heads, "
          "float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, lib) {
  lib.impl("rms_norm", tandem::rms_norm);
  lib.impl("gated_act", tandem::gated_act);
  lib.impl("decode_attention", tandem::decode_attention);
}
