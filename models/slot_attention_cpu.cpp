// Attention of a few new queries per row over the row's slot of the KV cache, on CPU: what
// slot_attention_reference.py computes (its rules for which keys a query sees), as one pass over each row's
// keys and values. One task per (row, KV head): the query heads of the group and the row's queries are the
// rows of one block of scores, so each key and each value is read from the cache once, in place, and the
// values' weighted sum streams each value row once for all of the group's queries (compiled loops that sum
// per query re-read every value row for each). An online softmax (FlashAttention-2) runs over blocks of
// BLOCK keys. Loaded by slot_attention_cpu.py (torch.utils.cpp_extension), registered as a torch op so a
// compiled step calls it as an extern kernel.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#include "simd_exp.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 64;  // keys a block of scores
// a score no key has: the running max starts here, and a masked score is this (its weight is exactly 0)
constexpr float NEG = -1.0e30f;

// Eight floats as one value (GCC/Clang vector extensions: AVX's ymm registers, two SSE or NEON ones
// elsewhere): a dot product as four independent running sums, not one serial chain the compiler must keep
// in order.
typedef float vec8 __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The lanes' sum, in the pairing `sums8` adds in, so that a score is the same number by either
inline float sum8(vec8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// {sum8(a[0]), ..., sum8(a[7])}: with AVX, three rounds of pairwise adds for all eight at once (a horizontal
// sum a score costs about as much as the score's multiply-adds)
inline vec8 sums8(const vec8* a) {
#if defined(__AVX__)
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_permute2f128_ps(u0, u1, 0x20) + _mm256_permute2f128_ps(u0, u1, 0x31);
#else
  return vec8{sum8(a[0]), sum8(a[1]), sum8(a[2]), sum8(a[3]), sum8(a[4]), sum8(a[5]), sum8(a[6]), sum8(a[7])};
#endif
}

// scores[r * BLOCK] = q[r] . key for every score row r, one row at a time; `dim` a multiple of 8. Each score's
// arithmetic is the same in every path (multiply-adds along d in one vector, then `sum8`), so that a query's
// output does not depend on how many queries share its task: a verify's query equals the decode step it stands
// for. Rows are not blocked here: the compiler can round a second, blocked copy of this loop differently.
inline void score_rows(const float* q, const float* key, int64_t rows, int64_t dim, float* scores) {
  for (int64_t r = 0; r < rows; ++r) {
    vec8 a = {};
    for (int64_t d = 0; d < dim; d += 8) a += load8(q + r * dim + d) * load8(key + d);
    scores[r * BLOCK] = sum8(a);
  }
}

// scores[r * BLOCK + j] = q[r] . keys[j * stride] for r < rows, j < count; `dim` a multiple of 8. Two score
// rows by four keys at a time: each load of a key or a query feeds two or four multiply-adds, and the eight
// sums are reduced together (`sums8`); every score is the same number as `score_rows` gives it.
inline void score_block(const float* q, const float* keys, int64_t stride, int64_t rows, int64_t count,
                        int64_t dim, float* scores) {
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) {
    const float* k0 = keys + j * stride;
    const float *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {
      const float* q0 = q + r * dim;
      const float* q1 = q0 + dim;
      vec8 a[8] = {};
      for (int64_t d = 0; d < dim; d += 8) {
        const vec8 x0 = load8(q0 + d), x1 = load8(q1 + d);
        const vec8 y0 = load8(k0 + d), y1 = load8(k1 + d), y2 = load8(k2 + d), y3 = load8(k3 + d);
        a[0] += x0 * y0;
        a[1] += x0 * y1;
        a[2] += x0 * y2;
        a[3] += x0 * y3;
        a[4] += x1 * y0;
        a[5] += x1 * y1;
        a[6] += x1 * y2;
        a[7] += x1 * y3;
      }
      const vec8 sums = sums8(a);
      std::memcpy(scores + r * BLOCK + j, &sums, 4 * sizeof(float));
      std::memcpy(scores + (r + 1) * BLOCK + j, reinterpret_cast<const float*>(&sums) + 4, 4 * sizeof(float));
    }
    if (r < rows) {
      for (int64_t i = 0; i < 4; ++i) {
        score_rows(q + r * dim, keys + (j + i) * stride, rows - r, dim, scores + r * BLOCK + j + i);
      }
    }
  }
  for (; j < count; ++j) score_rows(q, keys + j * stride, rows, dim, scores + j);
}

