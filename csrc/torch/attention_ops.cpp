// block_attention_fwd / block_attention_bwd (CPU) and jf_block_table: argument checks, output
// allocation, and the hand-off to the torch-free kernels in csrc/cpu/attention_cpu.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/fill.h>
#include <sys/mman.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "attention_kernel.h"
#include "checks.h"
#include "cpu/attention_cpu.h"
#include "jacobi/block_table.h"

namespace jacobi::ops {
namespace {

namespace ck = jacobi::checks;
using cpu::AttnPlan;

// Reads and validates the block table (int32, 1-D, contiguous, on the CPU with q) for a
// sequence of seq_len tokens. Every invariant the kernels rely on is checked here, once.
BlockTable check_table(const at::Tensor& block_start, const at::Tensor& kv_ptr,
                       const at::Tensor& kv_idx, const at::Tensor& q, int64_t seq_len) {
  for (auto [t, name] :
       {std::pair{&block_start, "block_start"}, {&kv_ptr, "kv_ptr"}, {&kv_idx, "kv_idx"}}) {
    ck::rank(*t, name, 1, "(block table)");
    ck::dtype(*t, name, at::kInt);
    ck::contiguous(*t, name);
    ck::same_device(*t, name, q, "q");
  }
  const int64_t nb = block_start.size(0) - 1;
  TORCH_CHECK_VALUE(nb >= 0, "block_start must have num_blocks + 1 >= 1 entries");
  TORCH_CHECK_VALUE(kv_ptr.size(0) == nb + 1, "kv_ptr must have num_blocks + 1 = ", nb + 1,
                    " entries (like block_start), got ", kv_ptr.size(0));
  const int32_t* bs = block_start.data_ptr<int32_t>();
  const int32_t* kp = kv_ptr.data_ptr<int32_t>();
  const int32_t* ki = kv_idx.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(bs[0] == 0, "block_start[0] must be 0, got ", bs[0]);
  for (int64_t b = 0; b < nb; ++b)
    TORCH_CHECK_VALUE(bs[b + 1] >= bs[b], "block_start must be non-decreasing, but block_start[",
                      b + 1, "] = ", bs[b + 1], " < block_start[", b, "] = ", bs[b]);
  TORCH_CHECK_VALUE(bs[nb] == seq_len, "the block table covers ", bs[nb],
                    " tokens (block_start[-1]) but q, k, v have seq_len = ", seq_len,
                    "; build the table for this sequence length");
  TORCH_CHECK_VALUE(kp[0] == 0 && kp[nb] == kv_idx.size(0),
                    "kv_ptr must start at 0 and end at "
                    "len(kv_idx) = ",
                    kv_idx.size(0), ", got kv_ptr[0] = ", kp[0], ", kv_ptr[-1] = ", kp[nb]);
  for (int64_t b = 0; b < nb; ++b) {
    TORCH_CHECK_VALUE(kp[b + 1] >= kp[b], "kv_ptr must be non-decreasing (at block ", b, ")");
    for (int32_t i = kp[b]; i < kp[b + 1]; ++i) {
      TORCH_CHECK_VALUE(ki[i] >= 0 && ki[i] < b, "kv_idx of query block ", b,
                        " must list key blocks in [0, ", b, "), got ", ki[i]);
      TORCH_CHECK_VALUE(i == kp[b] || ki[i] > ki[i - 1], "kv_idx of query block ", b,
                        " must be strictly ascending");
    }
  }
  return BlockTable{bs, kp, ki, static_cast<int32_t>(nb)};
}

// Memory row of every token of the table's processing order. block_row (optional) gives each
// block's first memory row; the blocks' ranges must tile [0, seq_len) exactly once.
std::vector<int32_t> row_map(const BlockTable& t, int64_t seq_len, const at::Tensor* block_row,
                             const at::Tensor& q) {
  std::vector<int32_t> row_of(seq_len);
  if (block_row == nullptr) {
    for (int64_t i = 0; i < seq_len; ++i) row_of[i] = static_cast<int32_t>(i);
    return row_of;
  }
  ck::rank(*block_row, "block_row", 1, "[num_blocks]");
  ck::dtype(*block_row, "block_row", at::kInt);
  ck::contiguous(*block_row, "block_row");
  ck::same_device(*block_row, "block_row", q, "q");
  TORCH_CHECK_VALUE(block_row->size(0) == t.num_blocks, "block_row must have one entry per block (",
                    t.num_blocks, "), got ", block_row->size(0));
  const int32_t* br = block_row->data_ptr<int32_t>();
  std::vector<uint8_t> hit(seq_len, 0);
  for (int b = 0; b < t.num_blocks; ++b) {
    const int32_t len = t.block_start[b + 1] - t.block_start[b];
    TORCH_CHECK_VALUE(br[b] >= 0 && static_cast<int64_t>(br[b]) + len <= seq_len, "block_row[", b,
                      "] = ", br[b], " puts block ", b, " (", len, " tokens) outside [0, ", seq_len,
                      ")");
    for (int32_t i = 0; i < len; ++i) {
      TORCH_CHECK_VALUE(!hit[br[b] + i], "block_row maps two blocks onto memory row ", br[b] + i,
                        "; the blocks' memory ranges must not overlap");
      hit[br[b] + i] = 1;
      row_of[t.block_start[b] + i] = br[b] + i;
    }
  }
  return row_of;
}

struct AttnShape {
  cpu::AttnDims dims;
  cpu::DType dtype;
};

AttnShape check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  ck::rank(q, "q", 4, "[batch, q_heads, seq_len, head_dim]");
  ck::rank(k, "k", 4, "[batch, kv_heads, seq_len, head_dim]");
  ck::rank(v, "v", 4, "[batch, kv_heads, seq_len, head_dim]");
  const auto st = q.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
                    "q must be float32, bfloat16 or float16, got ", st);
  ck::dtype(k, "k", st);
  ck::dtype(v, "v", st);
  ck::same_device(k, "k", q, "q");
  ck::same_device(v, "v", q, "q");
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3);
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have the same shape, got ", k.sizes(),
                    " and ", v.sizes());
  TORCH_CHECK_VALUE(k.size(0) == B && k.size(2) == S && k.size(3) == D,
                    "k and v must be [batch=", B, ", kv_heads, seq_len=", S, ", head_dim=", D,
                    "] to match q, got ", k.sizes());
  const int64_t Hkv = k.size(1);
  TORCH_CHECK_VALUE(Hkv >= 1 && Hq % Hkv == 0, "the number of query heads (", Hq,
                    ") must be a multiple of the number of key/value heads (", Hkv, ")");
  TORCH_CHECK_VALUE(D >= 1 && D <= 256, "head_dim must be in [1, 256], got ", D);
  TORCH_CHECK_VALUE(S <= std::numeric_limits<int32_t>::max(), "seq_len must fit in int32");
  const cpu::DType dt = st == at::kFloat      ? cpu::DType::f32
                        : st == at::kBFloat16 ? cpu::DType::bf16
                                              : cpu::DType::f16;
  return {{B, Hq, Hkv, S, D}, dt};
}

