// The packed result row of a decoding step, and AR acceptance: declared once.
//
// A step ends with one int64 row per sequence, the only thing the host reads back (one copy for
// the whole batch). Its layout, for a step of `width` commit slots (the runtime's scratch), K
// blocks, p pool rows, R verified rows and blocks of n tokens:
//
//   [summary (kSummarySize) | commit (width) | block ends (K) | candidate lengths (p) |
//    acceptances (R) | next first block (n) | candidates (p * n)]
//
// summary: the fields of StepSummary; commit: the tokens committed, then -1; the rest is the verify
// op's next state (jacobi/verify.h), zeros for an AR row. Who writes it: the verify_rows and
// ar_accept ops (jacobi/verify_rows.h and ar_step_row below, on the CPU and in CUDA kernels); their
// torch restatements in jacobi_ext/decoding/step.py (*_reference, compared with the ops by the
// tests). Who reads it: the host (jacobi_ext/decoding/sequence.py). Python reads the layout from
// here through the step_summary_fields and step_row_layout ops (jacobi_ext/decoding/step_row.py),
// so neither side restates it.
//
// Torch-free and header-only, like verify.h: the CPU ops and the CUDA kernels include it.
#pragma once

#include <cstdint>

#include "jacobi/hd.h"

namespace jacobi {

// Indices into a step row's summary (and into verify_step's "summary" output, the same fields).
enum StepSummary : int {
  kWinner = 0,         // winning row
  kAccepted = 1,       // tokens committed this step (a >= 1)
  kFinished = 2,       // 1 if the committed tokens end with EOS
  kNextLen = 3,        // length of the next main row
  kNextBlocks = 4,     // blocks in flight in the next main row
  kNextSeed = 5,       // first token of the next main row (the next committed token)
  kNumCandidates = 6,  // candidate rows with a non-zero length for the next step
  kReserved = 7,       // 0 (keeps the summary 64 bytes)
  kSummarySize = 8,
};

// The summary's field names in index order, comma-separated (exported to Python).
inline constexpr const char* kStepSummaryFields =
    "winner,accepted,finished,next_len,next_blocks,next_seed,num_candidates,reserved";

// Offsets of a step row's parts (see the top of this file).
struct StepRowLayout {
  int64_t width, max_blocks, pool_size, rows, block_size;

  JACOBI_HD int64_t commit() const { return kSummarySize; }
  JACOBI_HD int64_t block_ends() const { return commit() + width; }
  JACOBI_HD int64_t candidate_len() const { return block_ends() + max_blocks; }
  JACOBI_HD int64_t accept() const { return candidate_len() + pool_size; }
  JACOBI_HD int64_t next_block() const { return accept() + rows; }
  JACOBI_HD int64_t candidates() const { return next_block() + block_size; }
  JACOBI_HD int64_t size() const { return candidates() + pool_size * block_size; }
  // what follows the commit slots (verify's next state)
  JACOBI_HD int64_t tail() const { return size() - block_ends(); }
};

// An EOS test over a list of token ids (none where count == 0).
struct EosIds {
  const int64_t* ids;
  int64_t count;
  JACOBI_HD bool operator()(int64_t tok) const {
    for (int64_t k = 0; k < count; ++k) {
      if (ids[k] == tok) return true;
    }
    return false;
  }
};

// One EOS id (eos < 0: none, as no token id is negative).
struct OneEos {
  int64_t eos;
  JACOBI_HD bool operator()(int64_t tok) const { return tok == eos; }
};

// The acceptance rule of every row a step verifies, parallel and AR alike: 1 + the longest
// prefix with tokens[i + 1] == greedy[i] over tokens[0:len], capped at the first EOS (inclusive).
// len >= 1 (0 for len <= 0).
template <typename Tok, typename IsEos>
JACOBI_HD int accepted_length_if(const Tok* tokens, const Tok* greedy, int len, IsEos is_eos) {
  if (len <= 0) return 0;
  if (is_eos(static_cast<int64_t>(tokens[0]))) return 1;
  int a = 1;
  while (a < len && tokens[a] == greedy[a - 1]) {
    ++a;
    if (is_eos(static_cast<int64_t>(tokens[a - 1]))) break;
  }
  return a;
}

// One sequence's row of an AR step: it fed toks[0:fed] (the seed, then lookup drafts; fed <= Q,
// the step's width) and the model predicted tgt[0:Q]. Accepted: accepted_length_if over the fed
// tokens (over the seed alone where fed is 0: such a row is not committed). The summary is
// (0, accepted, finished, 1, 1, seed, 0, 0), the seed the target after the last accepted token;
// then the fed tokens in the `width` commit slots (-1 past them); zeros up to the row's `size`
// (an AR row has no verify state). Returns the tokens to commit (accepted; 0 where fed is 0).
template <typename IsEos>
JACOBI_HD int64_t ar_step_row(const int64_t* toks, const int64_t* tgt, int64_t fed, int64_t Q,
                              IsEos is_eos, int64_t width, int64_t size, int64_t* row) {
  const int64_t q = fed < Q ? fed : Q;
  const int64_t acc = accepted_length_if(toks, tgt, static_cast<int>(q > 1 ? q : 1), is_eos);
  for (int64_t i = 0; i < kSummarySize; ++i) row[i] = 0;
  row[kAccepted] = acc;
  row[kFinished] = is_eos(toks[acc - 1]) ? 1 : 0;
  row[kNextLen] = row[kNextBlocks] = 1;
  row[kNextSeed] = tgt[acc - 1];
  for (int64_t i = 0; i < width; ++i) row[kSummarySize + i] = i < q ? toks[i] : -1;
  for (int64_t i = kSummarySize + width; i < size; ++i) row[i] = 0;
  return fed > 0 ? acc : 0;
}

}  // namespace jacobi