typedef int32_t ivec8 __attribute__((vector_size(32)));

// e^x for x <= 0, eight at a time (simd_exp.h); masked scores are zeroed apart
inline vec8 exp8(vec8 x) { return exp_nonpositive_lanes<vec8, ivec8>(x); }

// A block's scores (row[0, count), masked ones NEG) -> their weights e^(score - max) in place (0 where
// masked), and the weights' sum. The row holds BLOCK floats: the last group of 8 is padded with NEG.
inline float weigh_block(float* row, int64_t count, float max) {
  const int64_t padded = (count + 7) / 8 * 8;
  std::fill(row + count, row + padded, NEG);
  vec8 total = {};
  for (int64_t j = 0; j < padded; j += 8) {
    const vec8 score = load8(row + j);
    const vec8 weight = score <= NEG ? vec8{} : exp8(score - max);
    std::memcpy(row + j, &weight, sizeof(weight));
    total += weight;
  }
  return sum8(total);
}

// The largest of row[0, count), NEG if none is larger, eight lanes at a time (a float max reduction does not
// vectorize on its own without -ffast-math: one serial chain of `count` compares a score row otherwise).
// Pads the row's last group of 8 with NEG.
inline float max_of(float* row, int64_t count) {
  const int64_t padded = (count + 7) / 8 * 8;
  std::fill(row + count, row + padded, NEG);
  vec8 most = vec8{} + NEG;
  for (int64_t j = 0; j < padded; j += 8) {
    const vec8 score = load8(row + j);
    most = score > most ? score : most;
  }
  return std::max(std::max(std::max(most[0], most[1]), std::max(most[2], most[3])),
                  std::max(std::max(most[4], most[5]), std::max(most[6], most[7])));
}

// acc[0, 64) += sum over j < count of weights[j] * values[j * stride + 0, 64): the 64 sums stay in registers
// across the block's keys (written to memory once, not once a key)
inline void add_values64(const float* weights, const float* values, int64_t stride, int64_t count, float* acc) {
  vec8 a[8];
  for (int c = 0; c < 8; ++c) a[c] = load8(acc + 8 * c);
  for (int64_t j = 0; j < count; ++j) {
    const float w = weights[j];
    if (w == 0.0f) continue;
    const float* value = values + j * stride;
    for (int c = 0; c < 8; ++c) a[c] += w * load8(value + 8 * c);
  }
  for (int c = 0; c < 8; ++c) std::memcpy(acc + 8 * c, &a[c], sizeof(vec8));
}

inline float exp_nonpositive(float x) { return exp8(vec8{} + x)[0]; }

// dst[j * dim + d] = src[j * stride + d] as floats, for j < count: a bf16 or fp16 cache's block of keys or values
// widened once, so that the fp32 micro-kernels score it (element by element, the conversions had cost a bf16
// draft head's attention 3x an fp32 target's over as many keys)
template <typename scalar_t>
inline void widen(const scalar_t* src, int64_t stride, int64_t count, int64_t dim, float* dst) {
  for (int64_t j = 0; j < count; ++j) {
    const scalar_t* row = src + j * stride;
    float* out = dst + j * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(row[d]);
  }
}

struct Strides {
  int64_t slot, head, pos;  // a cache's strides; head_dim is contiguous
};

// The keys query `i` of row `b` sees, as a range, plus the tree mask's rule inside the row's block.
struct QueryKeys {
  int64_t lo, hi;         // lo <= p < hi
  int64_t block_start;    // tree: keys from here on are seen only where the row's tree mask says
  const bool* tree;       // tree mask row [W] of this query, or nullptr (causal)
  int64_t tree_width;
};

