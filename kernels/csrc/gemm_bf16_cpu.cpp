// A GEMM for the bfloat16 linears of the engine's CPU forward, on AVX-512 float32 FMAs (or VDPBF16PS):
//
//   gemm_bf16(out, x, packed, bias, dot_products)   out[m, n] = bf16( sum_k x[m, k] * W[n, k]  (+ bias[n]) )
//
//   x       [M, K]  bfloat16, rows contiguous (any row stride), K even
//   packed  [N / 16, K / 2, 16, 2] bfloat16: W [N, K] in blocks of 16 output columns; a block holds, for
//           p = 0 .. K/2 - 1, the pairs (W[n, 2p], W[n, 2p + 1]) of its 16 columns, so one 64-byte load
//           brings 2 values of k for 16 columns (kernels/cpu_linear.py `pack_gemm_weight` builds it)
//   bias    [N] bfloat16 (or float32), or an empty tensor for none
//   out     [M, N]  bfloat16, rows contiguous (any row stride)
//   dot_products: VDPBF16PS micro-tiles instead of float32 FMAs (AVX512-BF16 builds; see below)
//
// Why: on a 2-core Intel Xeon with AVX512-BF16 and no AMX, oneDNN's bfloat16 GEMM ran a decode step's
// linears (SmolLM2, weights streamed from memory) at 65-128 GFLOP/s at 8-64 rows and MKL's float32 GEMM
// (on float32 copies) at 32-136. There, VDPBF16PS retires about 1.3 G instructions/s per core
// (86 GFLOP/s) while float32 FMAs retire 4.5-5.5 G/s (145-177 GFLOP/s), so the fast way to multiply
// bfloat16 weights is to widen them to float32 in registers (a bfloat16 is the upper half of a float32:
// one shift or one mask) and use FMAs, reading 2 bytes per weight from memory. Measured on the same
// step: 107-196 GFLOP/s at 8-64 rows, 1.4-1.7x the faster library (`python -m bench.cpu_linears`).
//
// On AMD CPUs with AVX512-BF16 (Zen 4 / 5) it is the other way round: VDPBF16PS runs at twice the float32
// FMA rate, and `dot_products` selects micro-tiles that feed the packed pairs to it as they are (x is not
// widened): the step's linears at 8-128 rows took 1.2-1.4x less time than oneDNN's bfloat16 GEMM on a
// 2-vCPU EPYC, level at 512. Each instruction adds, per output, x[m, 2p+1] W[n, 2p+1] and then
// x[m, 2p] W[n, 2p] to the accumulator (odd element first; inputs and sums below float32's normal range
// flushed to zero), so the k order below holds with that pair order (kernels.torch_ops.gemm_bf16 with
// dot_products=True is its reference; checked bit for bit on an EPYC).
//
// Arithmetic: every output keeps one float32 accumulator that runs over k = 0, 1, .. K-1 in this order,
// one FMA each (the product of two bfloat16 values is exact in float32 unless it overflows or falls
// below the normal range; the FMA rounds only the sum), whatever the row count M, the
// row's place in its tile, the thread count or the split of the columns among threads. A row's result
// therefore depends on its own values only: the GEMM is batch invariant by construction. The bias is
// added once at the end, then the sum is rounded to bfloat16 (nearest even, as torch's conversion).
//
// Tiling (register blocking as in BLIS micro-kernels: Van Zee and van de Geijn, "BLIS: A Framework for Rapidly
// Instantiating BLAS Functionality", ACM TOMS 2015): a micro-tile is MR <= 8 rows x NR <= 3 column blocks, 24 zmm
// accumulators (the VDPBF16PS path: 7 x 4 from 16 rows, see kWideRows); per pair of k it loads NR weight vectors,
// widens each into an even and an odd vector, and broadcasts 2 x MR values of x (x is widened to float32 once per
// call); the VDPBF16PS tiles instead broadcast MR pairs of x (bfloat16, not widened) and feed the weight vectors as
// they are. Each row tile reads its group's weights once more, so 8 rows (a decode step of 8 chats in one tile) ran the
// step's linears 1.17-1.25x faster than 6 (6 + 2), and 12-512 rows 1.03-1.09x; widening a group to float32 once per
// panel instead of in every tile gained nothing (one process A/B on the 2-core Xeon above). The columns are split among
// torch's threads in contiguous ranges of blocks; each thread walks its range NR blocks at a time and, for each group,
// all row tiles of a panel of kPanelRows rows, so the group's weights (96 * K bytes) stay in L2 while the panel's rows
// pass over them.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_vec.h"
#include "gemm_groups.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define KRN_GEMM_AVX512 1
#else
#define KRN_GEMM_AVX512 0
#endif

