// Per-CTA tile lists of the sm_90a attention: the work plan of attention_plan.h (stream
// order + tile classes) turned into what a warp-specialised kernel walks, at the kernel's own tile
// sizes (e.g. 128 x 128):
//   forward, one CTA per query tile:  the key tiles it must visit, ascending;
//   backward, one CTA per key tile:   the query tiles that see it, ascending;
//   each entry: mask index -1 = fully visible (no mask arithmetic), else the index of a
//   precomputed bit mask of the (query tile, key tile) pair;
//   fully masked pairs are never listed, so their K/V (or Q/dO) tiles are never loaded.
// Coordinates are permuted positions (plan_token maps them to tokens and blocks).
//
// Torch-free, header-only, __host__ __device__: the op's host side builds the lists once per block
// table (jacobi_ext::attention_tile_lists, CPU), the kernels consume them with the helpers at the
// end. Visibility comes from attention_plan.h / block_table.h only; nothing here restates it.
//
// Mask layout: masks[m] is tile_m rows x (tile_n / 32) uint32 words, row-major; bit (c % 32) of word
// c / 32 of row r is set iff permuted query r0 + r may attend permuted key c0 + c. Rows and columns
// past seq_len are 0.
#pragma once

#include <cstdint>

#include "jacobi/attention_plan.h"

