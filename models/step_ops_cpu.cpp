// The small ops of an eager decode step on CPU, each one pass in one op: RMSNorm, a residual add with the
// RMSNorm after it, SiLU times up (the MLP's activation) and rotary embedding (fp32 and bf16; what
// models/llama.py's RMSNorm and MLP and models/rope.py's apply_rope_qk compute) and the write of new keys or
// values into their cache slots (models/kv_cache.py's ForwardBatch.write). On CPU each small aten op costs a
// few microseconds whatever its size: PyTorch runs an RMSNorm as six, a rope as five and a write as an
// index_put with its index checks. Built into the same extension as slot_attention_cpu.cpp
// (slot_attention_cpu.py loads both) and registered in its `draftsmith_cpu` library.
// The rope's products are rounded before they are summed, as PyTorch's ops round them, so that it turns
// bit for bit as they do (the attention file in the same build fuses multiply-adds)
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "simd_exp.h"

namespace {

constexpr int64_t ROWS_A_TASK = 32;  // a decode step's few rows run on the calling thread

// The dtypes the norm and the rope take: fp32, and bf16 (a draft head on a CPU with fast bf16 matmuls).
// Each result is rounded to T where PyTorch's op-by-op form rounds it (T(float) rounds to nearest even, as
// PyTorch's bf16 ops do; for fp32 the casts are no-ops).
bool step_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

// dest = row / sqrt(mean(row^2) + eps) * weight, statistics in fp32; in bf16 transformers' order: the
// normalised row rounded to bf16 before the weight multiplies it
template <typename T>
inline void norm_row(const T* row, const T* w_data, T* dest, int64_t dim, float epsilon) {
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < dim; ++i) squares += static_cast<float>(row[i]) * static_cast<float>(row[i]);
  const float scale = 1.0f / std::sqrt(squares / static_cast<float>(dim) + epsilon);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) {
    const float normed = static_cast<float>(T(static_cast<float>(row[i]) * scale));
    dest[i] = T(normed * static_cast<float>(w_data[i]));
  }
}

// out[t] = norm_row(x[t]) over the last dimension
template <typename T>
void rms_norm_rows(const T* in_data, const T* w_data, T* out_data, int64_t rows, int64_t dim, float epsilon) {
  at::parallel_for(0, rows, ROWS_A_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(in_data + t * dim, w_data, out_data + t * dim, dim, epsilon);
  });
}

// sum[t] = x[t] + residual[t] (rounded to T, as PyTorch's add rounds it), out[t] = norm_row(sum[t]): a
// residual add and the norm after it in one pass, the norm bit for bit rms_norm_cpu's of the sum
template <typename T>
void add_rms_norm_rows(const T* x_data, const T* r_data, const T* w_data, T* sum_data, T* out_data, int64_t rows,
                       int64_t dim, float epsilon) {
  at::parallel_for(0, rows, ROWS_A_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* a = x_data + t * dim;
      const T* b = r_data + t * dim;
      T* sum = sum_data + t * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) sum[i] = T(static_cast<float>(a[i]) + static_cast<float>(b[i]));
      norm_row(sum, w_data, out_data + t * dim, dim, epsilon);
    }
  });
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(step_dtype(x) && weight.scalar_type() == x.scalar_type(), "rms_norm: fp32 or bf16, x's dtype the weight's");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim, "rms_norm: weight is [last dim of x]");
  const at::Tensor rows = x.reshape({-1, dim}).contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty_like(rows);
  const float epsilon = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows(rows.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), rows.size(0), dim, epsilon);
  } else {
    rms_norm_rows(rows.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                  rows.size(0), dim, epsilon);
  }
  return out.view(x.sizes());
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                     const at::Tensor& weight, double eps) {
  TORCH_CHECK(step_dtype(x) && residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: fp32 or bf16, x's dtype the residual's and the weight's");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x and residual have one shape");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim, "add_rms_norm: weight is [last dim of x]");
  const at::Tensor a = x.reshape({-1, dim}).contiguous(), b = residual.reshape({-1, dim}).contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor sum = at::empty_like(a), out = at::empty_like(a);
  const float epsilon = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_rows(a.data_ptr<float>(), b.data_ptr<float>(), w.data_ptr<float>(), sum.data_ptr<float>(),
                      out.data_ptr<float>(), a.size(0), dim, epsilon);
  } else {
    add_rms_norm_rows(a.data_ptr<at::BFloat16>(), b.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(),
                      sum.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), a.size(0), dim, epsilon);
  }
  return {sum.view(x.sizes()), out.view(x.sizes())};
}

typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t ivec16 __attribute__((vector_size(64)));

// silu(g) = g * sigmoid(g), sixteen at a time, sigmoid from e = e^-|g| (simd_exp.h, within 2 ulp):
// 1 / (1 + e) for g >= 0, e / (1 + e) below; below -87, where e^g is under fp32's normal range (and the
// exp's floor), a signed zero: the true value is a denormal, which bf16 rounds to zero
inline vec16 silu_lanes(vec16 g) {
  const vec16 e = exp_nonpositive_lanes<vec16, ivec16>(g < 0.0f ? g : -g);
  const vec16 one = vec16{} + 1.0f;
  const vec16 silu = g * ((g >= 0.0f ? one : e) / (one + e));
  return g < -87.0f ? g * 0.0f : silu;
}

// dest[j] = silu(gate[j]) * up[j] for `lanes` lanes (LANES, a constant the compiler turns into vector loads and
// stores; 0: the run-time `lanes`, a row's tail); the activation rounded to T before the product, as PyTorch's
// F.silu(gate) * up rounds it
template <typename T, int LANES>
inline void silu_mul_lanes(const T* gate, const T* up, T* dest, int64_t lanes = LANES) {
  vec16 gv = vec16{}, uv = vec16{};
  const int64_t n = LANES ? LANES : lanes;
  for (int64_t j = 0; j < n; ++j) {
    gv[j] = static_cast<float>(gate[j]);
    uv[j] = static_cast<float>(up[j]);
  }
  vec16 product;
  if constexpr (std::is_same_v<T, float>) {
    product = silu_lanes(gv) * uv;
  } else {
    const vec16 activated = silu_lanes(gv);
    for (int j = 0; j < 16; ++j) product[j] = static_cast<float>(T(activated[j])) * uv[j];
  }
  for (int64_t j = 0; j < n; ++j) dest[j] = T(product[j]);
}

// out[t] = silu(gate[t]) * up[t], each rounded to T as PyTorch's F.silu(gate) * up rounds it; gate and up rows
// `stride` apart (views into a fused gate/up projection), out contiguous
template <typename T>
void silu_mul_rows(const T* gate, int64_t gate_stride, const T* up, int64_t up_stride, T* out, int64_t rows,
                   int64_t dim) {
  at::parallel_for(0, rows, ROWS_A_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gate + t * gate_stride;
      const T* u = up + t * up_stride;
      T* dest = out + t * dim;
      int64_t i = 0;
      for (; i + 16 <= dim; i += 16) silu_mul_lanes<T, 16>(g + i, u + i, dest + i);
      if (i < dim) silu_mul_lanes<T, 0>(g + i, u + i, dest + i, dim - i);
    }
  });
}

at::Tensor silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(step_dtype(gate) && up.scalar_type() == gate.scalar_type(), "silu_mul: fp32 or bf16, gate's dtype up's");
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_mul: gate and up have one shape");
  const int64_t dim = gate.size(-1);
  at::Tensor g = gate.reshape({-1, dim}), u = up.reshape({-1, dim});
  if (g.stride(1) != 1) g = g.contiguous();
  if (u.stride(1) != 1) u = u.contiguous();
  at::Tensor out = at::empty({g.size(0), dim}, gate.options());
  if (gate.scalar_type() == at::kFloat) {
    silu_mul_rows(g.data_ptr<float>(), g.stride(0), u.data_ptr<float>(), u.stride(0), out.data_ptr<float>(),
                  g.size(0), dim);
  } else {
    silu_mul_rows(g.data_ptr<at::BFloat16>(), g.stride(0), u.data_ptr<at::BFloat16>(), u.stride(0),
                  out.data_ptr<at::BFloat16>(), g.size(0), dim);
  }
  return out.view(gate.sizes());
}

