// The walk of the engine's own GEMMs (gemm_bf16_cpu.cpp, gemm_f32_cpu.cpp) over one thread's columns: the
// thread's 16-column blocks [first, last) in groups of up to max_blocks, and for each group all rows of a
// panel of panel_rows rows, panel after panel, so a group's weights stay in cache while the panel's rows
// pass over them. For each group it names the thread's next group, whose weights the group's first row
// tile prefetches (after the thread's last group: its first group again in the next panel, or none).
#pragma once

#include <algorithm>
#include <cstdint>

namespace cbp {

// Calls group(m0, rows, b0, nr, nb0, nnext) for each group: rows m0 .. m0 + rows - 1, blocks b0 .. b0 + nr - 1;
// the next group starts at block nb0 with nnext blocks (0: none).
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

}  // namespace cbp