// The kernels take any strides for batch, head and token, but the head_dim must be unit-stride
// (each row is a GEMM operand).
cpu::Strides4 strides(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.size(3) <= 1 || t.stride(3) == 1, name,
                    " must be contiguous in its last dim (head_dim), got strides ", t.strides(),
                    "; call .contiguous()");
  return {t.stride(0), t.stride(1), t.stride(2)};
}

// The CPU has one kernel: None / 'auto' (the device's portable kernel) and 'cpu' run it; a CUDA
// kernel named for CPU tensors is a mistake worth a clear error. The environment plays no part:
// jacobi_ext/attention.py decides which kernel a call is passed (attention_kernel.h).
void check_cpu_kernel(const std::optional<std::string_view>& kernel, const char* op) {
  const AttnKernel k = parse_kernel(kernel, op);
  TORCH_CHECK_VALUE(k == AttnKernel::automatic || k == AttnKernel::cpu, op, ": kernel='",
                    kernel_name(k), "' is a CUDA kernel but q is on the CPU; pass kernel=None, "
                    "'auto' or 'cpu'");
}

// Tile sizes: 64 queries x 128 keys by default. JACOBI_EXT_ATTN_TILES="bq,bk" overrides them
// (for tuning and for tests that want many tile boundaries).
std::pair<int, int> tile_sizes() {
  int bq = 64, bk = 128;
  if (const char* env = std::getenv("JACOBI_EXT_ATTN_TILES"); env != nullptr && *env != '\0') {
    const std::string s(env);
    const auto comma = s.find(',');
    TORCH_CHECK_VALUE(comma != std::string::npos, "JACOBI_EXT_ATTN_TILES must be 'bq,bk', got '", s,
                      "'");
    bq = std::stoi(s.substr(0, comma));
    bk = std::stoi(s.substr(comma + 1));
    TORCH_CHECK_VALUE(bq >= 1 && bk >= 1 && bq <= 4096 && bk <= 4096,
                      "JACOBI_EXT_ATTN_TILES sizes must be in [1, 4096], got '", s, "'");
  }
  return {bq, bk};
}

