// verify_step: argument checks and the CPU implementation.
#include "verify_ops.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/verify_cpu.h"
#include "checks.h"

namespace jacobi::ops {

VerifyLaunch prepare_verify(const at::Tensor& tokens, const at::Tensor& greedy,
                            const at::Tensor& row_len, const at::Tensor& block_ends,
                            const at::Tensor& init_tokens, const at::Tensor& pool,
                            const at::Tensor& pool_len, const at::Tensor& pool_head,
                            int64_t spawn_threshold, int64_t eos_token_id) {
  namespace ck = jacobi::checks;
  // One sequence: the shapes below; a batch: the same with a leading [batch] on every tensor.
  TORCH_CHECK_VALUE(tokens.dim() == 2 || tokens.dim() == 3, "tokens must be 2-D [rows, width] "
                    "(one sequence) or 3-D [batch, rows, width], got shape ", tokens.sizes());
  const bool batched = tokens.dim() == 3;
  const int64_t d = batched ? 1 : 0;
  ck::rank(tokens, "tokens", 2 + d, batched ? "[batch, rows, width]" : "[rows, width]");
  ck::rank(greedy, "greedy", 2 + d, batched ? "[batch, rows, width]" : "[rows, width]");
  ck::rank(row_len, "row_len", 1 + d, batched ? "[batch, rows]" : "[rows]");
  ck::rank(block_ends, "block_ends", 1 + d, batched ? "[batch, max_blocks]" : "[max_blocks]");
  ck::rank(init_tokens, "init_tokens", 1 + d, batched ? "[batch, block_size]" : "[block_size]");
  ck::rank(pool, "pool", 2 + d, batched ? "[batch, pool_size, pool_width]"
                                        : "[pool_size, pool_width]");
  ck::rank(pool_len, "pool_len", 1 + d, batched ? "[batch, pool_size]" : "[pool_size]");
  ck::rank(pool_head, "pool_head", 1 + d, batched ? "[batch, 1]" : "[1]");
  for (auto [t, name] : {std::pair{&tokens, "tokens"}, {&greedy, "greedy"},
                         {&init_tokens, "init_tokens"}, {&pool, "pool"}}) {
    ck::dtype(*t, name, at::kLong);
  }
  for (auto [t, name] : {std::pair{&row_len, "row_len"}, {&block_ends, "block_ends"},
                         {&pool_len, "pool_len"}, {&pool_head, "pool_head"}}) {
    ck::dtype(*t, name, at::kInt);
  }
  const int64_t B = batched ? tokens.size(0) : 1;
  for (auto [t, name] :
       {std::pair{&tokens, "tokens"}, {&greedy, "greedy"}, {&row_len, "row_len"},
        {&block_ends, "block_ends"}, {&init_tokens, "init_tokens"}, {&pool, "pool"},
        {&pool_len, "pool_len"}, {&pool_head, "pool_head"}}) {
    ck::contiguous(*t, name);
    ck::same_device(*t, name, tokens, "tokens");
    TORCH_CHECK_VALUE(!batched || t->size(0) == B, name, " must have one entry per sequence (",
                      B, "), got shape ", t->sizes());
  }
  const int64_t R = tokens.size(d), W = tokens.size(d + 1);
  TORCH_CHECK_VALUE(R >= 1 && W >= 1, "tokens must hold at least one row and one column, got ",
                    tokens.sizes());
  TORCH_CHECK_VALUE(B <= INT32_MAX, "at most 2^31 - 1 sequences, got ", B);
  TORCH_CHECK_VALUE(greedy.sizes() == tokens.sizes(), "greedy must have the shape of tokens ",
                    tokens.sizes(), ", got ", greedy.sizes());
  TORCH_CHECK_VALUE(row_len.size(d) == R, "row_len must have one entry per row (", R, "), got ",
                    row_len.size(d));
  const int64_t K = block_ends.size(d), n = init_tokens.size(d);
  const int64_t p = pool.size(d), pw = pool.size(d + 1);
  TORCH_CHECK_VALUE(K >= 1, "block_ends must have max_blocks >= 1 entries");
  TORCH_CHECK_VALUE(n >= 2, "init_tokens must have block_size >= 2 entries, got ", n);
  TORCH_CHECK_VALUE(pool_len.size(d) == p, "pool_len must have one entry per pool row (", p,
                    "), got ", pool_len.size(d));
  TORCH_CHECK_VALUE(pool_head.size(d) == 1, "pool_head must have exactly one entry per sequence");
  TORCH_CHECK_VALUE(spawn_threshold >= 1 && spawn_threshold <= n,
                    "spawn_threshold must be in [1, block_size=", n, "], got ", spawn_threshold);
  // Host-side value checks are only affordable on the CPU (a GPU read would be a sync); the
  // CUDA path trusts the engine, which keeps these invariants by construction.
  if (tokens.device().is_cpu()) {
    for (int64_t b = 0; b < B; ++b) {
      const int32_t* rl = row_len.data_ptr<int32_t>() + b * R;
      const int32_t* be = block_ends.data_ptr<int32_t>() + b * K;
      const char* who = batched ? "of a sequence " : "";
      if (batched && rl[0] == 0) {  // takes no part: its other rows must be empty too
        for (int64_t r = 1; r < R; ++r)
          TORCH_CHECK_VALUE(rl[r] == 0, "row_len[", b, "] has an empty main row (the sequence "
                            "takes no part) but row ", r, " has length ", rl[r]);
        continue;
      }
      TORCH_CHECK_VALUE(rl[0] >= 1 && rl[0] <= W, "row_len[0] (the main row", who, ") must be in "
                        "[", batched ? 0 : 1, ", ", W, "], got ", rl[0]);
      int nb = 0, prev = 0;
      while (nb < K && be[nb] > 0) {
        TORCH_CHECK_VALUE(be[nb] > prev && be[nb] - prev <= n, "block_ends must increase by at "
                          "most block_size=", n, " per block, got ", block_ends);
        prev = be[nb++];
      }
      for (int b2 = nb; b2 < K; ++b2)
        TORCH_CHECK_VALUE(be[b2] == 0, "block_ends must be 0 after the last block, got ",
                          block_ends);
      TORCH_CHECK_VALUE(nb >= 1 && prev == rl[0], "block_ends must end at the main row's length ",
                        rl[0], ", got ", block_ends);
      for (int64_t r = 1; r < R; ++r)
        TORCH_CHECK_VALUE(rl[r] == 0 || rl[r] == be[0], "row_len[", r, "] (a candidate) must be "
                          "0 or the first block's length ", be[0], ", got ", rl[r]);
      const int32_t head = pool_head.data_ptr<int32_t>()[b];
      TORCH_CHECK_VALUE(p == 0 || (head >= 0 && head < p), "pool_head must be in [0, pool_size)");
    }
  }

  const auto opt = tokens.options();
  auto shape = [&](std::initializer_list<int64_t> dims) {  // [batch] + dims for a batch
    c10::SmallVector<int64_t, 4> v;
    if (batched) v.push_back(B);
    for (const int64_t x : dims) v.push_back(x);
    return v;
  };
  at::Tensor accept = at::empty(shape({R}), opt.dtype(at::kInt));
  at::Tensor summary = at::empty(shape({kSummarySize}), opt.dtype(at::kLong));
  at::Tensor commit = at::empty(shape({W}), opt);
  at::Tensor next_tokens = at::empty(shape({W + n}), opt);
  at::Tensor next_block_ends = at::empty(shape({K}), opt.dtype(at::kInt));
  at::Tensor candidates = at::empty(shape({p, n}), opt);
  at::Tensor candidate_len = at::empty(shape({p}), opt.dtype(at::kInt));

  VerifyLaunch l;
  l.batch = static_cast<int>(B);
  l.shape = VerifyShape{static_cast<int>(R),
                        static_cast<int>(W),
                        static_cast<int>(K),
                        static_cast<int>(n),
                        static_cast<int>(spawn_threshold),
                        static_cast<int>(p),
                        static_cast<int>(pw),
                        eos_token_id};
  l.args = VerifyArgs<int64_t>{tokens.data_ptr<int64_t>(),     greedy.data_ptr<int64_t>(),
                               row_len.data_ptr<int32_t>(),    block_ends.data_ptr<int32_t>(),
                               init_tokens.data_ptr<int64_t>(), pool.data_ptr<int64_t>(),
                               pool_len.data_ptr<int32_t>(),   pool_head.data_ptr<int32_t>(),
                               accept.data_ptr<int32_t>(),     summary.data_ptr<int64_t>(),
                               commit.data_ptr<int64_t>(),     next_tokens.data_ptr<int64_t>(),
                               next_block_ends.data_ptr<int32_t>(),
                               candidates.data_ptr<int64_t>(), candidate_len.data_ptr<int32_t>()};
  l.outputs = {accept, summary, commit, next_tokens, next_block_ends, candidates, candidate_len};
  return l;
}

VerifyRowsLaunch prepare_verify_rows(const at::Tensor& toks, const at::Tensor& tgt,
                                     const at::Tensor& row_start, const at::Tensor& row_len,
                                     const at::Tensor& init_idx, at::Tensor& src,
                                     const at::Tensor& block_ends, const at::Tensor& pool,
                                     at::Tensor& ctx, at::Tensor& ctx_len, int64_t width) {
  namespace ck = jacobi::checks;
  for (auto [t, name] : {std::pair{&toks, "toks"}, {&tgt, "tgt"}, {&row_start, "row_start"},
                         {&row_len, "row_len"}, {&init_idx, "init_idx"}, {&src, "src"},
                         {&ctx, "ctx"}, {&ctx_len, "ctx_len"}}) {
    ck::dtype(*t, name, at::kLong);
    ck::same_device(*t, name, toks, "toks");
  }
  for (auto [t, name] : {std::pair{&toks, "toks"}, {&tgt, "tgt"}, {&row_start, "row_start"},
                         {&row_len, "row_len"}, {&init_idx, "init_idx"}}) {
    ck::rank(*t, name, 2, "[B, columns]");
    TORCH_CHECK_VALUE(t->size(1) <= 1 || t->stride(1) == 1, name,
                      " must have adjacent columns (a row may be strided), got strides ",
                      t->strides());
  }
  ck::rank(pool, "pool", 3, "[B, pool_size, pool_width]");
  ck::rank(block_ends, "block_ends", 2, "[B, max_blocks]");
  for (auto [t, name] : {std::pair{&src, "src"}, {&ctx, "ctx"}, {&ctx_len, "ctx_len"}})
    ck::contiguous(*t, name);
  const int64_t B = toks.size(0), Q = toks.size(1), R = row_len.size(1), n = init_idx.size(1);
  const int64_t Wv = pool.size(2), K = block_ends.size(1), p = pool.size(1);
  const int64_t host0 = Wv + n + p * n;
  TORCH_CHECK_VALUE(tgt.sizes() == toks.sizes() && row_start.sizes() == row_len.sizes() &&
                        row_len.size(0) == B && init_idx.size(0) == B && src.dim() == 2 &&
                        src.size(0) == B && src.size(1) >= host0 && ctx.dim() == 2 &&
                        ctx.size(0) == B && ctx.size(1) >= 1 && ctx_len.dim() == 1 &&
                        ctx_len.size(0) == B && width >= Wv && Q >= 1,
                    "verify_rows: inconsistent shapes (toks ", toks.sizes(), ", row_len ",
                    row_len.sizes(), ", init_idx ", init_idx.sizes(), ", src ", src.sizes(),
                    ", ctx ", ctx.sizes(), ", pool ", pool.sizes(), ", width ", width, ")");
  const auto opt = toks.options();
  VerifyRowsLaunch l;
  l.shape = VerifyRowsShape{B, Q, R, Wv, n, K, p, src.size(1), ctx.size(1) - 1,
                            StepRowLayout{width, K, p, R, n}};
  l.tok_rows = at::empty({B, R, Wv}, opt);
  l.tgt_rows = at::empty({B, R, Wv}, opt);
  l.lens = at::empty({B, R}, opt.dtype(at::kInt));
  l.init = at::empty({B, n}, opt);
  at::Tensor rows = at::empty({B, l.shape.row.size()}, opt), first = at::empty({B}, opt);
  at::Tensor count = at::empty({B}, opt), part = at::empty({B}, opt.dtype(at::kBool));
  l.outputs = {rows, first, count, part};
  VerifyRowsArgs& a = l.args;
  a.toks = toks.data_ptr<int64_t>();
  a.tgt = tgt.data_ptr<int64_t>();
  a.row_start = row_start.data_ptr<int64_t>();
  a.row_len = row_len.data_ptr<int64_t>();
  a.init_idx = init_idx.data_ptr<int64_t>();
  a.toks_ld = toks.stride(0);
  a.tgt_ld = tgt.stride(0);
  a.row_start_ld = row_start.stride(0);
  a.row_len_ld = row_len.stride(0);
  a.init_idx_ld = init_idx.stride(0);
  a.src = src.data_ptr<int64_t>();
  a.block_ends = nullptr;  // (bind_verify)
  a.ctx = ctx.data_ptr<int64_t>();
  a.ctx_len = ctx_len.data_ptr<int64_t>();
  a.v = VerifyArgs<int64_t>{};
  a.tok_rows = l.tok_rows.data_ptr<int64_t>();
  a.tgt_rows = l.tgt_rows.data_ptr<int64_t>();
  a.lens = l.lens.data_ptr<int32_t>();
  a.init = l.init.data_ptr<int64_t>();
  a.rows = rows.data_ptr<int64_t>();
  a.first = first.data_ptr<int64_t>();
  a.count = count.data_ptr<int64_t>();
  a.part = part.data_ptr<bool>();
  return l;
}

void bind_verify(VerifyRowsLaunch& l, at::Tensor& block_ends, at::Tensor& pool,
                 at::Tensor& pool_len, at::Tensor& pool_head, int64_t spawn_threshold,
                 int64_t eos_token_id) {
  l.verify = prepare_verify(l.tok_rows, l.tgt_rows, l.lens, block_ends, l.init, pool, pool_len,
                            pool_head, spawn_threshold, eos_token_id);
  l.args.v = l.verify.args;
  l.args.block_ends = block_ends.data_ptr<int32_t>();
}

ArAcceptLaunch prepare_ar_accept(const at::Tensor& toks, const at::Tensor& tgt,
                                 const at::Tensor& fed, const std::optional<at::Tensor>& eos,
                                 int64_t width, int64_t tail) {
  namespace ck = jacobi::checks;
  ck::rank(toks, "toks", 2, "[B, Q]");
  ck::dtype(toks, "toks", at::kLong);
  ck::dtype(tgt, "tgt", at::kLong);
  ck::dtype(fed, "fed", at::kLong);
  ck::same_device(tgt, "tgt", toks, "toks");
  ck::same_device(fed, "fed", toks, "toks");
  const int64_t B = toks.size(0), Q = toks.size(1);
  TORCH_CHECK_VALUE(tgt.sizes() == toks.sizes(), "tgt must be [B, Q] like toks ", toks.sizes(),
                    ", got ", tgt.sizes());
  TORCH_CHECK_VALUE(fed.dim() == 1 && fed.size(0) == B, "fed must be [B = ", B, "], got ",
                    fed.sizes());
  TORCH_CHECK_VALUE(Q >= 1, "a step feeds at least one token, got Q = ", Q);
  TORCH_CHECK_VALUE(width >= Q && tail >= 0, "width (", width, ") must hold the step's ", Q,
                    " tokens and tail (", tail, ") be >= 0");
  ArAcceptLaunch l;
  l.batch = B;
  l.Q = Q;
  l.row_size = kSummarySize + width + tail;
  l.toks_c = toks.contiguous();
  l.tgt_c = tgt.contiguous();
  l.fed_c = fed.contiguous();
  l.num_eos = 0;
  l.eos = nullptr;
  if (eos.has_value()) {
    ck::dtype(*eos, "eos", at::kLong);
    ck::same_device(*eos, "eos", toks, "toks");
    TORCH_CHECK_VALUE(eos->dim() == 1, "eos must be [E] token ids, got ", eos->sizes());
    l.eos_c = eos->contiguous();
    l.num_eos = l.eos_c.size(0);
    l.eos = l.num_eos > 0 ? l.eos_c.data_ptr<int64_t>() : nullptr;
  }
  l.toks = l.toks_c.data_ptr<int64_t>();
  l.tgt = l.tgt_c.data_ptr<int64_t>();
  l.fed = l.fed_c.data_ptr<int64_t>();
  at::Tensor rows = at::empty({B, l.row_size}, toks.options());
  at::Tensor count = at::empty({B}, toks.options());
  l.rows = rows.data_ptr<int64_t>();
  l.count = count.data_ptr<int64_t>();
  l.outputs = {rows, count};
  return l;
}

namespace {

VerifyResult verify_step_cpu(const at::Tensor& tokens, const at::Tensor& greedy,
                             const at::Tensor& row_len, const at::Tensor& block_ends,
                             const at::Tensor& init_tokens, at::Tensor& pool,
                             at::Tensor& pool_len, at::Tensor& pool_head, int64_t spawn_threshold,
                             int64_t eos_token_id) {
  VerifyLaunch l = prepare_verify(tokens, greedy, row_len, block_ends, init_tokens, pool, pool_len,
                                  pool_head, spawn_threshold, eos_token_id);
  jacobi::cpu::verify_step(l.shape, l.args, l.batch);
  return l.outputs;
}

// The decoding step's AR rows (jacobi/step_row.h: ar_step_row, the rule and the row), per
// sequence b of toks, tgt [B, Q] with fed[b] tokens fed: rows [B, kSummarySize + width + tail]
// and count [B] (the tokens to commit). The CUDA twin runs the same function
// (csrc/cuda/verify_cuda.cu).
std::tuple<at::Tensor, at::Tensor> ar_accept_cpu(const at::Tensor& toks, const at::Tensor& tgt,
                                                 const at::Tensor& fed,
                                                 const std::optional<at::Tensor>& eos,
                                                 int64_t width, int64_t tail) {
  ArAcceptLaunch l = prepare_ar_accept(toks, tgt, fed, eos, width, tail);
  const EosIds is_eos{l.eos, l.num_eos};
  for (int64_t b = 0; b < l.batch; ++b) {
    l.count[b] = ar_step_row(l.toks + b * l.Q, l.tgt + b * l.Q, l.fed[b], l.Q, is_eos, width,
                             l.row_size, l.rows + b * l.row_size);
  }
  return l.outputs;
}

// The parallel sequences' side of a decoding step (jacobi/verify_rows.h: the cut, verify_step,
// the next state and the step rows), on a CPU: the header's functions in loops, after checking
// on the host the indices the device only clamps.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> verify_rows_cpu(
    const at::Tensor& toks, const at::Tensor& tgt, const at::Tensor& row_start,
    const at::Tensor& row_len, const at::Tensor& init_idx, at::Tensor& src,
    at::Tensor& block_ends, at::Tensor& pool, at::Tensor& pool_len, at::Tensor& pool_head,
    at::Tensor& ctx, at::Tensor& ctx_len, int64_t spawn_threshold, int64_t eos_token_id,
    int64_t width) {
  VerifyRowsLaunch l = prepare_verify_rows(toks, tgt, row_start, row_len, init_idx, src,
                                           block_ends, pool, ctx, ctx_len, width);
  const VerifyRowsShape& s = l.shape;
  const VerifyRowsArgs& a = l.args;  // (a reference: bind_verify below fills a.v)
  const int64_t B = s.batch, R = s.rows, n = s.block_size, cap = s.ctx_cap;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t len = a.row_len[b * a.row_len_ld + r];
      TORCH_CHECK_VALUE(len <= 0 || a.row_start[b * a.row_start_ld + r] >= 0, "row_start[", b,
                        "][", r, "] is negative");
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t at = a.init_idx[b * a.init_idx_ld + j];
      TORCH_CHECK_VALUE(at >= 0 && at <= cap, "init_idx[", b, "][", j, "] = ", at,
                        " is outside the context's ", cap + 1, " slots");
    }
    for (int64_t e = 0; e < R * s.wv; ++e) verify_rows_cut(s, a, b, e);
    for (int64_t j = 0; j < n; ++j) verify_rows_init(s, a, b, j);
  }
  bind_verify(l, block_ends, pool, pool_len, pool_head, spawn_threshold, eos_token_id);
  jacobi::cpu::verify_step(l.verify.shape, l.verify.args, l.verify.batch);
  for (int64_t b = 0; b < B; ++b) {
    const bool part = a.row_len[b * a.row_len_ld] > 0;
    const int64_t acc = a.v.summary[b * kSummarySize + kAccepted];
    TORCH_CHECK(!part || a.ctx_len[b] + acc <= cap, "verify_rows: the context (", cap,
                " tokens) cannot hold ", acc, " more after ", a.ctx_len[b]);
    verify_rows_finish(s, a, b);
  }
  return l.outputs;
}

}  // namespace

