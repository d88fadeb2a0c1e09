// Shared glue of the verify_step op: argument checks, output allocation, raw-pointer view.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "jacobi/step_row.h"
#include "jacobi/verify.h"
#include "jacobi/verify_rows.h"

namespace jacobi::ops {

using VerifyResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                at::Tensor, at::Tensor>;

struct VerifyLaunch {
  int batch;  // sequences (1 for the single-sequence form)
  VerifyShape shape;
  VerifyArgs<int64_t> args;
  VerifyResult outputs;
};

// Checks every argument (dtype, rank, shape, device, contiguity) and allocates the outputs on
// the inputs' device. Tensors of one sequence ([rows, width] tokens, ...) or of a batch (the
// same with a leading [batch]; the outputs then have it too): see jacobi/verify.h.
VerifyLaunch prepare_verify(const at::Tensor& tokens, const at::Tensor& greedy,
                            const at::Tensor& row_len, const at::Tensor& block_ends,
                            const at::Tensor& init_tokens, const at::Tensor& pool,
                            const at::Tensor& pool_len, const at::Tensor& pool_head,
                            int64_t spawn_threshold, int64_t eos_token_id);

// The ar_accept op's arguments, checked, and its outputs, allocated on the inputs' device
// (jacobi/step_row.h: ar_step_row). The pointers read the contiguous tensors kept here.
struct ArAcceptLaunch {
  int64_t batch, Q, row_size, num_eos;
  at::Tensor toks_c, tgt_c, fed_c, eos_c;  // (kept alive for the pointers below)
  const int64_t *toks, *tgt, *fed, *eos;   // eos: nullptr where num_eos == 0
  int64_t *rows, *count;                   // [batch, row_size], [batch]
  std::tuple<at::Tensor, at::Tensor> outputs;
};

ArAcceptLaunch prepare_ar_accept(const at::Tensor& toks, const at::Tensor& tgt,
                                 const at::Tensor& fed, const std::optional<at::Tensor>& eos,
                                 int64_t width, int64_t tail);

// The verify_rows op's arguments, checked (shapes, dtypes, devices: nothing read), its scratch
// (verify_step's cut inputs) and outputs (rows, first, count, part) allocated on the inputs'
// device. bind_verify then checks and binds verify_step over the cut rows (on a CPU it reads
// their lengths: call it after the cut there).
struct VerifyRowsLaunch {
  VerifyRowsShape shape;
  VerifyRowsArgs args;
  at::Tensor tok_rows, tgt_rows, lens, init;
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> outputs;
  VerifyLaunch verify;
};

VerifyRowsLaunch prepare_verify_rows(const at::Tensor& toks, const at::Tensor& tgt,
                                     const at::Tensor& row_start, const at::Tensor& row_len,
                                     const at::Tensor& init_idx, at::Tensor& src,
                                     const at::Tensor& block_ends, const at::Tensor& pool,
                                     at::Tensor& ctx, at::Tensor& ctx_len, int64_t width);

void bind_verify(VerifyRowsLaunch& l, at::Tensor& block_ends, at::Tensor& pool,
                 at::Tensor& pool_len, at::Tensor& pool_head, int64_t spawn_threshold,
                 int64_t eos_token_id);

}  // namespace jacobi::ops
