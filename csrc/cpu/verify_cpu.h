// CPU entry of the verify-accept-recycle step (torch-free; semantics in jacobi/verify.h).
#pragma once

#include "jacobi/verify.h"

namespace jacobi::cpu {

// `batch` sequences laid out as verify_args_at says (batch 1: the plain single-step layout).
void verify_step(const VerifyShape& shape, const VerifyArgs<int64_t>& args, int batch);

}  // namespace jacobi::cpu
