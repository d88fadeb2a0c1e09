// The parallel sequences' side of a decoding step around verify_step, once: the CPU op runs it
// in loops (csrc/torch/verify_ops.cpp), the CUDA kernel with a thread block a sequence
// (csrc/cuda/verify_cuda.cu). The torch statement of the same work is
// jacobi_ext/decoding/step.py: BatchStep._verify_reference, and tests compare them.
//
// Per sequence b, after the step's forward gave its fed tokens toks[b] and their targets tgt[b]
// ([batch, Q]):
//   1. cut: the R rows the verify op checks (row r: row_len[b][r] tokens from row_start[b][r],
//      -1 past them), as tokens and targets [R, wv]; a spawned block's drafts, init[b][j] =
//      ctx[b][init_idx[b][j]];
//   2. verify_step (jacobi/verify.h) over them: a sequence with row_len[b][0] == 0 takes no part;
//   3. finish: for a sequence that took part, its next main row and candidates into src (the
//      step's source buffer: [next main row (wv + n) | candidates (p * n) | host tokens]), its
//      block ends; the committed tokens appended to its context ctx[b] (ctx_len[b] advanced;
//      what is not committed goes to the dump slot ctx_cap); and every sequence's step row
//      (jacobi/step_row.h), the winner row's first query, the tokens committed, taking part.
// Indices read from the plan are clamped to their buffers (a device reads no host check); the
// CPU op checks them first and raises.
#pragma once

#include <cstdint>

#include "jacobi/hd.h"
#include "jacobi/step_row.h"
#include "jacobi/verify.h"

