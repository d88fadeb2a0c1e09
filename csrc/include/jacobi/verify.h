// The verify-accept-recycle step of Jacobi / multi-block decoding (docs/method.md §4-§5), once.
//
// Torch-free and header-only: the CPU op (csrc/cpu/verify_cpu.cpp) and the CUDA kernel
// (csrc/cuda/verify_cuda.cu) both call verify_step(), so they cannot disagree. The Python
// reference (jacobi_ext/decoding/reference.py) restates the same rules in plain Python and the
// tests compare all of them.
//
// One decoding step has run the model over R packed rows that all continue the committed prefix:
//   row 0      the main row: the blocks in flight, concatenated. Its first token is the seed (the
//              greedy token after the committed prefix, always correct); block b ends at
//              block_ends[b] (row offsets; the first block is the real-active one, the others are
//              pseudo-active blocks drafted behind it).
//   rows 1..   recycling candidates: alternatives for the first block only, each starting with the
//              same seed, of length block_ends[0] (0 = no candidate in that row).
// greedy[r][i] is the model's argmax after row r's token i (it predicts token i+1).
//
// The step:
//   1. Acceptance: a_r = 1 + the longest prefix with tokens[r][i+1] == greedy[r][i], capped at
//      the first EOS (inclusive). The main row's prefix runs across block boundaries: a pseudo
//      block whose predecessors were all accepted attended to exact context, so its matching
//      tokens are exact too (this is "promotion + re-verification" without an extra forward).
//   2. Winner: the row with the largest a_r; ties go to the lowest row (the main row first).
//      Commit tokens[w][0:a]; the caller moves their K/V into place if w > 0 and truncates the
//      cache after them. Nothing else is committed.
//   3. Next main row: the Jacobi update — every uncommitted position takes the greedy token of
//      the position before it, from the winner row while inside it, from the main row after it.
//      Blocks keep their absolute extents; fully committed blocks leave.
//   4. Spawn: if fewer than max_blocks blocks are in flight and the newest block has converged
//      at least spawn_threshold tokens (committed + locally accepted), or nothing is left in
//      flight, append a block of block_size tokens: its first is the greedy token after the last
//      one in flight, the others come from init_tokens (sampled by the caller from the context).
//   5. Recycling pool: the winner row's rejected draft tail tokens[w][a:len_w] (when it holds at
//      least two tokens) replaces the oldest pool entry. Candidates for the next step: for each
//      pool entry, its suffix from the first occurrence of the next seed, cut to the next first
//      block's length and padded with the next main row's tokens; entries without the seed, or
//      whose suffix holds only the seed, or that equal the main row's first block give none.
//
// A batch of B sequences is B such steps side by side, sharing the sizes and knobs (VerifyShape)
// and laid out with a leading batch dimension (verify_args_at). Sequence b takes part when its
// main row is non-empty (row_len[b][0] >= 1); otherwise (finished, or decoding as AR this step)
// its outputs are the neutral values of verify_inactive and its pool is left as it was, so one
// launch serves the whole batch with fixed-shape outputs.
#pragma once

#include <cstdint>

#include "jacobi/hd.h"
#include "jacobi/step_row.h"

