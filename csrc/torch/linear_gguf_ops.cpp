// cpu_linear_gguf_pack / cpu_linear_gguf / cpu_linear_gguf_types: argument checks, output
// allocation and the hand-off to the GGUF linear kernels (csrc/cpu/linear_gguf_cpu.cpp; layout
// and exactness: csrc/cpu/linear_gguf_cpu.h). cpu_weight_arena: one buffer on 2 MiB pages for a
// model's packed codes and LoRA factors.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "checks.h"
#include "cpu_step_ops.h"
#include "cpu/decode_cpu.h"
#include "cpu/linear_gguf_cpu.h"
#include "jacobi/greedy_screen.h"
#include "linear_common.h"

namespace jacobi::ops {
namespace {

namespace ck = jacobi::checks;
using cpu::GgufFormat;
using cpu::GgufType;

constexpr int32_t kTypes[] = {2, 3, 8, 12, 13, 14};
constexpr const char* kTypeNames[] = {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"};

std::string supported() {
  std::string s;
  for (size_t i = 0; i < std::size(kTypes); ++i) {
    s += (i ? ", " : "") + std::string(kTypeNames[i]) + " (" + std::to_string(kTypes[i]) + ")";
  }
  return s;
}

GgufFormat format_of(int64_t type) {
  GgufFormat f;
  TORCH_CHECK_VALUE(cpu::gguf_format(static_cast<int32_t>(type), &f), "ggml type ", type,
                    " is not read by the GGUF linear kernels; they read ", supported(),
                    ". Other types run dequantized to float32 (nn.Linear)");
  return f;
}

// The types the 8-bit kernel reads (linear_gguf_int8), and so the greedy head's screen.
bool int8_type(int64_t type) {
  return type == static_cast<int64_t>(GgufType::q4_1) || type == static_cast<int64_t>(GgufType::q8_0);
}

using linear_common::panel_width;

std::vector<int64_t> packed_shape(const GgufFormat& f, int64_t N, int64_t K) {
  const int64_t nr = panel_width();
  return {(N + nr - 1) / nr, K / f.group_k, cpu::gguf_group_bytes(f, nr)};
}

// rows: the weights' rows as the file stores them, uint8 [N_i, row_bytes] each, concatenated along
// the output features (fused q/k/v, gate/up) without materialising the concatenation.
at::Tensor cpu_linear_gguf_pack(at::TensorList weights, int64_t type) {
  const GgufFormat f = format_of(type);
  TORCH_CHECK_VALUE(!weights.empty(), "cpu_linear_gguf_pack needs at least one weight");
  std::vector<const uint8_t*> rows;
  int64_t row_bytes = -1;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    const std::string name = weights.size() == 1 ? "weight" : "weights[" + std::to_string(i) + "]";
    ck::rank(w, name.c_str(), 2, "[out_features, bytes per row] (the file's blocks)");
    ck::dtype(w, name.c_str(), at::kByte);
    TORCH_CHECK_VALUE(w.device().is_cpu(), name, " is on ", w.device(),
                      "; cpu_linear_gguf_pack packs CPU weights");
    ck::contiguous(w, name.c_str());
    TORCH_CHECK_VALUE(row_bytes < 0 || w.size(1) == row_bytes, name, " has ", w.size(1),
                      " bytes per row, weights[0] ", row_bytes);
    row_bytes = w.size(1);
    TORCH_CHECK_VALUE(row_bytes % f.block_bytes == 0, name, " has ", row_bytes,
                      " bytes per row, not a whole number of ", f.block_bytes,
                      "-byte blocks of ggml type ", type);
    const uint8_t* base = w.data_ptr<uint8_t>();
    for (int64_t n = 0; n < w.size(0); ++n) rows.push_back(base + n * row_bytes);
  }
  const int64_t K = row_bytes / f.block_bytes * f.block_k;
  const int64_t N = static_cast<int64_t>(rows.size());
  at::Tensor packed = at::empty(packed_shape(f, N, K), weights[0].options());
  JACOBI_CPU_DISPATCH(linear_gguf_pack, static_cast<GgufType>(type), rows.data(), N, K,
                      packed.data_ptr<uint8_t>());
  return packed;
}

}  // namespace

namespace {

// x's checks (K of the plan's weight, float32, the CPU) and the launch of a checked plan.
void check_gguf_x(const at::Tensor& x, int64_t K, int64_t type) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must be [..., in_features], got a 0-d tensor");
  TORCH_CHECK_VALUE(x.device().is_cpu(), "cpu_linear_gguf runs on the CPU; x is on ", x.device());
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, "x must be float32 (the GGUF linear computes in "
                    "float32), got ", x.scalar_type(), "; load the model in float32, or "
                    "dequantized for other dtypes");
  TORCH_CHECK_VALUE(x.size(-1) == K, "x has ", x.size(-1), " input features; the weight has ", K,
                    " (ggml type ", type, ")");
}

}  // namespace

