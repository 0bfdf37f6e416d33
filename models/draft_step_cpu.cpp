// One forward of a recurrent head (EAGLE-3, EAGLE-1, MTP) over a few queries a row as one op: a draft step
// (one query a row: drafts 2..k, the head's own output and draft fed back) or a catch-up (each row's newly
// verified positions, whose last yields draft 1): its input, its one decoder layer over its own cache, and
// its logits at each row's last query.
// Each part is this build's own op (panel_linear, rms_norm, add_rms_norm, rope, write_kv, slot_attention,
// silu_mul) called through the dispatcher, in the order the head's `step` runs them eagerly: so the results
// are the eager step's bit for bit wherever that attends through the slot kernel too. On two cores an eager
// one-row step of the demo EAGLE-3 head took about 300 us, of which its kernels were about 110: the rest was
// Python, a module call and a few op calls per part. models/draft_step_cpu.py holds the rules of when it
// runs. `recurrent_draft_loop` runs a greedy draft loop's later steps, their picks and its early stop, as one
// op. Built into the same extension as slot_attention_cpu.cpp (slot_attention_cpu.py loads it).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("draftsmith_cpu::rms_norm");
  return op.call(x, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  static const auto op = find_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                    const at::Tensor&, double)>(
      "draftsmith_cpu::add_rms_norm");
  return op.call(x, residual, weight, eps);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                  int64_t out_features) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                            int64_t)>("draftsmith_cpu::panel_linear");
  return op.call(x, panels, bias, out_features);
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "draftsmith_cpu::rope");
  return op.call(x, cos, sin);
}

void write_kv(at::Tensor& cache, const at::Tensor& slots, const at::Tensor& positions, const at::Tensor& fresh) {
  static const auto op = find_op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "draftsmith_cpu::write_kv");
  op.call(cache, slots, positions, fresh);
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&)>("draftsmith_cpu::silu_mul");
  return op.call(gate, up);
}

at::Tensor slot_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& slots, const at::Tensor& positions, const at::Tensor& kv_lens,
                          const at::Tensor& key_starts, std::optional<int64_t> window, double scale) {
  using Optional = std::optional<at::Tensor>;
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, const at::Tensor&, const at::Tensor&, const Optional&,
                                            std::optional<int64_t>, const Optional&, const Optional&, double,
                                            const Optional&)>("draftsmith_cpu::slot_attention");
  return op.call(q, k_cache, v_cache, slots, positions, kv_lens, key_starts, window, std::nullopt, std::nullopt,
                 scale, std::nullopt);
}

// A head's parts, in the op's list order; a part a head has not is None
enum Projection { INPUT, QKV, O, GATE_UP, DOWN, LM_HEAD, PROJECTIONS };  // panels, biases, out_features
enum Norm { EMBEDDING, STATE, ATTENTION_INPUT, POST_ATTENTION, FINAL, NORMS };
enum Flag { STATE_FIRST, NORMED_RESIDUAL, FEED_BACK_NORMED, ZERO_FIRST_EMBEDDING, FLAGS };

std::tuple<at::Tensor, at::Tensor> greedy_pick(const at::Tensor& logits, const std::optional<at::Tensor>& d2t) {
  static const auto op = find_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&)>(
      "draftsmith_cpu::greedy_pick");
  return op.call(logits, d2t);
}

at::Tensor normed_or_same(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  return weight.has_value() ? rms_norm(x, *weight, eps) : x;
}

// Where a step's W queries a row sit: positions [A, W] (base + step + j, past the cache's end its last),
// the slots their keys and values go to [A, W] (a padding query's: the scratch slot, the cache's last), the
// keys each row sees [A] (up to its last real query) and the flat index of each row's last real query [A]
// (ForwardBatch.build's rules for the same rows).
struct Queries {
  at::Tensor positions, write_slots, kv_lens, last;
};

