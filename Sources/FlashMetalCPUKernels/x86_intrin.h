/* The x86 intrinsics of the per-ISA kernels: <immintrin.h>; in the
 * emulated test build (FM_ISA_EMULATED, mk/cpu-harness.mk) SIMDe's portable
 * versions of the same names instead (tests/cpu_arm64/isa_emulated.h), so
 * the AVX-512 instances run on any x86-64 machine. */
#ifndef FM_X86_INTRIN_H
#define FM_X86_INTRIN_H
#if defined(FM_ISA_EMULATED)
#include "isa_emulated.h"
#else
#include <immintrin.h>
#endif
#endif
