// block_attention_fwd / block_attention_bwd: the CUDA implementation (checks, allocation, launch).
// Kernels: csrc/cuda/attention/ (torch-free). Schemas: module.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "attention_kernel.h"
#include "checks.h"
#include "cuda_launch.h"
#include "cuda/attention/attention_cuda.h"
#ifdef JACOBI_WITH_SM90
#include "cuda/attention/sm90/attention_sm90.h"
#include "tile_lists_view.h"
#endif

namespace jacobi::ops {
namespace {

namespace ca = jacobi::cuda::attn;
namespace ck = jacobi::checks;

struct AttnShape {
  int32_t batch, heads_q, heads_kv, seq_len, head_dim;
  ca::DType dtype;
};

// The kernels read rows of 16-byte chunks: a unit last-dim stride, other strides multiples of 8
// elements and a 16-byte aligned base. Anything else (rare: slicing the head dim) is copied.
at::Tensor rows_ready(const at::Tensor& t) {
  const bool ok = t.stride(3) == 1 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 &&
                  t.stride(2) % 8 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  return ok ? t : t.contiguous();
}

ca::Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

AttnShape check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  ck::rank(q, "q", 4, "[B, Hq, S, D]");
  ck::rank(k, "k", 4, "[B, Hkv, S, D]");
  ck::rank(v, "v", 4, "[B, Hkv, S, D]");
  TORCH_CHECK_VALUE(q.is_cuda(), op, ": q must be a CUDA tensor here, got ", q.device());
  ck::same_device(k, "k", q, "q");
  ck::same_device(v, "v", q, "q");
  const auto st = q.scalar_type();
  TORCH_CHECK_VALUE(st == at::kBFloat16 || st == at::kHalf, op,
                    ": the CUDA kernels take bfloat16 or float16 q/k/v, got ", st,
                    "; cast them (e.g. q.to(torch.bfloat16)) or run on CPU for float32");
  TORCH_CHECK_VALUE(ca::supported_dtype(st == at::kBFloat16 ? ca::DType::bf16 : ca::DType::fp16),
                    op, ": this build of jacobi_ext compiled the CUDA attention for bfloat16 only "
                    "(CMake JACOBI_EXT_CUDA_KERNELS=ci, a compile check); rebuild with the full "
                    "kernel set or cast q/k/v to bfloat16");
  ck::dtype(k, "k", st);
  ck::dtype(v, "v", st);
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), op, ": k and v must have the same shape, got ",
                    k.sizes(), " and ", v.sizes());
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3),
                    op, ": q ", q.sizes(), " and k ", k.sizes(),
                    " must agree on batch, sequence length and head dim");
  TORCH_CHECK_VALUE(k.size(1) > 0 && q.size(1) % k.size(1) == 0, op,
                    ": the number of query heads (", q.size(1),
                    ") must be a multiple of the number of key/value heads (", k.size(1), ")");
  TORCH_CHECK_VALUE(ca::supported_head_dim(q.size(3)), op, ": head dim ", q.size(3),
                    " has no CUDA kernel (compiled: 64, 96, 128, 256); jacobi_ext.block_attention "
                    "and jacobi_attention run other head dims in 32..256 through FlexAttention, "
                    "or pad the head dim");
  TORCH_CHECK_VALUE(q.size(2) < (int64_t(1) << 30), op, ": seq_len must be < 2**30, got ",
                    q.size(2));
  TORCH_CHECK_VALUE(q.size(0) * q.size(1) <= ca::kMaxGridY, op, ": batch * query heads (",
                    q.size(0), " * ", q.size(1), ") must be at most ", ca::kMaxGridY,
                    "; split the batch");
  // Everything the launch relies on, in the kernels' own terms (the checks above imply it).
  TORCH_CHECK_VALUE(ca::valid_shape(q.size(0), q.size(1), k.size(1), q.size(3)), op,
                    ": unsupported shape q ", q.sizes(), ", k ", k.sizes());
  return {int32_t(q.size(0)), int32_t(q.size(1)), int32_t(k.size(1)), int32_t(q.size(2)),
          int32_t(q.size(3)), st == at::kBFloat16 ? ca::DType::bf16 : ca::DType::fp16};
}

