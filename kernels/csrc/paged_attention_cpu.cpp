// Fused paged attention and KV-cache write for CPU tensors.
//
// KV layout (see kernels/__init__.py): key_cache, value_cache [num_blocks, num_kv_heads, block_size, head_dim].
//
// paged_attention: one pass over each sequence's K/V blocks, read in place through the block table
// (no gather copy), flash-attention style online softmax in float32. Work items are (sequence, KV
// head, tile of up to TILE_ROWS query rows): a tile holds `tq` consecutive query positions times the
// `group` query heads that share the KV head, so each K/V row is loaded once for all of them. Prefill
// chunks are cut into tiles of several positions, causal (row i of a sequence with q_len new tokens
// sits at position seq_len - q_len + i); a decode row (q_len == 1) is a tile of `group` rows, and
// with many decode rows one work item takes all KV heads of its sequence. Work items are sorted by
// cost (longest first) and handed to OpenMP threads dynamically; each is computed by one thread, so
// results do not depend on the thread count.
//
// Per tile, keys are processed KEY_CHUNK at a time:
//   1. pack the chunk's K rows transposed (keys in vector lanes), V rows as needed;
//   2. S = Q K^T for all rows of the tile (register-blocked micro-kernel);
//   3. online softmax update per row (running max m, sum l, rescale factor alpha), P = exp(S - m);
//   4. O = alpha * O + P V (register-blocked micro-kernel).
// Two compute paths:
//   * float32 FMAs on GCC vector types (16 lanes with AVX-512, 8 otherwise), K and V converted to
//     float32, P kept in float32: the default for every dtype. bfloat16 K is transposed as 32-bit pairs
//     of values, each pair then split by a shift and a mask (KRN_PACK_PAIRS: half the shuffles of a
//     float32 transpose); a tile of at most MR rows (a decode token's query heads) widens each V row as
//     the P V micro-kernel reads it, a larger tile converts it once into float32 first (KRN_V_DIRECT).
//     Both give the same float32 values in the same order, so a row's bits do not depend on its tile;
//   * bfloat16 caches on AMD CPUs with AVX512_BF16 (CBP_CPU_QK_DOT=1 / 0 forces it on / off): Q K^T with
//     vdpbf16ps on q and K pairs as they are (the products are exact in float32, as in the float32
//     path; the sums run pair by pair, odd element first, and flush values below float32's normal
//     range), P and P V in float32 as above. 1.1x on decode and 1.2x on prefill on a 2-vCPU EPYC
//     (Zen: vdpbf16ps at twice the float32 FMA rate). Decode and prefill rows take the same path, so
//     a decode row still equals the same row in a prefill chunk;
//   * bfloat16 caches on CPUs with AVX512_BF16, opt-in with CBP_CPU_BF16_DOT=1: Q K^T and P V with
//     vdpbf16ps (bf16 products, float32 accumulation; K packed as transposed element pairs, V as
//     interleaved row pairs, P rounded to bf16). About 1.3x faster on a long prefill, but the rounding
//     of P flips near-tied greedy choices of SmolLM2 that the float32 path keeps.
// No [q_len x ctx] mask is built: masking is per chunk from each row's position.
// While a unit (KEY_CHUNK keys of one KV head) computes, the K and V rows of the next unit (the next KV
// head, the next chunk, or the first chunk of the item this thread most likely takes next) are
// software-prefetched into L2: a sequence's blocks are scattered, so the hardware prefetchers meet a
// new short stream at every block. Measured 1.17x on decode at 64 sequences x 159 tokens, bfloat16.
// The prefetches are issued a few rows at a time, spread over the unit's work (KRN_PF_SPREAD): the
// transposes of its K pack, its Q K^T column blocks and, for float32 caches, its P V passes over
// head_dim. Not all at once: a burst of some 500 prefetches fills the core's miss buffers and its
// reorder window, so the unit's own loads wait behind them. Spread over the pack only: 1.5-1.6x on
// bfloat16 and float16 decode (64 sequences x 320 tokens, 30 layers of caches) on a 2-vCPU AMD EPYC.
// Spread over the whole unit instead of the pack only, on an AVX2-only EPYC (Zen 3), 30 layers of
// scattered caches, 64 decode sequences: float32 1.12-1.20x at 160 tokens, 1.23x at 320, 1.21x at
// 40; bfloat16 caches 1.15x; prefill chunks unchanged (1.01-1.02x). All bit-identical.
//
// Vector code uses GCC/Clang vector extensions so the same source builds for AVX2-only and AVX-512
// CPUs; AVX-512 intrinsics (transposes, bf16 dot products) are compiled only when the compiler
// targets them (-march=native at build time). AVX2 builds pack K with 8 x 8 float32 transposes (before,
// one scalar load and store per value): decode 1.35-1.6x, a 4,000-token prefill 1.07-1.15x on a 2-vCPU
// AMD EPYC (Zen 3), float32 and bfloat16 caches, bit-identical.

#include <cstdlib>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "cpu_vec.h"