// x [..., heads, head_dim] (head_dim contiguous) turned by cos/sin [..., head_dim], one table row per
// position of x's leading dims, shared by its heads: x * cos + rotate_half(x) * sin, rotate_half(x) being
// (-x[half:], x[:half]); each product and the sum rounded to T. -> a new contiguous tensor of x's shape.
template <typename T>
void rope_rows(const at::Tensor& turns, const at::Tensor& c, const at::Tensor& s, at::Tensor& out) {
  const int64_t positions = turns.size(0), heads = turns.size(1), dim = turns.size(2), half = dim / 2;
  const T* in_data = turns.data_ptr<T>();
  const T* c_data = c.data_ptr<T>();
  const T* s_data = s.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const int64_t pos_stride = turns.stride(0), head_stride = turns.stride(1);
  auto product = [](T a, T b) { return static_cast<float>(T(static_cast<float>(a) * static_cast<float>(b))); };
  at::parallel_for(0, positions, ROWS_A_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* ct = c_data + t * dim;
      const T* st = s_data + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* v = in_data + t * pos_stride + h * head_stride;
        T* dest = out_data + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          dest[i] = T(product(v[i], ct[i]) - product(v[i + half], st[i]));
          dest[i + half] = T(product(v[i + half], ct[i + half]) + product(v[i], st[i + half]));
        }
      }
    }
  });
}

at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(step_dtype(x) && cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope: fp32 or bf16, x's dtype the tables'");
  TORCH_CHECK(x.dim() >= 2, "rope: x is [..., heads, head_dim]");
  const int64_t heads = x.size(-2), dim = x.size(-1);
  TORCH_CHECK(dim % 2 == 0, "rope: head_dim is even");
  const at::Tensor turns = x.reshape({-1, heads, dim});
  TORCH_CHECK(turns.stride(2) == 1, "rope: head_dim is contiguous");
  const int64_t positions = turns.size(0);
  const at::Tensor c = cos.reshape({-1, dim}).contiguous(), s = sin.reshape({-1, dim}).contiguous();
  TORCH_CHECK(c.size(0) == positions && s.size(0) == positions, "rope: one cos/sin row per position of x");
  at::Tensor out = at::empty({positions, heads, dim}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rope_rows<float>(turns, c, s, out);
  } else {
    rope_rows<at::BFloat16>(turns, c, s, out);
  }
  return out.view(x.sizes());
}