// Block table tensors: int32, 1-D, contiguous, on q's device (values are not read on the host:
// that would synchronise; the layout layer builds them, jacobi/block_table.h fixes the format).
BlockTable check_table(const char* op, const at::Tensor& q, const at::Tensor& block_start,
                       const at::Tensor& kv_ptr, const at::Tensor& kv_idx) {
  for (auto [t, name] : {std::pair{&block_start, "block_start"}, {&kv_ptr, "kv_ptr"},
                         {&kv_idx, "kv_idx"}}) {
    ck::rank(*t, name, 1, "[n]");
    ck::dtype(*t, name, at::kInt);
    ck::same_device(*t, name, q, "q");
    ck::contiguous(*t, name);
  }
  TORCH_CHECK_VALUE(block_start.numel() >= 1 && kv_ptr.numel() == block_start.numel(), op,
                    ": block_start and kv_ptr must both have num_blocks + 1 entries, got ",
                    block_start.numel(), " and ", kv_ptr.numel());
  return {block_start.data_ptr<int32_t>(), kv_ptr.data_ptr<int32_t>(),
          kv_idx.numel() ? kv_idx.data_ptr<int32_t>() : kv_ptr.data_ptr<int32_t>(),
          int32_t(block_start.numel() - 1)};
}

// Compute capability major of q's device (cudaDeviceGetAttribute: cheap, no context switch; not
// ATen/cuda/CUDAContext.h, which needs the cuSPARSE headers of a full toolkit).
int cc_major(const char* op, const at::Tensor& t) {
  int major = 0;
  check_launch(op, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                          t.device().index()));
  return major;
}

// The kernel family of this call (attention_kernel.h names, attention_cuda.h choose_kernel): the
// one named (None / 'auto': sm80, the portable one); the device's compute capability decides
// where sm90 can run; asking for it elsewhere warns once.
ca::Kernel pick_kernel(const char* op, const std::optional<std::string_view>& kernel,
                       const at::Tensor& q, ca::DType dtype, int64_t head_dim) {
  const AttnKernel k = parse_kernel(kernel, op);
  TORCH_CHECK_VALUE(k != AttnKernel::cpu, op, ": kernel='cpu' is the CPU kernel but q is on ",
                    q.device(), "; pass kernel=None, 'auto', 'sm80' or 'sm90'");
  const ca::KernelChoice c =
      ca::choose_kernel(k == AttnKernel::sm90, cc_major(op, q), dtype, head_dim);
  if (c.fallback_reason != nullptr) {
    TORCH_WARN_ONCE("jacobi_ext attention: kernel 'sm90' was asked for, running 'sm80': ",
                    c.fallback_reason);
  }
  return c.kernel;
}

ca::Plan make_plan(const char* op, const BlockTable& table, int32_t seq_len, const at::Tensor& q,
                   at::Tensor& workspace, cudaStream_t stream) {
  workspace = at::empty({int64_t(ca::plan_workspace_bytes(seq_len, table.num_blocks)) + 16},
                        q.options().dtype(at::kByte));
  ca::Plan plan{};
  check_launch(op, ca::build_plan(table, seq_len, workspace.data_ptr(), &plan, stream));
  return plan;
}