GgufLinearPlan plan_linear_gguf(const at::Tensor& packed, int64_t type, int64_t out_features,
                                int64_t in_features, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& lora_a,
                                const std::optional<at::Tensor>& lora_b,
                                const std::optional<at::Tensor>& lora_panel_r0,
                                bool int8_activations) {
  const GgufFormat f = format_of(type);
  TORCH_CHECK_VALUE(packed.device().is_cpu(), "cpu_linear_gguf runs on the CPU; packed is on ",
                    packed.device());
  ck::dtype(packed, "packed", at::kByte);
  ck::contiguous(packed, "packed");
  const int64_t K = in_features, N = out_features;
  TORCH_CHECK_VALUE(N >= 0, "out_features must be >= 0, got ", N);
  TORCH_CHECK_VALUE(K % f.block_k == 0, "x has ", K, " input features, not a multiple of ggml type ",
                    type, "'s block of ", f.block_k);
  const auto want = packed_shape(f, N, K);
  TORCH_CHECK_VALUE(packed.sizes() == at::IntArrayRef(want), "packed has shape ", packed.sizes(),
                    " but a ", N, " x ", K, " weight of ggml type ", type, " packs to ",
                    at::IntArrayRef(want),
                    " on this CPU: pack it with cpu_linear_gguf_pack in this process");
  GgufLinearPlan plan;
  plan.type = type, plan.N = N, plan.K = K, plan.int8 = int8_activations;
  plan.packed = packed;
  plan.bias = linear_common::checked_bias(bias, N, at::kFloat);  // (x is float32)
  // An unmerged LoRA: the kernel computes t = x A^T first, then adds its B product per panel.
  const bool has_lora = lora_a.has_value() && lora_a->defined();
  TORCH_CHECK_VALUE(has_lora == (lora_b.has_value() && lora_b->defined()),
                    "lora_a and lora_b go together");
  if (has_lora) {
    // B in the kernels' panels of NR outputs; A in panels one vector wide (NR / 2 of its rows):
    // a rank-16 A is one such panel, where whole NR panels held as many zeros as weights.
    const int64_t nr = panel_width(), vl = nr / 2;
    const bool bf16 = lora_a->scalar_type() == at::kBFloat16;
    for (const at::Tensor* w : {&*lora_a, &*lora_b}) {
      TORCH_CHECK_VALUE(w->scalar_type() == (bf16 ? at::kBFloat16 : at::kFloat),
                        "lora factors must both be float32 or both bfloat16, got ",
                        lora_a->scalar_type(), " and ", lora_b->scalar_type());
      ck::contiguous(*w, "lora factors");
    }
    ck::rank(*lora_b, "lora_b", 3, "[panels, rank, NR] (B in panels of NR outputs)");
    TORCH_CHECK_VALUE(lora_b->size(2) == nr, "lora_b is packed for NR=", lora_b->size(2),
                      ", this CPU's kernels use ", nr, " (pack it with cpu_linear_pack)");
    ck::rank(*lora_a, "lora_a", 3, "[ceil(rank / VL), in_features, VL] (A in panels of VL rows)");
    TORCH_CHECK_VALUE(lora_a->size(2) == vl, "lora_a is packed in panels of ", lora_a->size(2),
                      " rows; this CPU's kernels take ", vl, " (cpu_lora_pack_a)");
    const int64_t r = lora_b->size(1), panels = (N + nr - 1) / nr;
    TORCH_CHECK_VALUE(lora_b->size(0) == panels, "lora_b has ", lora_b->size(0),
                      " panels; out_features ", N, " needs ", panels);
    // t = x A^T has every column of the packed A; B reads rank of them, from panel_r0[p] on,
    // or from 0 (then A is exactly the rank's panels).
    const bool offsets = lora_panel_r0.has_value() && lora_panel_r0->defined();
    const int64_t t_cols = lora_a->size(0) * vl;
    TORCH_CHECK_VALUE(lora_a->size(1) == K && r <= t_cols &&
                          (offsets || lora_a->size(0) == (r + vl - 1) / vl),
                      "lora_a must be an [rank=", r, ", ", K,
                      "] weight in panels of ", vl, " rows (cpu_lora_pack_a), got shape ",
                      lora_a->sizes());
    const int64_t* r0 = nullptr;
    if (offsets) {
      const at::Tensor& o = *lora_panel_r0;
      ck::dtype(o, "lora_panel_r0", at::kLong);
      ck::contiguous(o, "lora_panel_r0");
      TORCH_CHECK_VALUE(o.dim() == 1 && o.size(0) == panels, "lora_panel_r0 must be [", panels,
                        "] (one per panel of ", nr, " outputs), got ", o.sizes());
      r0 = o.data_ptr<int64_t>();
      for (int64_t p = 0; p < panels; ++p)
        TORCH_CHECK_VALUE(r0[p] >= 0 && r0[p] + r <= t_cols, "lora_panel_r0[", p, "] = ", r0[p],
                          ": columns [", r0[p], ", ", r0[p] + r, ") are outside x A^T's ",
                          t_cols);
      plan.lora_panel_r0 = o;
    }
    plan.lora_a = *lora_a, plan.lora_b = *lora_b;
    plan.lora = cpu::GgufLora{nullptr, t_cols, r, bf16, lora_a->data_ptr(), lora_b->data_ptr(), r0};
  }
  if (int8_activations) {
    TORCH_CHECK_VALUE(int8_type(type),
                      "int8_activations is implemented for Q4_1 (ggml type 3) and Q8_0 (8) "
                      "weights, got type ", type, "; run this linear with int8_activations=False");
  }
  return plan;
}

