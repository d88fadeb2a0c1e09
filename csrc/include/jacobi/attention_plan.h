// Work plan of the block-causal attention kernels: a token permutation into "stream order" and a
// per-(query tile, key tile) classification {empty, full, partial}.
//
// Torch-free, header-only, __host__ __device__: the CUDA kernels build the plan on the device with
// these functions, and the CPU debug op jacobi_ext::debug_tile_plan runs the very same code so
// that Python tests can check it against a dense mask without a GPU.
//
// Why a permutation. In the packed JF layout [prompt][noisy_0][clean_0][noisy_1]... blocks of
// n = 16..64 tokens alternate between two streams, so a 64- or 128-row tile straddles a noisy and
// a clean block and every off-diagonal tile is half visible: a kernel tiled over the original
// order computes twice the useful FLOPs and masks every tile. Visibility only depends on blocks
// (block_table.h), so the kernels may process tokens in any order as long as each token keeps its
// own identity: they gather rows of q/k/v through `perm` and scatter out/lse/grads back. We order
// blocks so that blocks that see each other's context are adjacent:
//   pred(b)   = the last fully visible key block of b (max of its kv_idx row), or none;
//   the pred links form a forest (pred(b) < b); heavy(p) = the child of p with the tallest
//   subtree (ties: lowest index); chains follow heavy links; chains are emitted in the order of
//   their head block.
// For the JF family this yields, with no knowledge of JF:
//   noisy_context: prompt, noisy_0..noisy_{T-1}, clean_0..clean_{T-1}  (two causal streams)
//   clean_context: prompt, clean_0..clean_{T-1}, noisy_0, ..., noisy_{T-1}
//   windowed(w):   prompt, clean stream, noisy stream
// so tiles become full or empty except on the diagonal and at stream boundaries. Any block table
// stays correct: the permutation only changes which tiles are partial, never the result.
#pragma once

#include <cstdint>

#include "jacobi/block_table.h"

