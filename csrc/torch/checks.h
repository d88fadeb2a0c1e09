// Argument checks with messages that name the argument and say what is expected.
// TORCH_CHECK_VALUE raises ValueError in Python; TORCH_CHECK raises RuntimeError.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <string>

namespace jacobi::checks {

inline void dtype(const at::Tensor& t, const char* name, at::ScalarType want) {
  TORCH_CHECK_VALUE(t.scalar_type() == want, name, " must have dtype ", want, ", got ",
                    t.scalar_type());
}

inline void rank(const at::Tensor& t, const char* name, int64_t want, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == want, name, " must be ", want, "-D ", layout, ", got shape ",
                    t.sizes());
}

inline void same_device(const at::Tensor& t, const char* name, const at::Tensor& ref,
                        const char* ref_name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name,
                    " is on ", ref.device(), "; move them to one device");
}

inline void contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous (call .contiguous())");
}

// A caller's output buffer (the C++ *_out forms of the CPU ops): a contiguous CPU tensor of
// `elements` values of the dtype, any shape.
inline void out_buffer(const at::Tensor& t, const char* name, int64_t elements,
                       at::ScalarType want) {
  TORCH_CHECK_VALUE(t.defined() && t.device().is_cpu() && t.is_contiguous() &&
                        t.scalar_type() == want && t.numel() == elements,
                    name, " must be a contiguous CPU ", want, " tensor of ", elements,
                    " elements, got ", t.defined() ? t.sizes() : at::IntArrayRef{});
}

// An op's output: the caller's buffer *given (checked as out_buffer: as many elements as
// `shape`, of options' dtype, any shape), or where given is nullptr a new tensor of `shape`.
inline at::Tensor out_or_new(at::Tensor* given, const char* name, at::IntArrayRef shape,
                             const at::TensorOptions& options) {
  if (given == nullptr) return at::empty(shape, options);
  out_buffer(*given, name, c10::multiply_integers(shape),
             c10::typeMetaToScalarType(options.dtype()));
  return *given;
}

// qk_rms_norm_'s arguments on either device: qkv contiguous [..., (heads + 2 kv_heads) D] with
// q_weight and k_weight [D] of its dtype and on its device. Returns D.
inline int64_t qk_norm_args(const at::Tensor& qkv, int64_t heads, int64_t kv_heads,
                            const at::Tensor& q_weight, const at::Tensor& k_weight) {
  TORCH_CHECK_VALUE(qkv.is_contiguous() && qkv.dim() >= 1, "qkv must be contiguous [..., (heads "
                    "+ 2 kv_heads) D], got ", qkv.sizes());
  TORCH_CHECK_VALUE(heads >= 1 && kv_heads >= 1, "heads and kv_heads must be >= 1");
  rank(q_weight, "q_weight", 1, "[head_dim]");
  const int64_t D = q_weight.size(0), row = qkv.size(-1);
  TORCH_CHECK_VALUE(D >= 1 && row == (heads + 2 * kv_heads) * D, "qkv's last dim is ", row,
                    ", expected (heads + 2 kv_heads) * head_dim = ", (heads + 2 * kv_heads) * D);
  for (const at::Tensor* w : {&q_weight, &k_weight}) {
    const char* name = w == &q_weight ? "q_weight" : "k_weight";
    TORCH_CHECK_VALUE(w->dim() == 1 && w->size(0) == D && w->scalar_type() == qkv.scalar_type(),
                      name, " must be [head_dim = ", D, "] of qkv's dtype ", qkv.scalar_type(),
                      ", got ", w->sizes(), " ", w->scalar_type());
    same_device(*w, name, qkv, "qkv");
  }
  return D;
}

}  // namespace jacobi::checks