at::Tensor run_linear_gguf(const GgufLinearPlan& plan, const at::Tensor& x, at::Tensor* y_out,
                           at::Tensor* t_ws) {
  check_gguf_x(x, plan.K, plan.type);
  const int64_t N = plan.N;
  const linear_common::Rows rows = linear_common::rows_of(x);
  const int64_t M = rows.M;
  at::Tensor y = linear_common::output_into(y_out, x, N);
  const cpu::LinearArgs a{cpu::LinearDType::f32, M, N, plan.K, rows.x.data_ptr(), rows.ldx,
                          plan.packed.data_ptr(),
                          plan.bias.defined() ? plan.bias.data_ptr() : nullptr, true, y.data_ptr(),
                          N};
  cpu::GgufLora lo = plan.lora;
  at::Tensor t;
  if (plan.lora_a.defined()) {
    const int64_t t_cols = lo.ldt;
    if (t_ws == nullptr) {
      t = at::empty({M, t_cols}, x.options());
    } else {
      if (!t_ws->defined() || t_ws->numel() < M * t_cols)
        *t_ws = at::empty({M * t_cols}, x.options());
      t = *t_ws;  // (its first M t_cols floats)
    }
    lo.t = t.data_ptr<float>();
  }
  const auto type = static_cast<GgufType>(plan.type);
  if (plan.int8) {
    JACOBI_CPU_DISPATCH(linear_gguf_int8, type, a, lo);
  } else {
    JACOBI_CPU_DISPATCH(linear_gguf, type, a, lo);
  }
  return y;
}