template <typename scalar_t>
struct Task {
  const scalar_t* q;  // q[b] at head 0
  int64_t q_head, q_query;  // q's strides for head and query (head_dim contiguous)
  const scalar_t* keys;  // k_cache[slot, kv_head]
  const scalar_t* values;
  int64_t k_pos, v_pos;  // strides between positions
  scalar_t* out;  // row b's first output: out[b] of [B, H, Q, D], or out[query_starts[b]] of packed [T, H, D]
  int64_t out_head, out_query;  // out's strides for head and query (head_dim contiguous)
};

template <typename scalar_t>
inline float dot(const float* q, const scalar_t* key, int64_t dim) {
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t d = 0; d < dim; ++d) total += q[d] * static_cast<float>(key[d]);
  return total;
}

// Masks what the query does not see among the `count` scores of keys from `start`.
inline void mask_block(const QueryKeys& query, int64_t start, int64_t count, float* scores) {
  const int64_t seen_from = std::clamp<int64_t>(query.lo - start, 0, count);
  const int64_t seen_to = std::clamp<int64_t>(query.hi - start, seen_from, count);
  std::fill(scores, scores + seen_from, NEG);
  std::fill(scores + seen_to, scores + count, NEG);
  if (query.tree == nullptr) return;
  for (int64_t j = std::max(seen_from, query.block_start - start); j < seen_to; ++j) {
    const int64_t offset = start + j - query.block_start;
    if (offset >= query.tree_width || !query.tree[offset]) scores[j] = NEG;
  }
}

// One (row, KV head): `group` query heads (from first_head) times the row's first `live` of `queries` queries;
// the rest are padding, whose outputs are zeros.
template <typename scalar_t>
void attend(const Task<scalar_t>& task, const std::vector<QueryKeys>& query_keys, int64_t first_head,
            int64_t group, int64_t queries, int64_t live, int64_t dim, float scale, std::vector<float>& buffer) {
  for (int64_t h = first_head; h < first_head + group; ++h) {
    for (int64_t i = live; i < queries; ++i) {
      scalar_t* dst = task.out + h * task.out_head + i * task.out_query;
      std::fill(dst, dst + dim, static_cast<scalar_t>(0));
    }
  }
  const int64_t rows = group * live;  // score rows: head-major, then query
  constexpr bool narrow = !std::is_same_v<scalar_t, float>;
  const bool widened = narrow && dim % 64 == 0;  // a narrow cache's blocks widened for the fp32 micro-kernels
  buffer.assign(rows * dim * 2 + rows * BLOCK + rows * 2 + (widened ? 2 * BLOCK * dim : 0), 0.0f);
  float* q = buffer.data();            // [rows, dim], scaled
  float* acc = q + rows * dim;         // [rows, dim]
  float* scores = acc + rows * dim;    // [rows, BLOCK]
  float* run_max = scores + rows * BLOCK;
  float* run_sum = run_max + rows;
  float* wide_keys = run_sum + rows;   // [BLOCK, dim] when widened
  float* wide_values = wide_keys + BLOCK * dim;
  int64_t first = INT64_MAX, last = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = first_head + r / live, i = r % live;
    const scalar_t* src = task.q + h * task.q_head + i * task.q_query;
    for (int64_t d = 0; d < dim; ++d) q[r * dim + d] = static_cast<float>(src[d]) * scale;
    run_max[r] = NEG;
    first = std::min(first, query_keys[i].lo);
    last = std::max(last, query_keys[i].hi);
  }
  for (int64_t start = first; start < last; start += BLOCK) {
    const int64_t count = std::min(BLOCK, last - start);
    bool scored = false;
    if constexpr (!narrow) {
      if (dim % 8 == 0) {
        score_block(q, task.keys + start * task.k_pos, task.k_pos, rows, count, dim, scores);
        scored = true;
      }
    } else if (widened) {
      widen(task.keys + start * task.k_pos, task.k_pos, count, dim, wide_keys);
      score_block(q, wide_keys, dim, rows, count, dim, scores);
      scored = true;
    }
    for (int64_t j = 0; !scored && j < count; ++j) {
      const scalar_t* key = task.keys + (start + j) * task.k_pos;
      for (int64_t r = 0; r < rows; ++r) scores[r * BLOCK + j] = dot(q + r * dim, key, dim);
    }
    for (int64_t r = 0; r < rows; ++r) mask_block(query_keys[r % live], start, count, scores + r * BLOCK);
    for (int64_t r = 0; r < rows; ++r) {
      float* row = scores + r * BLOCK;
      const float block_max = max_of(row, count);
      const float new_max = std::max(run_max[r], block_max);
      if (new_max <= NEG) {  // no key seen yet: nothing to weigh
        std::fill(row, row + count, 0.0f);
        continue;
      }
      const float rescale = exp_nonpositive(run_max[r] - new_max);
      run_sum[r] = run_sum[r] * rescale + weigh_block(row, count, new_max);
      run_max[r] = new_max;
      if (rescale != 1.0f) {
        float* a = acc + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] *= rescale;
      }
    }
    if (!narrow ? dim % 64 == 0 : widened) {
      const float* values = nullptr;
      int64_t stride = dim;
      if constexpr (!narrow) {
        values = task.values + start * task.v_pos;
        stride = task.v_pos;
      } else {
        widen(task.values + start * task.v_pos, task.v_pos, count, dim, wide_values);
        values = wide_values;
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t d = 0; d < dim; d += 64) {
          add_values64(scores + r * BLOCK, values + d, stride, count, acc + r * dim + d);
        }
      }
      continue;
    }
    for (int64_t j = 0; j < count; ++j) {
      const scalar_t* value = task.values + (start + j) * task.v_pos;
      for (int64_t r = 0; r < rows; ++r) {
        const float w = scores[r * BLOCK + j];
        if (w == 0.0f) continue;
        float* a = acc + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] += w * static_cast<float>(value[d]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // a query that saw no key gets zeros
    const int64_t h = first_head + r / live, i = r % live;
    const float inverse = run_sum[r] > 0.0f ? 1.0f / run_sum[r] : 0.0f;
    scalar_t* dst = task.out + h * task.out_head + i * task.out_query;
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(acc[r * dim + d] * inverse);
  }
}