Queries place_queries(const at::Tensor& base, int64_t step, const std::optional<at::Tensor>& held,
                      const at::Tensor& slots, int64_t width, const at::Tensor& k_cache) {
  const int64_t rows = base.size(0), last_position = k_cache.size(2) - 2, scratch = k_cache.size(0) - 1;
  TORCH_CHECK(base.dim() == 1 && slots.numel() == rows && (!held.has_value() || held->numel() == rows),
              "recurrent_draft_step: base, slots and held are [A]");
  const at::Tensor starts = base.to(at::kLong).contiguous(), slot_ids = slots.to(at::kLong).contiguous();
  const at::Tensor counts = held.has_value() ? held->to(at::kLong).contiguous() : at::full({rows}, width, at::kLong);
  Queries q{at::empty({rows, width}, at::kLong), at::empty({rows, width}, at::kLong), at::empty({rows}, at::kLong),
            at::empty({rows}, at::kLong)};
  const int64_t *start = starts.data_ptr<int64_t>(), *slot = slot_ids.data_ptr<int64_t>();
  const int64_t* count = counts.data_ptr<int64_t>();
  int64_t *position = q.positions.data_ptr<int64_t>(), *write = q.write_slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(1 <= count[b] && count[b] <= width, "recurrent_draft_step: each row holds 1 to W queries");
    for (int64_t j = 0; j < width; ++j) {
      position[b * width + j] = std::min(start[b] + step + j, last_position);
      write[b * width + j] = j < count[b] ? slot[b] : scratch;
    }
    q.kv_lens.data_ptr<int64_t>()[b] = start[b] + step + count[b];
    q.last.data_ptr<int64_t>()[b] = b * width + count[b] - 1;
  }
  return q;
}