namespace {

// cpu_linear_gguf into y (nullptr: a new tensor, returned), its LoRA's x A^T into *t_ws where
// given (made or grown there as needed; nullptr: a new tensor per call): a plan checked for this
// call, then its launch (which checks x).
at::Tensor linear_gguf_impl(const at::Tensor& x, const at::Tensor& packed, int64_t type,
                            int64_t out_features, const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& lora_a,
                            const std::optional<at::Tensor>& lora_b,
                            const std::optional<at::Tensor>& lora_panel_r0,
                            bool int8_activations, at::Tensor* y_out, at::Tensor* t_ws) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must be [..., in_features], got a 0-d tensor");
  const GgufLinearPlan plan = plan_linear_gguf(packed, type, out_features, x.size(-1), bias, lora_a,
                                               lora_b, lora_panel_r0, int8_activations);
  return run_linear_gguf(plan, x, y_out, t_ws);
}

}  // namespace

at::Tensor cpu_linear_gguf(const at::Tensor& x, const at::Tensor& packed, int64_t type,
                           int64_t out_features, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& lora_a,
                           const std::optional<at::Tensor>& lora_b,
                           const std::optional<at::Tensor>& lora_panel_r0,
                           bool int8_activations) {
  return linear_gguf_impl(x, packed, type, out_features, bias, lora_a, lora_b, lora_panel_r0,
                          int8_activations, nullptr, nullptr);
}

void cpu_linear_gguf_out(const at::Tensor& x, const at::Tensor& packed, int64_t type,
                         int64_t out_features, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& lora_a,
                         const std::optional<at::Tensor>& lora_b,
                         const std::optional<at::Tensor>& lora_panel_r0, bool int8_activations,
                         at::Tensor& y, at::Tensor& lora_t) {
  linear_gguf_impl(x, packed, type, out_features, bias, lora_a, lora_b, lora_panel_r0,
                   int8_activations, &y, &lora_t);
}

// Rows `ids` of a Q8_0 matrix as the file stores it (raw: uint8 [V, blocks * 34], each block an
// fp16 scale d then 32 int8 codes q), dequantized to float32 [*ids.shape, blocks * 32]: d * q,
// one fp32 product of the exact conversions, as the `gguf` package computes it. A token
// embedding read from the file's codes: ~3 us a decoding step, where ten small tensor ops cost
// ~40 us.
at::Tensor cpu_gguf_q8_0_rows(const at::Tensor& raw, const at::Tensor& ids) {
  ck::rank(raw, "raw", 2, "[rows, blocks * 34] (the file's Q8_0 blocks)");
  ck::dtype(raw, "raw", at::kByte);
  ck::contiguous(raw, "raw");
  ck::dtype(ids, "ids", at::kLong);
  TORCH_CHECK_VALUE(raw.device().is_cpu() && ids.device().is_cpu(),
                    "raw and ids must be CPU tensors, got ", raw.device(), " and ", ids.device());
  const int64_t V = raw.size(0), row_bytes = raw.size(1);
  TORCH_CHECK_VALUE(row_bytes % 34 == 0 && row_bytes > 0, "raw's rows must be whole Q8_0 blocks "
                    "of 34 bytes, got ", row_bytes, " bytes a row");
  const int64_t blocks = row_bytes / 34;
  const at::Tensor idc = ids.contiguous();
  const int64_t n = idc.numel();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_VALUE(id[i] >= 0 && id[i] < V, "ids[", i, "] = ", id[i], " is outside the ", V,
                      " rows");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(blocks * 32);
  at::Tensor out = at::empty(shape, raw.options().dtype(at::kFloat));
  float* y = out.data_ptr<float>();
  const uint8_t* base = raw.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* row = base + id[i] * row_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * 34;
      uint16_t h;
      std::memcpy(&h, blk, 2);
      const float d = c10::detail::fp16_ieee_to_fp32_value(h);
      float* yb = y + (i * blocks + b) * 32;
      for (int k = 0; k < 32; ++k) yb[k] = d * static_cast<float>(static_cast<int8_t>(blk[2 + k]));
    }
  }
  return out;
}

