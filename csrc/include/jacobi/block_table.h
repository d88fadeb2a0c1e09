// Which keys a query may attend in the block-causal attention (docs/method.md §1), once.
//
// Torch-free and header-only, usable from host and device code: the CPU and CUDA attention
// kernels and the Python layout (through an op) all derive visibility from this file.
//
// General form: a sequence is cut into contiguous blocks; block b covers tokens
// [block_start[b], block_start[b+1]). Query block qb attends the key blocks listed in
// kv_idx[kv_ptr[qb] .. kv_ptr[qb+1]) (ascending, each < qb, fully visible) and its own block
// causally (key index <= query index). Any block-causal layout is such a table; the Jacobi
// Forcing layouts below are one family of them.
#pragma once

#include <cstdint>

#include "jacobi/hd.h"

namespace jacobi {

struct BlockTable {
  const int32_t* block_start;  // [num_blocks + 1], block_start[0] == 0, non-decreasing
  const int32_t* kv_ptr;       // [num_blocks + 1], CSR row pointers into kv_idx
  const int32_t* kv_idx;       // off-diagonal key blocks of each query block, ascending, < qb
  int32_t num_blocks;
};

// True when key block kb is fully visible to query block qb (the diagonal is not listed: it is
// causal, see visible_token).
JACOBI_HD bool block_visible(const BlockTable& t, int qb, int kb) {
  for (int i = t.kv_ptr[qb]; i < t.kv_ptr[qb + 1]; ++i) {
    if (t.kv_idx[i] == kb) return true;
    if (t.kv_idx[i] > kb) return false;
  }
  return false;
}

// Token-level rule, given the blocks of query q and key k.
JACOBI_HD bool visible_token(const BlockTable& t, int q, int qb, int k, int kb) {
  return kb == qb ? k <= q : (kb < qb && block_visible(t, qb, kb));
}

// ---- The Jacobi Forcing family ------------------------------------------------------------------
// Packed sequence [prompt P][noisy_0 n][clean_0 n]...[noisy_{T-1} n][clean_{T-1} n].
// Blocks: 0 = prompt (present iff P > 0), then noisy_j and clean_j alternate.
enum class JfVariant : int32_t { noisy_context = 0, clean_context = 1, windowed = 2 };
enum class JfKind : int32_t { prompt = 0, noisy = 1, clean = 2 };

struct JfLayout {
  int32_t prompt_len;  // P >= 0
  int32_t block_size;  // n >= 1
  int32_t num_pairs;   // T >= 0
  JfVariant variant;
  int32_t window;      // w >= 1, for windowed (pairs per window)

  JACOBI_HD int32_t num_blocks() const { return (prompt_len > 0 ? 1 : 0) + 2 * num_pairs; }
  JACOBI_HD int32_t seq_len() const { return prompt_len + 2 * num_pairs * block_size; }
  // Block b -> kind and pair index j (j = -1 for the prompt).
  JACOBI_HD JfKind kind(int32_t b) const {
    const int32_t r = b - (prompt_len > 0 ? 1 : 0);
    return r < 0 ? JfKind::prompt : (r % 2 == 0 ? JfKind::noisy : JfKind::clean);
  }
  JACOBI_HD int32_t pair(int32_t b) const {
    const int32_t r = b - (prompt_len > 0 ? 1 : 0);
    return r < 0 ? -1 : r / 2;
  }
  JACOBI_HD int32_t block_start(int32_t b) const {
    if (prompt_len > 0 && b == 0) return 0;
    const int32_t r = b - (prompt_len > 0 ? 1 : 0);
    return prompt_len + r * block_size;
  }
  // The first pair whose noisy block a noisy query of pair j sees (earlier pairs: clean blocks).
  JACOBI_HD int32_t noisy_window_start(int32_t j) const {
    switch (variant) {
      case JfVariant::noisy_context:
        return 0;
      case JfVariant::clean_context:
        return j;
      default:
        return (j / window) * window;
    }
  }
  // docs/method.md §1 off the diagonal (kb < qb): is key block kb fully visible to query block qb?
  JACOBI_HD bool block_visible(int32_t qb, int32_t kb) const {
    if (kb >= qb) return false;
    const JfKind kk = kind(kb);
    if (kk == JfKind::prompt) return true;
    const JfKind qk = kind(qb);
    const int32_t jk = pair(kb);
    if (qk == JfKind::clean) return kk == JfKind::clean;
    // noisy query of pair j: clean blocks of pairs < i0, noisy blocks of pairs in [i0, j)
    const int32_t i0 = noisy_window_start(pair(qb));
    return kk == JfKind::clean ? jk < i0 : jk >= i0;
  }
};

}  // namespace jacobi
