#!/usr/bin/env python3
"""shim_strict.py — the simulator's shim must reject what MSL rejects.

Each planted snippet is a kernel in the portable dialect that real MSL (3.1)
refuses; compiled against the shim (Sources/FlashMetalSim/metal_shim.h) it
must fail to compile, with the diagnostic we expect. A control kernel using
the allowed forms of the same features must compile, so a broken command
line cannot pass for strictness.

Usage: shim_strict.py CXX [extra flags...]
"""
import os
import sys

from planted import run_planted

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ["-std=c++20", "-fsyntax-only", "-Xclang", "-ffloat16-excess-precision=none", "-Werror=double-promotion",
         "-Wno-unknown-attributes", "-I" + os.path.join(ROOT, "Sources/CFlashMetal/include")]

PRELUDE = '#include "%s/Resources/shaders/dialect.h"\nusing namespace metal;\n' % ROOT


def kernel(params, body):
    return PRELUDE + (
        "template <int D>\nkernel void k(device float *o [[buffer(0)]], const device half *h [[buffer(1)]],\n"
        "  const device bfloat *b [[buffer(2)]]%s) {\n%s\n}\nINSTANTIATE_KERNEL(\"k\", k, 0)\n" % (params, body))


LANE = ", uint lane BUILTIN(thread_index_in_simdgroup)"
CONTROL = kernel(LANE + ", uint3 tg BUILTIN(threadgroup_position_in_grid), ushort sl BUILTIN(thread_index_in_simdgroup)", """
    bfloat x = b[0];
    bfloat y = x * b[1] + bfloat(2.0f);
    o[0] = float(y) * 2.0f + float(exp2(float(x)));
    o[1] = simd_sum(float(lane)) + float(simd_sum(h[0])) + float(simd_xor(int(lane)));
    simdgroup_half8x8 m;
    simdgroup_load(m, h, 8);
    simdgroup_float8x8 a = make_filled_simdgroup_matrix<float, 8, 8>(1.0f), c;
    simdgroup_multiply_accumulate(c, a, a, a);
    simdgroup_store(c, o, 8);
    o[2] = float(tg.x + uint(sl));
""")

# (what MSL rejects, the snippet, a word the diagnostic must hold)
BAD = [
    ("bfloat from float, implicit", kernel("", "bfloat x = 1.0f; o[0] = float(x);"), "bfloat"),
    ("bfloat to float, implicit", kernel("", "float f = b[0]; o[0] = f;"), "bfloat"),
    ("bfloat mixed with float", kernel("", "o[0] = float(b[0] * 2.0f);"), "operands"),
    ("math function on bfloat", kernel("", "o[0] = float(exp2(b[0]));"), "exp2"),
    ("simd_sum of bfloat", kernel(LANE, "o[0] = float(simd_sum(b[lane]));"), "simd_sum"),
    ("simd_and of float", kernel(LANE, "o[0] = simd_and(float(lane));"), "simd_and"),
    ("simdgroup_load converting half", kernel("", "simdgroup_float8x8 m; simdgroup_load(m, h, 8);"),
     "simdgroup_load"),
    ("simdgroup_matrix of int", kernel("", "simdgroup_matrix<int, 8, 8> m; (void)m;"), "simdgroup_matrix"),
    ("MMA mixing element types", kernel("", "simdgroup_float8x8 a, c; simdgroup_half8x8 hb;\n"
                                            "simdgroup_multiply_accumulate(c, a, hb, a);"),
     "simdgroup_multiply_accumulate"),
    ("int builtin", kernel(", int tid BUILTIN(thread_index_in_threadgroup)", "o[tid] = 0.0f;"), "BUILTIN"),
    ("ulong builtin", kernel(", ulong tid BUILTIN(thread_position_in_grid)", "o[tid] = 0.0f;"), "BUILTIN"),
    ("uint3 of a scalar builtin", kernel(", uint3 l BUILTIN(thread_index_in_simdgroup)", "o[l.x] = 0.0f;"),
     "BUILTIN"),
    ("bfloat from double", kernel("", "double d = 1.0; o[0] = float(bfloat(d));"), "deleted"),
]


def main(argv):
    if not argv:
        print(__doc__)
        return 2
    return 1 if run_planted("shim strict", argv + FLAGS, CONTROL, BAD) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