namespace {

// uint8 [nbytes] at a 2 MiB boundary, its pages advised to be transparent huge pages (Linux,
// madvise; the OS may decline: then 4 KiB pages, as any tensor's).
//
// Why: a forward streams the model's ~100 MB of codes once. On 4 KiB pages that is ~25 000 pages
// a step, a TLB miss each, and the hardware prefetchers stop at each page's end, where the codes
// of one linear are 0.2-1.1 MB; the default (madvise) does not give a torch tensor huge pages.
// The codes gathered into one such buffer in the order a forward reads them
// (jacobi_ext.models.quantized.gather_weights) made a one-token step ~7 % faster on a 2-core
// EPYC, exact and 8-bit alike, and an unmerged LoRA's factors beside them ~2-4 % more on the
// shipped model (2026-12-05, alternating processes: docs/results/cpu-floor-2026-12-05).
at::Tensor cpu_weight_arena(int64_t nbytes) {
  TORCH_CHECK_VALUE(nbytes >= 0, "nbytes must be >= 0, got ", nbytes);
  const auto bytes = at::TensorOptions().dtype(at::kByte);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t size = (static_cast<size_t>(nbytes) + kHuge - 1) / kHuge * kHuge;
  if (size > 0) {
    // A mapping one huge page longer, trimmed to the 2 MiB boundary inside it.
    void* map = mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
    if (map != MAP_FAILED) {
      const auto start = reinterpret_cast<uintptr_t>(map);
      const uintptr_t aligned = (start + kHuge - 1) / kHuge * kHuge;
      if (aligned > start) munmap(map, aligned - start);
      if (aligned + size < start + size + kHuge)
        munmap(reinterpret_cast<void*>(aligned + size), start + size + kHuge - aligned - size);
      void* base = reinterpret_cast<void*>(aligned);
      madvise(base, size, MADV_HUGEPAGE);  // advice: declined, the pages stay 4 KiB
      return at::from_blob(base, {nbytes}, [size](void* p) { munmap(p, size); }, bytes);
    }
  }
#endif
  return at::empty({nbytes}, bytes);
}

// ---- the greedy head (jacobi/greedy_screen.h: the method and its bound) -------------------------

// W1_j = sum_k (|d c_kj| + |m|) of each column of a packed Q8_0 / Q4_1 weight (in double, rounded
// up to float32; a non-finite scale gives inf), then their maximum: float32 [N + 1].
at::Tensor cpu_linear_gguf_abs_sums(const at::Tensor& packed, int64_t type, int64_t out_features,
                                    int64_t in_features) {
  TORCH_CHECK_VALUE(int8_type(type), "abs sums are for Q4_1 (3) and Q8_0 (8) weights, got ggml "
                    "type ", type);
  TORCH_CHECK_VALUE(in_features >= 0, "in_features must be >= 0, got ", in_features);
  plan_linear_gguf(packed, type, out_features, in_features, {}, {}, {}, {}, false);  // its checks
  const GgufFormat f = format_of(type);
  const int64_t N = out_features, K = in_features, nr = panel_width();
  at::Tensor out = at::empty({N + 1}, packed.options().dtype(at::kFloat));
  float* w1 = out.data_ptr<float>();
  const uint8_t* base = packed.data_ptr<uint8_t>();
  const int64_t groups = K / f.group_k, gbytes = cpu::gguf_group_bytes(f, nr);
  const int64_t header = nr * f.header_bytes;
  auto half = [](const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return static_cast<double>(c10::detail::fp16_ieee_to_fp32_value(h));
  };
  float top = 0.f;
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* panel = base + (n / nr) * groups * gbytes;
    const int64_t j = n % nr;
    double sum = 0.0;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* grp = panel + g * gbytes;
      const double d = std::fabs(half(grp + 2 * j));
      int64_t codes = 0;  // sum of |code| over the group (exact)
      if (f.code_bits == 4) {
        for (int i = 0; i < f.group_k / 2; ++i) {
          const uint8_t b = grp[header + i * nr + j];
          codes += (b & 0xF) + (b >> 4);
        }
        sum += d * static_cast<double>(codes) + f.group_k * std::fabs(half(grp + 2 * (nr + j)));
      } else {
        for (int k = 0; k < f.group_k; ++k)
          codes += std::abs(static_cast<int>(static_cast<int8_t>(grp[header + k * nr + j])));
        sum += d * static_cast<double>(codes);
      }
    }
    float up = static_cast<float>(sum);  // (inf where sum is, or overflows float)
    if (std::isnan(sum)) up = std::numeric_limits<float>::infinity();
    if (static_cast<double>(up) < sum) up = std::nextafter(up, std::numeric_limits<float>::infinity());
    w1[n] = up;
    top = std::max(top, up);
  }
  w1[N] = top;
  return out;
}

