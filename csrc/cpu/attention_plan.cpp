// Tiling and tile-pair classification for the block-causal attention (integer bookkeeping,
// O(S/tile * blocks) per call: compiled once, no vector ISA to pick).
#include <algorithm>

#include "cpu/attention_cpu.h"

namespace jacobi::cpu {
namespace {

// Tile boundaries: consecutive whole blocks are merged while they fit in `tile` tokens; a block
// longer than `tile` is cut into near-equal slices. Tiles never straddle a block partially, so a
// tile pair is FULL whenever all its block pairs are.
std::vector<int32_t> make_tiles(const BlockTable& t, int64_t seq_len, int tile) {
  std::vector<int32_t> st{0};
  int64_t open = 0, pos = 0;
  for (int b = 0; b < t.num_blocks; ++b) {
    const int64_t s = t.block_start[b], e = t.block_start[b + 1];
    if (e == s) continue;
    if (e - open <= tile) {
      pos = e;
      continue;
    }
    if (pos > open) {
      st.push_back(static_cast<int32_t>(pos));
      open = pos;
    }
    const int64_t len = e - s;
    if (len > tile) {
      const int64_t pieces = (len + tile - 1) / tile;
      for (int64_t i = 1; i < pieces; ++i) st.push_back(static_cast<int32_t>(s + len * i / pieces));
      open = st.back();
    }
    pos = e;
  }
  if (pos > open) st.push_back(static_cast<int32_t>(pos));
  (void)seq_len;
  return st;
}

}  // namespace

AttnPlan make_attn_plan(const BlockTable& t, int64_t seq_len, int q_tile, int k_tile) {
  AttnPlan p;
  p.seq_len = seq_len;
  p.token_block.resize(seq_len);
  for (int b = 0; b < t.num_blocks; ++b)
    for (int32_t i = t.block_start[b]; i < t.block_start[b + 1]; ++i) p.token_block[i] = b;
  p.q_start = make_tiles(t, seq_len, q_tile);
  p.k_start = make_tiles(t, seq_len, k_tile);
  const int nq = p.num_q_tiles(), nk = p.num_k_tiles(), NB = t.num_blocks;
  p.q_cost.assign(nq, 0);
  p.k_cost.assign(nk, 0);
  p.fwd_ptr.assign(1, 0);

  // vis[(qb - qa) * NB + kb]: key block kb is fully visible to query block qb (off-diagonal).
  std::vector<uint8_t> vis;
  for (int qt = 0; qt < nq; ++qt) {
    const int32_t r0 = p.q_start[qt], r1 = p.q_start[qt + 1];
    const int qa = p.token_block[r0], qz = p.token_block[r1 - 1];
    vis.assign(static_cast<size_t>(qz - qa + 1) * NB, 0);
    for (int qb = qa; qb <= qz; ++qb)
      for (int i = t.kv_ptr[qb]; i < t.kv_ptr[qb + 1]; ++i)
        vis[static_cast<size_t>(qb - qa) * NB + t.kv_idx[i]] = 1;
    for (int kt = 0; kt < nk && p.k_start[kt] < r1; ++kt) {
      const int32_t c0 = p.k_start[kt], c1 = p.k_start[kt + 1];
      const int ka = p.token_block[c0], kz = p.token_block[c1 - 1];
      bool any_full = false, any_empty = false, any_partial = false;
      for (int qb = qa; qb <= qz; ++qb) {
        const int32_t R0 = std::max(r0, t.block_start[qb]),
                      R1 = std::min(r1, t.block_start[qb + 1]);
        if (R0 >= R1) continue;
        for (int kb = ka; kb <= kz; ++kb) {
          const int32_t C0 = std::max(c0, t.block_start[kb]),
                        C1 = std::min(c1, t.block_start[kb + 1]);
          if (C0 >= C1) continue;
          if (kb == qb) {
            // Causal inside the diagonal block: full if every key precedes every query.
            if (C1 - 1 <= R0) {
              any_full = true;
            } else if (C0 > R1 - 1) {
              any_empty = true;
            } else {
              any_partial = true;
            }
          } else if (kb < qb && vis[static_cast<size_t>(qb - qa) * NB + kb]) {
            any_full = true;
          } else {
            any_empty = true;
          }
        }
      }
      if (!any_full && !any_partial) continue;
      p.fwd_kt.push_back(kt);
      p.fwd_partial.push_back(any_partial || any_empty ? 1 : 0);
      const int64_t cost = static_cast<int64_t>(r1 - r0) * (c1 - c0);
      p.q_cost[qt] += cost;
      p.k_cost[kt] += cost;
    }
    p.fwd_ptr.push_back(static_cast<int32_t>(p.fwd_kt.size()));
  }

  // Transpose (query tiles in ascending order within each key tile).
  p.bwd_ptr.assign(nk + 1, 0);
  for (int32_t kt : p.fwd_kt) ++p.bwd_ptr[kt + 1];
  for (int j = 0; j < nk; ++j) p.bwd_ptr[j + 1] += p.bwd_ptr[j];
  p.bwd_qt.resize(p.fwd_kt.size());
  p.bwd_partial.resize(p.fwd_kt.size());
  std::vector<int32_t> fill(p.bwd_ptr.begin(), p.bwd_ptr.end() - 1);
  for (int qt = 0; qt < nq; ++qt) {
    for (int i = p.fwd_ptr[qt]; i < p.fwd_ptr[qt + 1]; ++i) {
      const int32_t pos = fill[p.fwd_kt[i]]++;
      p.bwd_qt[pos] = qt;
      p.bwd_partial[pos] = p.fwd_partial[i];
    }
  }
  return p;
}

}  // namespace jacobi::cpu
