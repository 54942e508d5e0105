// All decoder layers of the engine's Llama-family forward in one call (CPU):
//
//   decoder_layers(h, positions, weights, kv_caches, block_tables, seq_lens, query_start_loc, slot_mapping,
//                  cos, sin, num_heads, num_kv_heads, head_dim, scale, eps, dot_products, timings)
//       -> (h, residual)
//
// The same operations, in the same order, on the same kernels as engine/models/llama.py's LlamaLayer.forward
// run one layer after the other from Python (rms_norm or fused_add_rms_norm, the QKV GEMM, RoPE in place,
// reshape_and_cache, paged_attention, the O GEMM, fused_add_rms_norm, the gate/up GEMM, silu_and_mul, the down
// GEMM), so the results are bit-identical to that loop; only the Python between the kernels is gone. On a
// 2-vCPU AMD EPYC (Zen 4) that Python, with torch's dispatch of the views and the outputs' allocation, took
// about 3 ms of a 64-request decode step of 68-70 ms (SmolLM2, 30 layers, 10 kernel calls each), while the
// other core waited at the next parallel region (docs/performance.md, 2026-12-06). The activations live in
// six buffers allocated once per call and reused by every layer.
//
//   h          [T, hidden]  the embedded tokens (model dtype); also the first layer's residual, updated in place
//   positions  [T] int64
//   weights    10 per layer: input_norm [hidden], qkv [packed], qkv bias (float32 [N] or empty), o, o bias,
//              post_norm [hidden], gate_up, gate_up bias, down, down bias; the packed weights as the own GEMMs
//              take them (bfloat16 [N/16, K/2, 16, 2] for gemm_bf16, float32 [N/16, K, 16] for gemm_f32)
//   kv_caches  2 per layer: key_cache, value_cache [num_blocks, num_kv_heads, block_size, head_dim]
//   eps        1 per layer: its norms' epsilon (the input and post-attention norms use the same)
//   timings    float64 [3] or empty: when given, seconds spent in the linears, the attention (cache write
//              included) and the rest are added to it (python -m bench --profile)
//
// Returns the last layer's output (before the residual add of the final norm) and the residual, both
// [T, hidden]: the caller applies the final norm on the rows that sample and the LM head.

#include <torch/extension.h>

#include <chrono>
#include <vector>

namespace cbp {

// the kernels, defined in the other files of the extension
void gemm_bf16(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor bias, bool dot_products);
void gemm_f32(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor bias);
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin,
                      int64_t head_dim);
void silu_and_mul(torch::Tensor out, torch::Tensor x);
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     double scale, bool bf16_dot, bool qk_dot);
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                       const at::Tensor& slot_mapping);

namespace {

constexpr int kWeightsPerLayer = 10;

// seconds since `t` added to timings[slot] (when timing), and `t` moved to now
struct Clock {
  double* acc = nullptr;
  std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
  void lap(int slot) {
    if (acc == nullptr) return;
    const auto now = std::chrono::steady_clock::now();
    acc[slot] += std::chrono::duration<double>(now - t).count();
    t = now;
  }
};

}  // namespace

std::vector<at::Tensor> decoder_layers(at::Tensor h, const at::Tensor& positions, const std::vector<at::Tensor>& weights,
                                       const std::vector<at::Tensor>& kv_caches, const at::Tensor& block_tables,
                                       const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                       const at::Tensor& slot_mapping, const at::Tensor& cos, const at::Tensor& sin,
                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                                       const std::vector<double>& eps, bool dot_products, bool bf16_dot, bool qk_dot,
                                       at::Tensor timings) {
  const int64_t L = static_cast<int64_t>(weights.size()) / kWeightsPerLayer;
  TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == L * kWeightsPerLayer,
              "decoder_layers: weights must hold ", kWeightsPerLayer, " tensors per layer");
  TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == 2 * L && static_cast<int64_t>(eps.size()) == L,
              "decoder_layers: kv_caches must hold 2 entries per layer, eps 1");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.device().is_cpu(), "decoder_layers: h must be a contiguous CPU [T, hidden]");
  TORCH_CHECK(h.scalar_type() == at::kBFloat16 || h.scalar_type() == at::kFloat, "decoder_layers: bfloat16 or float32 only");
  const bool f32 = h.scalar_type() == at::kFloat;
  const int64_t T = h.size(0), hidden = h.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(weights[6].dim() >= 1, "decoder_layers: the gate/up weight must be packed for an own GEMM");
  const int64_t inter2 = weights[6].size(0) * 16;  // gate and up outputs: N of the packed gate/up weight
  Clock clock;
  if (timings.defined() && timings.numel() > 0) {
    TORCH_CHECK(timings.scalar_type() == at::kDouble && timings.numel() >= 3 && timings.is_contiguous(),
                "decoder_layers: timings must be float64 [3]");
    clock.acc = timings.data_ptr<double>();
  }
  auto gemm = [&](at::Tensor& out, const at::Tensor& x, int64_t l, int i) {
    const at::Tensor& w = weights[l * kWeightsPerLayer + i];
    const at::Tensor& b = weights[l * kWeightsPerLayer + i + 1];
    if (f32) {
      gemm_f32(out, x, w, b);
    } else {
      gemm_bf16(out, x, w, b, dot_products);
    }
  };
  const auto opts = h.options();
  at::Tensor residual = h;  // the first layer's residual is its input
  at::Tensor x = at::empty({T, hidden}, opts);
  at::Tensor qkv = at::empty({T, q_size + 2 * kv_size}, opts);
  at::Tensor attn = at::empty({T, num_heads, head_dim}, opts);
  at::Tensor o = at::empty({T, hidden}, opts);
  at::Tensor gate_up = at::empty({T, inter2}, opts);
  at::Tensor act = at::empty({T, inter2 / 2}, opts);
  const at::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size),
                   v = qkv.narrow(1, q_size + kv_size, kv_size);
  const at::Tensor q3 = q.view({T, num_heads, head_dim}), k3 = k.view({T, num_kv_heads, head_dim}),
                   v3 = v.view({T, num_kv_heads, head_dim});
  const at::Tensor attn2 = attn.view({T, q_size});
  if (T == 0) return {x, residual};
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * kWeightsPerLayer;
    if (l == 0) {
      rms_norm(x, h, w[0], eps[0]);
    } else {
      fused_add_rms_norm(x, residual, w[0], eps[l]);  // x holds the previous layer's output
    }
    clock.lap(2);
    gemm(qkv, x, l, 1);
    clock.lap(0);
    rotary_embedding(positions, q, k, cos, sin, head_dim);
    clock.lap(2);
    reshape_and_cache(k3, v3, kv_caches[2 * l], kv_caches[2 * l + 1], slot_mapping);
    paged_attention(attn, q3, kv_caches[2 * l], kv_caches[2 * l + 1], block_tables, seq_lens, query_start_loc, scale,
                    bf16_dot, qk_dot);
    clock.lap(1);
    gemm(o, attn2, l, 3);
    clock.lap(0);
    fused_add_rms_norm(o, residual, w[5], eps[l]);
    clock.lap(2);
    gemm(gate_up, o, l, 6);
    clock.lap(0);
    silu_and_mul(act, gate_up);
    clock.lap(2);
    gemm(x, act, l, 8);  // the layer's output, the next layer's input
    clock.lap(0);
  }
  return {x, residual};
}

void register_decoder_ops(pybind11::module& m) {
  m.def("decoder_layers", &decoder_layers,
        "all decoder layers of the Llama-family forward in one call: (h, residual) (CPU)",
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace cbp