// The greedy head's screen of x (rows.M rows) against a checked weight: the 8-bit rows' outputs
// y [2M, N] (x's, then its residual's), each row's e, its candidates and their count
// (jacobi/greedy_screen.h).
struct GreedyScreen {
  int64_t M = 0, N = 0, K = 0;
  at::Tensor y;  // float32 [2M, N]
  std::vector<float> e;
  std::vector<int32_t> cand;  // [M, kMaxCandidates]
  std::vector<int64_t> count;
  float t = 0.f;
};

// The checks of cpu_linear_gguf_greedy and debug_greedy_screen, then the screen.
GreedyScreen greedy_screen_of(const at::Tensor& x, const linear_common::Rows& rows,
                              const at::Tensor& packed, int64_t type, int64_t out_features,
                              const at::Tensor& abs_sums) {
  namespace gs = jacobi::greedy_screen;
  TORCH_CHECK_VALUE(int8_type(type), "cpu_linear_gguf_greedy screens Q4_1 (3) and Q8_0 (8) "
                    "weights, got ggml type ", type, "; take argmax of cpu_linear_gguf instead");
  const int64_t K = x.size(-1), N = out_features, M = rows.M;
  TORCH_CHECK_VALUE(N > 0, "out_features must be > 0 (an argmax needs a column), got ", N);
  plan_linear_gguf(packed, type, N, K, {}, {}, {}, {}, false);  // the weight side's checks
  ck::dtype(abs_sums, "abs_sums", at::kFloat);
  ck::contiguous(abs_sums, "abs_sums");
  TORCH_CHECK_VALUE(abs_sums.dim() == 1 && abs_sums.size(0) == N + 1 && abs_sums.device().is_cpu(),
                    "abs_sums must be float32 [out_features + 1] on the CPU "
                    "(cpu_linear_gguf_abs_sums of this weight), got ", abs_sums.sizes());
  GreedyScreen s;
  s.M = M, s.N = N, s.K = K, s.t = gs::absolute(K);
  if (M == 0) return s;
  const float* xp = rows.x.data_ptr<float>();
  const float* w1 = abs_sums.data_ptr<float>();
  // the 8-bit rows: x, then its residual
  at::Tensor xr = at::empty({2 * M, K}, x.options());
  float* xrp = xr.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) std::memcpy(xrp + m * K, xp + m * rows.ldx, K * sizeof(float));
  JACOBI_CPU_DISPATCH(linear_gguf_int8_residual, xp, M, K, rows.ldx, xrp + M * K, K);
  s.y = at::empty({2 * M, N}, x.options());
  float* yp = s.y.data_ptr<float>();
  const cpu::GgufLora none;
  JACOBI_CPU_DISPATCH(linear_gguf_int8, static_cast<GgufType>(type),
                      cpu::LinearArgs{cpu::LinearDType::f32, 2 * M, N, K, xrp, K,
                                      packed.data_ptr<uint8_t>(), nullptr, true, yp, N},
                      none);
  s.e.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    float ax = 0.f, ar = 0.f;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      finite = finite && std::isfinite(xrp[m * K + k]);
      ax = std::max(ax, std::fabs(xrp[m * K + k]));
      ar = std::max(ar, std::fabs(xrp[(M + m) * K + k]));
    }
    s.e[m] = finite && gs::in_range(ax, w1[N]) ? gs::error_per_w1(K, ax, ar)
                                              : std::numeric_limits<float>::infinity();
  }
  constexpr int64_t cap = gs::kMaxCandidates;
  s.cand.resize(M * cap);
  s.count.resize(M);
  JACOBI_CPU_DISPATCH(greedy_candidates, yp, yp + M * N, N, M, N, w1, s.e.data(), s.t, cap,
                      s.cand.data(), s.count.data());
  return s;
}