// cache[slots[b, q], h, positions[b, q]] = new[b, h, q] for every row b, head h and query q: new
// [B, heads, Q, head_dim] into cache [S, heads, L, head_dim] (head_dim contiguous in both), any dtype
void write_kv_cpu(at::Tensor& cache, const at::Tensor& slots, const at::Tensor& positions, const at::Tensor& fresh) {
  TORCH_CHECK(cache.dim() == 4 && fresh.dim() == 4, "write_kv: cache and new are 4-d");
  TORCH_CHECK(cache.scalar_type() == fresh.scalar_type(), "write_kv: cache and new share a dtype");
  const int64_t rows = fresh.size(0), heads = fresh.size(1), queries = fresh.size(2), dim = fresh.size(3);
  TORCH_CHECK(cache.size(1) == heads && cache.size(3) == dim, "write_kv: new's heads and head_dim are the cache's");
  TORCH_CHECK(cache.stride(3) == 1 && fresh.stride(3) == 1, "write_kv: head_dim is contiguous");
  const at::Tensor slot_ids = slots.to(at::kLong).contiguous(), pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(slot_ids.numel() == rows * queries && pos.numel() == rows * queries,
              "write_kv: slots and positions are [B, Q] of new's B and Q");
  const int64_t* slot_data = slot_ids.data_ptr<int64_t>();
  const int64_t* pos_data = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows * queries; ++i) {
    TORCH_CHECK(slot_data[i] >= 0 && slot_data[i] < cache.size(0), "write_kv: a slot past the cache");
    TORCH_CHECK(pos_data[i] >= 0 && pos_data[i] < cache.size(2), "write_kv: a position past the cache");
  }
  const int64_t bytes = dim * fresh.element_size();
  char* cache_data = static_cast<char*>(cache.data_ptr());
  const char* new_data = static_cast<const char*>(fresh.data_ptr());
  const int64_t es = fresh.element_size();
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t q = 0; q < queries; ++q) {
      const int64_t slot = slot_data[b * queries + q], p = pos_data[b * queries + q];
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(cache_data + (slot * cache.stride(0) + h * cache.stride(1) + p * cache.stride(2)) * es,
                    new_data + (b * fresh.stride(0) + h * fresh.stride(1) + q * fresh.stride(2)) * es, bytes);
      }
    }
  }
}

// 16 values of a row as fp32 lanes
template <typename T>
inline vec16 load_lanes(const T* at) {
  vec16 x;
  for (int j = 0; j < 16; ++j) x[j] = static_cast<float>(at[j]);
  return x;
}

// whether x at index i comes before top at index best as a row's argmax: larger, or equal and earlier; a NaN
// counts as larger than any number (torch.argmax's choice)
inline bool beats(float x, int64_t i, float top, int64_t best) {
  const bool x_nan = x != x, top_nan = top != top;
  if (x_nan || top_nan) return x_nan && (!top_nan || i < best);
  return x > top || (x == top && i < best);
}

// The first index of the row's largest value: every lane keeps its own first largest over four vectors a
// step (independent chains), then the lanes' largest wins, the first index on a tie
template <typename T>
int64_t first_largest(const T* row, int64_t vocab) {
  constexpr int64_t STEP = 64;
  float top = static_cast<float>(row[0]);
  int64_t best = 0, i = 0;
  if (vocab >= STEP) {
    ivec16 lane_index;
    for (int j = 0; j < 16; ++j) lane_index[j] = j;
    vec16 lane_top[4];
    ivec16 lane_best[4];
    for (int a = 0; a < 4; ++a) lane_top[a] = load_lanes(row + 16 * a), lane_best[a] = lane_index + 16 * a;
    for (i = STEP; i + STEP <= vocab; i += STEP) {
      for (int a = 0; a < 4; ++a) {
        const vec16 x = load_lanes(row + i + 16 * a);
        // larger, or the lane's first NaN
        const ivec16 take = (x > lane_top[a]) | ((x != x) & (lane_top[a] == lane_top[a]));
        lane_top[a] = take ? x : lane_top[a];
        lane_best[a] = take ? lane_index + static_cast<int32_t>(i + 16 * a) : lane_best[a];
      }
    }
    for (int a = 0; a < 4; ++a) {
      for (int j = 0; j < 16; ++j) {
        if (beats(lane_top[a][j], lane_best[a][j], top, best)) top = lane_top[a][j], best = lane_best[a][j];
      }
    }
  }
  for (; i < vocab; ++i) {
    const float x = static_cast<float>(row[i]);
    if (beats(x, i, top, best)) top = x, best = i;
  }
  return best;
}

