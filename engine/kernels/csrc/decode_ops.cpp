// The parts of a decoder layer between its linears, for the few query rows of decode and verify steps:
// RMSNorm, rotary embedding + KV-cache write + attention, and the gated activation. In PyTorch these
// are ~60 small ops a layer, each a Python call and a dispatch; at batch 1 on a small model that
// overhead was as large as the linears themselves (benchmarks/decode_step.py).
//
// Every output row is computed on its own, in a fixed order that does not depend on how many rows the
// step has, so a 1-token decode and a K+1-token verify still agree bit for bit (on one target; across
// targets the last bits of a sum may differ, simd.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace tandem {
namespace TANDEM_ISA {
namespace {

using namespace simd;
constexpr int64_t LANES = kLanes;

// e^x lane by lane: x = n ln2 + r, |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (< 2 ulp), times
// 2^n. Below -87.3 the result is 0 or tiny, above 88.7 +inf.
inline F exp_lanes(F x) {
  x = min(max(x, set1(-88.0f)), set1(88.7f));
  const F n = round_even(mul(x, set1(1.44269504088896341f)));
  F r = fnmadd(n, set1(0.693359375f), x);  // ln2 split in two: exact first part
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  F p = set1(1.0f / 720);
  p = fmadd(p, r, set1(1.0f / 120));
  p = fmadd(p, r, set1(1.0f / 24));
  p = fmadd(p, r, set1(1.0f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  return scale_pow2(p, n);
}

// rows per thread for an op of n features a row: below ~64K values a thread's start costs more than the work
inline int64_t row_grain(int64_t n) { return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, n)); }

inline float dot(const float* a, const float* b, int64_t n) {
  F acc = zero();
  for (int64_t i = 0; i < n; i += LANES) {
    const M m = first(n - i);
    acc = fmadd(load(m, a + i), load(m, b + i), acc);
  }
  return reduce_add(acc);
}

// q . k[l] for kLanes keys: kLanes running sums over the d values, then one transposing reduction that
// adds each key's lanes in the same tree, so a score doesn't depend on the keys beside it.
inline F dot_keys(const float* q, const float* const* k, int64_t d) {
  F acc[LANES];
  for (int64_t l = 0; l < LANES; ++l) acc[l] = zero();
  for (int64_t i = 0; i < d; i += LANES) {
    const M m = first(d - i);
    const F qi = load(m, q + i);
    for (int64_t l = 0; l < LANES; ++l) acc[l] = fmadd(qi, load(m, k[l] + i), acc[l]);
  }
  return transpose_sums(acc);
}

// y = x * rsqrt(mean(x^2) + eps) * (offset + w): Llama's norm (offset 0) and Gemma's (offset 1).
inline void rms_norm_row(const float* x, const float* w, float eps, float offset, int64_t n, float* y) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  const F rv = set1(r), off = set1(offset);
  for (int64_t i = 0; i < n; i += LANES) {
    const M m = first(n - i);
    const F h = mul(load(m, x + i), rv);
    store(m, y + i, mul(h, add(off, load(m, w + i))));
  }
}

}  // namespace

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
  // rows split across threads only for a prefill's many rows; each row's arithmetic is the same either way
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * n, wp, (float)eps, (float)offset, n, yp + r * n);
  });
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
  const F one = set1(1.0f);
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *g = gp + r * 2 * n, *u = g + n;
      for (int64_t i = 0; i < n; i += LANES) {
        const M m = first(n - i);
        const F x = load(m, g + i);
        // SiLU: x / (1 + e^-x). GELU (tanh form): 0.5 x (1 + tanh(y)) = x / (1 + e^-2y), which has no
        // cancellation where tanh(y) nears -1.
        F z = sub(zero(), x);
        if (gelu) {
          const F x3 = mul(mul(x, x), x);
          z = mul(set1(-2.0f * 0.7978845608028654f), fmadd(set1(0.044715f), x3, x));
        }
        const F a = div(x, add(one, exp_lanes(z)));
        store(m, yp + r * n + i, mul(a, load(m, u + i)));
      }
    }
  });
  return y;
}