namespace jacobi::attn {

// The plan's block order and permuted block starts, in caller-provided memory (nb, 2 nb, nb + 1).
struct StreamOrder {
  const int32_t* order;
  const int32_t* pstart;
};

JACOBI_HD int32_t mask_words(int32_t tile_n) { return tile_n / 32; }

// Pass 1: the class of every (query tile, key tile) pair, row-major [nq, nk], and the counts that
// size the lists. Returns the number of listed pairs; *num_partial gets the number of masks.
JACOBI_HD int32_t tile_classes(const BlockTable& t, StreamOrder so, int32_t seq_len, int32_t tile_m,
                               int32_t tile_n, uint8_t* cls, int32_t* num_partial) {
  const int32_t nq = ceil_div(seq_len, tile_m), nk = ceil_div(seq_len, tile_n);
  int32_t listed = 0, partial = 0;
  for (int32_t i = 0; i < nq; ++i) {
    for (int32_t j = 0; j < nk; ++j) {
      const uint8_t c =
          plan_classify_rect(t, so.order, so.pstart, seq_len, i * tile_m, tile_m, j * tile_n, tile_n);
      cls[int64_t(i) * nk + j] = c;
      listed += c != kTileEmpty;
      partial += c == kTilePartial;
    }
  }
  *num_partial = partial;
  return listed;
}

// Pass 2: the lists (CSR) from the classes. fwd_ptr [nq + 1], fwd_tile / fwd_mask [listed];
// bwd_ptr [nk + 1], bwd_tile / bwd_mask [listed]. Masks are numbered in forward order
// (query tile major), and a pair has the same mask index in both lists.
JACOBI_HD void tile_lists(const uint8_t* cls, int32_t nq, int32_t nk, int32_t* fwd_ptr,
                          int32_t* fwd_tile, int32_t* fwd_mask, int32_t* bwd_ptr,
                          int32_t* bwd_tile, int32_t* bwd_mask) {
  int32_t n = 0, m = 0;
  for (int32_t j = 0; j <= nk; ++j) bwd_ptr[j] = 0;
  fwd_ptr[0] = 0;
  for (int32_t i = 0; i < nq; ++i) {
    for (int32_t j = 0; j < nk; ++j) {
      const uint8_t c = cls[int64_t(i) * nk + j];
      if (c == kTileEmpty) continue;
      fwd_tile[n] = j;
      fwd_mask[n] = c == kTilePartial ? m++ : -1;
      ++bwd_ptr[j + 1];
      ++n;
    }
    fwd_ptr[i + 1] = n;
  }
  for (int32_t j = 0; j < nk; ++j) bwd_ptr[j + 1] += bwd_ptr[j];
  // Transpose: query tiles ascending within each key tile (forward order is query-major).
  for (int32_t i = 0; i < nq; ++i) {
    for (int32_t e = fwd_ptr[i]; e < fwd_ptr[i + 1]; ++e) {
      const int32_t j = fwd_tile[e];
      // bwd_ptr[j] is used as the fill cursor of column j and restored below.
      const int32_t pos = bwd_ptr[j]++;
      bwd_tile[pos] = i;
      bwd_mask[pos] = fwd_mask[e];
    }
  }
  for (int32_t j = nk; j > 0; --j) bwd_ptr[j] = bwd_ptr[j - 1];
  bwd_ptr[0] = 0;
}

// The bit mask of one pair (see the file comment); words: tile_m * mask_words(tile_n).
JACOBI_HD void tile_mask(const BlockTable& t, StreamOrder so, int32_t seq_len, int32_t tile_m,
                         int32_t tile_n, int32_t i, int32_t j, uint32_t* words) {
  const int32_t wpr = mask_words(tile_n);
  for (int32_t r = 0; r < tile_m; ++r) {
    uint32_t* row = words + int64_t(r) * wpr;
    for (int32_t w = 0; w < wpr; ++w) row[w] = 0;
    plan_row_mask(t, so.order, so.pstart, seq_len, i * tile_m + r, j * tile_n, (j + 1) * tile_n,
                  row);
  }
}

// ---- consumer side -------------------------------------------------------------------------------
// What a kernel holds: the lists and masks of one (tile_m, tile_n) plan, device pointers.
struct TileLists {
  const int32_t* fwd_ptr;
  const int32_t* fwd_tile;
  const int32_t* fwd_mask;
  const int32_t* bwd_ptr;
  const int32_t* bwd_tile;
  const int32_t* bwd_mask;
  const uint32_t* masks;
  int32_t num_q_tiles, num_k_tiles, tile_m, tile_n;
};

// May query row r of the pair attend key column c (tile-relative)? mask < 0: fully visible.
JACOBI_HD bool tile_visible(const TileLists& l, int32_t mask, int32_t r, int32_t c) {
  if (mask < 0) return true;
  const int32_t wpr = mask_words(l.tile_n);
  const uint32_t w = l.masks[(int64_t(mask) * l.tile_m + r) * wpr + c / 32];
  return (w >> (c % 32)) & 1u;
}

// The entry of key tile j in the forward list of query tile i, or -1 (never loaded).
JACOBI_HD int32_t find_entry(const TileLists& l, int32_t i, int32_t j) {
  for (int32_t e = l.fwd_ptr[i]; e < l.fwd_ptr[i + 1]; ++e) {
    if (l.fwd_tile[e] == j) return e;
    if (l.fwd_tile[e] > j) break;
  }
  return -1;
}

// The turn of key tile j among the key tiles that see query tile i (0 = the lowest listed key
// tile), or -1 if j does not see i. The sm_90a backward's deterministic dQ adds each query tile's
// partial sums in this order: the key tiles that list query tile i in their backward lists are
// exactly the entries of i's forward list (tile_lists transposes one into the other), ascending.
JACOBI_HD int32_t dq_turn(const TileLists& l, int32_t i, int32_t j) {
  const int32_t e = find_entry(l, i, j);
  return e < 0 ? -1 : e - l.fwd_ptr[i];
}

// What the forward kernel computes for permuted query p and key c, walking the lists as it will:
// visible iff the pair's tile is listed and, if partial, its mask bit is set. The debug expansion
// (jacobi_ext::debug_expand_tile_lists) runs this for every (p, c), on the CPU and on the GPU.
JACOBI_HD bool listed_visible(const TileLists& l, int32_t p, int32_t c) {
  const int32_t e = find_entry(l, p / l.tile_m, c / l.tile_n);
  return e >= 0 && tile_visible(l, l.fwd_mask[e], p % l.tile_m, c % l.tile_n);
}

}  // namespace jacobi::attn