namespace jacobi {

struct VerifyRowsShape {
  int64_t batch, Q;    // sequences; the step's width (toks, tgt: [batch, Q])
  int64_t rows;        // R: rows a sequence may have verified (main, candidates, lookup)
  int64_t wv;          // the verify op's row width (the longest main row: K n)
  int64_t block_size;  // n
  int64_t max_blocks;  // K
  int64_t pool_size;   // p
  int64_t src_stride;  // src's row length (>= wv + n + p n)
  int64_t ctx_cap;     // ctx: [batch, ctx_cap + 1]; slot ctx_cap is the dump
  StepRowLayout row;   // the step rows' layout (row.width >= wv commit slots)
};

struct VerifyRowsArgs {
  // the step: rows of these may be strided (the step's input fields are views of one tensor);
  // *_ld is a row's stride, elements within a row are adjacent
  const int64_t* toks;       // [batch, Q]
  const int64_t* tgt;        // [batch, Q]
  const int64_t* row_start;  // [batch, R]
  const int64_t* row_len;    // [batch, R]
  const int64_t* init_idx;   // [batch, n]
  int64_t toks_ld, tgt_ld, row_start_ld, row_len_ld, init_idx_ld;
  // the sequences' state, updated in place
  int64_t* src;         // [batch, src_stride]
  int32_t* block_ends;  // [batch, K]
  int64_t* ctx;         // [batch, ctx_cap + 1]
  int64_t* ctx_len;     // [batch]
  // verify_step's inputs (cut here) and outputs: VerifyArgs of the batch (verify_args_at)
  VerifyArgs<int64_t> v;
  int64_t* tok_rows;  // (v.tokens, writable)
  int64_t* tgt_rows;  // (v.greedy)
  int32_t* lens;      // (v.row_len)
  int64_t* init;      // (v.init_tokens)
  // results
  int64_t* rows;   // [batch, row.size()]
  int64_t* first;  // [batch] the winner row's first query (its K/V's scratch slot)
  int64_t* count;  // [batch] tokens committed (0 where the sequence took no part)
  bool* part;      // [batch]
};

JACOBI_HD int64_t clamp_index(int64_t i, int64_t lo, int64_t hi) {
  return i < lo ? lo : (i > hi ? hi : i);
}

// Element e < R * wv of sequence b's cut rows: row e / wv, token e % wv.
JACOBI_HD void verify_rows_cut(const VerifyRowsShape& s, const VerifyRowsArgs& a, int64_t b,
                               int64_t e) {
  const int64_t r = e / s.wv, i = e % s.wv, br = b * s.rows + r;
  const int64_t len = a.row_len[b * a.row_len_ld + r];
  const int64_t at = clamp_index(a.row_start[b * a.row_start_ld + r] + i, 0, s.Q - 1);
  const bool in = i < len;
  a.tok_rows[br * s.wv + i] = in ? a.toks[b * a.toks_ld + at] : -1;
  a.tgt_rows[br * s.wv + i] = in ? a.tgt[b * a.tgt_ld + at] : -1;
  if (i == 0) a.lens[br] = static_cast<int32_t>(len);
}

// Draft j < n of a block sequence b may spawn: its context token at init_idx[b][j].
JACOBI_HD void verify_rows_init(const VerifyRowsShape& s, const VerifyRowsArgs& a, int64_t b,
                                int64_t j) {
  const int64_t n = s.block_size;
  const int64_t at = clamp_index(a.init_idx[b * a.init_idx_ld + j], 0, s.ctx_cap);
  a.init[b * n + j] = a.ctx[b * (s.ctx_cap + 1) + at];
}

// After verify_step: sequence b's next state, context and step row (one thread).
JACOBI_HD void verify_rows_finish(const VerifyRowsShape& s, const VerifyRowsArgs& a, int64_t b) {
  const int64_t R = s.rows, wv = s.wv, n = s.block_size, K = s.max_blocks, p = s.pool_size;
  const int64_t cand0 = wv + n;
  const VerifyArgs<int64_t>& v = a.v;
  const int64_t* sm = v.summary + b * kSummarySize;
  const int64_t* commit = v.commit + b * wv;
  const int64_t* nxt = v.next_tokens + b * cand0;
  const int64_t* cands = v.candidates + b * p * n;
  const int32_t* ends = v.next_block_ends + b * K;
  const int32_t* cand_len = v.candidate_len + b * p;
  const int32_t* accept = v.accept + b * R;
  const bool part = a.row_len[b * a.row_len_ld] > 0;
  const int64_t acc = sm[kAccepted];
  if (part) {  // the next step's state (kept where the sequence took no part)
    int64_t* src = a.src + b * s.src_stride;
    for (int64_t i = 0; i < cand0; ++i) src[i] = nxt[i];
    for (int64_t i = 0; i < p * n; ++i) src[cand0 + i] = cands[i];
    for (int64_t i = 0; i < K; ++i) a.block_ends[b * K + i] = ends[i];
  }
  // the committed tokens join the context (the rest of the commit to the dump slot)
  int64_t* ctx = a.ctx + b * (s.ctx_cap + 1);
  for (int64_t i = 0; i < wv; ++i) {
    const int64_t at = part && i < acc ? clamp_index(a.ctx_len[b] + i, 0, s.ctx_cap) : s.ctx_cap;
    ctx[at] = commit[i];
  }
  if (part) a.ctx_len[b] += acc;
  const StepRowLayout& L = s.row;
  int64_t* row = a.rows + b * L.size();
  for (int64_t i = 0; i < kSummarySize; ++i) row[i] = sm[i];
  for (int64_t i = 0; i < L.width; ++i) row[L.commit() + i] = i < wv ? commit[i] : -1;
  for (int64_t i = 0; i < K; ++i) row[L.block_ends() + i] = ends[i];
  for (int64_t i = 0; i < p; ++i) row[L.candidate_len() + i] = cand_len[i];
  for (int64_t i = 0; i < R; ++i) row[L.accept() + i] = accept[i];
  for (int64_t i = 0; i < n; ++i) row[L.next_block() + i] = nxt[i];
  for (int64_t i = 0; i < p * n; ++i) row[L.candidates() + i] = cands[i];
  const int64_t w = clamp_index(sm[kWinner], 0, R - 1);
  a.first[b] = a.row_start[b * a.row_start_ld + w];
  a.count[b] = part ? acc : 0;
  a.part[b] = part;
}

}  // namespace jacobi