// o[0:D] += w[s] * values[s][0:D] for s in [from, to), in that order in every lane; the running sums stay in
// registers across the keys, C registers of columns [col, col + C * kLanes) at a time.
template <int C>
inline void accumulate_fixed(float* o, const float* w, const float* const* values, int64_t from, int64_t to, int64_t col) {
  F acc[C];
  for (int c = 0; c < C; ++c) acc[c] = loadu(o + col + c * LANES);
  for (int64_t s = from; s < to; ++s) {
    const F ws = set1(w[s]);
    for (int c = 0; c < C; ++c) acc[c] = fmadd(ws, loadu(values[s] + col + c * LANES), acc[c]);
  }
  for (int c = 0; c < C; ++c) storeu(o + col + c * LANES, acc[c]);
}

inline void accumulate_values(float* o, const float* w, const float* const* values, int64_t from, int64_t to, int64_t d) {
  const int64_t chunks = d / LANES;
  if (d % LANES == 0 && (chunks == 4 || chunks == 8 || chunks == 16 || chunks == 32)) {  // head sizes we serve
    // a pass holds at most half the registers (256-wide heads take two passes on 16 registers)
    const int64_t per = std::min<int64_t>(chunks, kRegisters / 2);
    for (int64_t c = 0; c < chunks; c += per) {
      if (per == 4) accumulate_fixed<4>(o, w, values, from, to, c * LANES);
      else if (per == 8) accumulate_fixed<8>(o, w, values, from, to, c * LANES);
      else accumulate_fixed<16>(o, w, values, from, to, c * LANES);
    }
    return;
  }
  for (int64_t i = 0; i < d; i += LANES) {
    const M m = first(d - i);
    F acc = load(m, o + i);
    for (int64_t s = from; s < to; ++s) acc = fmadd(set1(w[s]), load(m, values[s] + i), acc);
    store(m, o + i, acc);
  }
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
                            double eps, double norm_offset, int64_t num_heads, double scale, int64_t window,
                            const c10::optional<at::Tensor>& row_seqs) {
  check_rows("decode_attention", qkv);
  TORCH_CHECK(positions.dim() == 2 && positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "decode_attention: positions must be int64 [B, T]");
  const int64_t B = positions.size(0), T = positions.size(1);
  // each row's sequence (its block table): row / T, or row_seqs[row] for ragged rows ([1, N] positions: a
  // step's rows of different lengths, each sequence's rows consecutive)
  const bool ragged = row_seqs.has_value() && row_seqs->defined();
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous() &&
                  (ragged || tables.size(0) == B),
              "decode_attention: block tables must be int64 [B, blocks]");
  const int64_t num_seqs = tables.size(0);
  const int64_t* seq_of = nullptr;
  if (ragged) {
    TORCH_CHECK(row_seqs->dim() == 1 && row_seqs->scalar_type() == at::kLong && row_seqs->is_contiguous() &&
                    row_seqs->numel() == B * T,
                "decode_attention: row_seqs must be int64 [rows]");
    seq_of = row_seqs->data_ptr<int64_t>();
    for (int64_t i = 0; i < B * T; ++i)
      TORCH_CHECK(seq_of[i] >= 0 && seq_of[i] < num_seqs, "decode_attention: row_seqs names no block table");
  }
  auto seq_at = [&](int64_t row) { return seq_of ? seq_of[row] : row / T; };
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
  for (int64_t i = 0; i < num_seqs * NB; ++i)
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
    const int64_t b = seq_at(row);
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
  // Work item: a tile of query vectors (up to ROW_TILE rows of one sequence x heads of one kv head), so
  // each key and value row read from L2 serves every query of the tile from L1: at 512 prompt rows
  // re-reading the keys per query made attention memory-bound (2.5x SDPA). A query's arithmetic is the
  // same in any tile, so a token's output doesn't depend on the rows beside it.
  constexpr int64_t ROW_TILE = 16;
  struct Tile {
    int64_t seq, r0, r1;
  };
  std::vector<Tile> tiles;  // each sequence's consecutive rows, by ROW_TILE
  std::vector<int64_t> seq_tiles_end;  // where each sequence's run of tiles ends in `tiles`
  for (int64_t r0 = 0; r0 < B * T;) {
    const int64_t b = seq_at(r0);
    int64_t end = r0 + 1;
    while (end < B * T && seq_at(end) == b) ++end;
    for (int64_t r = r0; r < end; r += ROW_TILE) tiles.push_back({b, r, std::min(end, r + ROW_TILE)});
    seq_tiles_end.push_back(static_cast<int64_t>(tiles.size()));
    r0 = end;
  }
  const int64_t G = H / Hkv, num_tiles = static_cast<int64_t>(tiles.size());
  // fewer heads a tile only where there would be fewer tiles than threads: a decode step's attention
  // is bound by reading the keys and values (at 1000 positions ~1.5 MB a layer), once per tile
  int64_t heads_per_tile = G;
  const int64_t threads = at::get_num_threads();
  while (heads_per_tile % 2 == 0 && num_tiles * Hkv * (G / heads_per_tile) < threads) heads_per_tile /= 2;
  if (num_tiles * Hkv * (G / heads_per_tile) < threads) heads_per_tile = 1;
  const int64_t head_tiles = G / heads_per_tile;
  // Work item: (tile, kv head, head tile). Causal rows: a late tile reads more keys; within each
  // sequence late and early tiles alternate across the range, so the contiguous shares of the threads
  // are even.
  struct Item {
    int64_t tile, g, ht;
  };
  std::vector<Item> work;
  work.reserve(num_tiles * Hkv * head_tiles);
  for (size_t s = 0, first_tile = 0; s < seq_tiles_end.size(); first_tile = seq_tiles_end[s++]) {
    const int64_t row_tiles = seq_tiles_end[s] - first_tile, per_seq = Hkv * head_tiles * row_tiles;
    for (int64_t rest = 0; rest < per_seq; ++rest) {
      const int64_t t_idx = rest % 2 == 0 ? rest / 2 : per_seq - 1 - rest / 2;
      work.push_back({static_cast<int64_t>(first_tile) + t_idx % row_tiles, t_idx / (row_tiles * head_tiles),
                      (t_idx / row_tiles) % head_tiles});
    }
  }
  const int64_t items = static_cast<int64_t>(work.size());
  int64_t longest = 0;
  for (int64_t i = 0; i < B * T; ++i) longest = std::max(longest, pos[i] + 1);
  // one thread where the whole step is smaller than a thread's start-up is worth
  const int64_t grain = B * T * H * longest * D < (1 << 16) ? items : 1;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> q, scores;
    std::vector<const float*> keys, values;
    for (int64_t item = begin; item < end; ++item) {
      const Tile& tile = tiles[work[item].tile];
      const int64_t b = tile.seq, r0 = tile.r0, r1 = tile.r1, g = work[item].g, ht = work[item].ht;
      const int64_t h0 = g * G + ht * heads_per_tile, nq = (r1 - r0) * heads_per_tile;
      int64_t first = INT64_MAX, last = 0;  // keys any query of the tile reads
      for (int64_t row = r0; row < r1; ++row) {
        first = std::min(first, window > 0 ? std::max<int64_t>(0, pos[row] - window + 1) : 0);
        last = std::max(last, pos[row]);
      }
      const int64_t span = last + 1 - first;
      const int64_t stride = span + 2 * LANES;  // a query's scores at [LANES, LANES + span): groups may start before
      q.resize(nq * D), scores.resize(nq * stride), keys.resize(span), values.resize(span);
      for (int64_t s = 0; s < span; ++s) {
        keys[s] = cache_at(kc, b, g, first + s);
        values[s] = cache_at(vc, b, g, first + s);
      }
      for (int64_t j = 0; j < nq; ++j) {  // queries: normed, rotated
        const int64_t row = r0 + j / heads_per_tile, h = h0 + j % heads_per_tile;
        const float* src = qkvp + row * width + h * D;
        float* qj = q.data() + j * D;
        if (qn) rms_norm_row(src, qn, (float)eps, (float)norm_offset, D, qj);
        else std::copy(src, src + D, qj);
        rope(qj, cp + row * D, sp + row * D, D);
      }
      auto visible = [&](int64_t j, int64_t& lo, int64_t& n) {  // query j reads keys [lo, lo + n) of the span
        const int64_t p = pos[r0 + j / heads_per_tile];
        lo = (window > 0 ? std::max<int64_t>(0, p - window + 1) : 0) - first, n = p - first + 1 - lo;
      };
      // scores, for the kLanes keys of each aligned group of positions at once (a key's lane is its position
      // mod kLanes, whatever the tile), every query of the tile in turn while the group sits in L1
      for (int64_t at = first & ~(LANES - 1); at <= last; at += LANES) {
        const float* group[LANES];
        for (int64_t l = 0; l < LANES; ++l) group[l] = keys[std::clamp<int64_t>(at + l - first, 0, span - 1)];
        for (int64_t j = 0; j < nq; ++j) {
          int64_t lo, n;
          visible(j, lo, n);
          const int64_t base = at - first, from = std::max(base, lo) - base, to = std::min(base + LANES, lo + n) - base;
          if (from >= to) continue;
          store(lanes(from, to), scores.data() + j * stride + LANES + base,
                mul(dot_keys(q.data() + j * D, group, D), set1((float)scale)));
        }
      }
      for (int64_t j = 0; j < nq; ++j) {  // softmax weights, unnormalised; the sum's lanes start at lo
        int64_t lo, n;
        visible(j, lo, n);
        float* sc = scores.data() + j * stride + LANES + lo;
        float top = -INFINITY;
        for (int64_t s = 0; s < n; ++s) top = std::max(top, sc[s]);
        F total = zero();
        for (int64_t s = 0; s < n; s += LANES) {
          const M m = simd::first(n - s);
          const F e = exp_lanes(sub(load(m, sc + s), set1(top)));
          store(m, sc + s, e);
          total = add(total, keep(m, e));
        }
        // the normaliser waits in q (no longer needed) until the values are summed
        q[j * D] = 1.0f / reduce_add(total);
      }
      auto out_of = [&](int64_t j) { return op + (r0 + j / heads_per_tile) * H * D + (h0 + j % heads_per_tile) * D; };
      for (int64_t j = 0; j < nq; ++j) std::fill(out_of(j), out_of(j) + D, 0.0f);
      for (int64_t s0 = 0; s0 < span; s0 += LANES) {  // weighted values, in key order for each query
        for (int64_t j = 0; j < nq; ++j) {
          int64_t lo, n;
          visible(j, lo, n);
          const int64_t from = std::max(s0, lo), to = std::min(s0 + LANES, lo + n);
          if (from < to)
            accumulate_values(out_of(j), scores.data() + j * stride + LANES, values.data(), from, to, D);
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        float* o = out_of(j);
        const F inv = set1(q[j * D]);
        for (int64_t i = 0; i < D; i += LANES) {
          const M m = simd::first(D - i);
          store(m, o + i, mul(load(m, o + i), inv));
        }
      }
    }
  });
  return out;
}

}  // namespace TANDEM_ISA
}  // namespace tandem

TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, lib) {
  lib.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor");
  lib.def("gated_act(Tensor gate_up, bool gelu) -> Tensor");
  lib.def("decode_attention(Tensor qkv, Tensor positions, Tensor tables, Tensor(a!) k_cache, Tensor(b!) v_cache, "
          "Tensor cos, Tensor sin, Tensor? q_norm, Tensor? k_norm, float eps, float norm_offset, int num_heads, "
          "float scale, int window, Tensor? row_seqs=None) -> Tensor");
}

TANDEM_LIBRARY_IMPL(TANDEM_OPS, CPU, lib) {
  lib.impl("rms_norm", tandem::TANDEM_ISA::rms_norm);
  lib.impl("gated_act", tandem::TANDEM_ISA::gated_act);
  lib.impl("decode_attention", tandem::TANDEM_ISA::decode_attention);
}