void check_greedy_x(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.device().is_cpu() && x.scalar_type() == at::kFloat,
                    "x must be a float32 CPU tensor [..., in_features], got ", x.scalar_type(),
                    " on ", x.device(), " with shape ", x.sizes());
}

// The argmax over the outputs of x W^T on the exact (fp32) GGUF linear, int64 [...] (x's leading
// dims): bitwise argmax(cpu_linear_gguf(x, packed, type, out_features)), through the 8-bit
// screen (jacobi/greedy_screen.h). abs_sums: cpu_linear_gguf_abs_sums of the same weight.
at::Tensor cpu_linear_gguf_greedy(const at::Tensor& x, const at::Tensor& packed, int64_t type,
                                  int64_t out_features, const at::Tensor& abs_sums) {
  check_greedy_x(x);
  const linear_common::Rows rows = linear_common::rows_of(x);
  const GreedyScreen s = greedy_screen_of(x, rows, packed, type, out_features, abs_sums);
  at::Tensor out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong));
  int64_t* pick = out.data_ptr<int64_t>();
  const auto t = static_cast<GgufType>(type);
  const int64_t N = s.N, K = s.K, nr = panel_width(), panel_bytes = packed.size(1) * packed.size(2);
  const auto* codes = packed.data_ptr<uint8_t>();
  const float* xp = rows.x.data_ptr<float>();
  const cpu::GgufLora none;
  // The candidates' exact values, panel by panel (a panel's columns are the same chains as in the
  // whole product); a row without a usable screen in full (only then a vocabulary-wide buffer).
  std::vector<float> exact(nr);
  for (int64_t m = 0; m < s.M; ++m) {
    const float* xm = xp + m * rows.ldx;
    if (s.count[m] < 0) {
      exact.resize(std::max(nr, N));
      JACOBI_CPU_DISPATCH(linear_gguf, t,
                          cpu::LinearArgs{cpu::LinearDType::f32, 1, N, K, xm, K, codes, nullptr,
                                          true, exact.data(), N},
                          none);
      JACOBI_CPU_DISPATCH(argmax_f32, exact.data(), 1, N, pick + m);
      continue;
    }
    int64_t best = -1, panel = -1;
    float best_v = 0.f;
    for (int64_t i = 0; i < s.count[m]; ++i) {
      const int64_t j = s.cand[m * jacobi::greedy_screen::kMaxCandidates + i];
      if (j / nr != panel) {
        panel = j / nr;
        const int64_t cols = std::min(nr, N - panel * nr);
        JACOBI_CPU_DISPATCH(linear_gguf, t,
                            cpu::LinearArgs{cpu::LinearDType::f32, 1, cols, K, xm, K,
                                            codes + panel * panel_bytes, nullptr, true,
                                            exact.data(), cols},
                            none);
      }
      const float v = exact[j - panel * nr];
      if (best < 0 || v > best_v) best = j, best_v = v;  // the first of the maxima
    }
    pick[m] = best;  // (a row's exact argmax is always a candidate: count >= 1)
  }
  return out;
}