// The per-call fp32 workspaces (and the outputs) are tens of MB at training lengths and are written
// once right after allocation: with 4 KiB pages the first touch costs a fault per page (~8% of a
// backward at S=4096 when measured). Where transparent huge pages are in "madvise" mode, ask for
// them on the 2 MiB-aligned interior of the buffer, before anything touches it.
void want_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = begin + t.nbytes();
  const uintptr_t a = (begin + kHuge - 1) & ~(kHuge - 1), b = end & ~(kHuge - 1);
  if (b > a) madvise(reinterpret_cast<void*>(a), b - a, MADV_HUGEPAGE);  // advisory: ignore errors
#else
  (void)t;
#endif
}

// Test hook: with JACOBI_EXT_ATTN_POISON=1 every output and workspace is filled with NaN before
// the kernel runs, so a test can prove that each output element is written and that no unwritten
// workspace element is read (torch.empty alone would hide both).
bool poison_requested() {
  const char* env = std::getenv("JACOBI_EXT_ATTN_POISON");
  return env != nullptr && env[0] == '1';
}

void poison(std::initializer_list<at::Tensor*> ts) {
  if (!poison_requested()) return;
  for (at::Tensor* t : ts)
    if (t->defined()) t->fill_(std::numeric_limits<double>::quiet_NaN());
}

std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, const at::Tensor& block_start,
                                                 const at::Tensor& kv_ptr, const at::Tensor& kv_idx,
                                                 const at::Tensor* block_row, double scale) {
  const AttnShape sh = check_qkv(q, k, v);
  const auto& d = sh.dims;
  const BlockTable table = check_table(block_start, kv_ptr, kv_idx, q, d.S);
  const std::vector<int32_t> row_of = row_map(table, d.S, block_row, q);
  at::Tensor out = at::empty({d.B, d.Hq, d.S, d.D}, q.options());
  at::Tensor lse = at::empty({d.B, d.Hq, d.S}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, lse};
  const auto [bq, bk] = tile_sizes();
  const AttnPlan plan = cpu::make_attn_plan(table, d.S, bq, bk);
  at::Tensor ws =
      at::empty({cpu::fwd_workspace_floats(d, sh.dtype)}, q.options().dtype(at::kFloat));
  for (const at::Tensor* t : {&ws, &out}) want_huge_pages(*t);
  poison({&out, &lse, &ws});
  const cpu::AttnFwdArgs args{sh.dtype,
                              d,
                              static_cast<float>(scale),
                              q.data_ptr(),
                              strides(q, "q"),
                              k.data_ptr(),
                              strides(k, "k"),
                              v.data_ptr(),
                              strides(v, "v"),
                              out.data_ptr(),
                              lse.data_ptr<float>(),
                              row_of.data(),
                              ws.data_ptr<float>()};
  JACOBI_CPU_DISPATCH(block_attention_fwd, args, plan, table);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> block_attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v,
                                                           const at::Tensor& block_start,
                                                           const at::Tensor& kv_ptr,
                                                           const at::Tensor& kv_idx, double scale,
                                                           std::optional<std::string_view> kernel,
                                                           std::optional<at::TensorList> /*sm90 only*/) {
  check_cpu_kernel(kernel, "block_attention_fwd");
  return attention_fwd(q, k, v, block_start, kv_ptr, kv_idx, nullptr, scale);
}

