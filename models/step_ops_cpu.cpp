// The small ops of an eager decode step on CPU, each one pass in one op: RMSNorm and rotary embedding (fp32;
// what models/llama.py's RMSNorm and models/rope.py's apply_rope_qk compute) and the write of new keys or
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

namespace {

constexpr int64_t ROWS_A_TASK = 32;  // a decode step's few rows run on the calling thread

// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, over the last dimension
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: fp32 only");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim, "rms_norm: weight is [last dim of x]");
  const at::Tensor rows = x.reshape({-1, dim}).contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty_like(rows);
  const float* in_data = rows.data_ptr<float>();
  const float* w_data = w.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, rows.size(0), ROWS_A_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = in_data + t * dim;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < dim; ++i) squares += row[i] * row[i];
      const float scale = 1.0f / std::sqrt(squares / static_cast<float>(dim) + epsilon);
      float* dest = out_data + t * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) dest[i] = (row[i] * scale) * w_data[i];
    }
  });
  return out.view(x.sizes());
}

// x [..., heads, head_dim] (head_dim contiguous) turned by cos/sin [..., head_dim], one table row per
// position of x's leading dims, shared by its heads: x * cos + rotate_half(x) * sin, rotate_half(x) being
// (-x[half:], x[:half]). -> a new contiguous tensor of x's shape.
at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope: fp32 only");
  TORCH_CHECK(x.dim() >= 2, "rope: x is [..., heads, head_dim]");
  const int64_t heads = x.size(-2), dim = x.size(-1), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0, "rope: head_dim is even");
  const at::Tensor turns = x.reshape({-1, heads, dim});
  TORCH_CHECK(turns.stride(2) == 1, "rope: head_dim is contiguous");
  const int64_t positions = turns.size(0);
  const at::Tensor c = cos.reshape({-1, dim}).contiguous(), s = sin.reshape({-1, dim}).contiguous();
  TORCH_CHECK(c.size(0) == positions && s.size(0) == positions, "rope: one cos/sin row per position of x");
  at::Tensor out = at::empty({positions, heads, dim}, x.options());
  const float* in_data = turns.data_ptr<float>();
  const float* c_data = c.data_ptr<float>();
  const float* s_data = s.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t pos_stride = turns.stride(0), head_stride = turns.stride(1);
  at::parallel_for(0, positions, ROWS_A_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = c_data + t * dim;
      const float* st = s_data + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float* v = in_data + t * pos_stride + h * head_stride;
        float* dest = out_data + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          dest[i] = v[i] * ct[i] - v[i + half] * st[i];
          dest[i + half] = v[i + half] * ct[i + half] + v[i] * st[i + half];
        }
      }
    }
  });
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(draftsmith_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("write_kv(Tensor(a!) cache, Tensor slots, Tensor positions, Tensor new) -> ()");
}

TORCH_LIBRARY_IMPL(draftsmith_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rope", &rope_cpu);
  m.impl("write_kv", &write_kv_cpu);
}
