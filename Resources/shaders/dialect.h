// dialect.h — the portable kernel dialect: the only header that both the
// Metal compiler and the host C++ compiler (simulator) see. Shaders include
// this file and nothing else; on Metal it pulls in <metal_stdlib>, on the
// host the simulator's shim (Sources/FlashMetalSim/metal_shim.h).
//
//   TG_ARRAY(T, name, n)           threadgroup T name[n]  (inside a kernel body)
//   TG_BUFFER(T, name, idx)        threadgroup T *name [[threadgroup(idx)]]  (parameter)
//   BUILTIN(attr)                  [[attr]] on a parameter (must be trailing)
//   FUNCTION_CONSTANT(T, name, i)  constant T name [[function_constant(i)]];
//   FUNCTION_CONSTANT_EXPR(T, n, e) constant T n = (e);
//   INSTANTIATE_KERNEL("host", f, targs...)  explicit instantiation + host name
//
// Kernel parameter order: buffer parameters in order of their index
// ([[buffer(0)]], [[buffer(1)]], ... - parameter position == buffer index;
// unbound ones are allowed), then TG_BUFFER parameters, then BUILTIN ones.
// Kernels are function templates (INSTANTIATE_KERNEL needs template args).
// Pitfalls: write `1.0h` (lowercase), convert vectors with the concrete name
// (float4(x)) not a template alias, compare vectors through select/any/all,
// never rely on SIMD lockstep without simdgroup_barrier.
#ifndef FLASHMETAL_DIALECT_H
#define FLASHMETAL_DIALECT_H

#if defined(__METAL_VERSION__)

#include <metal_stdlib>

// Hooks for the MSL check (tests/msl/metal_stdlib, a stand-in that makes the
// address spaces clang address spaces): Apple's compiler sees the defaults.
// The stand-in makes TG_ARRAY's storage `static` (clang has no automatic
// variables in an address space) and the two attributes inert (clang cannot
// place them there, and `threadgroup` is a macro there).
#ifndef FM_TG_ARRAY_STORAGE
#define FM_TG_ARRAY_STORAGE
#endif
#ifndef FM_TG_BUFFER_ATTRIBUTE
#define FM_TG_BUFFER_ATTRIBUTE(idx) [[threadgroup(idx)]]
#endif
#ifndef FM_KERNEL_ATTRIBUTES
#define FM_KERNEL_ATTRIBUTES(hname) [[host_name(hname)]] [[kernel]]
#endif

#define TG_ARRAY(T, name, n) FM_TG_ARRAY_STORAGE threadgroup T name[(n)]
#define TG_BUFFER(T, name, idx) threadgroup T *name FM_TG_BUFFER_ATTRIBUTE(idx)
#define BUILTIN(attr) [[attr]]
#define FUNCTION_CONSTANT(T, name, idx) constant T name [[function_constant(idx)]];
#define FUNCTION_CONSTANT_EXPR(T, name, expr) constant T name = (expr);
#define INSTANTIATE_KERNEL(hname, f, ...) \
    template FM_KERNEL_ATTRIBUTES(hname) decltype(f<__VA_ARGS__>) f<__VA_ARGS__>;

#else

#include "../../Sources/FlashMetalSim/metal_shim.h"

#define TG_ARRAY(T, name, n) FMSIM_TG_ARRAY(T, name, n)
#define TG_BUFFER(T, name, idx) FMSIM_TG_BUFFER(T, name, idx)
#define BUILTIN(attr) FMSIM_BUILTIN(attr)
#define FUNCTION_CONSTANT(T, name, idx) FMSIM_FUNCTION_CONSTANT(T, name, idx)
#define FUNCTION_CONSTANT_EXPR(T, name, expr) FMSIM_FUNCTION_CONSTANT_EXPR(T, name, expr)
#define INSTANTIATE_KERNEL(hname, f, ...) FMSIM_INSTANTIATE_KERNEL(hname, f, __VA_ARGS__)

#endif

#endif // FLASHMETAL_DIALECT_H
