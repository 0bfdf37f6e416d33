// One draft step of a recurrent head (EAGLE-3, EAGLE-1, MTP) at one query a row (drafts 2..k: the head's own
// output and draft fed back), as one op: its input, its one decoder layer over its own cache, and its logits.
// Each part is this build's own op (panel_linear, rms_norm, add_rms_norm, rope, write_kv, slot_attention,
// silu_mul) called through the dispatcher, in the order the head's `step` runs them eagerly: so the results
// are the eager step's bit for bit wherever that attends through the slot kernel too. On two cores an eager
// one-row step of the demo EAGLE-3 head took about 300 us, of which its kernels were about 110: the rest was
// Python, a module call and a few op calls per part. models/draft_step_cpu.py holds the rules of when it
// runs. Built into the same extension as slot_attention_cpu.cpp (slot_attention_cpu.py loads it).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
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
                          const at::Tensor& key_starts, double scale) {
  using Optional = std::optional<at::Tensor>;
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, const at::Tensor&, const at::Tensor&, const Optional&,
                                            std::optional<int64_t>, const Optional&, const Optional&, double,
                                            const Optional&)>("draftsmith_cpu::slot_attention");
  return op.call(q, k_cache, v_cache, slots, positions, kv_lens, key_starts, std::nullopt, std::nullopt,
                 std::nullopt, scale, std::nullopt);
}

// A head's parts, in the op's list order; a part a head has not is None
enum Projection { INPUT, QKV, O, GATE_UP, DOWN, LM_HEAD, PROJECTIONS };  // panels, biases, out_features
enum Norm { EMBEDDING, STATE, ATTENTION_INPUT, POST_ATTENTION, FINAL, NORMS };
enum Flag { STATE_FIRST, NORMED_RESIDUAL, FEED_BACK_NORMED, FLAGS };

at::Tensor normed_or_same(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  return weight.has_value() ? rms_norm(x, *weight, eps) : x;
}

