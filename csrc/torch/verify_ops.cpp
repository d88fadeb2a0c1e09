// verify_step: argument checks and the CPU implementation.
#include "verify_ops.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu/verify_cpu.h"
#include "checks.h"

namespace jacobi::ops {

VerifyLaunch prepare_verify(const at::Tensor& tokens, const at::Tensor& greedy,
                            const at::Tensor& row_len, const at::Tensor& block_ends,
                            const at::Tensor& init_tokens, const at::Tensor& pool,
                            const at::Tensor& pool_len, const at::Tensor& pool_head,
                            int64_t spawn_threshold, int64_t eos_token_id) {
  namespace ck = jacobi::checks;
  ck::rank(tokens, "tokens", 2, "[rows, width]");
  ck::rank(greedy, "greedy", 2, "[rows, width]");
  ck::rank(row_len, "row_len", 1, "[rows]");
  ck::rank(block_ends, "block_ends", 1, "[max_blocks]");
  ck::rank(init_tokens, "init_tokens", 1, "[block_size]");
  ck::rank(pool, "pool", 2, "[pool_size, pool_width]");
  ck::rank(pool_len, "pool_len", 1, "[pool_size]");
  ck::rank(pool_head, "pool_head", 1, "[1]");
  for (auto [t, name] : {std::pair{&tokens, "tokens"}, {&greedy, "greedy"},
                         {&init_tokens, "init_tokens"}, {&pool, "pool"}}) {
    ck::dtype(*t, name, at::kLong);
  }
  for (auto [t, name] : {std::pair{&row_len, "row_len"}, {&block_ends, "block_ends"},
                         {&pool_len, "pool_len"}, {&pool_head, "pool_head"}}) {
    ck::dtype(*t, name, at::kInt);
  }
  for (auto [t, name] :
       {std::pair{&tokens, "tokens"}, {&greedy, "greedy"}, {&row_len, "row_len"},
        {&block_ends, "block_ends"}, {&init_tokens, "init_tokens"}, {&pool, "pool"},
        {&pool_len, "pool_len"}, {&pool_head, "pool_head"}}) {
    ck::contiguous(*t, name);
    ck::same_device(*t, name, tokens, "tokens");
  }
  const int64_t R = tokens.size(0), W = tokens.size(1);
  TORCH_CHECK_VALUE(R >= 1 && W >= 1, "tokens must hold at least one row and one column, got ",
                    tokens.sizes());
  TORCH_CHECK_VALUE(greedy.sizes() == tokens.sizes(), "greedy must have the shape of tokens ",
                    tokens.sizes(), ", got ", greedy.sizes());
  TORCH_CHECK_VALUE(row_len.size(0) == R, "row_len must have one entry per row (", R, "), got ",
                    row_len.size(0));
  const int64_t K = block_ends.size(0), n = init_tokens.size(0);
  TORCH_CHECK_VALUE(K >= 1, "block_ends must have max_blocks >= 1 entries");
  TORCH_CHECK_VALUE(n >= 2, "init_tokens must have block_size >= 2 entries, got ", n);
  TORCH_CHECK_VALUE(pool_len.size(0) == pool.size(0), "pool_len must have one entry per pool row (",
                    pool.size(0), "), got ", pool_len.size(0));
  TORCH_CHECK_VALUE(pool_head.size(0) == 1, "pool_head must have exactly one entry");
  TORCH_CHECK_VALUE(spawn_threshold >= 1 && spawn_threshold <= n,
                    "spawn_threshold must be in [1, block_size=", n, "], got ", spawn_threshold);
  // Host-side value checks are only affordable on the CPU (a GPU read would be a sync); the
  // CUDA path trusts the engine, which keeps these invariants by construction.
  if (tokens.device().is_cpu()) {
    const int32_t* rl = row_len.data_ptr<int32_t>();
    const int32_t* be = block_ends.data_ptr<int32_t>();
    TORCH_CHECK_VALUE(rl[0] >= 1 && rl[0] <= W, "row_len[0] (the main row) must be in [1, ", W,
                      "], got ", rl[0]);
    int nb = 0, prev = 0;
    while (nb < K && be[nb] > 0) {
      TORCH_CHECK_VALUE(be[nb] > prev && be[nb] - prev <= n, "block_ends must increase by at most "
                        "block_size=", n, " per block, got ", block_ends);
      prev = be[nb++];
    }
    for (int b = nb; b < K; ++b)
      TORCH_CHECK_VALUE(be[b] == 0, "block_ends must be 0 after the last block, got ", block_ends);
    TORCH_CHECK_VALUE(nb >= 1 && prev == rl[0], "block_ends must end at the main row's length ",
                      rl[0], ", got ", block_ends);
    for (int64_t r = 1; r < R; ++r)
      TORCH_CHECK_VALUE(rl[r] == 0 || rl[r] == be[0], "row_len[", r, "] (a candidate) must be 0 "
                        "or the first block's length ", be[0], ", got ", rl[r]);
    const int64_t p = pool.size(0);
    TORCH_CHECK_VALUE(p == 0 || (pool_head.data_ptr<int32_t>()[0] >= 0 &&
                                 pool_head.data_ptr<int32_t>()[0] < p),
                      "pool_head must be in [0, pool_size)");
  }

  const auto opt = tokens.options();
  at::Tensor accept = at::empty({R}, opt.dtype(at::kInt));
  at::Tensor summary = at::empty({kSummarySize}, opt.dtype(at::kLong));
  at::Tensor commit = at::empty({W}, opt);
  at::Tensor next_tokens = at::empty({W + n}, opt);
  at::Tensor next_block_ends = at::empty({K}, opt.dtype(at::kInt));
  at::Tensor candidates = at::empty({pool.size(0), n}, opt);
  at::Tensor candidate_len = at::empty({pool.size(0)}, opt.dtype(at::kInt));

  VerifyLaunch l;
  l.shape = VerifyShape{static_cast<int>(R),
                        static_cast<int>(W),
                        static_cast<int>(K),
                        static_cast<int>(n),
                        static_cast<int>(spawn_threshold),
                        static_cast<int>(pool.size(0)),
                        static_cast<int>(pool.size(1)),
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

namespace {

VerifyResult verify_step_cpu(const at::Tensor& tokens, const at::Tensor& greedy,
                             const at::Tensor& row_len, const at::Tensor& block_ends,
                             const at::Tensor& init_tokens, at::Tensor& pool,
                             at::Tensor& pool_len, at::Tensor& pool_head, int64_t spawn_threshold,
                             int64_t eos_token_id) {
  VerifyLaunch l = prepare_verify(tokens, greedy, row_len, block_ends, init_tokens, pool, pool_len,
                                  pool_head, spawn_threshold, eos_token_id);
  jacobi::cpu::verify_step(l.shape, l.args);
  return l.outputs;
}

}  // namespace

TORCH_LIBRARY_IMPL(jacobi_ext, CPU, m) { m.impl("verify_step", &verify_step_cpu); }

}  // namespace jacobi::ops
