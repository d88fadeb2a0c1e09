// Run-time choice of the CPU kernel variant.
//
// Every file listed in JACOBI_CPU_KERNELS (CMakeLists.txt) is compiled three times, with
// JACOBI_ISA = baseline | avx2 | avx512 and the matching -m flags and ATen CPU_CAPABILITY, into
// namespaces jacobi::cpu::{baseline,avx2,avx512}. Declare a kernel once with
// JACOBI_DECLARE_CPU_KERNEL and call it through JACOBI_CPU_DISPATCH: the variant is chosen from
// what the running CPU supports (override with JACOBI_EXT_CPU_ISA=baseline|avx2|avx512).
#pragma once

namespace jacobi::cpu {

enum class Isa { baseline = 0, avx2 = 1, avx512 = 2 };

// The variant in use: the best the CPU supports, capped by JACOBI_EXT_CPU_ISA. Cached.
Isa active_isa();
const char* isa_name(Isa isa);

}  // namespace jacobi::cpu

#define JACOBI_DECLARE_CPU_KERNEL(decl)  \
  namespace jacobi::cpu::baseline {      \
  decl;                                  \
  }                                      \
  namespace jacobi::cpu::avx2 {          \
  decl;                                  \
  }                                      \
  namespace jacobi::cpu::avx512 {        \
  decl;                                  \
  }

#define JACOBI_CPU_DISPATCH(fn, ...)                  \
  [&]() {                                             \
    switch (::jacobi::cpu::active_isa()) {            \
      case ::jacobi::cpu::Isa::avx512:                \
        return ::jacobi::cpu::avx512::fn(__VA_ARGS__); \
      case ::jacobi::cpu::Isa::avx2:                  \
        return ::jacobi::cpu::avx2::fn(__VA_ARGS__);   \
      default:                                        \
        return ::jacobi::cpu::baseline::fn(__VA_ARGS__); \
    }                                                 \
  }()