namespace cbp {

#ifndef KRN_KEY_CHUNK
#define KRN_KEY_CHUNK 128
#endif
#ifndef KRN_TILE_ROWS
#define KRN_TILE_ROWS 96
#endif
#ifndef KRN_DECODE_ALL_HEADS
#define KRN_DECODE_ALL_HEADS 1
#endif
#ifndef KRN_PACK_PAIRS
#define KRN_PACK_PAIRS 1
#endif
#ifndef KRN_V_DIRECT
#define KRN_V_DIRECT 1
#endif
#ifndef KRN_PF_SPREAD
#define KRN_PF_SPREAD 1
#endif
#ifndef KRN_MR
#define KRN_MR 6
#endif
constexpr int KEY_CHUNK = KRN_KEY_CHUNK;  // keys per online-softmax step (multiple of 16 and of VL)
constexpr int TILE_ROWS = KRN_TILE_ROWS;  // target query rows (positions x group heads) per work item
constexpr int MR = KRN_MR;                // query rows per micro-tile (at most 6)
static_assert(1 <= MR && MR <= 6, "KRN_DISPATCH_ROWS covers micro-tiles of 1 to 6 query rows");
constexpr int MAX_HEAD_DIM = 512;
constexpr int MAX_ROWS = 1024;   // query rows of one work item (tile rows x group x KV heads)
// register blocking of the float32 micro-kernels: MR rows x QK_NV vectors of keys (Q K^T) and
// MR rows x PV_DV vectors of head_dim (P V); 32 vector registers with AVX-512, 16 otherwise
constexpr int QK_NV = VL == 16 ? 4 : 2;
constexpr int PV_DV = VL == 16 ? 4 : 2;
constexpr float LOG2E = 1.4426950408889634f;

alignas(64) static const uint16_t kZeroRow[MAX_HEAD_DIM * 2] = {0};

// ------------------------------------------------------------------------------------------------
// transposes
// ------------------------------------------------------------------------------------------------
#if defined(__AVX512F__)
// r[0..15] (16 rows of 16 x 32-bit) -> r[j] holds column j. Only moves bits (works for any 32-bit data).
__attribute__((always_inline)) static inline void transpose16x16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // t[4a+0] = lo(rows 4a,4a+1): per 128-bit lane k: r4a[4k], r4a+1[4k], r4a[4k+1], r4a+1[4k+1]
  for (int a = 0; a < 4; ++a) {
    __m512d t0 = _mm512_castps_pd(t[4 * a]), t1 = _mm512_castps_pd(t[4 * a + 1]);
    __m512d t2 = _mm512_castps_pd(t[4 * a + 2]), t3 = _mm512_castps_pd(t[4 * a + 3]);
    u[4 * a + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));  // column 4k+0 of rows 4a..4a+3
    u[4 * a + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));  // column 4k+1
    u[4 * a + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));  // column 4k+2
    u[4 * a + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));  // column 4k+3
  }
  // u[4a+c], 128-bit lane k: column 4k+c of rows 4a..4a+3
  __m512 v[16];
  for (int c = 0; c < 4; ++c) {
    // rows 0..7: lanes (k=0 of a=0, k=2 of a=0, k=0 of a=1, k=2 of a=1) etc.
    v[c] = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);       // cols c (lanes 0,1) and 8+c (lanes 2,3)? see below
    v[4 + c] = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);   // cols 4+c and 12+c
    v[8 + c] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    v[12 + c] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
  }
  // v[c]: lanes = (col c rows 0-3, col 8+c rows 0-3, col c rows 4-7, col 8+c rows 4-7)
  // v[4+c]: (col 4+c rows 0-3, col 12+c rows 0-3, col 4+c rows 4-7, col 12+c rows 4-7); v[8+..] rows 8-15
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_f32x4(v[c], v[8 + c], 0x88);           // col c: lanes 0,2 of v[c], 0,2 of v[8+c]
    r[8 + c] = _mm512_shuffle_f32x4(v[c], v[8 + c], 0xDD);       // col 8+c
    r[4 + c] = _mm512_shuffle_f32x4(v[4 + c], v[12 + c], 0x88);  // col 4+c
    r[12 + c] = _mm512_shuffle_f32x4(v[4 + c], v[12 + c], 0xDD); // col 12+c
  }
}
#elif defined(__AVX2__)
// r[0..7] (8 rows of 8 x 32-bit) -> r[j] holds column j. Only moves bits.
__attribute__((always_inline)) static inline void transpose8x8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);      // per 128-bit half h: r2i[4h], r2i+1[4h], r2i[4h+1], r2i+1[4h+1]
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);  // the same for 4h+2, 4h+3
  }
  for (int a = 0; a < 2; ++a) {  // rows 4a .. 4a+3
    u[4 * a + 0] = _mm256_shuffle_ps(t[4 * a], t[4 * a + 2], 0x44);      // per half h: column 4h of rows 4a..4a+3
    u[4 * a + 1] = _mm256_shuffle_ps(t[4 * a], t[4 * a + 2], 0xEE);      // column 4h + 1
    u[4 * a + 2] = _mm256_shuffle_ps(t[4 * a + 1], t[4 * a + 3], 0x44);  // column 4h + 2
    u[4 * a + 3] = _mm256_shuffle_ps(t[4 * a + 1], t[4 * a + 3], 0xEE);  // column 4h + 3
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);      // column c: low halves of rows 0-3 and 4-7
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);  // column 4 + c: high halves
  }
}
#endif

// ------------------------------------------------------------------------------------------------
// the float32 path
// ------------------------------------------------------------------------------------------------
// KT[d * KEY_CHUNK + n] = float(K[n][d]) for n < KEY_CHUNK (rows past the chunk: zero rows).
struct NoPrefetch {
  void operator()() const {}
};