// The screen itself, for tests: per row of x [M, K] the approximate outputs a [M, N], their bounds
// E [M, N] (float32, as the screen computes them) and the number of candidates (-1: the row is
// computed in full).
std::tuple<at::Tensor, at::Tensor, at::Tensor> debug_greedy_screen(const at::Tensor& x,
                                                                   const at::Tensor& packed,
                                                                   int64_t type,
                                                                   int64_t out_features,
                                                                   const at::Tensor& abs_sums) {
  check_greedy_x(x);
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [M, in_features], got ", x.sizes());
  const linear_common::Rows rows = linear_common::rows_of(x);
  const GreedyScreen s = greedy_screen_of(x, rows, packed, type, out_features, abs_sums);
  const int64_t M = s.M, N = s.N;
  at::Tensor a = at::empty({M, N}, x.options()), E = at::empty({M, N}, x.options());
  at::Tensor count = at::empty({M}, x.options().dtype(at::kLong));
  const float* w1 = abs_sums.data_ptr<float>();
  float *ap = a.data_ptr<float>(), *Ep = E.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* y0 = s.y.data_ptr<float>() + m * N;
    const float* y1 = y0 + M * N;
    for (int64_t j = 0; j < N; ++j) {
      ap[m * N + j] = y0[j] + y1[j];
      Ep[m * N + j] = w1[j] * s.e[m] + s.t;
    }
    count.data_ptr<int64_t>()[m] = s.count[m];
  }
  return {a, E, count};
}

// The ggml type ids the kernels read.
std::vector<int64_t> cpu_linear_gguf_types() {
  return std::vector<int64_t>(std::begin(kTypes), std::end(kTypes));
}

// cpu_linear_gguf.out (module.cpp), over cpu_linear_gguf_out (a LoRA's x A^T in a workspace
// of this call's).
at::Tensor& linear_gguf_out_op(const at::Tensor& x, const at::Tensor& packed, int64_t type,
                               int64_t out_features, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& lora_a,
                               const std::optional<at::Tensor>& lora_b,
                               const std::optional<at::Tensor>& lora_panel_r0,
                               bool int8_activations, at::Tensor& out) {
  at::Tensor lora_t;
  cpu_linear_gguf_out(x, packed, type, out_features, bias, lora_a, lora_b, lora_panel_r0,
                      int8_activations, out, lora_t);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(jacobi_ext, CPU, m) {
  m.impl("cpu_linear_gguf.out", &linear_gguf_out_op);
  m.impl("cpu_linear_gguf_pack", &cpu_linear_gguf_pack);
  m.impl("cpu_linear_gguf", &cpu_linear_gguf);
  m.impl("cpu_gguf_q8_0_rows", &cpu_gguf_q8_0_rows);
  m.impl("cpu_linear_gguf_abs_sums", &cpu_linear_gguf_abs_sums);
  m.impl("cpu_linear_gguf_greedy", &cpu_linear_gguf_greedy);
  m.impl("debug_greedy_screen", &debug_greedy_screen);
}

TORCH_LIBRARY_IMPL(jacobi_ext, CompositeExplicitAutograd, m) {
  m.impl("cpu_linear_gguf_types", &cpu_linear_gguf_types);
  m.impl("cpu_weight_arena", &cpu_weight_arena);
}

}  // namespace jacobi::ops