#ifdef JACOBI_WITH_SM90
// The host-built tile lists at 128 x 128 (`tile_lists`, the 8 outputs of
// jacobi_ext::attention_tile_lists on q's device, or built here from a copy of the table, which
// synchronises), checked; their device view, forward and backward lists both. `keep` holds the
// tensors until the launch is queued.
jacobi::attn::TileLists sm90_lists(const char* op, const at::Tensor& q,
                                   const at::Tensor& block_start, const at::Tensor& kv_ptr,
                                   const at::Tensor& kv_idx,
                                   std::optional<at::TensorList> tile_lists,
                                   std::vector<at::Tensor>& lists) {
  const int64_t S = q.size(2);
  if (tile_lists.has_value()) lists.assign(tile_lists->begin(), tile_lists->end());
  if (lists.empty()) {
    static auto build = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("jacobi_ext::attention_tile_lists", "")
                            .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                              at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                                const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                int64_t, int64_t)>();
    auto t = build.call(block_start.cpu(), kv_ptr.cpu(), kv_idx.cpu(), S, ca::sm90::kTileM,
                        ca::sm90::kTileN);
    for (const at::Tensor& x : {std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t),
                                std::get<4>(t), std::get<5>(t), std::get<6>(t), std::get<7>(t)})
      lists.push_back(x.to(q.device()));
  }
  TORCH_CHECK_VALUE(lists.size() == 8, op, ": tile_lists must be the 8 tensors of "
                    "jacobi_ext::attention_tile_lists(block_start, kv_ptr, kv_idx, S, ",
                    ca::sm90::kTileM, ", ", ca::sm90::kTileN, "), got ", lists.size());
  const at::Tensor& perm = lists[0];
  ck::same_device(perm, "tile_lists[0] (perm)", q, "q");
  ck::dtype(perm, "tile_lists[0] (perm)", at::kInt);
  ck::contiguous(perm, "tile_lists[0] (perm)");
  TORCH_CHECK_VALUE(perm.dim() == 1 && perm.numel() == S, op, ": tile_lists[0] (perm) must have ",
                    S, " entries, got ", perm.sizes());
  // masks are read 16 bytes at a time.
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(lists[7].data_ptr()) % 16 == 0, op,
                    ": tile_lists[7] (masks) must be 16-byte aligned");
  jacobi::attn::TileLists l = tile_lists_view(lists[1], lists[2], lists[3], lists[7], S,
                                              ca::sm90::kTileM, ca::sm90::kTileN);
  // The backward lists (tile_lists_view checks the forward ones): one entry per listed pair too.
  const char* names[3] = {"tile_lists[4] (bwd_ptr)", "tile_lists[5] (bwd_tile)",
                          "tile_lists[6] (bwd_mask)"};
  for (int i = 0; i < 3; ++i) {
    ck::same_device(lists[4 + i], names[i], q, "q");
    ck::dtype(lists[4 + i], names[i], at::kInt);
    ck::contiguous(lists[4 + i], names[i]);
  }
  TORCH_CHECK_VALUE(lists[4].dim() == 1 && lists[4].numel() == l.num_k_tiles + 1, op, ": ",
                    names[0], " must have ", l.num_k_tiles + 1, " entries, got ", lists[4].sizes());
  TORCH_CHECK_VALUE(lists[5].sizes() == lists[2].sizes() && lists[6].sizes() == lists[2].sizes(),
                    op, ": ", names[1], " and ", names[2], " must have fwd_tile's shape ",
                    lists[2].sizes());
  l.bwd_ptr = lists[4].data_ptr<int32_t>();
  l.bwd_tile = lists[5].data_ptr<int32_t>();
  l.bwd_mask = lists[6].data_ptr<int32_t>();
  return l;
}

// The sm_90a forward's inputs (attention_cuda.h Sm90FwdInputs): the tile lists (sm90_lists) and
// q/k/v gathered into stream order. `keep` holds the tensors the kernel reads until the launch is
// queued.
ca::Sm90FwdInputs sm90_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& block_start,
                              const at::Tensor& kv_ptr, const at::Tensor& kv_idx,
                              std::optional<at::TensorList> tile_lists,
                              std::vector<at::Tensor>& keep) {
  std::vector<at::Tensor> lists;
  ca::Sm90FwdInputs in;
  in.lists = sm90_lists(op, q, block_start, kv_ptr, kv_idx, tile_lists, lists);
  const at::Tensor& perm = lists[0];
  // Stream order, contiguous: each 128-row tile is then one TMA box.
  for (const at::Tensor* t : {&q, &k, &v}) keep.push_back(at::index_select(*t, 2, perm).contiguous());
  keep.push_back(perm);
  for (auto& x : lists) keep.push_back(x);
  in.q = keep[0].data_ptr();
  in.k = keep[1].data_ptr();
  in.v = keep[2].data_ptr();
  in.perm = perm.data_ptr<int32_t>();
  return in;
}