// pf() is called once per 16 x 32 transpose (a hook for spreading software prefetches over the pack)
template <typename T, typename PF = NoPrefetch>
static void pack_k_f32(const T* const* krow, int nk_pad, int D, float* KT, PF&& pf = PF{}) {
#if defined(__AVX512F__)
#if KRN_PACK_PAIRS
  if constexpr (std::is_same<T, at::BFloat16>::value) {
    if (D % 32 == 0) {
      // transpose 32-bit pairs of bfloat16 (d, d + 1), then split each pair: half the shuffles per
      // value of the float32 transpose below, and the same float32 values in the same places
      const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
      for (int n0 = 0; n0 < nk_pad; n0 += 16) {
        for (int d0 = 0; d0 < D; d0 += 32) {
          pf();
          __m512 r[16];
          for (int i = 0; i < 16; ++i) r[i] = _mm512_castsi512_ps(_mm512_loadu_si512(krow[n0 + i] + d0));
          transpose16x16(r);  // r[j], lane i: the pair (2j, 2j + 1) of key n0 + i
          for (int j = 0; j < 16; ++j) {
            const __m512i v = _mm512_castps_si512(r[j]);
            _mm512_storeu_ps(KT + (d0 + 2 * j) * KEY_CHUNK + n0, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            _mm512_storeu_ps(KT + (d0 + 2 * j + 1) * KEY_CHUNK + n0, _mm512_castsi512_ps(_mm512_and_si512(v, high)));
          }
        }
      }
      return;
    }
  }
#endif
  if (D % 16 == 0) {
    for (int n0 = 0; n0 < nk_pad; n0 += 16) {
      for (int d0 = 0; d0 < D; d0 += 16) {
        __m512 r[16];
        if (d0 % 32 == 0) pf();
        for (int i = 0; i < 16; ++i) r[i] = (__m512)Cvt<T>::load(krow[n0 + i] + d0);
        transpose16x16(r);
        for (int j = 0; j < 16; ++j) _mm512_storeu_ps(KT + (d0 + j) * KEY_CHUNK + n0, r[j]);
      }
    }
    return;
  }
#elif defined(__AVX2__)
  if (D % 8 == 0 && nk_pad % 8 == 0) {
    // 8 x 8 transposes of float32 (bfloat16 / float16 rows widened as they are loaded); the prefetch
    // hook still runs once per 16 keys x 32 values
    for (int n0 = 0; n0 < nk_pad; n0 += 8) {
      for (int d0 = 0; d0 < D; d0 += 8) {
        if (n0 % 16 == 0 && d0 % 32 == 0) pf();
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = (__m256)Cvt<T>::load(krow[n0 + i] + d0);
        transpose8x8(r);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(KT + (d0 + j) * KEY_CHUNK + n0, r[j]);
      }
    }
    return;
  }
#endif
  for (int n = 0; n < nk_pad; ++n) {
    if ((n & 15) == 0)
      for (int c = 0; c < (D + 31) / 32; ++c) pf();
    const T* k = krow[n];
    for (int d = 0; d < D; ++d) KT[d * KEY_CHUNK + n] = Cvt<T>::one(k[d]);
  }
}

// S[m][n] (m < mr, n < NV*VL) = sum_d Q[m][d] * KT[d][n]
template <int R, int NV>
static inline void qk_f32(const float* Q, int ldq, const float* KT, int D, float* S, int lds) {
  vfloat acc[R][NV];
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[m][v] = vfloat{};
  for (int d = 0; d < D; ++d) {
    vfloat b[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) b[v] = vload(KT + d * KEY_CHUNK + v * VL);
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      vfloat a = vset1(Q[m * ldq + d]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[m][v] += a * b[v];
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) vstore(S + m * lds + v * VL, acc[m][v]);
}

// O[m][d0 : d0 + DV*VL] = alpha[m] * O[m][...] + sum_{n < nk} P[m][n] * V[n][...]; V rows float32, or
// bfloat16 / float16 widened as they are read (exact: the same products and sums)
template <int R, int DV, typename TV>
static inline void pv_f32(const float* P, int ldp, const TV* const* vrow, int nk, int d0, float* O, int ldo,
                          const float* alpha) {
  vfloat acc[R][DV];
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m) {
    vfloat al = vset1(alpha[m]);
#pragma GCC unroll 8
    for (int v = 0; v < DV; ++v) acc[m][v] = vload(O + m * ldo + d0 + v * VL) * al;
  }
  for (int n = 0; n < nk; ++n) {
    vfloat b[DV];
    const TV* vr = vrow[n] + d0;
#pragma GCC unroll 8
    for (int v = 0; v < DV; ++v) b[v] = Cvt<TV>::load(vr + v * VL);
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      vfloat a = vset1(P[m * ldp + n]);
#pragma GCC unroll 8
      for (int v = 0; v < DV; ++v) acc[m][v] += a * b[v];
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < DV; ++v) vstore(O + m * ldo + d0 + v * VL, acc[m][v]);
}

template <int R>
static void qk_f32_rows(const float* Q, int ldq, const float* KT, int D, int nv, float* S, int lds) {
  switch (nv) {
    case 1: qk_f32<R, 1>(Q, ldq, KT, D, S, lds); break;
    case 2: qk_f32<R, 2>(Q, ldq, KT, D, S, lds); break;
    case 3: qk_f32<R, std::min(3, QK_NV)>(Q, ldq, KT, D, S, lds); break;
    default: qk_f32<R, QK_NV>(Q, ldq, KT, D, S, lds); break;
  }
}

template <int R, typename TV>
static void pv_f32_rows(const float* P, int ldp, const TV* const* vrow, int nk, int D, float* O, int ldo,
                        const float* alpha) {
  int d0 = 0;
  for (; d0 + PV_DV * VL <= D; d0 += PV_DV * VL) pv_f32<R, PV_DV, TV>(P, ldp, vrow, nk, d0, O, ldo, alpha);
  switch ((D - d0) / VL) {
    case 3: pv_f32<R, std::min(3, PV_DV), TV>(P, ldp, vrow, nk, d0, O, ldo, alpha); break;
    case 2: pv_f32<R, 2, TV>(P, ldp, vrow, nk, d0, O, ldo, alpha); break;
    case 1: pv_f32<R, 1, TV>(P, ldp, vrow, nk, d0, O, ldo, alpha); break;
    default: break;
  }
}

template <int R, typename TV>
static void pv_f32_pass(const float* P, int ldp, const TV* const* vrow, int nk, int d0, float* O, int ldo,
                        const float* alpha) {
  pv_f32<R, PV_DV, TV>(P, ldp, vrow, nk, d0, O, ldo, alpha);
}

#define KRN_DISPATCH_ROWS(r, FN, ...)       \
  switch (r) {                              \
    case 1: FN<1>(__VA_ARGS__); break;      \
    case 2: FN<2>(__VA_ARGS__); break;      \
    case 3: FN<3>(__VA_ARGS__); break;      \
    case 4: FN<4>(__VA_ARGS__); break;      \
    case 5: FN<5>(__VA_ARGS__); break;      \
    default: FN<6>(__VA_ARGS__); break;     \
  }

// ------------------------------------------------------------------------------------------------
// the bfloat16 dot-product path (AVX512_BF16)
// ------------------------------------------------------------------------------------------------
#if defined(__AVX512BF16__)
#define KRN_HAVE_BF16DP 1
// KTp[(p * KEY_CHUNK + n) * 2 + {0,1}] = K[n][2p + {0,1}]: element pairs, keys in lanes.
template <typename PF = NoPrefetch>
static void pack_k_bf16(const uint16_t* const* krow, int nk_pad, int D, uint16_t* KTp, PF&& pf = PF{}) {
  if (D % 32 == 0) {
    for (int n0 = 0; n0 < nk_pad; n0 += 16) {
      for (int p0 = 0; p0 < D / 2; p0 += 16) {
        pf();
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_castsi512_ps(_mm512_loadu_si512(krow[n0 + i] + 2 * p0));
        transpose16x16(r);
        for (int j = 0; j < 16; ++j)
          _mm512_storeu_si512(KTp + ((p0 + j) * KEY_CHUNK + n0) * 2, _mm512_castps_si512(r[j]));
      }
    }
    return;
  }
  for (int n = 0; n < nk_pad; ++n) {
    if ((n & 15) == 0)
      for (int c = 0; c < (D + 31) / 32; ++c) pf();
    const uint32_t* k = reinterpret_cast<const uint32_t*>(krow[n]);
    uint32_t* dst = reinterpret_cast<uint32_t*>(KTp);
    for (int p = 0; p < D / 2; ++p) dst[p * KEY_CHUNK + n] = k[p];
  }
}

// Vp[(j * D + d) * 2 + {0,1}] = V[2j + {0,1}][d]: row pairs interleaved, d in lanes.
static void pack_v_bf16(const uint16_t* const* vrow, int npairs, int D, uint16_t* Vp) {
  if (D % 32 == 0) {
    alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i il = _mm512_load_si512(lo_idx), ih = _mm512_load_si512(hi_idx);
    for (int j = 0; j < npairs; ++j) {
      const uint16_t* a = vrow[2 * j];
      const uint16_t* b = vrow[2 * j + 1];
      uint16_t* dst = Vp + (size_t)j * D * 2;
      for (int d = 0; d < D; d += 32) {
        __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
        _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(x, il, y));
        _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(x, ih, y));
      }
    }
    return;
  }
  for (int j = 0; j < npairs; ++j) {
    const uint16_t* a = vrow[2 * j];
    const uint16_t* b = vrow[2 * j + 1];
    for (int d = 0; d < D; ++d) {
      Vp[(j * D + d) * 2] = a[d];
      Vp[(j * D + d) * 2 + 1] = b[d];
    }
  }
}

