// Prompt lookup for the n-gram proposer (draftsmith/methods/ngram/proposer.py): for each row, the most recent
// earlier occurrence of the longest suffix n-gram (min_n <= n <= max_n) that a token follows, as
// find_continuations computes it with tensor ops, and the drafts that follow it. Those ops took 0.46 ms a
// propose at one row in flight (some forty small aten ops over the history, a few microseconds each), a tenth
// of a demo decode step; this scans each row's history from its end, one op for the batch. Built into the
// CPU attention kernel's extension (slot_attention_cpu.py loads it), in its `draftsmith_cpu` library.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>

namespace {

// The most recent earlier occurrence of the longest suffix n-gram of row[0..len) that a token follows ->
// (where the proposal starts, how many tokens before it equal the suffix's, up to max(n, agree_cap)), or
// (-1, 0)
std::pair<int64_t, int64_t> lookup(const int64_t* row, int64_t len, int64_t min_n, int64_t max_n,
                                   int64_t agree_cap) {
  for (int64_t n = max_n; n >= min_n; --n) {
    if (len <= n) continue;
    // an n-gram ending at p (n - 1 <= p) followed by a token (p + 1 < len) equal to the last n tokens
    for (int64_t p = len - 2; p >= n - 1; --p) {
      int64_t i = 0;
      while (i < n && row[p - i] == row[len - 1 - i]) ++i;
      if (i < n) continue;
      while (i < agree_cap && i <= p && row[p - i] == row[len - 1 - i]) ++i;
      return {p + 1, i};
    }
  }
  return {-1, 0};
}

// Row b's history is tokens[slots[b], 0..lengths[b]); its drafts, up to limits[b] and to the history's end,
// go to drafts[b] (-1 after them), their number to counts[b] and the match's length (the tokens before the
// proposal that equal the history's last ones, at least n, at most max(n, agree_cap); 0: no match) to
// agreed[b]
void ngram_propose_cpu(const at::Tensor& tokens, const at::Tensor& slots, const at::Tensor& lengths,
                       const at::Tensor& limits, int64_t min_n, int64_t max_n, int64_t agree_cap,
                       at::Tensor& drafts, at::Tensor& counts, at::Tensor& agreed) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && tokens.is_contiguous(),
              "ngram_propose: tokens is a contiguous [slots, L] int64 buffer");
  const int64_t rows = slots.numel(), width = tokens.size(1), k = drafts.size(1);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&slots, &lengths, &limits, &counts, &agreed})
    TORCH_CHECK(t->dim() == 1 && t->numel() == rows && t->scalar_type() == at::kLong && t->is_contiguous(),
                "ngram_propose: slots, lengths, limits, counts and agreed are [rows] contiguous int64");
  TORCH_CHECK(drafts.dim() == 2 && drafts.size(0) == rows && drafts.scalar_type() == at::kLong &&
              drafts.is_contiguous(), "ngram_propose: drafts is a contiguous [rows, k] int64");
  TORCH_CHECK(1 <= min_n && min_n <= max_n, "ngram_propose: 1 <= min_n <= max_n");
  const int64_t* all = tokens.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* limit = limits.data_ptr<int64_t>();
  int64_t* out = drafts.data_ptr<int64_t>();
  int64_t* count = counts.data_ptr<int64_t>();
  int64_t* agree = agreed.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(0 <= slot[b] && slot[b] < tokens.size(0) && 0 <= len[b] && len[b] <= width,
                "ngram_propose: a slot or length past the buffer");
    const int64_t* row = all + slot[b] * width;
    const auto [start, matched] = lookup(row, len[b], min_n, max_n, agree_cap);
    int64_t c = 0;
    if (start >= 0) c = std::max<int64_t>(0, std::min({limit[b], k, len[b] - start}));
    for (int64_t j = 0; j < k; ++j) out[b * k + j] = j < c ? row[start + j] : -1;
    count[b] = c;
    agree[b] = matched;
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(draftsmith_cpu, m) {
  m.def("ngram_propose(Tensor tokens, Tensor slots, Tensor lengths, Tensor limits, int min_n, int max_n, "
        "int agree_cap, Tensor(a!) drafts, Tensor(b!) counts, Tensor(c!) agreed) -> ()");
}

TORCH_LIBRARY_IMPL(draftsmith_cpu, CPU, m) { m.impl("ngram_propose", &ngram_propose_cpu); }
