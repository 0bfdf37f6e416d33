// Causal attention of prompt chunks over their rows' slots of the KV cache, on CPU: query i of a chunk that
// starts at position `start` sees the slot's keys 0..start + i, its own keys and values already written (what
// SDPA's is_causal computes for start 0; models/prompt_attention.py has the reference). FlashAttention-2 over
// blocks of KEYS keys with both products as register-blocked micro-kernels: the scores of MR queries against
// a block's keys (transposed once a block, so a pass over head_dim is MR x KEYS multiply-adds in registers),
// and the weighted sum of the block's values for MR queries (head_dim 64 columns at a time in registers).
// Blocks past a query block's last position are skipped: PyTorch's CPU flash kernel takes keys in blocks of
// 512, so a 550-token prompt computes almost its whole square of scores. One task per (row, KV head, block of
// QUERIES positions), its group's query heads together; tasks are ordered so that the two halves of a row's
// blocks pair early with late ones (a thread given a contiguous range gets as many scores as another).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd_exp.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t KEYS = 64;     // keys a block
constexpr int64_t QUERIES = 32;  // query positions a task
constexpr int MR = 4;            // query rows a micro-kernel pass
constexpr int LANES = 16;
constexpr int KEY_VECS = KEYS / LANES;
constexpr float NEG = -1.0e30f;  // a masked score; the running max starts here

typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t ivec16 __attribute__((vector_size(64)));

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