static inline __m512 dpbf16(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
static inline __m512i bcast32(const uint16_t* p) {
  int32_t x;
  std::memcpy(&x, p, 4);
  return _mm512_set1_epi32(x);
}

// S[m][n] (m < R, n < 16 NV) = sum_d q[m][d] K[n][d]; q rows read in place (bf16 pairs broadcast).
template <int R, int NV>
static inline void qk_bf16(const uint16_t* const* qrow, const uint16_t* KTp, int D, float* S, int lds) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    __m512i b[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(KTp + (p * KEY_CHUNK + v * 16) * 2);
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      __m512i a = bcast32(qrow[m] + 2 * p);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[m][v] = dpbf16(acc[m][v], a, b[v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(S + m * lds + v * 16, acc[m][v]);
}

// O[m][d0 : d0 + 16 DV] = alpha[m] O[m][...] + sum_j P[m][2j..2j+1] . Vp[j][...]
template <int R, int DV>
static inline void pv_bf16(const uint16_t* P, int ldp, const uint16_t* Vp, int npairs, int D, int d0, float* O,
                           int ldo, const float* alpha) {
  __m512 acc[R][DV];
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m) {
    __m512 al = _mm512_set1_ps(alpha[m]);
#pragma GCC unroll 8
    for (int v = 0; v < DV; ++v) acc[m][v] = _mm512_mul_ps(_mm512_loadu_ps(O + m * ldo + d0 + v * 16), al);
  }
  for (int j = 0; j < npairs; ++j) {
    __m512i b[DV];
#pragma GCC unroll 8
    for (int v = 0; v < DV; ++v) b[v] = _mm512_loadu_si512(Vp + ((size_t)j * D + d0 + v * 16) * 2);
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      __m512i a = bcast32(P + m * ldp + 2 * j);
#pragma GCC unroll 8
      for (int v = 0; v < DV; ++v) acc[m][v] = dpbf16(acc[m][v], a, b[v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < DV; ++v) _mm512_storeu_ps(O + m * ldo + d0 + v * 16, acc[m][v]);
}

template <int R>
static void qk_bf16_rows(const uint16_t* const* qrow, const uint16_t* KTp, int D, int nv, float* S, int lds) {
  switch (nv) {
    case 1: qk_bf16<R, 1>(qrow, KTp, D, S, lds); break;
    case 2: qk_bf16<R, 2>(qrow, KTp, D, S, lds); break;
    case 3: qk_bf16<R, 3>(qrow, KTp, D, S, lds); break;
    default: qk_bf16<R, 4>(qrow, KTp, D, S, lds); break;
  }
}

template <int R>
static void pv_bf16_rows(const uint16_t* P, int ldp, const uint16_t* Vp, int npairs, int D, float* O, int ldo,
                         const float* alpha) {
  int d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) pv_bf16<R, 4>(P, ldp, Vp, npairs, D, d0, O, ldo, alpha);
  switch ((D - d0) / 16) {
    case 3: pv_bf16<R, 3>(P, ldp, Vp, npairs, D, d0, O, ldo, alpha); break;
    case 2: pv_bf16<R, 2>(P, ldp, Vp, npairs, D, d0, O, ldo, alpha); break;
    case 1: pv_bf16<R, 1>(P, ldp, Vp, npairs, D, d0, O, ldo, alpha); break;
    default: break;
  }
}
#else
#define KRN_HAVE_BF16DP 0
#endif

// ------------------------------------------------------------------------------------------------
// work items and the tile loop
// ------------------------------------------------------------------------------------------------
struct Work {
  int32_t seq, kvh, nh, i0, tq;  // rows i0 .. i0+tq-1 of sequence seq's new tokens, KV heads kvh .. kvh+nh-1
  int64_t cost;
};

struct Args {
  const void* q;
  int64_t q_st, q_sh;  // strides (elements) of query over tokens, heads
  void* out;
  int64_t o_st, o_sh;
  const void* kc;
  const void* vc;
  int64_t c_sb, c_sh;  // cache strides over blocks, heads (rows of head_dim are contiguous)
  const int32_t* bt;
  int64_t bt_st;
  const int32_t* seq_lens;
  const int32_t* qsl;
  int num_heads, num_kv_heads, group, block_size, head_dim;
  float scale;
};

// Per-thread scratch, grown as needed, reused across calls.
struct Scratch {
  std::vector<float> buf;
  float* get(size_t n) {
    if (buf.size() < n + 16) buf.resize(n + 16);
    uintptr_t p = reinterpret_cast<uintptr_t>(buf.data());
    return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
  }
};

// One work item: rows of tile (w.seq, w.i0 .. w.i0 + w.tq) for KV heads w.kvh .. w.kvh + w.nh - 1.
// BF16DP: Q K^T and P V with vdpbf16ps (P rounded to bfloat16); QKDP: Q K^T only, P and P V in float32.
template <typename T, bool BF16DP, bool QKDP = false>
static void run_tile(const Args& a, const Work& w, Scratch& scratch, const Work* next_work) {
  constexpr bool QK_BF16 = BF16DP || QKDP;  // scores from bfloat16 pairs (q read in place, K packed as pairs)
  const int D = a.head_dim, group = a.group, BS = a.block_size;
  const int M = w.tq * group;  // query rows per KV head
  const int MT = M * w.nh;     // rows of the work item (its KV heads one after the other)
  const int ctx = a.seq_lens[w.seq];
  const int q0 = a.qsl[w.seq];
  const int qlen = a.qsl[w.seq + 1] - q0;
  const int first_pos = ctx - qlen + w.i0;  // position of the tile's first query row
  const int last_pos = first_pos + w.tq - 1;
  const int nkeys = last_pos + 1;
  const int32_t* bt = a.bt + (int64_t)w.seq * a.bt_st;
  const float sc = a.scale * LOG2E;

  // scratch layout (floats)
  const int Mp = (MT + 7) & ~7;
  size_t off = 0;
  auto take = [&](size_t n) { size_t o = off; off += (n + 15) & ~size_t(15); return o; };
  const size_t o_O = take((size_t)Mp * D), o_S = take((size_t)Mp * KEY_CHUNK), o_P = take((size_t)Mp * KEY_CHUNK),
               o_m = take(Mp), o_l = take((size_t)Mp * VL), o_al = take(Mp),
               o_Q = take(QK_BF16 ? 0 : (size_t)Mp * D), o_KT = take((size_t)D * KEY_CHUNK),
               o_V = take((size_t)D * KEY_CHUNK);
  float* base = scratch.get(off);
  float* O_all = base + o_O;
  float* S_all = base + o_S;
  float* Pf_all = base + o_P;
  float* mrow_all = base + o_m;
  vfloat* lvec_all = reinterpret_cast<vfloat*>(base + o_l);  // 64-byte aligned (offsets are multiples of 16)
  float* alpha_all = base + o_al;
  float* Qf_all = base + o_Q;
  float* KT = base + o_KT;
  float* Vf = base + o_V;

  const T* qrow_all[MAX_ROWS];
  int64_t koff[KEY_CHUNK];  // element offset of each key's row within a KV head's cache
  const T* krow[KEY_CHUNK];
  const T* vrow[KEY_CHUNK];
  const float* vrowf[KEY_CHUNK];
  const char* pf_k[KEY_CHUNK];  // rows of the next unit to prefetch (see below)
  const char* pf_v[KEY_CHUNK];
  int pf_n = 0, pf_i = 0;  // rows of the next unit, and how many of them are prefetched already
  const int row_lines = (int)((D * sizeof(T) + 63) / 64);  // cache lines of one K or V row
  auto prefetch_next = [&]() {  // the next row of the next unit (no-op when all are)
    if (pf_i >= pf_n) return;
    for (int l = 0; l < row_lines; ++l) {
      __builtin_prefetch(pf_k[pf_i] + 64 * l, 0, 2);
      __builtin_prefetch(pf_v[pf_i] + 64 * l, 0, 2);
    }
    ++pf_i;
  };
  auto prefetch_rest = [&]() { while (pf_i < pf_n) prefetch_next(); };
  // The next unit's prefetches, pf_per rows at each tick(): ticks come once per 16 keys x 32 values of
  // the K pack, once per Q K^T column block and (float32 caches) once per P V pass over head_dim, so
  // the prefetches run evenly over the whole unit (KRN_PF_SPREAD; with 0 they all wait for
  // prefetch_rest before P V). spread_prefetches(nk_pad) sets pf_per and returns the pack's hook.
  int pf_per = 0;
  auto tick = [&]() { for (int i = 0; i < pf_per; ++i) prefetch_next(); };
  auto spread_prefetches = [&](int nk_pad) {
    const int npack = nk_pad / 16 * ((D + 31) / 32);
    // ticks of the Q K^T and P V steps that call tick() (the float32 Q K^T; P V over float32 V rows)
    const int nqk = QK_BF16 ? 0 : (nk_pad + QK_NV * VL - 1) / (QK_NV * VL) * ((M + MR - 1) / MR);
    const int npv = std::is_same<T, float>::value && !BF16DP && D % (PV_DV * VL) == 0
                        ? D / (PV_DV * VL) * ((M + MR - 1) / MR) : 0;
    const int hooks = npack + nqk + npv;
    pf_per = KRN_PF_SPREAD && hooks > 0 ? (pf_n + hooks - 1) / hooks : 0;
    return [&tick]() { tick(); };
  };
  const T* zero = reinterpret_cast<const T*>(kZeroRow);
  for (int hi = 0; hi < w.nh; ++hi)
    for (int i = 0; i < w.tq; ++i)
      for (int g = 0; g < group; ++g)
        qrow_all[hi * M + i * group + g] = static_cast<const T*>(a.q) + (int64_t)(q0 + w.i0 + i) * a.q_st +
                                           (int64_t)((w.kvh + hi) * group + g) * a.q_sh;
  if (!QK_BF16) {
    for (int m = 0; m < MT; ++m)
      for (int d = 0; d < D; d += VL) vstore(Qf_all + m * D + d, Cvt<T>::load(qrow_all[m] + d));
  }
  for (int m = 0; m < MT; ++m) {
    mrow_all[m] = -std::numeric_limits<float>::infinity();
    lvec_all[m] = vfloat{};
  }
  std::memset(O_all, 0, sizeof(float) * (size_t)MT * D);

  // offsets of the keys c0 .. c0 + nk - 1 of the sequence with block table tbl, block by block (no
  // division per key)
  auto key_offsets = [&](const int32_t* tbl, int c0, int nk, int64_t* off) {
    int j = c0 / BS, o = c0 % BS;
    for (int n = 0; n < nk;) {
      const int64_t base_o = (int64_t)tbl[j] * a.c_sb;
      const int cnt = std::min(BS - o, nk - n);
      for (int t = 0; t < cnt; ++t) off[n + t] = base_o + (int64_t)(o + t) * D;
      n += cnt;
      ++j;
      o = 0;
    }
  };
  int64_t koff_next[KEY_CHUNK];
  key_offsets(bt, 0, std::min(KEY_CHUNK, nkeys), koff);
  for (int c0 = 0; c0 < nkeys; c0 += KEY_CHUNK) {
    const int nk = std::min(KEY_CHUNK, nkeys - c0);
    const int nv = (nk + VL - 1) / VL;          // vectors of keys (float32 path)
    const int nk16 = (nk + 15) & ~15;           // keys rounded up for 16-wide packing
    int nk_next = std::min(KEY_CHUNK, nkeys - c0 - KEY_CHUNK);  // keys of the next chunk (<= 0: none)
    int64_t next_head_off = (int64_t)w.kvh * a.c_sh;  // the KV head of the next chunk's first unit
    if (nk_next > 0) {
      key_offsets(bt, c0 + KEY_CHUNK, nk_next, koff_next);
    } else if (next_work != nullptr) {  // the last chunk: the next work item's first chunk instead
      const Work& x = *next_work;
      const int xq0 = a.qsl[x.seq], xqlen = a.qsl[x.seq + 1] - xq0;
      const int xkeys = a.seq_lens[x.seq] - xqlen + x.i0 + x.tq;
      nk_next = std::min(KEY_CHUNK, xkeys);
      key_offsets(a.bt + (int64_t)x.seq * a.bt_st, 0, nk_next, koff_next);
      next_head_off = (int64_t)x.kvh * a.c_sh;
    }
    const bool last_chunk = c0 + KEY_CHUNK >= nkeys;
    // the item's KV heads one after the other: their rows of a block are neighbours in memory
    for (int hi = 0; hi < w.nh; ++hi) {
      const int64_t hoff = (int64_t)(w.kvh + hi) * a.c_sh;
      const T* kc = static_cast<const T*>(a.kc) + hoff;
      const T* vc = static_cast<const T*>(a.vc) + hoff;
      for (int n = 0; n < nk; ++n) {
        krow[n] = kc + koff[n];
        vrow[n] = vc + koff[n];
      }
      for (int n = nk; n < KEY_CHUNK; ++n) krow[n] = vrow[n] = zero;
      // Software prefetch (into L2) of the next unit's K and V rows: the next KV head of this chunk,
      // else the first head of the next chunk. A sequence's blocks are scattered, so the hardware
      // prefetchers meet a new short stream at every block; this unit's compute hides the next one's reads.
      {
        const int64_t* noff = hi + 1 < w.nh ? koff : koff_next;
        const int nn = hi + 1 < w.nh ? nk : nk_next;
        const int64_t nh_off = hi + 1 < w.nh ? hoff + a.c_sh : next_head_off;
        const char* nkc = reinterpret_cast<const char*>(static_cast<const T*>(a.kc) + nh_off);
        const char* nvc = reinterpret_cast<const char*>(static_cast<const T*>(a.vc) + nh_off);
        pf_n = nn;
        pf_i = 0;
        for (int n = 0; n < nn; ++n) {
          pf_k[n] = nkc + noff[n] * (int64_t)sizeof(T);
          pf_v[n] = nvc + noff[n] * (int64_t)sizeof(T);
        }
      }
      const int r0 = hi * M;  // this head's rows
      const T* const* qrow = qrow_all + r0;
      float* O = O_all + (size_t)r0 * D;
      float* S = S_all + (size_t)r0 * KEY_CHUNK;
      float* Pf = Pf_all + (size_t)r0 * KEY_CHUNK;
      float* mrow = mrow_all + r0;
      vfloat* lvec = lvec_all + r0;
      float* alpha = alpha_all + r0;
      float* Qf = Qf_all + (size_t)r0 * D;
      // 1-2: scores
#if KRN_HAVE_BF16DP
      if constexpr (QK_BF16) {
        uint16_t* KTp = reinterpret_cast<uint16_t*>(KT);
        pack_k_bf16(reinterpret_cast<const uint16_t* const*>(krow), nk16, D, KTp, spread_prefetches(nk16));
        for (int n0 = 0; n0 < nk16; n0 += 64) {  // column blocks of up to 4 x 16 keys
          const int nv16 = std::min(64, nk16 - n0) / 16;
          for (int m0 = 0; m0 < M; m0 += MR) {
            const int r = std::min(MR, M - m0);
            KRN_DISPATCH_ROWS(r, qk_bf16_rows, reinterpret_cast<const uint16_t* const*>(qrow + m0), KTp + n0 * 2, D,
                              nv16, S + m0 * KEY_CHUNK + n0, KEY_CHUNK);
          }
        }
      } else
#endif
      {
        const int nk_pad = std::max(nk16, nv * VL);
        pack_k_f32<T>(krow, nk_pad, D, KT, spread_prefetches(nk_pad));
        for (int n0 = 0; n0 < nv * VL; n0 += QK_NV * VL) {  // column blocks of up to QK_NV vectors
          const int nvb = std::min(QK_NV * VL, nv * VL - n0) / VL;
          for (int m0 = 0; m0 < M; m0 += MR) {
            const int r = std::min(MR, M - m0);
            KRN_DISPATCH_ROWS(r, qk_f32_rows, Qf + m0 * D, D, KT + n0, D, nvb, S + m0 * KEY_CHUNK + n0, KEY_CHUNK);
            tick();
          }
        }
      }

      // 3: online softmax. Row m (position first_pos + m / group) sees keys c0 .. pos of this chunk;
      // P columns up to ncols are written (zeros past the row's last key) for the P V step.
      const int ncols = BF16DP ? nk16 : nv * VL;
      const vint lane = iota();
      const vfloat ninf = vset1(-std::numeric_limits<float>::infinity());
      for (int m = 0; m < M; ++m) {
        const int pos = first_pos + m / group;
        const int L = std::min(nk, pos + 1 - c0);
        float* s = S + m * KEY_CHUNK;
        float* prow = Pf + m * KEY_CHUNK;
        if (L <= 0) {  // the whole chunk lies past this row's position
          alpha[m] = 1.f;
          if (BF16DP) std::memset(prow, 0, ncols * sizeof(uint16_t));
          else std::memset(s, 0, ncols * sizeof(float));
          continue;
        }
        const int Lfull = L & ~(VL - 1);  // columns in whole unmasked vectors
        vfloat mx = ninf;
        for (int n = 0; n < Lfull; n += VL) mx = vmax(mx, vload(s + n));
        if (Lfull < L) mx = vmax(mx, (lane + Lfull) < L ? vload(s + Lfull) : ninf);
        const float mnew = std::max(mrow[m], hmax(mx) * sc);
        // 0 on the first chunk (mrow = -inf), 1 when the running max did not move
        const float al = mnew == mrow[m] ? 1.f : std::exp2(mrow[m] - mnew);
        const vfloat vsc = vset1(sc), vm = vset1(mnew);
        vfloat sum = vfloat{};
        for (int n = 0; n < ncols; n += VL) {
          vfloat p = BF16DP ? vexp2<5>(vload(s + n) * vsc - vm) : vexp2<7>(vload(s + n) * vsc - vm);
          if (n + VL > L) p = (lane + n) < L ? p : vfloat{};
          sum += p;
#if KRN_HAVE_BF16DP
          if constexpr (BF16DP) {
            __m256bh h = _mm512_cvtneps_pbh((__m512)p);
            std::memcpy(reinterpret_cast<uint16_t*>(prow) + n, &h, 32);
          } else
#endif
          {
            vstore(s + n, p);
          }
        }
        lvec[m] = lvec[m] * al + sum;  // row sums kept as vectors, reduced once at the end
        mrow[m] = mnew;
        alpha[m] = al;
      }

      // 4: O = alpha O + P V
#if KRN_HAVE_BF16DP
      if constexpr (BF16DP) {
        uint16_t* Vp = reinterpret_cast<uint16_t*>(Vf);
        const int npairs = (nk + 1) / 2;
        pack_v_bf16(reinterpret_cast<const uint16_t* const*>(vrow), npairs, D, Vp);
        prefetch_rest();
        const uint16_t* Pb = reinterpret_cast<const uint16_t*>(Pf);
        for (int m0 = 0; m0 < M; m0 += MR) {
          const int r = std::min(MR, M - m0);
          // P rows are bf16 in the float rows of Pf: row m starts at Pb + 2 * KEY_CHUNK * m
          KRN_DISPATCH_ROWS(r, pv_bf16_rows, Pb + (size_t)m0 * 2 * KEY_CHUNK, 2 * KEY_CHUNK, Vp, npairs, D, O + m0 * D,
                            D, alpha + m0);
        }
      } else
#endif
      {
        const float* const* vr;
        if constexpr (std::is_same<T, float>::value) {
          if (D % (PV_DV * VL) == 0) {
            // float32 V rows are read in place, one pass of PV_DV vectors of head_dim at a time, with
            // a tick of the next unit's prefetches after each pass
            const float* const* vrr = reinterpret_cast<const float* const*>(vrow);
            for (int m0 = 0; m0 < M; m0 += MR) {
              const int r = std::min(MR, M - m0);
              for (int d0 = 0; d0 < D; d0 += PV_DV * VL) {
                KRN_DISPATCH_ROWS(r, pv_f32_pass, S + m0 * KEY_CHUNK, KEY_CHUNK, vrr, nk, d0, O + m0 * D, D, alpha + m0);
                tick();
              }
            }
            prefetch_rest();
            continue;
          }
          prefetch_rest();
          vr = reinterpret_cast<const float* const*>(vrow);
        } else if (KRN_V_DIRECT && M <= MR) {
          // one row block (a decode tile): each V row is read once, so it is widened as the P V
          // micro-kernel reads it instead of being copied to float32 first
          prefetch_rest();
          KRN_DISPATCH_ROWS(M, pv_f32_rows, S, KEY_CHUNK, vrow, nk, D, O, D, alpha);
          continue;
        } else {
          for (int n = 0; n < nk; ++n) {
            for (int d = 0; d < D; d += VL) vstore(Vf + n * D + d, Cvt<T>::load(vrow[n] + d));
            vrowf[n] = Vf + n * D;
            prefetch_next();
          }
          prefetch_rest();
          vr = vrowf;
        }
        for (int m0 = 0; m0 < M; m0 += MR) {
          const int r = std::min(MR, M - m0);
          KRN_DISPATCH_ROWS(r, pv_f32_rows, S + m0 * KEY_CHUNK, KEY_CHUNK, vr, nk, D, O + m0 * D, D, alpha + m0);
        }
      }
    }
    if (!last_chunk) std::memcpy(koff, koff_next, sizeof(int64_t) * nk_next);
  }

  // 5: normalise and write out
  for (int hi = 0; hi < w.nh; ++hi) {
    for (int i = 0; i < w.tq; ++i) {
      for (int g = 0; g < group; ++g) {
        const int m = hi * M + i * group + g;
        const float inv = 1.f / hsum(lvec_all[m]);
        float* o = O_all + (size_t)m * D;
        for (int d = 0; d < D; ++d) o[d] *= inv;
        T* dst = static_cast<T*>(a.out) + (int64_t)(q0 + w.i0 + i) * a.o_st +
                 (int64_t)((w.kvh + hi) * group + g) * a.o_sh;
        Cvt<T>::store_row(dst, o, D);
      }
    }
  }
}

template <typename T, bool BF16DP, bool QKDP = false>
static void run_all(const Args& a, const std::vector<Work>& works) {
  const int64_t n = (int64_t)works.size();
  if (n == 0) return;
  at::internal::lazy_init_num_threads();  // this thread's OpenMP team size = torch.get_num_threads()
  const int nthreads = std::min<int64_t>(omp_get_max_threads(), n);
  if (nthreads <= 1) {
    thread_local Scratch s;
    for (int64_t i = 0; i < n; ++i) run_tile<T, BF16DP, QKDP>(a, works[i], s, i + 1 < n ? &works[i + 1] : nullptr);
    return;
  }
  // (no num_threads clause: changing the team size makes GOMP rebuild its pool; idle threads just pass)
#pragma omp parallel
  {
    thread_local Scratch s;
#pragma omp for schedule(dynamic, 1)
    // the item this thread most likely takes next (dynamic schedule, items of similar cost): its first
    // K/V rows are prefetched during this item's last unit (a wrong guess only costs the prefetches)
    for (int64_t i = 0; i < n; ++i)
      run_tile<T, BF16DP, QKDP>(a, works[i], s, i + nthreads < n ? &works[i + nthreads] : nullptr);
  }
}

static at::Tensor as_int32(const at::Tensor& t) {
  at::Tensor r = t.scalar_type() == at::kInt ? t : t.to(at::kInt);
  return r.stride(-1) == 1 ? r : r.contiguous();
}

// out[num_tokens, num_heads, head_dim] (written rows: those of the sequences; others untouched)

// bf16_dot: bfloat16 caches use vdpbf16ps for Q K^T and P V (P rounded to bfloat16); qk_dot: Q K^T of
// bfloat16 caches with vdpbf16ps, P and P V in float32 (the caller decides: kernels.cpu_ops.attention_dot_products;
// both ignored by a build without AVX512-BF16)
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, bool bf16_dot, bool qk_dot) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && key_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type() &&
                  out.scalar_type() == key_cache.scalar_type(),
              "query, caches and out must share a dtype");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.strides() == value_cache.strides(),
              "key and value caches must have the same shape and strides");
  const int D = (int)query.size(2);
  const int H = (int)query.size(1);
  const int KVH = (int)key_cache.size(1);
  const int BS = (int)key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && H % KVH == 0, "head_dim / head count mismatch");
  TORCH_CHECK(D % 16 == 0 && D <= MAX_HEAD_DIM, "head_dim must be a multiple of 16, at most ", MAX_HEAD_DIM);
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query/out rows must be contiguous");
  TORCH_CHECK(key_cache.stride(3) == 1 && key_cache.stride(2) == D, "cache rows [block_size, head_dim] must be contiguous");
  at::Tensor bt = as_int32(block_tables), sl = as_int32(seq_lens).contiguous(), qsl = as_int32(query_start_loc).contiguous();
  const int num_seqs = (int)sl.size(0);
  TORCH_CHECK(qsl.size(0) == num_seqs + 1 && bt.size(0) >= num_seqs, "metadata sizes");
  TORCH_CHECK(out.size(0) == query.size(0) && out.size(1) == H && out.size(2) == D, "out must have the query's shape");

  Args a;
  a.q = query.data_ptr();
  a.q_st = query.stride(0);
  a.q_sh = query.stride(1);
  a.out = out.data_ptr();
  a.o_st = out.stride(0);
  a.o_sh = out.stride(1);
  a.kc = key_cache.data_ptr();
  a.vc = value_cache.data_ptr();
  a.c_sb = key_cache.stride(0);
  a.c_sh = key_cache.stride(1);
  a.bt = bt.data_ptr<int32_t>();
  a.bt_st = bt.stride(0);
  a.seq_lens = sl.data_ptr<int32_t>();
  a.qsl = qsl.data_ptr<int32_t>();
  a.num_heads = H;
  a.num_kv_heads = KVH;
  a.group = H / KVH;
  a.block_size = BS;
  a.head_dim = D;
  a.scale = (float)scale;
  TORCH_CHECK(a.group <= MAX_ROWS, "too many query heads per KV head");
  const int tq_max = std::max(1, TILE_ROWS / a.group);
  // Decode rows take all KV heads of their sequence in one work item (the heads' rows of a block are
  // neighbours in memory: longer contiguous reads) when there are enough sequences to keep every
  // thread busy; otherwise, and for prompt chunks, one KV head per item.
  int num_decode = 0;
  for (int b = 0; b < num_seqs; ++b) num_decode += (a.qsl[b + 1] - a.qsl[b]) == 1;
  at::internal::lazy_init_num_threads();
  const bool decode_all_heads = KRN_DECODE_ALL_HEADS && H <= MAX_ROWS && num_decode >= 4 * omp_get_max_threads();

  std::vector<Work> works;
  works.reserve(num_seqs * KVH);
  const int64_t num_blocks = key_cache.size(0);
  for (int b = 0; b < num_seqs; ++b) {
    const int qlen = a.qsl[b + 1] - a.qsl[b];
    const int ctx = a.seq_lens[b];
    if (qlen <= 0) continue;
    TORCH_CHECK(qlen <= ctx, "query longer than its context");
    TORCH_CHECK(a.qsl[b] >= 0 && a.qsl[b + 1] <= query.size(0), "query_start_loc beyond the query's rows");
    TORCH_CHECK((ctx + BS - 1) / BS <= bt.size(1), "block table too narrow for seq_len");
    // a block id outside the cache would read (and, for the cache write, write) outside it: refused, not a crash
    const int32_t* row = a.bt + (int64_t)b * a.bt_st;
    for (int i = 0; i < (ctx + BS - 1) / BS; ++i)
      TORCH_CHECK(row[i] >= 0 && row[i] < num_blocks, "block table entry ", row[i], " outside the cache's ", num_blocks, " blocks");
    // equal tiles of at most tq_max positions
    const int ntiles = (qlen + tq_max - 1) / tq_max;
    const int tq = (qlen + ntiles - 1) / ntiles;
    for (int i0 = 0; i0 < qlen; i0 += tq) {
      const int n = std::min(tq, qlen - i0);
      const int64_t keys = ctx - qlen + i0 + n;
      if (qlen == 1 && decode_all_heads) {
        works.push_back(Work{b, 0, KVH, i0, n, keys * (n * a.group + 8) * KVH});
      } else {
        for (int h = 0; h < KVH; ++h) works.push_back(Work{b, h, 1, i0, n, keys * (n * a.group + 8)});
      }
    }
  }
  std::stable_sort(works.begin(), works.end(), [](const Work& x, const Work& y) { return x.cost > y.cost; });

  switch (key_cache.scalar_type()) {
    case at::kFloat: run_all<float, false>(a, works); break;
    case at::kHalf: run_all<at::Half, false>(a, works); break;
    case at::kBFloat16:
#if KRN_HAVE_BF16DP
      // bf16 dot products (P rounded to bf16, as FlashAttention does) are faster, but on SmolLM2 they flip
      // near-tied greedy choices that float32 products keep: opt-in (CBP_CPU_BF16_DOT=1)
      if (bf16_dot) {
        run_all<at::BFloat16, true>(a, works);
        break;
      }
      if (qk_dot) {
        run_all<at::BFloat16, false, true>(a, works);
        break;
      }
#else
      (void)bf16_dot;
      (void)qk_dot;
#endif
      run_all<at::BFloat16, false>(a, works);
      break;
    default: TORCH_CHECK(false, "unsupported dtype ", key_cache.scalar_type());
  }
}