namespace cbp {

namespace {

#if KRN_GEMM_AVX512

#ifndef KRN_GEMM_MR
#define KRN_GEMM_MR 8
#endif
#ifndef KRN_GEMM_NR
#define KRN_GEMM_NR 3
#endif
#ifndef KRN_GEMM_PANEL
#define KRN_GEMM_PANEL 192
#endif
constexpr int kMaxRows = KRN_GEMM_MR;        // MR: rows of a micro-tile
constexpr int kMaxBlocks = KRN_GEMM_NR;      // NR: 16-column blocks of a micro-tile
constexpr int64_t kPanelRows = KRN_GEMM_PANEL;  // rows of x that pass over one group of weights before the next group
// The VDPBF16PS path's tile from kWideMinRows rows on: 7 rows x 4 blocks (28 accumulators; the MR
// broadcasts become memory operands of the instructions). Per pair of k it loads 4 weight vectors for 28
// instructions instead of 3 for 24. On a 2-vCPU AMD EPYC (Zen 4: family 25 model 17), SmolLM2's four
// layer linears: 1.03-1.08x at 16-64 rows, 1.06-1.07x at 512-2048 (then ahead of oneDNN's bfloat16 GEMM
// by 1.02-1.03x); at 8 rows one 8 x 3 tile stays faster (the LM head: 1.06x). Not measured on Zen 5.
// Any tile gives the same instructions per output in the same k order, so the choice by row count keeps
// results bit-identical.
#ifndef KRN_GEMM_DP_WIDE_MR
#define KRN_GEMM_DP_WIDE_MR 7
#endif
#ifndef KRN_GEMM_DP_WIDE_NR
#define KRN_GEMM_DP_WIDE_NR 4
#endif
constexpr int kWideRows = KRN_GEMM_DP_WIDE_MR;
constexpr int kWideBlocks = KRN_GEMM_DP_WIDE_NR;
constexpr int64_t kWidePanelRows = (KRN_GEMM_PANEL / kWideRows) * kWideRows;
constexpr int64_t kWideMinRows = 16;

static_assert(VL == 16, "a column block is one AVX-512 vector of 16 float32 lanes");
static_assert(1 <= kMaxRows && kMaxRows <= 12 && 1 <= kMaxBlocks && kMaxBlocks <= 4 && kPanelRows % kMaxRows == 0 &&
                  1 <= kWideRows && kWideRows <= 12 && 1 <= kWideBlocks && kWideBlocks <= 4,
              "the tile dispatch covers MR <= 12, NR <= 4, and a panel is whole row tiles");

// The end of a micro-tile: the float32 accumulators plus the bias (if any), rounded to bfloat16 (nearest
// even) into MR x (16 * NR) outputs (row stride os).
template <int MR, int NR>
__attribute__((always_inline)) inline void store_tile(const __m512 (&acc)[MR][NR], const float* bias, uint16_t* out,
                                                      int64_t os) {
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      __m512 v = acc[i][j];
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * j));
      Store<at::BFloat16>::vec(reinterpret_cast<at::BFloat16*>(out + i * os + 16 * j), (vfloat)v);
    }
  }
}

// One micro-tile: MR rows of x (float32, row stride xs) against NR column blocks of the packed weight
// (block stride bs elements); writes MR x (16 * NR) outputs (row stride os).
template <int MR, int NR>
inline void micro_tile(const float* x, int64_t xs, const uint16_t* w, int64_t bs, int64_t K2,
                       const float* bias, uint16_t* out, int64_t os, const uint16_t* next, int next_blocks) {
  __m512 acc[MR][NR];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t p = 0; p < K2; ++p) {
    // bring the next group's weights towards L2 while this one computes: the same line of each of its
    // blocks that this step reads of ours, so the whole group arrives during one pass over k
    for (int j = 0; j < next_blocks; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * bs + p * 32), _MM_HINT_T1);
    __m512 even[NR], odd[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const __m512i pairs = _mm512_loadu_si512(w + j * bs + p * 32);
      even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));  // W[n, 2p]
      odd[j] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));   // W[n, 2p + 1]
    }
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512 xe = _mm512_set1_ps(x[i * xs + 2 * p]);
      const __m512 xo = _mm512_set1_ps(x[i * xs + 2 * p + 1]);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        acc[i][j] = _mm512_fmadd_ps(even[j], xe, acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(odd[j], xo, acc[i][j]);
      }
    }
  }
  store_tile<MR, NR>(acc, bias, out, os);
}