// Row t's greedy draft: the first index of its largest logit (`first_largest`; mapped to a target id by `d2t`
// offsets when given) and that pick's softmax probability, 1 / sum_i e^(x_i - max), the sum in fp32 over
// simd_exp.h's e^x (what draft_pick_reference.py computes, to within a few fp32 ulp)
template <typename T>
void greedy_pick_rows(const T* logits, int64_t stride, int64_t rows, int64_t vocab, const int64_t* offsets,
                      int64_t* ids, float* probs) {
  for (int64_t t = 0; t < rows; ++t) {
    const T* row = logits + t * stride;
    const int64_t best = first_largest(row, vocab);
    const float top = static_cast<float>(row[best]);
    vec16 sums = vec16{};
    int64_t i = 0;
    for (; i + 16 <= vocab; i += 16) sums += exp_nonpositive_lanes<vec16, ivec16>(load_lanes(row + i) - top);
    float sum = 0.0f;
    for (int j = 0; j < 16; ++j) sum += sums[j];
    if (i < vocab) {  // the tail in one vector; its unused lanes are not added
      vec16 x = vec16{};
      for (int64_t j = 0; i + j < vocab; ++j) x[j] = static_cast<float>(row[i + j]) - top;
      const vec16 tail = exp_nonpositive_lanes<vec16, ivec16>(x);
      for (int64_t j = 0; i + j < vocab; ++j) sum += tail[j];
    }
    ids[t] = offsets == nullptr ? best : best + offsets[best];
    probs[t] = 1.0f / sum;
  }
}

std::tuple<at::Tensor, at::Tensor> greedy_pick_cpu(const at::Tensor& logits, const std::optional<at::Tensor>& d2t) {
  TORCH_CHECK(step_dtype(logits) && logits.dim() == 2 && logits.size(1) > 0,
              "greedy_pick: fp32 or bf16 logits [rows, vocab]");
  const at::Tensor rows = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t count = rows.size(0), vocab = rows.size(1);
  at::Tensor offsets;
  if (d2t.has_value() && d2t->defined()) {
    offsets = d2t->contiguous();
    TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.numel() == vocab,
                "greedy_pick: d2t is int64 offsets, one per logit");
  }
  at::Tensor ids = at::empty({count}, logits.options().dtype(at::kLong));
  at::Tensor probs = at::empty({count}, logits.options().dtype(at::kFloat));
  const int64_t* offset_data = offsets.defined() ? offsets.data_ptr<int64_t>() : nullptr;
  if (logits.scalar_type() == at::kFloat) {
    greedy_pick_rows(rows.data_ptr<float>(), rows.stride(0), count, vocab, offset_data, ids.data_ptr<int64_t>(),
                     probs.data_ptr<float>());
  } else {
    greedy_pick_rows(rows.data_ptr<at::BFloat16>(), rows.stride(0), count, vocab, offset_data,
                     ids.data_ptr<int64_t>(), probs.data_ptr<float>());
  }
  return {ids, probs};
}

// each row's `first_largest`
template <typename T>
void greedy_ids_rows(const T* logits, int64_t stride, int64_t rows, int64_t vocab, int64_t* ids) {
  for (int64_t t = 0; t < rows; ++t) ids[t] = first_largest(logits + t * stride, vocab);
}

at::Tensor greedy_ids_cpu(const at::Tensor& logits) {
  TORCH_CHECK(step_dtype(logits) && logits.dim() >= 1 && logits.size(-1) > 0,
              "greedy_ids: fp32 or bf16 logits [..., vocab]");
  const int64_t vocab = logits.size(-1);
  const at::Tensor rows = logits.reshape({-1, vocab});
  const at::Tensor dense = rows.stride(1) == 1 ? rows : rows.contiguous();
  std::vector<int64_t> shape(logits.sizes().begin(), logits.sizes().end() - 1);
  at::Tensor ids = at::empty({dense.size(0)}, logits.options().dtype(at::kLong));
  if (logits.scalar_type() == at::kFloat) {
    greedy_ids_rows(dense.data_ptr<float>(), dense.stride(0), dense.size(0), vocab, ids.data_ptr<int64_t>());
  } else {
    greedy_ids_rows(dense.data_ptr<at::BFloat16>(), dense.stride(0), dense.size(0), vocab, ids.data_ptr<int64_t>());
  }
  return ids.view(shape);
}