namespace jacobi::attn {

// Granularity of the plan (rows and columns); kernel tiles are multiples of it.
constexpr int kPlanTile = 64;

enum TileClass : uint8_t { kTileEmpty = 0, kTileFull = 1, kTilePartial = 2 };

// Combining the classes of two sub-tiles into the class of their union.
JACOBI_HD uint8_t combine_class(uint8_t a, uint8_t b) { return a == b ? a : uint8_t(kTilePartial); }

JACOBI_HD int32_t ceil_div(int32_t a, int32_t b) { return (a + b - 1) / b; }

// Fully visible key block kb of query block qb (off the diagonal)? Binary search of the CSR row
// (kv_idx ascending): the kernels call this on partial tiles, where rows can be long (a noisy block
// of clean_context lists every earlier clean block).
JACOBI_HD bool block_visible_bsearch(const BlockTable& t, int32_t qb, int32_t kb) {
  int32_t lo = t.kv_ptr[qb], hi = t.kv_ptr[qb + 1];
  while (lo < hi) {
    const int32_t mid = (lo + hi) >> 1;
    const int32_t v = t.kv_idx[mid];
    if (v == kb) return true;
    if (v < kb) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return false;
}

// The last fully visible key block of qb, or -1. Defensive against malformed rows (an entry >= qb
// would break the forest; the kernels stay memory-safe, the order is just not improved).
JACOBI_HD int32_t block_pred(const BlockTable& t, int32_t b) {
  const int32_t e = t.kv_ptr[b + 1];
  if (e <= t.kv_ptr[b]) return -1;
  const int32_t p = t.kv_idx[e - 1];
  return (p >= 0 && p < b) ? p : -1;
}

// Block order (heavy-path chains, see the file comment). Sequential, O(num_blocks).
// scratch: 2 * num_blocks ints. order: num_blocks ints, a permutation of [0, num_blocks).
JACOBI_HD void plan_block_order(const BlockTable& t, int32_t* order, int32_t* scratch) {
  const int32_t nb = t.num_blocks;
  int32_t* height = scratch;
  int32_t* heavy = scratch + nb;
  for (int32_t b = 0; b < nb; ++b) {
    height[b] = 1;
    heavy[b] = -1;
  }
  for (int32_t b = nb - 1; b >= 0; --b) {
    const int32_t p = block_pred(t, b);
    if (p >= 0 && height[b] + 1 > height[p]) height[p] = height[b] + 1;
  }
  for (int32_t b = 0; b < nb; ++b) {
    const int32_t p = block_pred(t, b);
    if (p >= 0 && (heavy[p] < 0 || height[b] > height[heavy[p]])) heavy[p] = b;
  }
  int32_t out = 0;
  for (int32_t b = 0; b < nb; ++b) {
    const int32_t p = block_pred(t, b);
    if (p >= 0 && heavy[p] == b) continue;  // emitted inside its parent's chain
    for (int32_t x = b; x >= 0 && out < nb; x = heavy[x]) order[out++] = x;
  }
}

// Start of each block in permuted order: pstart[i] = sum of the sizes of order[0..i).
// pstart has num_blocks + 1 entries; pstart[num_blocks] = tokens covered by blocks (<= seq_len).
JACOBI_HD void plan_block_starts(const BlockTable& t, const int32_t* order, int32_t* pstart) {
  int32_t acc = 0;
  for (int32_t i = 0; i < t.num_blocks; ++i) {
    pstart[i] = acc;
    acc += t.block_start[order[i] + 1] - t.block_start[order[i]];
  }
  pstart[t.num_blocks] = acc;
}

// Permuted position p -> (original token, original block). Tokens at or past the end of the last
// block (a table that does not cover the sequence) keep their place at the end with block -1: they
// see nothing and nobody sees them (output 0, lse -inf).
struct PermutedToken {
  int32_t token;
  int32_t block;
};

// Index i into `order` of the permuted block holding permuted position p < pstart[num_blocks]
// (binary search; empty blocks share a start with their successor and are skipped).
JACOBI_HD int32_t plan_block_index(const int32_t* pstart, int32_t nb, int32_t p) {
  int32_t lo = 0, hi = nb - 1;  // last i with pstart[i] <= p
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) >> 1;
    if (pstart[mid] <= p) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  while (lo + 1 < nb && pstart[lo + 1] <= p) ++lo;
  return lo;
}

JACOBI_HD PermutedToken plan_token(const BlockTable& t, const int32_t* order, const int32_t* pstart,
                                   int32_t p) {
  const int32_t nb = t.num_blocks;
  if (p >= pstart[nb]) {
    const int32_t covered = nb > 0 ? t.block_start[nb] : 0;
    return {covered + (p - pstart[nb]), -1};
  }
  const int32_t i = plan_block_index(pstart, nb, p);
  const int32_t b = order[i];
  return {t.block_start[b] + (p - pstart[i]), b};
}

// Class of the rectangle of permuted rows [r0, r0 + rows) x columns [c0, c0 + cols). Rows at or
// past seq_len do not exist (never stored) and are ignored; columns past seq_len are invisible, so
// a rectangle that overhangs the end is partial unless it is empty.
// Work: (blocks in the rows) x (blocks in the columns) pair tests, each O(log row length).
JACOBI_HD uint8_t plan_classify_rect(const BlockTable& t, const int32_t* order,
                                     const int32_t* pstart, int32_t seq_len, int32_t r0,
                                     int32_t rows, int32_t c0, int32_t cols) {
  const int32_t nb = t.num_blocks;
  const int32_t covered = pstart[nb];
  const int32_t r1 = r0 + rows < seq_len ? r0 + rows : seq_len;
  const int32_t c1e = c0 + cols;
  const int32_t c1 = c1e < seq_len ? c1e : seq_len;
  bool any_vis = false, any_hidden = c1e > seq_len;
  // Segments [a, e) of the row and column ranges that lie in one permuted block each.
  // Uncovered tail tokens (block -1) are hidden from everyone.
  if (r1 > covered && r0 < r1) any_hidden = true;
  if (c1 > covered && c0 < c1) any_hidden = true;
  const int32_t rend = r1 < covered ? r1 : covered;
  const int32_t cend = c1 < covered ? c1 : covered;
  if (r0 < rend && c0 < cend) {
    for (int32_t qi = plan_block_index(pstart, nb, r0); qi < nb && pstart[qi] < rend; ++qi) {
      if (pstart[qi + 1] <= pstart[qi]) continue;  // empty block
      const int32_t qa = pstart[qi] > r0 ? pstart[qi] : r0;
      const int32_t qe = pstart[qi + 1] < rend ? pstart[qi + 1] : rend;
      const int32_t qb = order[qi];
      for (int32_t ki = plan_block_index(pstart, nb, c0); ki < nb && pstart[ki] < cend; ++ki) {
        if (pstart[ki + 1] <= pstart[ki]) continue;
        const int32_t ka = pstart[ki] > c0 ? pstart[ki] : c0;
        const int32_t ke = pstart[ki + 1] < cend ? pstart[ki + 1] : cend;
        const int32_t kb = order[ki];
        if (kb == qb) {
          // Same block, same relative order: causal on offsets within the block.
          const int32_t q_lo = qa - pstart[qi], q_hi = qe - 1 - pstart[qi];
          const int32_t k_lo = ka - pstart[ki], k_hi = ke - 1 - pstart[ki];
          if (k_hi <= q_lo) {
            any_vis = true;
          } else if (k_lo > q_hi) {
            any_hidden = true;
          } else {
            any_vis = any_hidden = true;
          }
        } else if (kb < qb && block_visible_bsearch(t, qb, kb)) {
          any_vis = true;
        } else {
          any_hidden = true;
        }
        if (any_vis && any_hidden) return kTilePartial;
      }
    }
  }
  if (!any_vis) return kTileEmpty;
  return any_hidden ? uint8_t(kTilePartial) : uint8_t(kTileFull);
}

// The visible columns of permuted query row p among permuted columns [c0, c1), as bits: bit
// (c - c0) % 32 of words[(c - c0) / 32] is set iff p may attend c (the table's rule in permuted
// coordinates: tokens outside every block see and are seen by nothing; inside one block, key
// offset <= query offset; across blocks, the key block listed for the query block); the words
// must start zeroed. Walks the column range one permuted block at a time, as plan_classify_rect
// does: O(blocks in the range) per row, not a token lookup per column.
JACOBI_HD void plan_row_mask(const BlockTable& t, const int32_t* order, const int32_t* pstart,
                             int32_t seq_len, int32_t p, int32_t c0, int32_t c1, uint32_t* words) {
  const int32_t nb = t.num_blocks;
  const int32_t covered = pstart[nb];
  if (p >= seq_len || p >= covered) return;  // no such row, or an uncovered token: sees nothing
  int32_t cend = c1 < seq_len ? c1 : seq_len;
  cend = cend < covered ? cend : covered;  // uncovered columns are hidden from everyone
  if (c0 >= cend) return;
  const int32_t qi = plan_block_index(pstart, nb, p);
  const int32_t qb = order[qi], q_off = p - pstart[qi];
  for (int32_t ki = plan_block_index(pstart, nb, c0); ki < nb && pstart[ki] < cend; ++ki) {
    if (pstart[ki + 1] <= pstart[ki]) continue;  // empty block
    const int32_t ka = pstart[ki] > c0 ? pstart[ki] : c0;
    const int32_t ke = pstart[ki + 1] < cend ? pstart[ki + 1] : cend;
    const int32_t kb = order[ki];
    int32_t hi = ke;  // visible columns: [ka, hi)
    if (kb == qb) {
      const int32_t last = pstart[ki] + q_off + 1;  // k offset <= q offset
      hi = last < ke ? last : ke;
    } else if (!(kb < qb && block_visible_bsearch(t, qb, kb))) {
      continue;
    }
    for (int32_t c = ka - c0; c < hi - c0;) {
      const int32_t w = c >> 5, b = c & 31;
      const int32_t n = (hi - c0 - c) < (32 - b) ? (hi - c0 - c) : (32 - b);
      words[w] |= (n == 32 ? ~0u : ((1u << n) - 1u)) << b;
      c += n;
    }
  }
}

// Class of the (query tile i, key tile j) pair at kPlanTile granularity (the sm_80 kernels).
JACOBI_HD uint8_t plan_classify_tile(const BlockTable& t, const int32_t* order,
                                     const int32_t* pstart, int32_t seq_len, int32_t i,
                                     int32_t j) {
  return plan_classify_rect(t, order, pstart, seq_len, i * kPlanTile, kPlanTile, j * kPlanTile,
                            kPlanTile);
}

}  // namespace jacobi::attn