#if defined(__AVX512BF16__)
#define KRN_GEMM_DP 1
// The same micro-tile on VDPBF16PS: x stays bfloat16 (X = uint16_t, row stride xs elements) and each
// instruction adds the two products of a pair of k to the float32 accumulator of output (m, n), first
// x[m, 2p + 1] W[n, 2p + 1], then x[m, 2p] W[n, 2p]: still one accumulator per output over p = 0 .. K/2 - 1
// in this order, the same instructions for a row whatever the tile it sits in, so batch invariant as well.
template <int MR, int NR>
inline void micro_tile_dp(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t bs, int64_t K2,
                          const float* bias, uint16_t* out, int64_t os, const uint16_t* next, int next_blocks) {
  __m512 acc[MR][NR];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K2; ++p) {
    for (int j = 0; j < next_blocks; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * bs + p * 32), _MM_HINT_T1);
    __m512i b[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) b[j] = _mm512_loadu_si512(w + j * bs + p * 32);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      int32_t pair;  // x[m, 2p], x[m, 2p + 1] (memcpy: any alignment, no aliasing of the uint16_t data)
      std::memcpy(&pair, x + i * xs + 2 * p, sizeof(pair));
      const __m512i a = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)a, (__m512bh)b[j]);
    }
  }
  store_tile<MR, NR>(acc, bias, out, os);
}
#else
#define KRN_GEMM_DP 0
#endif

template <int MR, int NR, bool DP, typename X>
inline void tile(const X* x, int64_t xs, const uint16_t* w, int64_t bs, int64_t K2, const float* bias,
                 uint16_t* out, int64_t os, const uint16_t* next, int next_blocks) {
#if KRN_GEMM_DP
  if constexpr (DP) {
    micro_tile_dp<MR, NR>(x, xs, w, bs, K2, bias, out, os, next, next_blocks);
    return;
  }
#endif
  if constexpr (!DP) micro_tile<MR, NR>(x, xs, w, bs, K2, bias, out, os, next, next_blocks);
}

// All row tiles of M rows against one group of NR blocks; the first tile also prefetches the next group
// (next_blocks blocks at next; 0 for none). A tile's height never changes an output's instructions or
// their k order, so the heights chosen here keep every result bit-identical.
template <int MR, int NR, bool DP, typename X>
void row_tiles(const X* x, int64_t xs, int64_t M, const uint16_t* w, int64_t bs, int64_t K2,
               const float* bias, uint16_t* out, int64_t os, const uint16_t* next, int next_blocks) {
  // ceil(M / MR) tiles of near-equal height (M = 64, MR = 7: 4 x 7 + 6 x 6 rows, not 9 x 7 + 1): a 1-row tile
  // reads the group's weights as a 7-row one does for a seventh of the work (3% of the 64-row GEMM's samples)
  const int64_t ntiles = (M + MR - 1) / MR, h0 = M / ntiles, extra = M % ntiles;
  int64_t m = 0;
  for (int64_t t = 0; t < ntiles; ++t) {
    const int64_t h = h0 + (t < extra ? 1 : 0);
    const X* xr = x + m * xs;
    uint16_t* o = out + m * os;
    switch (h) {
#define KRN_GEMM_TILE(r) \
      case r: if constexpr (r <= MR) tile<r, NR, DP>(xr, xs, w, bs, K2, bias, o, os, next, next_blocks); break;
      KRN_GEMM_TILE(1) KRN_GEMM_TILE(2) KRN_GEMM_TILE(3) KRN_GEMM_TILE(4) KRN_GEMM_TILE(5) KRN_GEMM_TILE(6)
      KRN_GEMM_TILE(7) KRN_GEMM_TILE(8) KRN_GEMM_TILE(9) KRN_GEMM_TILE(10) KRN_GEMM_TILE(11) KRN_GEMM_TILE(12)
#undef KRN_GEMM_TILE
      default: break;
    }
    next_blocks = 0;
    m += h;
  }
}

// x [M, K] bfloat16 (row stride xs) -> x32 [M, K] float32, contiguous: exact (a bfloat16 is the upper
// half of a float32)
void widen_rows(const at::BFloat16* x, int64_t xs, int64_t M, int64_t K, float* x32) {
  at::parallel_for(0, M, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const at::BFloat16* src = x + r * xs;
      float* dst = x32 + r * K;
      int64_t k = 0;
      for (; k + VL <= K; k += VL) vstore(dst + k, Cvt<at::BFloat16>::load(src + k));
      for (; k < K; ++k) dst[k] = Cvt<at::BFloat16>::one(src[k]);
    }
  });
}