// The first index of the largest of row + bias, each sum rounded to fp32 as PyTorch's add rounds it (summed
// into `scratch`, then `first_largest`)
int64_t first_largest_sum(const float* row, const float* bias, int64_t vocab, float* scratch) {
  for (int64_t i = 0; i < vocab; ++i) scratch[i] = row[i] + bias[i];
  return first_largest(scratch, vocab);
}

// A greedy Markov chain along a block: drafted[a, j] is the first largest of base[a, j] + table[row_of[t]],
// t the token before position j (start_tokens[a] for j = 0, else drafted[a, j - 1]), from position `start`
// on. Stops at the first position where some row's token has no kept row (row_of < 0) and returns it (the
// positions before it done), or the block's width when all are done.
int64_t markov_chain_cpu(const at::Tensor& base, const at::Tensor& table, const at::Tensor& row_of,
                         const at::Tensor& start_tokens, at::Tensor& drafted, int64_t start) {
  TORCH_CHECK(base.scalar_type() == at::kFloat && base.dim() == 3 && base.stride(2) == 1,
              "markov_chain: fp32 base logits [rows, width, vocab], vocab contiguous");
  const int64_t rows = base.size(0), width = base.size(1), vocab = base.size(2);
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.dim() == 2 && table.size(1) == vocab && table.is_contiguous(),
              "markov_chain: fp32 kept rows [capacity, vocab]");
  TORCH_CHECK(row_of.scalar_type() == at::kLong && row_of.is_contiguous() && row_of.numel() == vocab,
              "markov_chain: row_of is int64, one per token");
  TORCH_CHECK(start_tokens.scalar_type() == at::kLong && start_tokens.is_contiguous() && start_tokens.numel() == rows,
              "markov_chain: start_tokens is int64 [rows]");
  TORCH_CHECK(drafted.scalar_type() == at::kLong && drafted.is_contiguous() && drafted.size(0) == rows &&
              drafted.size(1) == width, "markov_chain: drafted is int64 [rows, width]");
  const float* base_data = base.data_ptr<float>();
  const float* table_data = table.data_ptr<float>();
  const int64_t* rows_of = row_of.data_ptr<int64_t>();
  const int64_t* first = start_tokens.data_ptr<int64_t>();
  int64_t* out = drafted.data_ptr<int64_t>();
  std::vector<float> scratch(vocab);
  for (int64_t j = start; j < width; ++j) {
    for (int64_t a = 0; a < rows; ++a) {
      const int64_t token = j == 0 ? first[a] : out[a * width + j - 1];
      TORCH_CHECK(token >= 0 && token < vocab, "markov_chain: a token outside the vocabulary");
      if (rows_of[token] < 0) return j;
    }
    for (int64_t a = 0; a < rows; ++a) {
      const int64_t token = j == 0 ? first[a] : out[a * width + j - 1];
      out[a * width + j] = first_largest_sum(base_data + a * base.stride(0) + j * base.stride(1),
                                             table_data + rows_of[token] * vocab, vocab, scratch.data());
    }
  }
  return width;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(draftsmith_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("write_kv(Tensor(a!) cache, Tensor slots, Tensor positions, Tensor new) -> ()");
  m.def("greedy_pick(Tensor logits, Tensor? d2t) -> (Tensor, Tensor)");
  m.def("greedy_ids(Tensor logits) -> Tensor");
  m.def("markov_chain(Tensor base, Tensor table, Tensor row_of, Tensor start_tokens, Tensor(a!) drafted, "
        "int start) -> int");
}

TORCH_LIBRARY_IMPL(draftsmith_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("add_rms_norm", &add_rms_norm_cpu);
  m.impl("silu_mul", &silu_mul_cpu);
  m.impl("rope", &rope_cpu);
  m.impl("write_kv", &write_kv_cpu);
  m.impl("greedy_pick", &greedy_pick_cpu);
  m.impl("greedy_ids", &greedy_ids_cpu);
  m.impl("markov_chain", &markov_chain_cpu);
}