// ids [A] (target ids), state [A, H], base [A] (each row's first draft step's position; this step sits `step`
// further on), slots and key_starts [A] (the head's cache slot and the first key each row reads) -> (the
// head's output [A, H], fed back as the next state, and logits [A, vocab]). fp32 throughout. The rules, as
// the heads' `step` runs them (EAGLE-3, EAGLE-1, MTP):
// - the embedding and the state are each normed where their norm is given, and joined (the state first with
//   STATE_FIRST);
// - with an INPUT projection, it maps them to x, the layer's residual, and its input is x normed where
//   ATTENTION_INPUT is given; without, the joined vector is the layer's input, and its residual the state
//   (normed with NORMED_RESIDUAL);
// - the layer: q/k/v, rope, the keys and values written at the step's position, attention over the row's
//   cache from its first key, o, the residual add and the post-attention norm, the gated MLP, its add;
// - logits: the LM head over the output, normed first where FINAL is given, which is then fed back with
//   FEED_BACK_NORMED.
std::tuple<at::Tensor, at::Tensor> recurrent_draft_step(
    const at::Tensor& ids, const at::Tensor& state, const at::Tensor& base, int64_t step, const at::Tensor& slots,
    const at::Tensor& key_starts, const at::Tensor& embedding, const c10::List<std::optional<at::Tensor>>& norms,
    const c10::List<std::optional<at::Tensor>>& panels, const c10::List<std::optional<at::Tensor>>& biases,
    at::IntArrayRef out_features, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& cos_table,
    const at::Tensor& sin_table, int64_t heads, int64_t kv_heads, double eps, at::IntArrayRef flags) {
  TORCH_CHECK(norms.size() == NORMS && panels.size() == PROJECTIONS && biases.size() == PROJECTIONS &&
                  out_features.size() == PROJECTIONS && flags.size() == FLAGS,
              "recurrent_draft_step: 5 norms, 6 projections (input, qkv, o, gate_up, down, lm_head), 3 flags");
  for (const int p : {QKV, O, GATE_UP, DOWN, LM_HEAD}) {
    TORCH_CHECK(panels.get(p).has_value(), "recurrent_draft_step: only the input projection may be None");
  }
  TORCH_CHECK(norms.get(POST_ATTENTION).has_value(), "recurrent_draft_step: the post-attention norm is the layer's");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.dim() == 2 && ids.dim() == 1 && ids.size(0) == state.size(0),
              "recurrent_draft_step: fp32 state [A, H] and ids [A]");
  const int64_t rows = ids.size(0), dim = k_cache.size(3), per_head = heads + kv_heads;
  TORCH_CHECK(out_features[QKV] == (heads + 2 * kv_heads) * dim && out_features[GATE_UP] % 2 == 0,
              "recurrent_draft_step: qkv's and gate_up's widths");
  auto project = [&](const at::Tensor& x, Projection p) { return linear(x, *panels.get(p), biases.get(p), out_features[p]); };
  const at::Tensor hidden = state.contiguous();
  const at::Tensor positions = step == 0 ? base : base + step;
  const at::Tensor at_rows = positions.view({rows, 1}), slot_rows = slots.view({rows, 1});

  const at::Tensor normed = normed_or_same(hidden, norms.get(STATE), eps);
  const at::Tensor embedded = normed_or_same(at::embedding(embedding, ids), norms.get(EMBEDDING), eps);
  const at::Tensor joined = flags[STATE_FIRST] ? at::cat({normed, embedded}, -1) : at::cat({embedded, normed}, -1);
  at::Tensor layer_input = joined, residual = flags[NORMED_RESIDUAL] ? normed : hidden;
  if (panels.get(INPUT).has_value()) {
    residual = project(joined, INPUT);
    layer_input = normed_or_same(residual, norms.get(ATTENTION_INPUT), eps);
  }
  const at::Tensor qkv = project(layer_input, QKV);
  const at::Tensor turned = rope(qkv.narrow(1, 0, per_head * dim).view({rows, per_head, dim}),
                                 cos_table.index_select(0, positions), sin_table.index_select(0, positions));
  const at::Tensor values = qkv.narrow(1, per_head * dim, kv_heads * dim).view({rows, kv_heads, 1, dim});
  write_kv(k_cache, slot_rows, at_rows, turned.narrow(1, heads, kv_heads).unsqueeze(2));
  write_kv(v_cache, slot_rows, at_rows, values);
  const at::Tensor attended = slot_attention(turned.narrow(1, 0, heads).unsqueeze(2), k_cache, v_cache, slots,
                                             at_rows, positions + 1, key_starts,
                                             std::pow(static_cast<double>(dim), -0.5));
  const at::Tensor projected = project(attended.view({rows, heads * dim}), O);
  const auto [summed, post_normed] = add_rms_norm(residual, projected, *norms.get(POST_ATTENTION), eps);
  const at::Tensor gate_up = project(post_normed, GATE_UP);
  const int64_t intermediate = out_features[GATE_UP] / 2;
  const at::Tensor mixed = silu_mul(gate_up.narrow(1, 0, intermediate), gate_up.narrow(1, intermediate, intermediate));
  const at::Tensor out = summed + project(mixed, DOWN);
  const at::Tensor read = normed_or_same(out, norms.get(FINAL), eps);
  return {flags[FEED_BACK_NORMED] ? read : out, project(read, LM_HEAD)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(draftsmith_cpu, m) {
  m.def("recurrent_draft_step(Tensor ids, Tensor state, Tensor base, int step, Tensor slots, Tensor key_starts, "
        "Tensor embedding, Tensor?[] norms, Tensor?[] panels, Tensor?[] biases, int[] out_features, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cos, Tensor sin, int heads, int kv_heads, float eps, "
        "int[] flags) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(draftsmith_cpu, CPU, m) { m.impl("recurrent_draft_step", &recurrent_draft_step); }