// Copy key/value [num_tokens, num_kv_heads, head_dim] into the caches at slot_mapping (-1: skip).
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type(),
              "key/value must have the cache dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value rows must be contiguous");
  TORCH_CHECK(key_cache.stride(3) == 1 && key_cache.stride(2) == key_cache.size(3) && value_cache.strides() == key_cache.strides(),
              "cache rows must be contiguous");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "key and value caches must have the same shape");
  TORCH_CHECK(value.size(0) == key.size(0) && value.size(1) == key.size(1) && value.size(2) == key.size(2),
              "key and value must have the same shape");
  const int64_t T = key.size(0), KVH = key.size(1), D = key.size(2);
  const int64_t BS = key_cache.size(2), NB = key_cache.size(0);
  TORCH_CHECK(key_cache.size(1) == KVH && key_cache.size(3) == D, "shape mismatch");
  at::Tensor slots = slot_mapping.scalar_type() == at::kLong ? slot_mapping.contiguous() : slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == T, "slot_mapping length");
  const int64_t* s = slots.data_ptr<int64_t>();
  const size_t row = (size_t)D * key.element_size();
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t es = key.element_size();
  const int64_t k_st = key.stride(0) * es, k_sh = key.stride(1) * es, v_st = value.stride(0) * es, v_sh = value.stride(1) * es;
  const int64_t c_sb = key_cache.stride(0) * es, c_sh = key_cache.stride(1) * es;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = s[t];
    if (slot < 0) continue;
    const int64_t blk = slot / BS, o = slot % BS;
    TORCH_CHECK(blk < NB, "slot out of range");
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t dst = blk * c_sb + h * c_sh + o * (int64_t)row;
      std::memcpy(kc + dst, kp + t * k_st + h * k_sh, row);
      std::memcpy(vc + dst, vp + t * v_st + h * v_sh, row);
    }
  }
}

std::string isa() {
  std::string s;
#if defined(__AVX512F__)
  s += "avx512";
#elif defined(__AVX2__)
  s += "avx2";
#else
  s += "generic";
#endif
#if KRN_HAVE_BF16DP
  s += "+bf16dp";
#endif
  s += " vl" + std::to_string(VL);
  return s;
}

void register_fused_ops(pybind11::module& m);   // fused_ops_cpu.cpp
void register_logits_ops(pybind11::module& m);  // logits_cpu.cpp
void register_gemm_ops(pybind11::module& m);    // gemm_bf16_cpu.cpp
void register_gemm_f32_ops(pybind11::module& m);  // gemm_f32_cpu.cpp
void register_decoder_ops(pybind11::module& m);  // decoder_cpu.cpp

}  // namespace cbp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  cbp::register_fused_ops(m);
  cbp::register_logits_ops(m);
  cbp::register_gemm_ops(m);
  cbp::register_gemm_f32_ops(m);
  cbp::register_decoder_ops(m);
  m.def("paged_attention", &cbp::paged_attention, "fused paged attention (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("reshape_and_cache", &cbp::reshape_and_cache, "write K/V into the paged cache (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("isa", &cbp::isa, "the instruction set the extension was compiled for");
}
