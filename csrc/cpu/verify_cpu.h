// CPU entry of the verify-accept-recycle step (torch-free; semantics in jacobi/verify.h).
#pragma once

#include "jacobi/verify.h"

namespace jacobi::cpu {

void verify_step(const VerifyShape& shape, const VerifyArgs<int64_t>& args);

}  // namespace jacobi::cpu