TORCH_LIBRARY_IMPL(jacobi_ext, CPU, m) {
  m.impl("verify_step", &verify_step_cpu);
  m.impl("verify_rows", &verify_rows_cpu);
  m.impl("ar_accept", &ar_accept_cpu);
}

namespace {

// The step row's layout (jacobi/step_row.h), for Python (jacobi_ext/decoding/step_row.py).
std::string step_summary_fields() { return kStepSummaryFields; }

std::vector<int64_t> step_row_layout(int64_t width, int64_t num_blocks, int64_t pool_size,
                                     int64_t rows, int64_t block_size) {
  TORCH_CHECK_VALUE(width >= 0 && num_blocks >= 0 && pool_size >= 0 && rows >= 0 &&
                        block_size >= 0,
                    "step_row_layout: sizes must be >= 0, got width ", width, ", num_blocks ",
                    num_blocks, ", pool_size ", pool_size, ", rows ", rows, ", block_size ",
                    block_size);
  const StepRowLayout l{width, num_blocks, pool_size, rows, block_size};
  return {l.commit(),     l.block_ends(), l.candidate_len(), l.accept(),
          l.next_block(), l.candidates(), l.size()};
}

}  // namespace

TORCH_LIBRARY_IMPL(jacobi_ext, CompositeExplicitAutograd, m) {
  m.impl("step_summary_fields", &step_summary_fields);
  m.impl("step_row_layout", &step_row_layout);
}

}  // namespace jacobi::ops
