// jacobi_ext::debug_tile_plan: the CUDA attention's work plan computed on the CPU by the very
// functions the device runs (jacobi/attention_plan.h), so that tests can check the permutation and
// the tile classes against a dense mask on a machine without a GPU. Not a fast path.
// jacobi_ext::attention_tile_lists: the sm_90a attention's per-CTA tile lists (jacobi/tile_list.h),
// built on the host once per block table; jacobi_ext::debug_expand_tile_lists walks them back.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "checks.h"
#include "jacobi/attention_plan.h"
#include "jacobi/tile_list.h"
#include "tile_lists_view.h"

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

void check_tile_sizes(int64_t tile_m, int64_t tile_n) {
  TORCH_CHECK_VALUE(tile_m >= 16 && tile_m <= 256 && tile_m % 16 == 0,
                    "tile_m must be a multiple of 16 in [16, 256] (query rows per CTA), got ",
                    tile_m);
  TORCH_CHECK_VALUE(tile_n >= 32 && tile_n <= 256 && tile_n % 32 == 0,
                    "tile_n must be a multiple of 32 in [32, 256] (key columns per tile: the masks "
                    "hold 32 columns per word), got ",
                    tile_n);
}

// The host side of the sm_90a attention: per-CTA tile lists of a block table at the kernel's tile
// sizes (jacobi/tile_list.h). Returns perm [S] (permuted position -> token), fwd_ptr [nq + 1],
// fwd_tile, fwd_mask, bwd_ptr [nk + 1], bwd_tile, bwd_mask (int32, one entry per listed pair) and
// masks [num_partial, tile_m, tile_n / 32] int32 (the uint32 bit words).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor>
attention_tile_lists_cpu(const at::Tensor& block_start, const at::Tensor& kv_ptr,
                         const at::Tensor& kv_idx, int64_t seq_len, int64_t tile_m,
                         int64_t tile_n) {
  namespace ck = jacobi::checks;
  namespace ja = jacobi::attn;
  for (auto [t, name] : {std::pair{&block_start, "block_start"}, {&kv_ptr, "kv_ptr"},
                         {&kv_idx, "kv_idx"}}) {
    ck::rank(*t, name, 1, "[n] (block table)");
    ck::dtype(*t, name, at::kInt);
    ck::contiguous(*t, name);
    TORCH_CHECK_VALUE(t->device().is_cpu(), name,
                      " must be a CPU tensor: the tile lists are built on the host, once per "
                      "block table (BlockTable.to('cpu'))");
  }
  check_tile_sizes(tile_m, tile_n);
  TORCH_CHECK_VALUE(seq_len >= 0 && seq_len < (int64_t(1) << 30), "seq_len must be in [0, 2**30), "
                    "got ", seq_len);
  const int64_t nb64 = block_start.numel() - 1;
  TORCH_CHECK_VALUE(nb64 >= 0 && kv_ptr.numel() == nb64 + 1,
                    "block_start and kv_ptr must both have num_blocks + 1 entries, got ",
                    block_start.numel(), " and ", kv_ptr.numel());
  const int32_t nb = int32_t(nb64);
  const int32_t* bs = block_start.data_ptr<int32_t>();
  const int32_t* kp = kv_ptr.data_ptr<int32_t>();
  // What the plan functions index with: every read stays inside the tensors.
  TORCH_CHECK_VALUE(bs[0] == 0 && bs[nb] <= seq_len, "block_start must start at 0 and end at most "
                    "at seq_len = ", seq_len, ", got ", bs[0], " .. ", bs[nb]);
  TORCH_CHECK_VALUE(kp[0] == 0 && kp[nb] == kv_idx.numel(),
                    "kv_ptr must run from 0 to len(kv_idx) = ", kv_idx.numel());
  for (int32_t b = 0; b < nb; ++b) {
    TORCH_CHECK_VALUE(bs[b + 1] >= bs[b], "block_start must be non-decreasing (at block ", b, ")");
    TORCH_CHECK_VALUE(kp[b + 1] >= kp[b], "kv_ptr must be non-decreasing (at block ", b, ")");
    for (int32_t e = kp[b]; e < kp[b + 1]; ++e) {
      const int32_t kb = kv_idx.data_ptr<int32_t>()[e];
      TORCH_CHECK_VALUE(kb >= 0 && kb < b && (e == kp[b] || kb > kv_idx.data_ptr<int32_t>()[e - 1]),
                        "kv_idx of query block ", b, " must list key blocks in [0, ", b,
                        ") in ascending order, got ", kb);
    }
  }
  static const int32_t kEmpty = 0;
  const BlockTable t{bs, kp, kv_idx.numel() ? kv_idx.data_ptr<int32_t>() : &kEmpty, nb};
  const int32_t S = int32_t(seq_len), tm = int32_t(tile_m), tn = int32_t(tile_n);
  std::vector<int32_t> order(nb), scratch(2 * size_t(nb)), pstart(size_t(nb) + 1);
  ja::plan_block_order(t, order.data(), scratch.data());
  ja::plan_block_starts(t, order.data(), pstart.data());
  const ja::StreamOrder so{order.data(), pstart.data()};
  const int32_t nq = ja::ceil_div(S, tm), nk = ja::ceil_div(S, tn);
  std::vector<uint8_t> cls(size_t(nq) * size_t(nk));
  int32_t num_partial = 0;
  const int32_t listed = ja::tile_classes(t, so, S, tm, tn, cls.data(), &num_partial);
  const auto opts = block_start.options();
  at::Tensor perm = at::empty({S}, opts);
  for (int32_t p = 0; p < S; ++p)
    perm.data_ptr<int32_t>()[p] = ja::plan_token(t, order.data(), pstart.data(), p).token;
  at::Tensor fwd_ptr = at::empty({nq + 1}, opts), fwd_tile = at::empty({listed}, opts),
             fwd_mask = at::empty({listed}, opts), bwd_ptr = at::empty({nk + 1}, opts),
             bwd_tile = at::empty({listed}, opts), bwd_mask = at::empty({listed}, opts);
  ja::tile_lists(cls.data(), nq, nk, fwd_ptr.data_ptr<int32_t>(), fwd_tile.data_ptr<int32_t>(),
                 fwd_mask.data_ptr<int32_t>(), bwd_ptr.data_ptr<int32_t>(),
                 bwd_tile.data_ptr<int32_t>(), bwd_mask.data_ptr<int32_t>());
  const int32_t wpr = ja::mask_words(tn);
  at::Tensor masks = at::empty({num_partial, tm, wpr}, opts);
  auto* words = reinterpret_cast<uint32_t*>(masks.data_ptr<int32_t>());
  for (int32_t i = 0; i < nq; ++i) {
    for (int32_t e = fwd_ptr.data_ptr<int32_t>()[i]; e < fwd_ptr.data_ptr<int32_t>()[i + 1]; ++e) {
      const int32_t m = fwd_mask.data_ptr<int32_t>()[e];
      if (m < 0) continue;
      ja::tile_mask(t, so, S, tm, tn, i, fwd_tile.data_ptr<int32_t>()[e],
                    words + int64_t(m) * tm * wpr);
    }
  }
  return {perm, fwd_ptr, fwd_tile, fwd_mask, bwd_ptr, bwd_tile, bwd_mask, masks};
}