// Holds a loaded vector in a register for the multiply-adds that share it: GCC otherwise folds the load into
// each of them (a block's key vector reloaded once per query row), and the kernel ran load-bound, 0.87x as fast
inline void keep_in_register(vec16& v) {
#ifdef __AVX512F__
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

inline float max16(vec16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  float m = v[0];
  for (int i = 1; i < LANES; ++i) m = std::max(m, v[i]);
  return m;
#endif
}

// One query row of a task: its q, its position, and its running softmax state and output sums.
struct QueryRow {
  const float* q;
  int64_t position;
  float* acc;  // [dim]
  float max, total;
};

// keys_t[d * KEYS + j] = keys[j * stride + d] for j < count, 0 past it
inline void transpose_block(const float* keys, int64_t stride, int64_t count, int64_t dim, float* keys_t) {
  for (int64_t j = 0; j < KEYS; ++j) {
    if (j < count) {
      const float* key = keys + j * stride;
      for (int64_t d = 0; d < dim; ++d) keys_t[d * KEYS + j] = key[d];
    } else {
      for (int64_t d = 0; d < dim; ++d) keys_t[d * KEYS + j] = 0.0f;
    }
  }
}

// scores[r][j] = scale * q_r . key_j for MR rows and the block's KEYS keys (zero keys past its count)
inline void score_rows(QueryRow* const* rows, const float* keys_t, int64_t dim, float scale,
                       float (&scores)[MR][KEYS]) {
  const float* q[MR];
  for (int r = 0; r < MR; ++r) q[r] = rows[r]->q;
  vec16 acc[MR][KEY_VECS] = {};
  for (int64_t d = 0; d < dim; ++d) {
    vec16 key[KEY_VECS];
    for (int c = 0; c < KEY_VECS; ++c) {
      key[c] = load16(keys_t + d * KEYS + c * LANES);
      keep_in_register(key[c]);
    }
    for (int r = 0; r < MR; ++r) {
      const float x = q[r][d];
      for (int c = 0; c < KEY_VECS; ++c) acc[r][c] += x * key[c];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < KEY_VECS; ++c) store16(scores[r] + c * LANES, acc[r][c] * scale);
}

// The rows' scores of keys first_key.. (count of them) -> their weights e^(score - new max) in place, each
// row's running max, total and output sums rescaled; keys past a row's position or the count weigh 0. The MR
// rows go through each stage together, so that their dependent chains (a total's lanes summed in order, the
// rescale's exp) overlap
inline void weigh_rows(QueryRow* const* rows, int64_t first_key, int64_t count, float (&scores)[MR][KEYS],
                       int64_t dim) {
  const ivec16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vec16 masked = vec16{} + NEG;
  vec16 totals[MR];
  vec16 shifts = vec16{};  // lane r: row r's old max - new max
  float new_max[MR];
  for (int r = 0; r < MR; ++r) {
    QueryRow& row = *rows[r];
    const int64_t seen = std::min<int64_t>(count, row.position - first_key + 1);  // keys this row sees
    const ivec16 limit = ivec16{} + static_cast<int32_t>(std::max<int64_t>(seen, 0));
    vec16 score[KEY_VECS], most = masked;
    for (int c = 0; c < KEY_VECS; ++c) {
      score[c] = lane + c * LANES < limit ? load16(scores[r] + c * LANES) : masked;
      most = score[c] > most ? score[c] : most;
    }
    new_max[r] = std::max(row.max, max16(most));
    shifts[r] = row.max - new_max[r];
    vec16 total = {};
    for (int c = 0; c < KEY_VECS; ++c) {
      const vec16 weight = score[c] <= NEG ? vec16{} : exp_nonpositive_lanes<vec16, ivec16>(score[c] - new_max[r]);
      store16(scores[r] + c * LANES, weight);
      total += weight;
    }
    totals[r] = total;
  }
  const vec16 rescales = exp_nonpositive_lanes<vec16, ivec16>(shifts);
  static_assert(MR <= LANES, "a row's rescale is a lane of one vector");
  float sums[MR];
  for (int r = 0; r < MR; ++r) sums[r] = 0.0f;
  for (int i = 0; i < LANES; ++i)
    for (int r = 0; r < MR; ++r) sums[r] += totals[r][i];
  for (int r = 0; r < MR; ++r) {
    QueryRow& row = *rows[r];
    const float rescale = rescales[r];
    if (rescale != 1.0f)
      for (int64_t d = 0; d < dim; ++d) row.acc[d] *= rescale;
    row.total = row.total * rescale + sums[r];
    row.max = new_max[r];
  }
}

// acc_r[col, col + 64) += sum over j < count of weights[r][j] * values[j * stride + col, + 64), for MR rows
inline void add_values(QueryRow* const* rows, const float (&weights)[MR][KEYS], const float* values,
                       int64_t stride, int64_t count, int64_t col) {
  vec16 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = load16(rows[r]->acc + col + c * LANES);
  for (int64_t j = 0; j < count; ++j) {
    const float* value = values + j * stride + col;
    vec16 v[4];
    for (int c = 0; c < 4; ++c) {
      v[c] = load16(value + c * LANES);
      keep_in_register(v[c]);
    }
    for (int r = 0; r < MR; ++r) {
      const float w = weights[r][j];
      for (int c = 0; c < 4; ++c) acc[r][c] += w * v[c];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) store16(rows[r]->acc + col + c * LANES, acc[r][c]);
}

struct Chunk {
  const float* keys;    // k_cache[slot, kv_head]
  const float* values;  // v_cache[slot, kv_head]
  int64_t k_stride, v_stride;
};

// One task: `rows` (the group's heads at the task's positions, head-major), over the keys they see; `pad`:
// the row a short last group of MR is filled with (it sees no key, and its sums are scratch)
void attend(const Chunk& chunk, std::vector<QueryRow>& rows, QueryRow& pad, int64_t dim, float scale,
            float* keys_t) {
  int64_t last = 0;
  for (const QueryRow& row : rows) last = std::max(last, row.position);
  const int64_t size = static_cast<int64_t>(rows.size());
  for (int64_t first_key = 0; first_key <= last; first_key += KEYS) {
    const int64_t count = std::min(KEYS, last + 1 - first_key);
    transpose_block(chunk.keys + first_key * chunk.k_stride, chunk.k_stride, count, dim, keys_t);
    for (int64_t g = 0; g < size; g += MR) {
      QueryRow* group[MR];
      int64_t seen = 0;  // the most keys of the block a row of the group sees
      for (int r = 0; r < MR; ++r) {
        group[r] = g + r < size ? &rows[g + r] : &pad;
        seen = std::max(seen, std::min(count, group[r]->position - first_key + 1));
      }
      if (seen <= 0) continue;
      alignas(64) float scores[MR][KEYS];
      score_rows(group, keys_t, dim, scale, scores);
      weigh_rows(group, first_key, count, scores, dim);
      for (int64_t col = 0; col < dim; col += 64)
        add_values(group, scores, chunk.values + first_key * chunk.v_stride, chunk.v_stride, seen, col);
    }
  }
}

// q [T, H, D] (head_dim contiguous), k_cache, v_cache [S, KVH, L, D] fp32; spans [R, 4] int64 rows of (slot,
// start, count, first token in q): out [T, H, D], token t of span r attending as position start + (t - first)
at::Tensor prompt_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& spans, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "prompt_attention: q [T, H, D], caches 4-d");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat, "prompt_attention: fp32 only");
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1), cache_len = k_cache.size(2);
  TORCH_CHECK(dim % 64 == 0, "prompt_attention: head_dim is a multiple of 64");
  TORCH_CHECK(heads % kv_heads == 0, "prompt_attention: query heads are a multiple of KV heads");
  TORCH_CHECK(k_cache.size(3) == dim && v_cache.sizes() == k_cache.sizes(), "prompt_attention: cache shapes");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "prompt_attention: the caches' head_dim is contiguous");
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 4, "prompt_attention: spans is [R, 4]");
  const at::Tensor query = q.stride(2) == 1 ? q : q.contiguous();
  const at::Tensor span = spans.to(at::kLong).contiguous();
  const int64_t* s = span.data_ptr<int64_t>();
  const int64_t num_spans = span.size(0), group = heads / kv_heads;
  std::vector<int64_t> first_task(num_spans + 1, 0);  // tasks of span r: [first_task[r], first_task[r + 1])
  for (int64_t r = 0; r < num_spans; ++r) {
    const int64_t slot = s[4 * r], start = s[4 * r + 1], count = s[4 * r + 2], first = s[4 * r + 3];
    TORCH_CHECK(slot >= 0 && slot < k_cache.size(0), "prompt_attention: a slot past the cache");
    TORCH_CHECK(start >= 0 && count >= 0 && start + count <= cache_len, "prompt_attention: a span past the cache");
    TORCH_CHECK(first >= 0 && first + count <= q.size(0), "prompt_attention: a span past q's tokens");
    first_task[r + 1] = first_task[r] + kv_heads * ((count + QUERIES - 1) / QUERIES);
  }
  at::Tensor out = at::zeros({q.size(0), heads, dim}, q.options());
  const float* q_data = query.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, first_task[num_spans], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> keys_t(KEYS * dim), acc, scratch(dim);
    std::vector<QueryRow> rows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
      const int64_t slot = s[4 * r], start = s[4 * r + 1], count = s[4 * r + 2], first = s[4 * r + 3];
      const int64_t blocks = (count + QUERIES - 1) / QUERIES, local = task - first_task[r];
      const int64_t kv_head = local / blocks, order = local % blocks;
      // early and late blocks alternate: 0, last, 1, last - 1, ...
      const int64_t block = order % 2 == 0 ? order / 2 : blocks - 1 - order / 2;
      const int64_t lo = block * QUERIES, hi = std::min(count, lo + QUERIES);
      acc.assign(group * (hi - lo) * dim, 0.0f);
      rows.clear();
      for (int64_t h = 0; h < group; ++h)
        for (int64_t i = lo; i < hi; ++i)
          rows.push_back(QueryRow{q_data + (first + i) * query.stride(0) + (kv_head * group + h) * query.stride(1),
                                  start + i, acc.data() + (h * (hi - lo) + i - lo) * dim, NEG, 0.0f});
      const Chunk chunk{k_cache.data_ptr<float>() + slot * k_cache.stride(0) + kv_head * k_cache.stride(1),
                        v_cache.data_ptr<float>() + slot * v_cache.stride(0) + kv_head * v_cache.stride(1),
                        k_cache.stride(2), v_cache.stride(2)};
      QueryRow pad{rows.front().q, -1, scratch.data(), NEG, 0.0f};
      attend(chunk, rows, pad, dim, static_cast<float>(scale), keys_t.data());
      for (int64_t h = 0; h < group; ++h)
        for (int64_t i = lo; i < hi; ++i) {
          const QueryRow& row = rows[h * (hi - lo) + i - lo];
          float* o = out_data + ((first + i) * heads + kv_head * group + h) * dim;
          const float inverse = 1.0f / row.total;
          for (int64_t d = 0; d < dim; ++d) o[d] = row.acc[d] * inverse;
        }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(draftsmith_cpu, m) {
  m.def("prompt_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor spans, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftsmith_cpu, CPU, m) { m.impl("prompt_attention", &prompt_attention_cpu); }