std::vector<QueryKeys> row_query_keys(int64_t b, int64_t queries, const int64_t* positions, int64_t kv_len,
                                      int64_t key_start, std::optional<int64_t> window, const bool* tree,
                                      int64_t tree_width, int64_t block_start, int64_t cache_len) {
  std::vector<QueryKeys> keys(queries);
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t position = positions[b * queries + i];
    int64_t lo = key_start, hi = std::min(kv_len, cache_len);
    if (tree == nullptr) hi = std::min(hi, position + 1);
    if (window.has_value()) lo = std::max(lo, position - *window + 1);
    keys[i] = QueryKeys{std::max<int64_t>(lo, 0), hi, block_start,
                        tree == nullptr ? nullptr : tree + (b * queries + i) * tree_width, tree_width};
  }
  return keys;
}

// Row b's queries up to its last at a position below its kv_len: those after it are padding (a verify's row
// with fewer drafts than the batch's widest), which scores no key (at 8 rows in flight, one row verifying 4
// drafts among plain ones had every row's padding attend over its whole context: 3x a decode's attention).
// A tree's positions are depths, not cache positions: every query is scored.
int64_t live_queries(int64_t b, int64_t queries, const at::Tensor& positions, const at::Tensor& kv_lens,
                     const at::Tensor& tree) {
  if (tree.defined()) return queries;
  const int64_t* pos = positions.data_ptr<int64_t>() + b * queries;
  const int64_t kv_len = kv_lens.data_ptr<int64_t>()[b];
  int64_t live = queries;
  while (live > 0 && pos[live - 1] >= kv_len) --live;
  return live;
}