// The walk with micro-tiles of MR rows x NR blocks and panels of PANEL rows.
template <int MR, int NR, int64_t PANEL, bool DP, typename X>
void gemm_tiles(const X* x, int64_t xs, int64_t M, int64_t K, const uint16_t* w, int64_t NB, const float* bias,
                uint16_t* out, int64_t os) {
  const int64_t K2 = K / 2, bs = K * 16;  // elements per 16-column block
  parallel_groups(NB, M, PANEL, NR, [&](int64_t m0, int64_t rows, int64_t b0, int nr, int64_t nb0, int nnext) {
    const X* xp = x + m0 * xs;
    const uint16_t* wg = w + b0 * bs;
    const float* bg = bias == nullptr ? nullptr : bias + 16 * b0;
    uint16_t* og = out + m0 * os + 16 * b0;
    const uint16_t* next = w + nb0 * bs;
    switch (nr) {
      case 4: if constexpr (NR >= 4) row_tiles<MR, 4, DP>(xp, xs, rows, wg, bs, K2, bg, og, os, next, nnext); break;
      case 3: if constexpr (NR >= 3) row_tiles<MR, 3, DP>(xp, xs, rows, wg, bs, K2, bg, og, os, next, nnext); break;
      case 2: row_tiles<MR, 2, DP>(xp, xs, rows, wg, bs, K2, bg, og, os, next, nnext); break;
      default: row_tiles<MR, 1, DP>(xp, xs, rows, wg, bs, K2, bg, og, os, next, nnext); break;
    }
  });
}

template <bool DP, typename X>
void gemm_impl(const X* x, int64_t xs, int64_t M, int64_t K, const uint16_t* w, int64_t NB, const float* bias,
               uint16_t* out, int64_t os) {
  if constexpr (DP) {
    if (M >= kWideMinRows) {
      gemm_tiles<kWideRows, kWideBlocks, kWidePanelRows, DP>(x, xs, M, K, w, NB, bias, out, os);
      return;
    }
  }
  gemm_tiles<kMaxRows, kMaxBlocks, kPanelRows, DP>(x, xs, M, K, w, NB, bias, out, os);
}

#endif  // KRN_GEMM_AVX512

}  // namespace

bool gemm_bf16_available() { return KRN_GEMM_AVX512 != 0; }

#if KRN_GEMM_AVX512
bool gemm_bf16_dp_available() { return KRN_GEMM_DP != 0; }
#else
bool gemm_bf16_dp_available() { return false; }
#endif

void gemm_bf16(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor bias, bool dot_products) {
  TORCH_CHECK(gemm_bf16_available(), "gemm_bf16: this build has no AVX-512");
  TORCH_CHECK(!dot_products || gemm_bf16_dp_available(), "gemm_bf16: this build has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.device().is_cpu(),
              "gemm_bf16: x must be a CPU bfloat16 [M, K] tensor with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.device().is_cpu() &&
              packed.size(2) == 16 && packed.size(3) == 2, "gemm_bf16: packed must be [N/16, K/2, 16, 2] bfloat16");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = NB * 16;
  TORCH_CHECK(packed.size(1) * 2 == K, "gemm_bf16: x has ", K, " columns, packed expects ", packed.size(1) * 2);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kBFloat16 && out.stride(1) == 1 && out.size(0) == M &&
              out.size(1) == N, "gemm_bf16: out must be bfloat16 [M, ", N, "] with contiguous rows");
  torch::Tensor bias32;
  if (bias.defined() && bias.numel() > 0) {
    TORCH_CHECK(bias.dim() == 1 && bias.numel() == N && bias.device().is_cpu(), "gemm_bf16: bias must be [", N, "]");
    bias32 = bias.to(at::kFloat).contiguous();
  }
  if (M == 0 || N == 0) return;
#if KRN_GEMM_AVX512
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
#if KRN_GEMM_DP
  if (dot_products) {
    gemm_impl<true>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0), M, K, w, NB, b, o,
                    out.stride(0));
    return;
  }
#endif
  const torch::Tensor x32 = torch::empty({M, K}, x.options().dtype(at::kFloat));  // x widened once
  widen_rows(x.data_ptr<at::BFloat16>(), x.stride(0), M, K, x32.data_ptr<float>());
  gemm_impl<false>(x32.data_ptr<float>(), K, M, K, w, NB, b, o, out.stride(0));
#endif
}

void register_gemm_ops(pybind11::module& m) {
  m.def("gemm_bf16", &gemm_bf16, "out = x W^T (+ bias): bfloat16 weights, float32 FMAs or VDPBF16PS, AVX-512 (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_bf16_available", &gemm_bf16_available, "whether gemm_bf16 was compiled (AVX-512)");
  m.def("gemm_bf16_dp_available", &gemm_bf16_dp_available,
        "whether gemm_bf16 has its VDPBF16PS micro-kernels (dot_products=True: AVX512-BF16)");
}

}  // namespace cbp