// The consumer side, on the CPU: visible [S, S] uint8 in permuted coordinates, as the kernels
// walking these lists will see it (jacobi/tile_list.h listed_visible). The CUDA implementation
// (csrc/cuda/attention/sm90/) runs the same function on the device.
at::Tensor debug_expand_tile_lists_cpu(const at::Tensor& fwd_ptr, const at::Tensor& fwd_tile,
                                       const at::Tensor& fwd_mask, const at::Tensor& masks,
                                       int64_t seq_len, int64_t tile_m, int64_t tile_n) {
  namespace ja = jacobi::attn;
  check_tile_sizes(tile_m, tile_n);
  const int32_t S = int32_t(seq_len);
  const ja::TileLists l = tile_lists_view(fwd_ptr, fwd_tile, fwd_mask, masks, seq_len, tile_m,
                                          tile_n);
  at::Tensor vis = at::empty({S, S}, fwd_ptr.options().dtype(at::kByte));
  for (int32_t p = 0; p < S; ++p)
    for (int32_t c = 0; c < S; ++c)
      vis.data_ptr<uint8_t>()[int64_t(p) * S + c] = ja::listed_visible(l, p, c) ? 1 : 0;
  return vis;
}

}  // namespace

// Defined here rather than in module.cpp: ops owned by the CUDA attention's plan.
TORCH_LIBRARY_FRAGMENT(jacobi_ext, m) {
  m.def(
      "debug_tile_plan(Tensor block_start, Tensor kv_ptr, Tensor kv_idx, int seq_len) -> "
      "(Tensor perm, Tensor block_of, Tensor tile_class)");
  m.def(
      "attention_tile_lists(Tensor block_start, Tensor kv_ptr, Tensor kv_idx, int seq_len, "
      "int tile_m, int tile_n) -> (Tensor perm, Tensor fwd_ptr, Tensor fwd_tile, "
      "Tensor fwd_mask, Tensor bwd_ptr, Tensor bwd_tile, Tensor bwd_mask, Tensor masks)");
  m.def(
      "debug_expand_tile_lists(Tensor fwd_ptr, Tensor fwd_tile, Tensor fwd_mask, Tensor masks, "
      "int seq_len, int tile_m, int tile_n) -> Tensor");
}

TORCH_LIBRARY_IMPL(jacobi_ext, CPU, m) {
  m.impl("debug_tile_plan", &debug_tile_plan_cpu);
  m.impl("attention_tile_lists", &attention_tile_lists_cpu);
  m.impl("debug_expand_tile_lists", &debug_expand_tile_lists_cpu);
}

}  // namespace jacobi::ops
