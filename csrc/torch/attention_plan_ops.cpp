// jacobi_ext::debug_tile_plan: the CUDA attention's work plan computed on the CPU by the very
// functions the device runs (jacobi/attention_plan.h), so that tests can check the permutation and
// the tile classes against a dense mask on a machine without a GPU. Not a fast path.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "checks.h"
#include "jacobi/attention_plan.h"

namespace jacobi::ops {
namespace {

// Returns perm [S] (permuted position -> token), block_of [S] (permuted position -> block, -1 if
// uncovered) and tile_class [T, T] uint8 (0 empty, 1 full, 2 partial; T = ceil(S / 64)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> debug_tile_plan_cpu(const at::Tensor& block_start,
                                                                   const at::Tensor& kv_ptr,
                                                                   const at::Tensor& kv_idx,
                                                                   int64_t seq_len) {
  namespace ck = jacobi::checks;
  for (auto [t, name] : {std::pair{&block_start, "block_start"}, {&kv_ptr, "kv_ptr"},
                         {&kv_idx, "kv_idx"}}) {
    ck::rank(*t, name, 1, "[n]");
    ck::dtype(*t, name, at::kInt);
    ck::contiguous(*t, name);
    TORCH_CHECK_VALUE(t->device().is_cpu(), name, " must be a CPU tensor");
  }
  TORCH_CHECK_VALUE(block_start.numel() >= 1 && kv_ptr.numel() == block_start.numel(),
                    "block_start and kv_ptr must both have num_blocks + 1 entries");
  TORCH_CHECK_VALUE(seq_len >= 0 && seq_len < (int64_t(1) << 30), "bad seq_len ", seq_len);
  const int32_t nb = int32_t(block_start.numel() - 1);
  const int32_t S = int32_t(seq_len);
  static const int32_t kEmpty = 0;
  const BlockTable t{block_start.data_ptr<int32_t>(), kv_ptr.data_ptr<int32_t>(),
                     kv_idx.numel() ? kv_idx.data_ptr<int32_t>() : &kEmpty, nb};
  std::vector<int32_t> order(nb), scratch(2 * size_t(nb)), pstart(size_t(nb) + 1);
  jacobi::attn::plan_block_order(t, order.data(), scratch.data());
  jacobi::attn::plan_block_starts(t, order.data(), pstart.data());
  const auto opts = block_start.options();
  at::Tensor perm = at::empty({S}, opts), block_of = at::empty({S}, opts);
  for (int32_t p = 0; p < S; ++p) {
    const auto tok = jacobi::attn::plan_token(t, order.data(), pstart.data(), p);
    perm.data_ptr<int32_t>()[p] = tok.token;
    block_of.data_ptr<int32_t>()[p] = tok.block;
  }
  const int32_t nt = jacobi::attn::ceil_div(S, jacobi::attn::kPlanTile);
  at::Tensor cls = at::empty({nt, nt}, opts.dtype(at::kByte));
  for (int32_t i = 0; i < nt; ++i) {
    for (int32_t j = 0; j < nt; ++j) {
      cls.data_ptr<uint8_t>()[int64_t(i) * nt + j] =
          jacobi::attn::plan_classify_tile(t, order.data(), pstart.data(), S, i, j);
    }
  }
  return {perm, block_of, cls};
}

}  // namespace

// Defined here rather than in module.cpp: a debug op owned by the CUDA attention.
TORCH_LIBRARY_FRAGMENT(jacobi_ext, m) {
  m.def(
      "debug_tile_plan(Tensor block_start, Tensor kv_ptr, Tensor kv_idx, int seq_len) -> "
      "(Tensor perm, Tensor block_of, Tensor tile_class)");
}

TORCH_LIBRARY_IMPL(jacobi_ext, CPU, m) { m.impl("debug_tile_plan", &debug_tile_plan_cpu); }

}  // namespace jacobi::ops