std::tuple<at::Tensor, at::Tensor> block_attention_ordered_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& block_start,
    const at::Tensor& kv_ptr, const at::Tensor& kv_idx, const at::Tensor& block_row, double scale) {
  return attention_fwd(q, k, v, block_start, kv_ptr, kv_idx, &block_row, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& block_start,
    const at::Tensor& kv_ptr, const at::Tensor& kv_idx, const at::Tensor* block_row, double scale) {
  const AttnShape sh = check_qkv(q, k, v);
  const auto& d = sh.dims;
  ck::rank(grad_out, "grad_out", 4, "[batch, q_heads, seq_len, head_dim]");
  ck::rank(out, "out", 4, "[batch, q_heads, seq_len, head_dim]");
  ck::rank(lse, "lse", 3, "[batch, q_heads, seq_len]");
  TORCH_CHECK_VALUE(grad_out.sizes() == q.sizes(), "grad_out must have q's shape ", q.sizes(),
                    ", got ", grad_out.sizes());
  TORCH_CHECK_VALUE(out.sizes() == q.sizes(), "out must have q's shape ", q.sizes(), ", got ",
                    out.sizes());
  TORCH_CHECK_VALUE(lse.size(0) == d.B && lse.size(1) == d.Hq && lse.size(2) == d.S,
                    "lse must be [", d.B, ", ", d.Hq, ", ", d.S, "], got ", lse.sizes());
  ck::dtype(grad_out, "grad_out", q.scalar_type());
  ck::dtype(out, "out", q.scalar_type());
  ck::dtype(lse, "lse", at::kFloat);
  ck::contiguous(lse, "lse");
  for (auto [t, name] : {std::pair{&grad_out, "grad_out"}, {&out, "out"}, {&lse, "lse"}})
    ck::same_device(*t, name, q, "q");
  const BlockTable table = check_table(block_start, kv_ptr, kv_idx, q, d.S);
  const std::vector<int32_t> row_of = row_map(table, d.S, block_row, q);

  at::Tensor dq = at::empty({d.B, d.Hq, d.S, d.D}, q.options());
  at::Tensor dk = at::empty({d.B, d.Hkv, d.S, d.D}, q.options());
  at::Tensor dv = at::empty({d.B, d.Hkv, d.S, d.D}, q.options());
  if (dq.numel() == 0) return {dq, dk, dv};
  const auto [bq, bk] = tile_sizes();
  const AttnPlan plan = cpu::make_attn_plan(table, d.S, bq, bk);

  // Work items are (batch, kv head, chunk of key tiles). With few kv heads the key tiles are
  // split into chunks so that each thread gets several items (dynamic scheduling then evens out
  // the load); each chunk costs one fp32 dQ^T accumulator, hence the cap. The chunk count
  // depends on the thread count, so results are bit-identical run to run at a fixed
  // torch.get_num_threads().
  const int64_t nt = at::get_num_threads();
  const int64_t items = d.B * d.Hkv;
  int chunks = static_cast<int>(std::clamp<int64_t>((6 * nt + items - 1) / items, 1, 8));
  if (nt == 1) chunks = 1;
  chunks = std::min(chunks, std::max(1, plan.num_k_tiles()));
  at::Tensor ws =
      at::empty({cpu::bwd_workspace_floats(d, sh.dtype, chunks)}, q.options().dtype(at::kFloat));
  for (const at::Tensor* t : {&ws, &dq, &dk, &dv}) want_huge_pages(*t);
  poison({&dq, &dk, &dv, &ws});
  const cpu::AttnBwdArgs args{sh.dtype,
                              d,
                              static_cast<float>(scale),
                              grad_out.data_ptr(),
                              strides(grad_out, "grad_out"),
                              q.data_ptr(),
                              strides(q, "q"),
                              k.data_ptr(),
                              strides(k, "k"),
                              v.data_ptr(),
                              strides(v, "v"),
                              out.data_ptr(),
                              strides(out, "out"),
                              lse.data_ptr<float>(),
                              dq.data_ptr(),
                              dk.data_ptr(),
                              dv.data_ptr(),
                              chunks,
                              row_of.data(),
                              ws.data_ptr<float>()};
  JACOBI_CPU_DISPATCH(block_attention_bwd, args, plan, table);
  return {dq, dk, dv};
}

// The CPU backward is always deterministic (see AttnBwdArgs::chunks); the flag is for CUDA.
std::tuple<at::Tensor, at::Tensor, at::Tensor> block_attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& block_start,
    const at::Tensor& kv_ptr, const at::Tensor& kv_idx, double scale, bool /*deterministic*/,
    std::optional<std::string_view> kernel, std::optional<at::TensorList> /*tile_lists*/) {
  check_cpu_kernel(kernel, "block_attention_bwd");
  return attention_bwd(grad_out, q, k, v, out, lse, block_start, kv_ptr, kv_idx, nullptr, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_attention_ordered_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& block_start,
    const at::Tensor& kv_ptr, const at::Tensor& kv_idx, const at::Tensor& block_row, double scale,
    bool /*deterministic*/) {
  return attention_bwd(grad_out, q, k, v, out, lse, block_start, kv_ptr, kv_idx, &block_row, scale);
}

std::string attention_kernel_cpu(const at::Tensor& q, std::optional<std::string_view> kernel) {
  check_cpu_kernel(kernel, "attention_kernel");
  return "cpu";
}

std::string attention_bwd_kernel_cpu(const at::Tensor& q, bool /*deterministic*/,
                                     std::optional<std::string_view> kernel) {
  check_cpu_kernel(kernel, "attention_bwd_kernel");
  return "cpu";
}

// The Jacobi Forcing block table, from JfLayout (block_table.h): the one statement of
// docs/method.md §1.
std::tuple<at::Tensor, at::Tensor, at::Tensor> jf_block_table(int64_t prompt_len,
                                                              int64_t block_size, int64_t num_pairs,
                                                              int64_t variant, int64_t window) {
  TORCH_CHECK_VALUE(prompt_len >= 0, "prompt_len must be >= 0, got ", prompt_len);
  TORCH_CHECK_VALUE(block_size >= 1, "block_size must be >= 1, got ", block_size);
  TORCH_CHECK_VALUE(num_pairs >= 0, "num_blocks (pairs) must be >= 0, got ", num_pairs);
  TORCH_CHECK_VALUE(variant >= 0 && variant <= 2,
                    "variant must be 0 (noisy_context), 1 (clean_context) or 2 (windowed), got ",
                    variant);
  TORCH_CHECK_VALUE(variant != 2 || window >= 1, "windowed needs window >= 1, got ", window);
  TORCH_CHECK_VALUE(prompt_len + 2 * num_pairs * block_size <= std::numeric_limits<int32_t>::max(),
                    "sequence too long for int32 indices");
  const JfLayout L{static_cast<int32_t>(prompt_len), static_cast<int32_t>(block_size),
                   static_cast<int32_t>(num_pairs), static_cast<JfVariant>(variant),
                   static_cast<int32_t>(std::max<int64_t>(window, 1))};
  const int32_t nb = L.num_blocks();
  const auto opt = at::TensorOptions().dtype(at::kInt);
  at::Tensor block_start = at::empty({nb + 1}, opt);
  at::Tensor kv_ptr = at::empty({nb + 1}, opt);
  int32_t* bs = block_start.data_ptr<int32_t>();
  int32_t* kp = kv_ptr.data_ptr<int32_t>();
  std::vector<int32_t> idx;
  kp[0] = 0;
  for (int32_t qb = 0; qb < nb; ++qb) {
    bs[qb] = L.block_start(qb);
    for (int32_t kb = 0; kb < qb; ++kb)
      if (L.block_visible(qb, kb)) idx.push_back(kb);
    kp[qb + 1] = static_cast<int32_t>(idx.size());
  }
  bs[nb] = L.seq_len();
  at::Tensor kv_idx = at::empty({static_cast<int64_t>(idx.size())}, opt);
  std::copy(idx.begin(), idx.end(), kv_idx.data_ptr<int32_t>());
  return {block_start, kv_ptr, kv_idx};
}

}  // namespace

TORCH_LIBRARY_IMPL(jacobi_ext, CPU, m) {
  m.impl("block_attention_fwd", &block_attention_fwd_cpu);
  m.impl("block_attention_bwd", &block_attention_bwd_cpu);
  m.impl("block_attention_ordered_fwd", &block_attention_ordered_fwd_cpu);
  m.impl("block_attention_ordered_bwd", &block_attention_ordered_bwd_cpu);
  m.impl("attention_kernel", &attention_kernel_cpu);
  m.impl("attention_bwd_kernel", &attention_bwd_kernel_cpu);
}

// No tensor arguments: a composite kernel is what the dispatcher runs for every backend.
TORCH_LIBRARY_IMPL(jacobi_ext, CompositeExplicitAutograd, m) {
  m.impl("jf_block_table", &jf_block_table);
}

}  // namespace jacobi::ops
