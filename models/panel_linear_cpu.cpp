// fp32 linear layers on CPU over a weight packed into column panels: the GEMM of decode and verify forwards.
//
// The weight [N, K] is packed once into panels [ceil(N / 32), K, 32]: for each k, 32 consecutive output
// columns, so that a tile of rows streams its panel front to back. A tile keeps its rows x 32-column (or 64)
// accumulators in registers: for every k it broadcasts each row's x[r, k] and adds x[r, k] * w[k, cols]
// (fused multiply-add) into them. oneDNN, which ran these layers before, reached about 19 GB/s of weights at
// 8 rows on the 2-core dev VM, where the memory gives 32: at a few rows a layer is a read of its weight.
//
// Batch invariance, which greedy speculation rests on (a verify computes a row exactly as a decode does):
// every output element is one chain of multiply-adds over k = 0..K-1 in order, from zero, then its bias,
// whatever the tile, the row count or the thread that computes it. The tile shape is chosen by the row count
// for speed only.
//
// Panels may hold bfloat16 weights (a draft head's, `models.linear.pack_weights_in`, or any fp32 weight whose
// values are all bfloat16 ones: a checkpoint stored in bfloat16): each is widened to fp32 exactly as it is
// loaded (a bfloat16 is an fp32's upper 16 bits), and the sums are the fp32 ones above over those values, so
// a layer reads half the bytes. Inputs, accumulators and outputs stay fp32.
//
// Built only with AVX-512 (16-float registers, 32 of them): the tiles are sized for that register file, and
// elsewhere oneDNN runs (`panel_linear_available`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t PANEL = 32;  // output columns a panel holds: two 16-float vectors
// fp32 panels: up to this many rows, 8 x 32 tiles (a pass over the weight for all rows)
constexpr int64_t FEW_ROWS = 8;
// past it, and bfloat16 panels at any row count: 6 x 64 tiles over two panels at once (more arithmetic per
// load). A bfloat16 panel row takes two more ops to widen, and an 8 x 32 tile (a broadcast per two
// multiply-adds) then ran 0.75-0.9x as fast as 6 x 64 ones at 4-8 rows (house shapes, weights from memory)
constexpr int64_t BLOCK_ROWS = 6;

#ifdef __AVX512F__
// the 32 weights of one panel row as two 16-float vectors
inline void load_row(const float* w, __m512& low, __m512& high) {
  low = _mm512_loadu_ps(w);
  high = _mm512_loadu_ps(w + 16);
}

// bfloat16 panel rows are stored interleaved (`pack_panels_cpu`: columns 0, 16, 1, 17, ..., 15, 31), so that
// each 32-bit lane holds column c in its low half and column c + 16 in its high half: a shift and a mask widen
// them, where widening 32 consecutive columns took two cross-lane conversions, an extract and two shifts
inline void load_row(const at::BFloat16* w, __m512& low, __m512& high) {
  const __m512i both = _mm512_loadu_si512(w);
  low = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
  high = _mm512_castsi512_ps(_mm512_and_si512(both, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// out[r, c] = sum_k x[r, k] * w[k, c] (+ bias[c]) for `ROWS` rows and the 32 columns of each of `PANELS`
// panels (`panel_step` floats apart), `cols` of them kept (a last panel's padding is not)
template <int ROWS, int PANELS, typename W>
inline void tile(const float* x, int64_t ldx, const W* panel, int64_t panel_step, int64_t K, const float* bias,
                 float* out, int64_t ldo, int64_t cols) {
  constexpr int VECTORS = 2 * PANELS;
  __m512 acc[ROWS][VECTORS];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[VECTORS];
    for (int p = 0; p < PANELS; ++p) load_row(panel + p * panel_step + k * PANEL, w[2 * p], w[2 * p + 1]);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      for (int v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_fmadd_ps(xb, w[v], acc[r][v]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float row[16 * VECTORS];
    for (int v = 0; v < VECTORS; ++v) _mm512_storeu_ps(row + 16 * v, acc[r][v]);
    const int64_t kept = std::min<int64_t>(cols, 16 * VECTORS);
    if (bias != nullptr) {
      for (int64_t c = 0; c < kept; ++c) row[c] += bias[c];
    }
    std::memcpy(out + r * ldo, row, kept * sizeof(float));
  }
}

// `rows` (1..ROWS) rows through the tile of that many
template <int ROWS, int PANELS, typename W>
inline void tile_rows(int rows, const float* x, int64_t ldx, const W* panel, int64_t panel_step, int64_t K,
                      const float* bias, float* out, int64_t ldo, int64_t cols) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) return tile_rows<ROWS - 1, PANELS, W>(rows, x, ldx, panel, panel_step, K, bias, out, ldo, cols);
  }
  tile<ROWS, PANELS, W>(x, ldx, panel, panel_step, K, bias, out, ldo, cols);
}
#endif

#ifdef __AVX512F__
// out [M, N] = rows [M, K] x the panels' weight: fp32 panels in 8 x 32 tiles up to FEW_ROWS rows, else 6 x 64 ones
template <typename W>
void panel_gemm(const float* xd, int64_t M, int64_t K, const W* pd, int64_t P, const float* bias_data, float* od,
                int64_t N) {
  const int64_t step = K * PANEL;
  auto bias_at = [&](int64_t column) { return bias_data == nullptr ? nullptr : bias_data + column; };
  if (std::is_same_v<W, float> && M <= FEW_ROWS) {
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        tile_rows<FEW_ROWS, 1, W>(static_cast<int>(M), xd, K, pd + p * step, step, K, bias_at(p * PANEL),
                                  od + p * PANEL, N, N - p * PANEL);
      }
    });
    return;
  }
  at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t p = 2 * pair, column = p * PANEL;
      for (int64_t m = 0; m < M; m += BLOCK_ROWS) {
        const int block = static_cast<int>(std::min<int64_t>(BLOCK_ROWS, M - m));
        if (p + 1 < P) {
          tile_rows<BLOCK_ROWS, 2, W>(block, xd + m * K, K, pd + p * step, step, K, bias_at(column),
                                      od + m * N + column, N, N - column);
        } else {
          tile_rows<BLOCK_ROWS, 1, W>(block, xd + m * K, K, pd + p * step, step, K, bias_at(column),
                                      od + m * N + column, N, N - column);
        }
      }
    }
  });
}
#endif