// The sm_90a backward's inputs (attention_cuda.h Sm90BwdInputs): the tile lists (sm90_lists: the
// forward's, which autograd passes on, or built from a host copy of the table), q/k/v/dout
// gathered into stream order, the lse/delta scratch, dq_accum ([B, Hq, S, D] fp32 zeros, read
// in stream order) and, for a deterministic dQ, its turn counters ([B, Hq, Spad / 64] int32
// zeros). `keep` holds the tensors until the launch is queued.
ca::Sm90BwdInputs sm90_bwd_inputs(const char* op, const at::Tensor& dout, const at::Tensor& q,
                                  const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& block_start, const at::Tensor& kv_ptr,
                                  const at::Tensor& kv_idx, const at::Tensor& dq_accum,
                                  bool deterministic, std::optional<at::TensorList> tile_lists,
                                  std::vector<at::Tensor>& keep) {
  std::vector<at::Tensor> lists;
  ca::Sm90BwdInputs in;
  in.lists = sm90_lists(op, q, block_start, kv_ptr, kv_idx, tile_lists, lists);
  const at::Tensor& perm = lists[0];
  for (const at::Tensor* t : {&q, &k, &v, &dout})
    keep.push_back(at::index_select(*t, 2, perm).contiguous());
  const int64_t seq_pad = int64_t(in.lists.num_q_tiles) * ca::sm90::kTileM;
  keep.push_back(at::empty({q.size(0), q.size(1), 2 * seq_pad}, q.options().dtype(at::kFloat)));
  keep.push_back(perm);
  for (auto& x : lists) keep.push_back(x);
  in.q = keep[0].data_ptr();
  in.k = keep[1].data_ptr();
  in.v = keep[2].data_ptr();
  in.dout = keep[3].data_ptr();
  in.lse_delta = keep[4].data_ptr<float>();
  in.perm = perm.data_ptr<int32_t>();
  in.dq_accum = dq_accum.data_ptr<float>();
  if (deterministic) {
    keep.push_back(at::zeros({q.size(0), q.size(1), seq_pad / ca::sm90::kBwdBlockM},
                             q.options().dtype(at::kInt)));
    in.dq_semaphore = keep.back().data_ptr<int32_t>();
  }
  return in;
}
#endif

// The family of the backward: the sm_90a backward where the forward family is sm90 and this
// build has one for (dtype, head dim), deterministic or not (a deterministic one adds each query
// tile's dQ in key-tile order); the sm_80 backward otherwise (it reads the same lse).
ca::Kernel bwd_family(ca::Kernel family, ca::DType dtype, int64_t head_dim) {
#ifdef JACOBI_WITH_SM90
  if (family == ca::Kernel::sm90 && ca::sm90::has_bwd_kernel(dtype, head_dim))
    return ca::Kernel::sm90;
#else
  (void)family;
  (void)dtype;
  (void)head_dim;
#endif
  return ca::Kernel::sm80;
}

