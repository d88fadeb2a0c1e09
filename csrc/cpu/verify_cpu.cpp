// The verify step is a few hundred integer compares: one thread, no vector ISA to pick.
#include "cpu/verify_cpu.h"

namespace jacobi::cpu {

void verify_step(const VerifyShape& shape, const VerifyArgs<int64_t>& args) {
  for (int r = 0; r < shape.rows; ++r) verify_accept_row(shape, args, r);
  verify_finish(shape, args);
}

}  // namespace jacobi::cpu
