// A GEMM for the float32 linears of the engine's CPU forward, on float32 FMAs (AVX2 + FMA or AVX-512):
//
//   gemm_f32(out, x, packed, bias)   out[m, n] = sum_k x[m, k] * W[n, k]  (+ bias[n])
//
//   x       [M, K]  float32, rows contiguous (any row stride)
//   packed  [N / 16, K, 16] float32: W [N, K] in blocks of 16 output columns; a block holds, for
//           k = 0 .. K - 1, the 16 columns' W[n, k], so one 64-byte line brings one k for 16 columns
//           (kernels/cpu_linear.py `pack_gemm_weight_f32` builds it)
//   bias    [N] float32, or an empty tensor for none
//   out     [M, N]  float32, rows contiguous (any row stride)
//
// Why: on AVX2-only CPUs float32 is the engine's dtype (their bfloat16 matmuls run several times slower),
// and torch's float32 linear (MKL) ran a decode step's linears at 64 rows at about 100 GFLOP/s on a
// 2-vCPU AMD EPYC (Zen 3) whose large square matmuls reach 155-180: the small-M shapes of a decode step
// (M = 1-128 rows against K = 576-1536) leave MKL's kernels below the FMA rate. This GEMM ran the step's
// 121 linears 1.3-3.8x faster than MKL at 1-96 rows, 0.95-1.6x at 128-512, and per shape 1.1-1.37x slower
// at 2048 rows (docs/performance.md; `python -m bench.cpu_linears --dtype float32`).
//
// Arithmetic: every output keeps one float32 accumulator that runs over k = 0, 1, .. K-1 in this order,
// one FMA each (the product is not rounded, the FMA rounds the sum), whatever the row count M, the row's
// place in its tile, the thread count or the split of the columns among threads. A row's result therefore
// depends on its own values only: the GEMM is batch invariant by construction, and the AVX2 and AVX-512
// builds give the same bits. The bias is added once at the end. kernels.torch_ops.gemm_f32 is the
// reference (exact: it emulates each FMA in float64 with the sum rounded to odd).
//
// Tiling (register blocking as in BLIS micro-kernels: Van Zee and van de Geijn, "BLIS: A Framework for
// Rapidly Instantiating BLAS Functionality", ACM TOMS 2015; the 6 x 16 AVX2 tile is the shape BLIS and
// OpenBLAS use for float32 on Haswell / Zen): a micro-tile is MR rows x NR column blocks of 16, kept in
// MR x NR x (16 / VL) vector accumulators (AVX2: 6 x 1 x 2 = 12 of the 16 ymm registers; AVX-512: 8 x 3 x
// 1 = 24 zmm); per k it loads the NR blocks' lines and broadcasts MR values of x from memory. The columns
// are split among torch's threads in contiguous ranges of blocks; each thread walks its range NR blocks at
// a time and, for each group, all row tiles of a panel of kPanelRows rows, so the group's weights (64 NR K
// bytes) stay in L1 / L2 while the panel's rows pass over them; the first row tile of a group prefetches
// the next group's weights, one line per k.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "cpu_vec.h"
#include "gemm_groups.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define KRN_GEMM_F32 1
#else
#define KRN_GEMM_F32 0
#endif