std::tuple<at::Tensor, at::Tensor> block_attention_fwd_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& block_start, const at::Tensor& kv_ptr, const at::Tensor& kv_idx,
    double scale, std::optional<std::string_view> kernel,
    std::optional<at::TensorList> tile_lists) {
  const char* op = "block_attention_fwd";
  const AttnShape s = check_qkv(op, q_in, k_in, v_in);
  const BlockTable table = check_table(op, q_in, block_start, kv_ptr, kv_idx);
  const ca::Kernel family = pick_kernel(op, kernel, q_in, s.dtype, s.head_dim);
  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = rows_ready(q_in), k = rows_ready(k_in), v = rows_ready(v_in);
  at::Tensor out = at::empty(q.sizes(), q.options());  // every row is written
  at::Tensor lse = at::empty({s.batch, s.heads_q, s.seq_len}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {out, lse};
  const cudaStream_t stream = current_stream();
  at::Tensor workspace;
  ca::FwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_stride = strides_of(q);
  p.k_stride = strides_of(k);
  p.v_stride = strides_of(v);
  p.o_stride = strides_of(out);
  p.batch = s.batch;
  p.heads_q = s.heads_q;
  p.heads_kv = s.heads_kv;
  p.seq_len = s.seq_len;
  p.head_dim = s.head_dim;
  p.scale = float(scale);
  p.kernel = family;
  std::vector<at::Tensor> keep;  // the sm90 inputs, alive until the launch is queued
#ifdef JACOBI_WITH_SM90
  if (family == ca::Kernel::sm90) {
    p.sm90 = sm90_inputs(op, q, k, v, block_start, kv_ptr, kv_idx, tile_lists, keep);
  } else {
    p.plan = make_plan(op, table, s.seq_len, q, workspace, stream);
  }
#else
  p.plan = make_plan(op, table, s.seq_len, q, workspace, stream);
#endif
  check_launch(op, ca::block_attention_fwd(p, s.dtype, stream));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_attention_bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in,
    const at::Tensor& block_start, const at::Tensor& kv_ptr, const at::Tensor& kv_idx,
    double scale, bool deterministic, std::optional<std::string_view> kernel,
    std::optional<at::TensorList> tile_lists) {
  const char* op = "block_attention_bwd";
  const AttnShape s = check_qkv(op, q_in, k_in, v_in);
  const BlockTable table = check_table(op, q_in, block_start, kv_ptr, kv_idx);
  const ca::Kernel family =
      bwd_family(pick_kernel(op, kernel, q_in, s.dtype, s.head_dim), s.dtype, s.head_dim);
  for (auto [t, name] : {std::pair{&dout_in, "grad_out"}, {&out_in, "out"}}) {
    ck::same_device(*t, name, q_in, "q");
    ck::dtype(*t, name, q_in.scalar_type());
    TORCH_CHECK_VALUE(t->sizes() == q_in.sizes(), op, ": ", name, " must have q's shape ",
                      q_in.sizes(), ", got ", t->sizes());
  }
  ck::same_device(lse_in, "lse", q_in, "q");
  ck::dtype(lse_in, "lse", at::kFloat);
  TORCH_CHECK_VALUE(lse_in.dim() == 3 && lse_in.size(0) == s.batch && lse_in.size(1) == s.heads_q &&
                        lse_in.size(2) == s.seq_len,
                    op, ": lse must be [B, Hq, S] = [", s.batch, ", ", s.heads_q, ", ", s.seq_len,
                    "], got ", lse_in.sizes());
  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = rows_ready(q_in), k = rows_ready(k_in), v = rows_ready(v_in);
  const at::Tensor dout = rows_ready(dout_in), out = rows_ready(out_in);
  const at::Tensor lse = lse_in.contiguous();
  at::Tensor dq = at::empty(q.sizes(), q.options());  // every row is written
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  if (q.numel() == 0) return {dq, dk, dv};
  const cudaStream_t stream = current_stream();
  at::Tensor workspace;
  // rowsum(dout * out) for the sm_80 backward; the sm_90a one keeps its own (lse_delta).
  at::Tensor dsum;
  if (family != ca::Kernel::sm90)
    dsum = at::empty({s.batch, s.heads_q, s.seq_len}, q.options().dtype(at::kFloat));
  // fp32 dQ sums: the sm_90a backward's always, the sm_80 one's in its fast (atomic) mode.
  at::Tensor dq_accum;
  if (family == ca::Kernel::sm90 || !deterministic)
    dq_accum = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
  ca::BwdParams p{};
  p.dout = dout.data_ptr();
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dq_accum = dq_accum.defined() ? dq_accum.data_ptr<float>() : nullptr;
  p.dsum = dsum.defined() ? dsum.data_ptr<float>() : nullptr;
  p.do_stride = strides_of(dout);
  p.q_stride = strides_of(q);
  p.k_stride = strides_of(k);
  p.v_stride = strides_of(v);
  p.o_stride = strides_of(out);
  p.dq_stride = strides_of(dq);
  p.dk_stride = strides_of(dk);
  p.dv_stride = strides_of(dv);
  p.batch = s.batch;
  p.heads_q = s.heads_q;
  p.heads_kv = s.heads_kv;
  p.seq_len = s.seq_len;
  p.head_dim = s.head_dim;
  p.scale = float(scale);
  p.deterministic = deterministic;
  p.kernel = family;
  std::vector<at::Tensor> keep;  // the sm90 inputs, alive until the launches are queued
#ifdef JACOBI_WITH_SM90
  if (family == ca::Kernel::sm90) {
    p.sm90 = sm90_bwd_inputs(op, dout, q, k, v, block_start, kv_ptr, kv_idx, dq_accum,
                             deterministic, tile_lists, keep);
  } else {
    p.plan = make_plan(op, table, s.seq_len, q, workspace, stream);
  }
#else
  p.plan = make_plan(op, table, s.seq_len, q, workspace, stream);
#endif
  check_launch(op, ca::block_attention_bwd(p, s.dtype, stream));
  return {dq, dk, dv};
}

// Which family block_attention_fwd/bwd would run for q with this `kernel` ("sm80" or "sm90"):
// for benchmarks and tests, so that a figure always names the kernel that produced it.
std::string attention_kernel_cuda(const at::Tensor& q, std::optional<std::string_view> kernel) {
  const char* op = "attention_kernel";
  ck::rank(q, "q", 4, "[B, Hq, S, D]");
  const ca::DType dtype = q.scalar_type() == at::kHalf ? ca::DType::fp16 : ca::DType::bf16;
  const ca::Kernel k = pick_kernel(op, kernel, q, dtype, q.size(3));
  return k == ca::Kernel::sm90 ? "sm90" : "sm80";
}

// Which family block_attention_bwd would run for q with this `kernel` and `deterministic`:
// "sm90" only where the forward family is sm90 and the sm_90a backward applies (bwd_family);
// both families have both dQ modes, so `deterministic` no longer changes the answer (the op's
// schema keeps it).
std::string attention_bwd_kernel_cuda(const at::Tensor& q, bool /*deterministic*/,
                                      std::optional<std::string_view> kernel) {
  const char* op = "attention_bwd_kernel";
  ck::rank(q, "q", 4, "[B, Hq, S, D]");
  const ca::DType dtype = q.scalar_type() == at::kHalf ? ca::DType::fp16 : ca::DType::bf16;
  const ca::Kernel k =
      bwd_family(pick_kernel(op, kernel, q, dtype, q.size(3)), dtype, q.size(3));
  return k == ca::Kernel::sm90 ? "sm90" : "sm80";
}

#ifdef JACOBI_WITH_SM90
// The sm_90a tile-list consumer (attention_sm90.cu), for the GPU test of the host-built lists.
at::Tensor debug_expand_tile_lists_cuda(const at::Tensor& fwd_ptr, const at::Tensor& fwd_tile,
                                        const at::Tensor& fwd_mask, const at::Tensor& masks,
                                        int64_t seq_len, int64_t tile_m, int64_t tile_n) {
  TORCH_CHECK_VALUE(cc_major("debug_expand_tile_lists", fwd_ptr) == 9,
                    "debug_expand_tile_lists: the CUDA tile-list consumer is sm_90a code and "
                    "needs a compute capability 9.x device; run it on the CPU elsewhere");
  c10::cuda::CUDAGuard guard(fwd_ptr.device());
  const jacobi::attn::TileLists l =
      tile_lists_view(fwd_ptr, fwd_tile, fwd_mask, masks, seq_len, tile_m, tile_n);
  at::Tensor vis = at::empty({seq_len, seq_len}, fwd_ptr.options().dtype(at::kByte));
  check_launch("debug_expand_tile_lists",
               ca::sm90::expand_tile_lists(l, int32_t(seq_len), vis.data_ptr<uint8_t>(),
                                           current_stream()));
  return vis;
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(jacobi_ext, CUDA, m) {
  m.impl("block_attention_fwd", &block_attention_fwd_cuda);
  m.impl("block_attention_bwd", &block_attention_bwd_cuda);
  m.impl("attention_kernel", &attention_kernel_cuda);
  m.impl("attention_bwd_kernel", &attention_bwd_kernel_cuda);
#ifdef JACOBI_WITH_SM90
  m.impl("debug_expand_tile_lists", &debug_expand_tile_lists_cuda);
#endif
}

}  // namespace jacobi::ops
