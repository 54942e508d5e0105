// The walk of the engine's own GEMMs (gemm_bf16_cpu.cpp, gemm_f32_cpu.cpp) over the output: units of a
// panel of panel_rows rows x a chunk of consecutive 16-column blocks, handed to torch's threads one at a
// time from a shared counter (dynamic scheduling, as OpenMP's schedule(dynamic)), panel after panel. In a
// unit the blocks go in groups of up to max_blocks, and each group meets all rows of the panel, so a
// group's weights stay in cache while the panel's rows pass over them. For each group it names the next
// group the thread will likely compute, whose weights the group's first row tile prefetches.
//
// Why dynamic: with a fixed split (each thread half of the columns) a thread that loses its core for a
// while (to the HTTP server, the benchmark client, a browser on a laptop, another VM's work on a shared
// host) holds the whole call back while the other thread waits at the end; with units taken from a counter
// the other thread goes on with the remaining units. Measured on a 2-vCPU AMD EPYC (docs/performance.md,
// 2026-12-05). A unit computes whole outputs (every k), so which thread takes which unit never changes a
// result's bits: the GEMMs stay batch invariant.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace cbp {

// Below this many rows a call reads its weights once and is short: each thread takes one contiguous share
// of the columns (the fixed split of at::parallel_for), which keeps the weight reads in long streams. On the
// Zen 3 EPYC the dynamic walk cost 5-12% at one row, even with one unit per thread.
constexpr int64_t kDynamicMinRows = 32;

// The target blocks per unit of the dynamic walk: about 8 units per thread over the call (so the last unit's
// imbalance is small) and at most 8 groups of blocks (so a unit stays long against the counter's cost); a
// multiple of max_blocks. parallel_groups then cuts a panel's columns into a multiple of the thread count of
// near-equal chunks of about this size.
inline int64_t unit_blocks(int64_t NB, int64_t panels, int64_t threads, int max_blocks) {
  const int64_t groups = (NB + max_blocks - 1) / max_blocks;
  const int64_t per = std::clamp<int64_t>(groups * panels / (8 * threads), 1, 8);
  return std::min(groups, per) * max_blocks;
}

// The fixed walk over one thread's share of the columns, blocks [first, last): for each panel of rows, the
// share's groups in order; the next group is the share's next one (after its last: its first again in the
// next panel, or none).
template <typename F>
inline void walk_groups(int64_t first, int64_t last, int64_t M, int64_t panel_rows, int max_blocks, F&& group) {
  for (int64_t m0 = 0; m0 < M; m0 += panel_rows) {
    const int64_t rows = std::min(panel_rows, M - m0);
    for (int64_t b0 = first; b0 < last; b0 += max_blocks) {
      const int nr = static_cast<int>(std::min<int64_t>(max_blocks, last - b0));
      const int64_t nb0 = b0 + max_blocks < last ? b0 + max_blocks : (m0 + panel_rows < M ? first : last);
      const int nnext = static_cast<int>(std::min<int64_t>(max_blocks, last - nb0));
      group(m0, rows, b0, nr, nb0, nnext);
    }
  }
}

// Calls group(m0, rows, b0, nr, nb0, nnext) on torch's threads, once for each group of every unit: rows
// m0 .. m0 + rows - 1, blocks b0 .. b0 + nr - 1 of the NB blocks; the thread's likely next group starts at
// block nb0 with nnext blocks (0: none).
template <typename F>
inline void parallel_groups(int64_t NB, int64_t M, int64_t panel_rows, int max_blocks, F&& group) {
  if (NB <= 0 || M <= 0) return;
  if (M < kDynamicMinRows) {
    at::parallel_for(0, NB, 1, [&](int64_t first, int64_t last) { walk_groups(first, last, M, panel_rows, max_blocks, group); });
    return;
  }
  const int64_t panels = (M + panel_rows - 1) / panel_rows;
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t cb = unit_blocks(NB, panels, threads, max_blocks);
  // A panel's chunks: a multiple of the thread count, of sizes that differ by one block at most (the larger
  // ones first), so threads of the same speed end together. Chunks of exactly cb blocks left the last round
  // to one thread where the groups did not divide among the threads (SmolLM2's o and down projections at 64
  // rows: 36 blocks, 9 units of 4, 5 against 4): on a 2-vCPU Zen 4 EPYC the 30 layers' four linears at 64
  // rows took 1.01-1.02x less time with weights cold from memory, 1.04x with them in cache
  // (docs/performance.md, 2026-12-06).
  const int64_t chunks = std::min<int64_t>(NB, threads * std::max<int64_t>(1, (NB + cb * threads / 2) / (cb * threads)));
  const int64_t q = NB / chunks, r = NB % chunks;
  auto begin = [&](int64_t i) { return i * q + std::min(i, r); };
  const int64_t units = chunks * panels;
  const int64_t nt = std::min(threads, units);
  std::atomic<int64_t> counter{nt};  // each thread's first unit is its own index; later ones come from here
  at::parallel_for(0, nt, 1, [&](int64_t own, int64_t) {
    for (int64_t u = own; u < units; u = counter.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t m0 = (u / chunks) * panel_rows, rows = std::min(panel_rows, M - m0);
      const int64_t first = begin(u % chunks), last = begin(u % chunks + 1);
      // after this unit the thread most likely takes the unit nt further on (the others take the ones between)
      const int64_t gu = (u + nt) % chunks;
      const int64_t guess = u + nt < units ? begin(gu) : NB;
      const int64_t guess_end = u + nt < units ? begin(gu + 1) : NB;
      for (int64_t b0 = first; b0 < last; b0 += max_blocks) {
        const int nr = static_cast<int>(std::min<int64_t>(max_blocks, last - b0));
        const bool inside = b0 + max_blocks < last;
        const int64_t nb0 = inside ? b0 + max_blocks : guess;
        const int64_t nend = inside ? last : guess_end;
        const int nnext = static_cast<int>(std::min<int64_t>(max_blocks, nend - nb0));
        group(m0, rows, b0, nr, nb0, nnext);
      }
    }
  });
}

}  // namespace cbp