// ids [A, W] (target ids; [A] for one query a row), state [A, W, H] ([A, H]), base [A] (where each row's
// first query sits when `step` is 0; a draft loop's later steps sit `step` further on), held [A] (each row's
// real queries, the rest padding; None: all W), slots and key_starts [A] (the head's cache slot and the
// first key each row reads), window (each query's newest keys; None: all) -> (the head's output at each
// row's last real query [A, H], fed back as the next state, and the logits there [A, vocab]). fp32
// throughout. The rules, as the heads' `step` runs them (EAGLE-3, EAGLE-1, MTP):
// - the embedding (zero at position 0 with ZERO_FIRST_EMBEDDING) and the state are each normed where their
//   norm is given, and joined (the state first with STATE_FIRST);
// - with an INPUT projection, it maps them to x, the layer's residual, and its input is x normed where
//   ATTENTION_INPUT is given; without, the joined vector is the layer's input, and its residual the state
//   (normed with NORMED_RESIDUAL);
// - the layer: q/k/v, rope, the keys and values written at the queries' positions, attention over each
//   row's cache from its first key (causal), o, the residual add and the post-attention norm, the gated MLP,
//   its add;
// - logits: the LM head over the output, normed first where FINAL is given, which is then fed back with
//   FEED_BACK_NORMED.
std::tuple<at::Tensor, at::Tensor> recurrent_draft_step(
    const at::Tensor& ids, const at::Tensor& state, const at::Tensor& base, int64_t step,
    const std::optional<at::Tensor>& held, const at::Tensor& slots, const at::Tensor& key_starts,
    std::optional<int64_t> window, const at::Tensor& embedding, const c10::List<std::optional<at::Tensor>>& norms,
    const c10::List<std::optional<at::Tensor>>& panels, const c10::List<std::optional<at::Tensor>>& biases,
    at::IntArrayRef out_features, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& cos_table,
    const at::Tensor& sin_table, int64_t heads, int64_t kv_heads, double eps, at::IntArrayRef flags) {
  TORCH_CHECK(norms.size() == NORMS && panels.size() == PROJECTIONS && biases.size() == PROJECTIONS &&
                  out_features.size() == PROJECTIONS && flags.size() == FLAGS,
              "recurrent_draft_step: 5 norms, 6 projections (input, qkv, o, gate_up, down, lm_head), 4 flags");
  for (const int p : {QKV, O, GATE_UP, DOWN, LM_HEAD}) {
    TORCH_CHECK(panels.get(p).has_value(), "recurrent_draft_step: only the input projection may be None");
  }
  TORCH_CHECK(norms.get(POST_ATTENTION).has_value(), "recurrent_draft_step: the post-attention norm is the layer's");
  const int64_t rows = base.size(0), width = ids.dim() == 2 ? ids.size(1) : 1, hidden_size = state.size(-1);
  TORCH_CHECK(state.scalar_type() == at::kFloat && ids.numel() == rows * width && state.numel() == ids.numel() * hidden_size,
              "recurrent_draft_step: fp32 state [A, W, H] and ids [A, W] of base's A rows");
  TORCH_CHECK(key_starts.numel() == rows, "recurrent_draft_step: key_starts is [A]");
  const int64_t dim = k_cache.size(3), per_head = heads + kv_heads, tokens = rows * width;
  TORCH_CHECK(out_features[QKV] == (heads + 2 * kv_heads) * dim && out_features[GATE_UP] % 2 == 0,
              "recurrent_draft_step: qkv's and gate_up's widths");
  auto project = [&](const at::Tensor& x, Projection p) { return linear(x, *panels.get(p), biases.get(p), out_features[p]); };
  const Queries queries = place_queries(base, step, held, slots, width, k_cache);
  const at::Tensor hidden = state.reshape({tokens, hidden_size}).contiguous();

  const at::Tensor normed = normed_or_same(hidden, norms.get(STATE), eps);
  at::Tensor embedded = at::embedding(embedding, ids.reshape({tokens}));
  if (flags[ZERO_FIRST_EMBEDDING]) embedded.masked_fill_(queries.positions.view({tokens, 1}) == 0, 0.0);
  embedded = normed_or_same(embedded, norms.get(EMBEDDING), eps);
  const at::Tensor joined = flags[STATE_FIRST] ? at::cat({normed, embedded}, -1) : at::cat({embedded, normed}, -1);
  at::Tensor layer_input = joined, residual = flags[NORMED_RESIDUAL] ? normed : hidden;
  if (panels.get(INPUT).has_value()) {
    residual = project(joined, INPUT);
    layer_input = normed_or_same(residual, norms.get(ATTENTION_INPUT), eps);
  }
  const at::Tensor qkv = project(layer_input, QKV);
  const at::Tensor flat_positions = queries.positions.view({tokens});
  // [A, W, heads + kv_heads, D] turned; each part as [A, its heads, W, D]
  const at::Tensor turned = rope(qkv.narrow(1, 0, per_head * dim).view({tokens, per_head, dim}),
                                 cos_table.index_select(0, flat_positions), sin_table.index_select(0, flat_positions))
                                .view({rows, width, per_head, dim});
  const at::Tensor values = qkv.narrow(1, per_head * dim, kv_heads * dim).view({rows, width, kv_heads, dim});
  write_kv(k_cache, queries.write_slots, queries.positions, turned.narrow(2, heads, kv_heads).transpose(1, 2));
  write_kv(v_cache, queries.write_slots, queries.positions, values.transpose(1, 2));
  const at::Tensor attended = slot_attention(turned.narrow(2, 0, heads).transpose(1, 2), k_cache, v_cache, slots,
                                             queries.positions, queries.kv_lens, key_starts, window,
                                             std::pow(static_cast<double>(dim), -0.5));
  const at::Tensor projected = project(attended.transpose(1, 2).reshape({tokens, heads * dim}), O);
  const auto [summed, post_normed] = add_rms_norm(residual, projected, *norms.get(POST_ATTENTION), eps);
  const at::Tensor gate_up = project(post_normed, GATE_UP);
  const int64_t intermediate = out_features[GATE_UP] / 2;
  const at::Tensor mixed = silu_mul(gate_up.narrow(1, 0, intermediate), gate_up.narrow(1, intermediate, intermediate));
  const at::Tensor out = summed + project(mixed, DOWN);
  const at::Tensor at_last = width == 1 ? out : out.index_select(0, queries.last);
  const at::Tensor read = normed_or_same(at_last, norms.get(FINAL), eps);
  return {flags[FEED_BACK_NORMED] ? read : at_last, project(read, LM_HEAD)};
}