namespace jacobi {

// 1 + longest prefix with tokens[i+1] == greedy[i] over tokens[0:len], capped at the first EOS
// (inclusive). eos < 0 means none. len >= 1. (step_row.h: the rule, for one EOS id.)
template <typename Tok>
JACOBI_HD int accepted_length(const Tok* tokens, const Tok* greedy, int len, int64_t eos) {
  return accepted_length_if(tokens, greedy, len, OneEos{eos});
}

// Problem sizes and knobs of one step. All tensors are dense, row-major.
struct VerifyShape {
  int rows;             // R: 1 + candidate rows
  int width;            // W: row stride of tokens / greedy (>= main row length)
  int max_blocks;       // K: blocks in flight at most; block_ends has K entries
  int block_size;       // n
  int spawn_threshold;  // ceil(r * n)
  int pool_size;        // p: pool rows (0 disables recycling)
  int pool_width;       // pool row stride (entries hold at most this many tokens)
  int64_t eos;          // < 0: none
};

// Pointers of one step. Inputs are read-only except pool/pool_len/pool_head (updated in place).
template <typename Tok>
struct VerifyArgs {
  const Tok* tokens;         // [R, W]
  const Tok* greedy;         // [R, W]
  const int32_t* row_len;    // [R]   row 0: main length; others: 0 or block_ends[0]
  const int32_t* block_ends; // [K]   cumulative ends in the main row; entries past the blocks in flight are 0
  const Tok* init_tokens;    // [n]   draft tokens for a spawned block (index 0 unused)
  Tok* pool;                 // [p, pool_width]
  int32_t* pool_len;         // [p]
  int32_t* pool_head;        // [1]   next pool row to overwrite
  // outputs
  int32_t* accept;           // [R]
  int64_t* summary;          // [kSummarySize]
  Tok* commit;               // [W]   tokens[w][0:a], rest filled with -1
  Tok* next_tokens;          // [W + n] next main row, rest -1
  int32_t* next_block_ends;  // [K]
  Tok* candidates;           // [p, n] next candidate rows, rest -1
  int32_t* candidate_len;    // [p]
};

// Phase 1 (parallel over rows on the GPU): acceptance of row r.
template <typename Tok>
JACOBI_HD void verify_accept_row(const VerifyShape& s, const VerifyArgs<Tok>& a, int r) {
  const int len = a.row_len[r];
  a.accept[r] = len > 0 ? accepted_length(a.tokens + static_cast<int64_t>(r) * s.width,
                                          a.greedy + static_cast<int64_t>(r) * s.width, len, s.eos)
                        : 0;
}

// Phase 2 (one thread): winner, commit, next row, spawn, pool and candidates. Needs every
// accept[r] from phase 1.
template <typename Tok>
JACOBI_HD void verify_finish(const VerifyShape& s, const VerifyArgs<Tok>& a) {
  const int W = s.width, n = s.block_size;
  // -- 2. winner
  int w = 0;
  for (int r = 1; r < s.rows; ++r)
    if (a.accept[r] > a.accept[w]) w = r;
  const int acc = a.accept[w];
  const Tok* tw = a.tokens + static_cast<int64_t>(w) * W;
  const Tok* gw = a.greedy + static_cast<int64_t>(w) * W;
  const Tok* g0 = a.greedy;
  const int len_w = a.row_len[w];
  const int M = a.row_len[0];
  for (int i = 0; i < W; ++i) a.commit[i] = i < acc ? tw[i] : Tok(-1);
  const bool finished = s.eos >= 0 && static_cast<int64_t>(tw[acc - 1]) == s.eos;

  // -- 3. next main row: position p (row offset) takes the greedy token of p-1.
  auto greedy_before = [&](int p) -> Tok { return (p - 1 < len_w) ? gw[p - 1] : g0[p - 1]; };
  int next_len = 0;
  for (int p = acc; p < M; ++p) a.next_tokens[next_len++] = greedy_before(p);
  int nb = 0;
  int nblocks_in = 0;
  while (nblocks_in < s.max_blocks && a.block_ends[nblocks_in] > 0) ++nblocks_in;
  for (int b = 0; b < nblocks_in; ++b) {
    const int e = a.block_ends[b] - acc;
    if (e > 0) a.next_block_ends[nb++] = e;
  }
  // The newest block's converged tokens: committed + locally accepted (a pseudo block counts
  // from its own first token, which is a draft until the blocks before it converge).
  int converged = 0;
  if (nblocks_in > 0) {
    const int start = nblocks_in > 1 ? a.block_ends[nblocks_in - 2] : 0;
    const int end = a.block_ends[nblocks_in - 1];
    if (nblocks_in == 1) {
      converged = (n - end) + (acc < end ? acc : end);
    } else {
      converged = accepted_length(a.tokens + start, g0 + start, end - start, int64_t(-1));
    }
  }
  // -- 4. spawn
  const Tok seed = gw[acc - 1];
  if (!finished && nb < s.max_blocks && (nb == 0 || converged >= s.spawn_threshold)) {
    const Tok first = nb == 0 ? seed : greedy_before(M);
    const int start = next_len;
    a.next_tokens[next_len++] = first;
    for (int i = 1; i < n; ++i) a.next_tokens[next_len++] = a.init_tokens[i];
    a.next_block_ends[nb++] = start + n;
  }
  for (int i = next_len; i < W + n; ++i) a.next_tokens[i] = Tok(-1);
  for (int b = nb; b < s.max_blocks; ++b) a.next_block_ends[b] = 0;

  // -- 5. recycling pool: remember the winner's rejected draft tail, then match the new seed.
  if (s.pool_size > 0 && !finished) {
    const int tail = len_w - acc;
    if (tail >= 2) {
      const int slot = a.pool_head[0];
      Tok* dst = a.pool + static_cast<int64_t>(slot) * s.pool_width;
      const int m = tail < s.pool_width ? tail : s.pool_width;
      for (int i = 0; i < s.pool_width; ++i) dst[i] = i < m ? tw[acc + i] : Tok(-1);
      a.pool_len[slot] = m;
      a.pool_head[0] = (slot + 1) % s.pool_size;
    }
  }
  const int first_len = nb > 0 ? a.next_block_ends[0] : 0;
  int ncand = 0;
  for (int c = 0; c < s.pool_size; ++c) {
    Tok* out = a.candidates + static_cast<int64_t>(c) * n;
    int len = 0;
    if (!finished && first_len >= 2) {
      const Tok* e = a.pool + static_cast<int64_t>(c) * s.pool_width;
      const int le = a.pool_len[c];
      int j = 0;
      while (j < le && e[j] != a.next_tokens[0]) ++j;
      if (j + 1 < le) {  // the seed and at least one proposed token after it
        bool same_as_main = true;
        for (int i = 0; i < first_len; ++i) {
          out[i] = (j + i < le) ? e[j + i] : a.next_tokens[i];
          same_as_main = same_as_main && out[i] == a.next_tokens[i];
        }
        // Duplicates of an earlier candidate are dropped too: they cannot win.
        bool dup = same_as_main;
        for (int c2 = 0; c2 < c && !dup; ++c2) {
          if (a.candidate_len[c2] != first_len) continue;
          const Tok* o = a.candidates + static_cast<int64_t>(c2) * n;
          bool eq = true;
          for (int i = 0; i < first_len && eq; ++i) eq = o[i] == out[i];
          dup = eq;
        }
        if (!dup) len = first_len;
      }
    }
    for (int i = len; i < n; ++i) out[i] = Tok(-1);
    a.candidate_len[c] = len;
    ncand += len > 0;
  }

  a.summary[kWinner] = w;
  a.summary[kAccepted] = acc;
  a.summary[kFinished] = finished ? 1 : 0;
  a.summary[kNextLen] = next_len;
  a.summary[kNextBlocks] = nb;
  a.summary[kNextSeed] = next_len > 0 ? static_cast<int64_t>(a.next_tokens[0]) : static_cast<int64_t>(seed);
  a.summary[kNumCandidates] = ncand;
  a.summary[kReserved] = 0;
}

// Sequence b's view of a batch: every tensor of VerifyArgs with a leading batch dimension
// ([B, R, W] tokens and greedy, [B, R] row_len, [B, K] block_ends, [B, n] init_tokens,
// [B, p, pool_width] pool, [B, p] pool_len, [B, 1] pool_head; outputs [B, R] accept,
// [B, kSummarySize] summary, [B, W] commit, [B, W + n] next_tokens, [B, K] next_block_ends,
// [B, p, n] candidates, [B, p] candidate_len), dense and row-major.
template <typename Tok>
JACOBI_HD VerifyArgs<Tok> verify_args_at(const VerifyShape& s, const VerifyArgs<Tok>& a, int b) {
  const int64_t B = b, R = s.rows, W = s.width, K = s.max_blocks, n = s.block_size;
  const int64_t p = s.pool_size;
  VerifyArgs<Tok> o;
  o.tokens = a.tokens + B * R * W;
  o.greedy = a.greedy + B * R * W;
  o.row_len = a.row_len + B * R;
  o.block_ends = a.block_ends + B * K;
  o.init_tokens = a.init_tokens + B * n;
  o.pool = a.pool + B * p * s.pool_width;
  o.pool_len = a.pool_len + B * p;
  o.pool_head = a.pool_head + B;
  o.accept = a.accept + B * R;
  o.summary = a.summary + B * kSummarySize;
  o.commit = a.commit + B * W;
  o.next_tokens = a.next_tokens + B * (W + n);
  o.next_block_ends = a.next_block_ends + B * K;
  o.candidates = a.candidates + B * p * n;
  o.candidate_len = a.candidate_len + B * p;
  return o;
}

// Whether the sequence takes part in this step (its main row is non-empty).
template <typename Tok>
JACOBI_HD bool verify_active(const VerifyArgs<Tok>& a) {
  return a.row_len[0] > 0;
}

// The outputs of a sequence that does not take part: nothing accepted, nothing committed, no
// next row, no blocks, no candidates (summary all 0). Its pool is not touched.
template <typename Tok>
JACOBI_HD void verify_inactive(const VerifyShape& s, const VerifyArgs<Tok>& a) {
  const int W = s.width, n = s.block_size;
  for (int r = 0; r < s.rows; ++r) a.accept[r] = 0;
  for (int i = 0; i < kSummarySize; ++i) a.summary[i] = 0;
  for (int i = 0; i < W; ++i) a.commit[i] = Tok(-1);
  for (int i = 0; i < W + n; ++i) a.next_tokens[i] = Tok(-1);
  for (int b = 0; b < s.max_blocks; ++b) a.next_block_ends[b] = 0;
  for (int c = 0; c < s.pool_size; ++c) {
    for (int i = 0; i < n; ++i) a.candidates[static_cast<int64_t>(c) * n + i] = Tok(-1);
    a.candidate_len[c] = 0;
  }
}

}  // namespace jacobi
