// Masking of partial tiles on register fragments. Only tiles the plan classifies as partial come
// here (full tiles skip it, empty tiles are never loaded), so this may afford a shared-memory pass
// and a binary search per (row block, key block) change: in stream order partial tiles are the
// diagonal ones and the few at stream boundaries.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

#include "cuda/attention/attention_cuda.h"
#include "jacobi/attention_plan.h"

namespace jacobi::cuda::attn {

using namespace cute;

// Step 1, cooperative: the visibility of a partial (kRows x 64) tile as one 64-bit word per row
// in shared memory. One thread per row walks the 64 columns (a rolled loop: small code, few
// registers; the accumulators of the kernel stay live around it). Rows/columns at or past seq_len
// and uncovered tokens (block -1) are invisible.
template <int kRows, int kNThreads>
__device__ __forceinline__ void build_tile_mask(uint64_t* smask, int row0, int col0,
                                                const Plan& plan, int seq_len, int tid) {
  static_assert(jacobi::attn::kPlanTile == 64, "one 64-bit word per row");
  for (int r = tid; r < kRows; r += kNThreads) {
    const int p = row0 + r;
    const int q_blk = p < seq_len ? __ldg(plan.pblk + p) : -1;
    const int q_tok = p < seq_len ? __ldg(plan.perm + p) : 0;
    uint64_t word = 0;
    if (q_blk >= 0) {
      // Off-diagonal visibility is per block pair: memoise the last key block (columns run in
      // ascending permuted order, so it changes only at block boundaries).
      int last_kb = -2;
      bool last_vis = false;
      const int c_end = min(64, seq_len - col0);
#pragma unroll 1
      for (int c = 0; c < c_end; ++c) {
        const int kb = __ldg(plan.pblk + col0 + c);
        bool vis;
        if (kb < 0) {
          vis = false;
        } else if (kb == q_blk) {
          vis = __ldg(plan.perm + col0 + c) <= q_tok;  // causal inside the block (block_table.h)
        } else {
          if (kb != last_kb) {
            last_kb = kb;
            last_vis = kb < q_blk && jacobi::attn::block_visible_bsearch(plan.table, q_blk, kb);
          }
          vis = last_vis;
        }
        word |= uint64_t(vis) << c;
      }
    }
    smask[r] = word;
  }
}

// Step 2, per thread, after a barrier: invisible score entries become -inf. scores: this
// thread's accumulator in (rows, cols) view; coords: the matching (row, col) inside the tile (a
// partitioned identity tensor in the same view). col_offset: the tile's first column inside the
// 64-wide plan tile (0 unless the kernel's key tile is narrower).
template <class TensorS, class TensorC>
__device__ __forceinline__ void apply_tile_mask(TensorS& scores, TensorC const& coords,
                                                const uint64_t* smask) {
  CUTE_UNROLL
  for (int r = 0; r < size<0>(scores); ++r) {
    const uint64_t word = smask[get<0>(coords(r, 0))];
    CUTE_UNROLL
    for (int c = 0; c < size<1>(scores); ++c) {
      if (!((word >> get<1>(coords(0, c))) & 1)) scores(r, c) = -INFINITY;
    }
  }
}

}  // namespace jacobi::cuda::attn