// Greedy draft steps first..steps - 1 of a draft loop, whose step first - 1 chose `ids` [A] (target ids) and
// gave the head's output `state` [A, H]: step s runs `recurrent_draft_step` (step index s - 1 from the loop's
// `base`, one query a row) and picks as `greedy_pick` does (each row's first largest logit, plus d2t's offset
// there; its softmax probability), into drafted[:, s] and probs[:, s]. With stop_below > 0 the loop ends where
// the proposer's own loop would: after step s (while s + 1 < steps), `product` [A] (each row's running product
// of probabilities, through step s - 1 on entry) takes step s's, rows at their limit (`limits` [A], None:
// every row drafts every step) count 0, and below stop_below x batch_rows in all the loop stops. -> the draft
// steps run in all, the steps before `first` included.
int64_t recurrent_draft_loop(
    const at::Tensor& ids, const at::Tensor& state, const at::Tensor& base, int64_t first, int64_t steps,
    const at::Tensor& slots, const at::Tensor& key_starts, const at::Tensor& embedding,
    const c10::List<std::optional<at::Tensor>>& norms, const c10::List<std::optional<at::Tensor>>& panels,
    const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef out_features, at::Tensor& k_cache,
    at::Tensor& v_cache, const at::Tensor& cos_table, const at::Tensor& sin_table, int64_t heads, int64_t kv_heads,
    double eps, at::IntArrayRef flags, const std::optional<at::Tensor>& d2t, at::Tensor& drafted, at::Tensor& probs,
    at::Tensor& product, const std::optional<at::Tensor>& limits, double stop_below, int64_t batch_rows) {
  const int64_t rows = base.size(0);
  TORCH_CHECK(1 <= first && first <= steps && steps <= drafted.size(1) && drafted.size(0) == rows &&
                  probs.sizes() == drafted.sizes() && product.numel() == rows && ids.numel() == rows,
              "recurrent_draft_loop: ids and product [A], drafted and probs [A, k] with k >= steps > first - 1 >= 0");
  at::Tensor chosen = ids, fed = state, running = product;
  for (int64_t s = first; s < steps; ++s) {
    const auto [output, logits] = recurrent_draft_step(
        chosen, fed, base, s - 1, std::nullopt, slots, key_starts, std::nullopt, embedding, norms, panels, biases,
        out_features, k_cache, v_cache, cos_table, sin_table, heads, kv_heads, eps, flags);
    const auto [picked, probability] = greedy_pick(logits, d2t);
    drafted.select(1, s).copy_(picked);
    probs.select(1, s).copy_(probability);
    chosen = picked;
    fed = output;
    if (stop_below > 0 && s + 1 < steps) {
      running = running * probability;
      const at::Tensor going = limits.has_value() ? at::where(*limits > s + 1, running, 0.0) : running;
      if (going.sum().item<double>() < stop_below * static_cast<double>(batch_rows)) return s + 1;
    }
  }
  return steps;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(draftsmith_cpu, m) {
  m.def("recurrent_draft_step(Tensor ids, Tensor state, Tensor base, int step, Tensor? held, Tensor slots, "
        "Tensor key_starts, int? window, Tensor embedding, Tensor?[] norms, Tensor?[] panels, Tensor?[] biases, int[] out_features, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cos, Tensor sin, int heads, int kv_heads, float eps, "
        "int[] flags) -> (Tensor, Tensor)");
  m.def("recurrent_draft_loop(Tensor ids, Tensor state, Tensor base, int first, int steps, Tensor slots, "
        "Tensor key_starts, Tensor embedding, Tensor?[] norms, Tensor?[] panels, Tensor?[] biases, int[] out_features, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cos, Tensor sin, int heads, int kv_heads, float eps, "
        "int[] flags, Tensor? d2t, Tensor(c!) drafted, Tensor(d!) probs, Tensor product, Tensor? limits, "
        "float stop_below, int batch_rows) -> int");
}

TORCH_LIBRARY_IMPL(draftsmith_cpu, CPU, m) {
  m.impl("recurrent_draft_step", &recurrent_draft_step);
  m.impl("recurrent_draft_loop", &recurrent_draft_loop);
}