// weight [N, K], fp32 or bfloat16 -> panels [ceil(N / 32), K, 32] of its dtype
at::Tensor pack_panels_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "pack_panels: an fp32 or bfloat16 [N, K] weight");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + PANEL - 1) / PANEL;
  // panels[p, k, c] = weight[p * 32 + c, k], zero past N; bfloat16 ones interleave each panel row's two
  // halves (`load_row`): panels[p, k, 2 i + h] = weight[p * 32 + 16 h + i, k]
  const at::Tensor padded = at::constant_pad_nd(weight, {0, 0, 0, panels * PANEL - N});
  if (weight.scalar_type() == at::kBFloat16) {
    return padded.view({panels, 2, PANEL / 2, K}).permute({0, 3, 2, 1}).contiguous().view({panels, K, PANEL});
  }
  return padded.view({panels, PANEL, K}).transpose(1, 2).contiguous();
}

at::Tensor panel_linear_cpu(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                            int64_t out_features) {
#ifdef __AVX512F__
  const bool half = panels.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.scalar_type() == at::kFloat && (half || panels.scalar_type() == at::kFloat),
              "panel_linear: fp32 inputs over fp32 or bfloat16 panels");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == PANEL && panels.is_contiguous(),
              "panel_linear: panels are pack_panels' [P, K, 32]");
  const int64_t K = x.size(-1), P = panels.size(0), N = out_features;
  TORCH_CHECK(panels.size(1) == K, "panel_linear: x's last dimension is the weight's in_features");
  TORCH_CHECK(N > (P - 1) * PANEL && N <= P * PANEL, "panel_linear: out_features does not fit the panels");
  const float* bias_data = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == N, "panel_linear: an fp32 bias of out_features");
    bias_data = b.data_ptr<float>();
  }
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  if (M == 0) return out;
  if (half) {
    panel_gemm(rows.data_ptr<float>(), M, K, panels.data_ptr<at::BFloat16>(), P, bias_data, out.data_ptr<float>(), N);
  } else {
    panel_gemm(rows.data_ptr<float>(), M, K, panels.data_ptr<float>(), P, bias_data, out.data_ptr<float>(), N);
  }
  return out;
#else
  TORCH_CHECK(false, "panel_linear: this build has no AVX-512 (panel_linear_available)");
#endif
}

bool panel_linear_available() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(draftsmith_cpu, m) {
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("panel_linear_available() -> bool", &panel_linear_available);
}

TORCH_LIBRARY_IMPL(draftsmith_cpu, CPU, m) {
  m.impl("pack_panels", &pack_panels_cpu);
  m.impl("panel_linear", &panel_linear_cpu);
}