// The (row, KV head) tasks, costliest first (live queries times keys in range), which the threads take one
// at a time: split into equal ranges, a verify's rows with drafts among plain ones left one thread with most
// of the work (3 rows of 5 queries and 5 of 1 took longer than 8 rows of 3).
std::vector<int64_t> costliest_first(int64_t rows, int64_t kv_heads, const std::vector<int64_t>& live,
                                     const at::Tensor& kv_lens, const at::Tensor& firsts) {
  std::vector<int64_t> cost(rows);
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t first = firsts.defined() ? firsts.data_ptr<int64_t>()[b] : 0;
    cost[b] = live[b] * std::max<int64_t>(kv_lens.data_ptr<int64_t>()[b] - first, 1);
  }
  std::vector<int64_t> order(rows * kv_heads);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost[a / kv_heads] > cost[b / kv_heads]; });
  return order;
}

at::Tensor slot_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& slots, const at::Tensor& positions, const at::Tensor& kv_lens,
                              const std::optional<at::Tensor>& key_starts, std::optional<int64_t> window,
                              const std::optional<at::Tensor>& tree_mask,
                              const std::optional<at::Tensor>& block_starts, double scale,
                              const std::optional<at::Tensor>& query_starts) {
  // packed: q holds the rows' real queries only, [T, H, D], row b's from query_starts[b] to query_starts[b + 1]
  // (a packed verify's tokens), and so does the output; positions stay [B, Q] of the padded layout
  const bool packed = query_starts.has_value();
  TORCH_CHECK(q.dim() == (packed ? 3 : 4) && k_cache.dim() == 4 && v_cache.dim() == 4,
              "slot_attention: q is [B, H, Q, D] (or [T, H, D] with query_starts), k_cache and v_cache 4-d");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "slot_attention: q, k_cache and v_cache share a dtype");
  TORCH_CHECK(!packed || (positions.dim() == 2 && !tree_mask.has_value()),
              "slot_attention: packed queries take positions [B, Q] and no tree_mask");
  const at::Tensor q_starts = packed ? query_starts->to(at::kLong).contiguous() : at::Tensor();
  TORCH_CHECK(!packed || (q_starts.dim() == 1 && q_starts.numel() >= 1), "slot_attention: query_starts is [B + 1]");
  const int64_t rows = packed ? q_starts.numel() - 1 : q.size(0), heads = q.size(1);
  const int64_t queries = packed ? positions.size(1) : q.size(2), dim = q.size(packed ? 2 : 3);
  const int64_t kv_heads = k_cache.size(1), cache_len = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "slot_attention: query heads are a multiple of KV heads");
  TORCH_CHECK(k_cache.size(3) == dim && v_cache.size(3) == dim, "slot_attention: head_dim differs");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "slot_attention: the caches' head_dim is contiguous");
  const at::Tensor query = q.stride(-1) == 1 ? q : q.contiguous();
  const at::Tensor slot_ids = slots.to(at::kLong).contiguous();
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  const at::Tensor lens = kv_lens.to(at::kLong).contiguous();
  const at::Tensor firsts = key_starts.has_value() ? key_starts->to(at::kLong).contiguous() : at::Tensor();
  const at::Tensor blocks = block_starts.has_value() ? block_starts->to(at::kLong).contiguous() : at::Tensor();
  const at::Tensor tree = tree_mask.has_value() ? tree_mask->to(at::kBool).contiguous() : at::Tensor();
  TORCH_CHECK(!tree.defined() || blocks.defined(), "slot_attention: a tree_mask needs block_starts");
  TORCH_CHECK(pos.numel() == rows * queries, "slot_attention: positions is [B, Q] of q's B and Q");
  TORCH_CHECK(slot_ids.numel() == rows && lens.numel() == rows, "slot_attention: slots and kv_lens are [B]");
  TORCH_CHECK(!firsts.defined() || firsts.numel() == rows, "slot_attention: key_starts is [B]");
  TORCH_CHECK(!blocks.defined() || blocks.numel() == rows, "slot_attention: block_starts is [B]");
  TORCH_CHECK(!tree.defined() || (tree.dim() == 3 && tree.size(0) == rows && tree.size(1) == queries),
              "slot_attention: tree_mask is [B, Q, W]");
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == kv_heads && v_cache.size(2) == cache_len,
              "slot_attention: k_cache and v_cache differ in shape");
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t slot = slot_ids.data_ptr<int64_t>()[b];
    TORCH_CHECK(slot >= 0 && slot < k_cache.size(0), "slot_attention: a slot past the cache");
  }
  // row b's queries in the output's layout (padded: Q; packed: its own) and those scored
  std::vector<int64_t> laid(rows, queries), live(rows);
  const int64_t* q_first = packed ? q_starts.data_ptr<int64_t>() : nullptr;
  TORCH_CHECK(!packed || (q_first[0] == 0 && q_first[rows] == q.size(0)),
              "slot_attention: query_starts run from 0 to q's T, each row at most Q queries");
  for (int64_t b = 0; b < rows; ++b) {
    if (packed) {
      laid[b] = q_first[b + 1] - q_first[b];
      TORCH_CHECK(0 <= laid[b] && laid[b] <= queries,
                  "slot_attention: query_starts run from 0 to q's T, each row at most Q queries");
    }
    live[b] = std::min(laid[b], live_queries(b, queries, pos, lens, tree));
  }
  // where row b's queries and outputs start, and their strides by query and (outputs) by head
  const int64_t q_query = packed ? query.stride(0) : query.stride(2);
  const int64_t out_head = packed ? dim : queries * dim, out_query = packed ? heads * dim : dim;
  auto q_row = [&](int64_t b) { return (packed ? q_first[b] : b) * query.stride(0); };
  auto out_row = [&](int64_t b) { return packed ? q_first[b] * heads * dim : b * heads * queries * dim; };
  at::Tensor out = packed ? at::empty({q.size(0), heads, dim}, q.options())
                          : at::empty({rows, heads, queries, dim}, q.options());
  const int64_t group = heads / kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "slot_attention_cpu", [&] {
    const scalar_t* q_data = query.data_ptr<scalar_t>();
    const scalar_t* k_data = k_cache.data_ptr<scalar_t>();
    const scalar_t* v_data = v_cache.data_ptr<scalar_t>();
    scalar_t* out_data = out.data_ptr<scalar_t>();
    const int64_t* slot_data = slot_ids.data_ptr<int64_t>();
    const Strides ks{k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
    const Strides vs{v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
    const std::vector<int64_t> order = costliest_first(rows, kv_heads, live, lens, firsts);
    std::atomic<int64_t> next{0};
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), rows * kv_heads);
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      std::vector<float> buffer;
      for (int64_t n; (n = next.fetch_add(1)) < static_cast<int64_t>(order.size());) {
        const int64_t task_id = order[n], b = task_id / kv_heads, kv_head = task_id % kv_heads;
        const int64_t slot = slot_data[b];
        const auto query_keys = row_query_keys(
            b, queries, pos.data_ptr<int64_t>(), lens.data_ptr<int64_t>()[b],
            firsts.defined() ? firsts.data_ptr<int64_t>()[b] : 0, window,
            tree.defined() ? tree.data_ptr<bool>() : nullptr, tree.defined() ? tree.size(2) : 0,
            blocks.defined() ? blocks.data_ptr<int64_t>()[b] : 0, cache_len);
        const Task<scalar_t> task{q_data + q_row(b), query.stride(1), q_query,
                                  k_data + slot * ks.slot + kv_head * ks.head,
                                  v_data + slot * vs.slot + kv_head * vs.head, ks.pos, vs.pos,
                                  out_data + out_row(b), out_head, out_query};
        attend(task, query_keys, kv_head * group, group, laid[b], live[b], dim, static_cast<float>(scale), buffer);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(draftsmith_cpu, m) {
  m.def("slot_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor positions, "
        "Tensor kv_lens, Tensor? key_starts, int? window, Tensor? tree_mask, Tensor? block_starts, "
        "float scale, Tensor? query_starts=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftsmith_cpu, CPU, m) { m.impl("slot_attention", &slot_attention_cpu); }