namespace cbp {

namespace {

#if KRN_GEMM_F32

constexpr int kVecs = 16 / VL;  // vectors per 16-column block (2 on AVX2, 1 on AVX-512)
#if defined(__AVX512F__)
constexpr int kMaxRows = 8;    // MR
constexpr int kMaxBlocks = 3;  // NR
#else
constexpr int kMaxRows = 6;
constexpr int kMaxBlocks = 1;
#endif
constexpr int64_t kPanelRows = 192;  // rows of x that pass over one group of weights before the next group
static_assert(kMaxRows * kMaxBlocks * kVecs + kMaxBlocks * kVecs + 1 <= (VL == 16 ? 32 : 16),
              "accumulators, weight vectors and one broadcast fit the vector registers");
static_assert(kPanelRows % kMaxRows == 0 && kMaxRows <= 8 && kMaxBlocks <= 3, "the tile dispatch covers MR <= 8, NR <= 3");

// One micro-tile: MR rows of x (row stride xs) against NR column blocks of the packed weight (block
// stride bs elements); writes MR x (16 * NR) outputs (row stride os), adding bias (16 * NR values) if any.
template <int MR, int NR>
inline void micro_tile(const float* x, int64_t xs, const float* w, int64_t bs, int64_t K, const float* bias,
                       float* out, int64_t os, const float* next, int next_blocks) {
  constexpr int NV = NR * kVecs;
  vfloat acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 6
    for (int j = 0; j < NV; ++j) acc[i][j] = vfloat{};
  for (int64_t k = 0; k < K; ++k) {
    // bring the next group's weights towards L2 while this one computes: the same line of each of its
    // blocks that this k reads of ours, so the whole group arrives during one pass over k
    for (int j = 0; j < next_blocks; ++j) __builtin_prefetch(next + j * bs + k * 16, 0, 2);
    vfloat wv[NV];
#pragma GCC unroll 6
    for (int j = 0; j < NV; ++j) wv[j] = vload(w + (j / kVecs) * bs + k * 16 + (j % kVecs) * VL);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const vfloat xb = vset1(x[i * xs + k]);
#pragma GCC unroll 6
      for (int j = 0; j < NV; ++j) acc[i][j] = vfma(wv[j], xb, acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 6
    for (int j = 0; j < NV; ++j) {
      vfloat v = acc[i][j];
      if (bias != nullptr) v += vload(bias + (j / kVecs) * 16 + (j % kVecs) * VL);
      vstore(out + i * os + (j / kVecs) * 16 + (j % kVecs) * VL, v);
    }
  }
}

// All row tiles of M rows against one group of NR blocks; the first tile also prefetches the next group
// (next_blocks blocks at next; 0 for none). Tried on the Zen 3 EPYC and dropped, each without a difference
// beyond that machine's noise at 1-2048 rows in one-process A/Bs: spreading these prefetches over all
// the group's tiles, passes over k of 256 values (KC), x packed per row tile (k-major) from 128 rows, and
// BLIS's whole loop order from 96 rows (x packed in blocks of 48-288 rows x 160-1536 k, the weight
// blocks' K slices passing over them; bit-identical results): 0.87-1.14x at 256-2048 rows, paired medians.
// At 2048 rows MKL's float32 GEMM stays 1.1-1.3x faster per shape; the own GEMM keeps every row count
// (one kernel for every batch is what makes a row's result independent of the batch).
template <int NR>
void row_tiles(const float* x, int64_t xs, int64_t M, const float* w, int64_t bs, int64_t K, const float* bias,
               float* out, int64_t os, const float* next, int next_blocks) {
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows) {
    micro_tile<kMaxRows, NR>(x + m * xs, xs, w, bs, K, bias, out + m * os, os, next, next_blocks);
    next_blocks = 0;
  }
  const float* xr = x + m * xs;
  float* o = out + m * os;
  switch (M - m) {
#define KRN_GEMM_TAIL(r) \
    case r: if constexpr (r < kMaxRows) micro_tile<r, NR>(xr, xs, w, bs, K, bias, o, os, next, next_blocks); break;
    KRN_GEMM_TAIL(1) KRN_GEMM_TAIL(2) KRN_GEMM_TAIL(3) KRN_GEMM_TAIL(4) KRN_GEMM_TAIL(5) KRN_GEMM_TAIL(6)
    KRN_GEMM_TAIL(7)
#undef KRN_GEMM_TAIL
    default: break;
  }
}

void gemm_impl(const float* x, int64_t xs, int64_t M, int64_t K, const float* w, int64_t NB, const float* bias,
               float* out, int64_t os) {
  const int64_t bs = K * 16;  // elements per 16-column block
  parallel_groups(NB, M, kPanelRows, kMaxBlocks, [&](int64_t m0, int64_t rows, int64_t b0, int nr, int64_t nb0, int nnext) {
    const float* xp = x + m0 * xs;
    const float* wg = w + b0 * bs;
    const float* bg = bias == nullptr ? nullptr : bias + 16 * b0;
    float* og = out + m0 * os + 16 * b0;
    const float* next = w + nb0 * bs;
    switch (nr) {
      case 3: if constexpr (kMaxBlocks >= 3) row_tiles<3>(xp, xs, rows, wg, bs, K, bg, og, os, next, nnext); break;
      case 2: if constexpr (kMaxBlocks >= 2) row_tiles<2>(xp, xs, rows, wg, bs, K, bg, og, os, next, nnext); break;
      default: row_tiles<1>(xp, xs, rows, wg, bs, K, bg, og, os, next, nnext); break;
    }
  });
}

#endif  // KRN_GEMM_F32

}  // namespace

bool gemm_f32_available() { return KRN_GEMM_F32 != 0; }

void gemm_f32(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  TORCH_CHECK(gemm_f32_available(), "gemm_f32: this build has neither AVX2 with FMA nor AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && (x.stride(1) == 1 || x.size(1) <= 1) && x.device().is_cpu(),
              "gemm_f32: x must be a CPU float32 [M, K] tensor with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() && packed.device().is_cpu() &&
              packed.size(2) == 16, "gemm_f32: packed must be [N/16, K, 16] float32");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = NB * 16;
  TORCH_CHECK(packed.size(1) == K, "gemm_f32: x has ", K, " columns, packed expects ", packed.size(1));
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 && out.size(0) == M &&
              out.size(1) == N, "gemm_f32: out must be float32 [M, ", N, "] with contiguous rows");
  torch::Tensor bias32;
  if (bias.defined() && bias.numel() > 0) {  // the wrapper passes an empty tensor for no bias
    TORCH_CHECK(bias.dim() == 1 && bias.numel() == N && bias.device().is_cpu(), "gemm_f32: bias must be [", N, "]");
    bias32 = bias.to(at::kFloat).contiguous();
  }
  if (M == 0 || N == 0) return;
#if KRN_GEMM_F32
  gemm_impl(x.data_ptr<float>(), x.stride(0), M, K, packed.data_ptr<float>(), NB,
            bias32.defined() ? bias32.data_ptr<float>() : nullptr, out.data_ptr<float>(), out.stride(0));
#endif
}

void register_gemm_f32_ops(pybind11::module& m) {
  m.def("gemm_f32", &gemm_f32, "out = x W^T (+ bias): float32, one FMA chain per output in k order (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_f32_available", &gemm_f32_available, "whether gemm_f32 was compiled (AVX2 with FMA, or AVX-512)");
}

}  // namespace cbp
