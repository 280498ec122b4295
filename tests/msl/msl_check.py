#!/usr/bin/env python3
"""msl_check.py — compile every shader as the Metal compiler would check it.

clang, C++14, syntax only, __METAL_VERSION__ = 310, against the stand-in
<metal_stdlib> in this folder (device / constant / threadgroup are distinct
clang address spaces; MSL's signatures for what the shaders use; no double;
no C++17 or later; min / max / clamp on two operands of one type, long
included, as Apple's metal_integer declares them). What clang accepts but
MSL does not is then looked for in the preprocessed source: a linkage
specification (`extern "C"`: the Metal compiler defines __cplusplus, so a
header must hide it behind !defined(__METAL_VERSION__)). First a self-test:
planted errors (address-space mixing, C++17 constructs, a double, wrong
simdgroup element types, an implicit bfloat conversion, mixed-type integer
min / max, an extern "C" block) must each be rejected and a control shader
must compile; then every Resources/shaders/*.metal must compile.

What it cannot prove: that Apple's compiler accepts the shaders (attributes,
function constants and pipeline specialisation are only checked there).

Usage: msl_check.py CXX [SHADER_DIR]
"""
import os
import re
import subprocess
import sys

from planted import compile_file, run_planted

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FLAGS = ["-std=c++14", "-fsyntax-only", "-x", "c++", "-D__METAL_VERSION__=310", "-nostdinc", "-nostdinc++",
         "-I" + HERE, "-I" + os.path.join(ROOT, "Sources/CFlashMetal/include"), "-Wno-unknown-attributes",
         "-pedantic-errors"]
PRELUDE = '#include "%s/Resources/shaders/dialect.h"\nusing namespace metal;\n' % ROOT


# In the preprocessed source: (pattern, diagnostic) of what MSL rejects and clang does not.
PREPROCESSED_RULES = [
    (re.compile(r'\bextern\s*"C\+*"'), 'extern "C": MSL has no linkage specifications (it defines __cplusplus: '
                                       'guard with #if defined(__cplusplus) && !defined(__METAL_VERSION__))'),
]


def preprocessed_check(cmd):
    """A post-compile check for planted.compile_file: the preprocessed source against PREPROCESSED_RULES."""
    pp = [a for a in cmd if a != "-fsyntax-only"] + ["-E", "-P"]

    def check(path):
        r = subprocess.run(pp + [path], capture_output=True, text=True)
        if r.returncode != 0:
            return "preprocessing failed: " + r.stderr[-2000:]
        return "; ".join(msg for rx, msg in PREPROCESSED_RULES if rx.search(r.stdout))
    return check


def shader(helpers, body, params=""):
    return PRELUDE + helpers + (
        "\ntemplate <typename T>\nkernel void k(device float *o [[buffer(0)]], const device T *x [[buffer(1)]]%s,\n"
        "  uint lane BUILTIN(thread_index_in_simdgroup)) {\n%s\n}\nINSTANTIATE_KERNEL(\"k\", k, half)\n"
        % (params, body))


CONTROL = shader("inline float first(const threadgroup float *t) { return t[0]; }\n"
                 "inline float sum2(thread const float *v) { return v[0] + v[1]; }\n", """
    TG_ARRAY(float, t, 64);
    t[lane] = float(x[lane]);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float v[2] = {first(t), exp2(t[1])};
    threadgroup float *w = reinterpret_cast<threadgroup float *>(t + 2);
    simdgroup_float8x8 a = make_filled_simdgroup_matrix<float, 8, 8>(1.0f), c;
    simdgroup_multiply_accumulate(c, a, a, a);
    bfloat b = bfloat(v[0]);
    o[lane] = simd_sum(sum2(v)) + w[0] + c.thread_elements()[0] + float(b * b) + float(max(long(lane), 1L));
""", ", TG_BUFFER(float, scratch, 0)")

BAD = [
    ("threadgroup array as thread float*", shader("inline float sum2(thread const float *v) { return v[0] + v[1]; }\n",
                                                  "TG_ARRAY(float, t, 64); o[0] = sum2(t);"), "address_space"),
    ("device pointer into a threadgroup one", shader("", "TG_ARRAY(half, t, 64); threadgroup const half *p = x;"
                                                     " o[0] = float(p[lane]) + float(t[0]);"), "address_space"),
    ("reinterpret_cast across spaces", shader("", "TG_ARRAY(float, t, 64);"
                                              " device float *d = reinterpret_cast<device float *>(t); o[0] = d[0];"),
     "address_space"),
    ("threadgroup element as a device ref", shader("inline void put(device float &d) { d = 1.0f; }\n",
                                                   "TG_ARRAY(float, t, 64); put(t[lane]); o[0] = t[0];"),
     "address space"),
    ("C++17 if constexpr", shader("", "if constexpr (sizeof(T) == 2) o[0] = 1.0f;"), "C++17"),
    ("C++17 structured binding", shader("struct P { float a, b; };\n", "P p{1.0f, 2.0f}; auto [u, w] = p;"
                                        " o[0] = u + w;"), "C++17"),
    ("C++17 inline variable", "inline constexpr int kFoo = 1;\n" + shader("", "o[0] = float(kFoo);"), "C++17"),
    ("C++17 fold expression", shader("template <class... A> float add(A... a) { return (a + ...); }\n",
                                     "o[0] = add(1.0f, 2.0f);"), "C++17"),
    ("double", shader("", "double d = 1.0; o[0] = float(d);"), "poisoned"),
    ("simdgroup_matrix of int", shader("", "simdgroup_matrix<int, 8, 8> m; (void)m;"), "simdgroup_matrix"),
    ("MMA mixing half and float", shader("", "simdgroup_float8x8 a, c; simdgroup_half8x8 h;"
                                         " simdgroup_multiply_accumulate(c, a, h, a);"),
     "simdgroup_multiply_accumulate"),
    ("simd_sum of bfloat", shader("", "bfloat b = bfloat(1.0f); o[0] = float(simd_sum(b));"), "simd_sum"),
    ("bfloat from float, implicit", shader("", "bfloat b = 1.0f; o[0] = float(b);"), "bfloat"),
    ("bfloat times float", shader("", "bfloat b = bfloat(1.0f); o[0] = b * 2.0f;"), "operands"),
    ("min of long and int", shader("", "o[0] = float(min(long(lane), 1));"), "min"),
    ("max of int and uint", shader("", "o[0] = float(max(int(lane), lane));"), "max"),
    ("clamp of long and int", shader("", "o[0] = float(clamp(long(lane), 0, 8));"), "clamp"),
    ('extern "C" block seen by MSL', "#ifdef __cplusplus\nextern \"C\" {\n#endif\nstruct S { int a; };\n"
     "#ifdef __cplusplus\n}\n#endif\n" + shader("", "o[0] = 1.0f;"), 'extern "C"'),
]


def main(argv):
    if not argv:
        print(__doc__)
        return 2
    cmd = [argv[0]] + FLAGS
    shader_dir = argv[1] if len(argv) > 1 else os.path.join(ROOT, "Resources/shaders")
    post = preprocessed_check(cmd)
    failed = run_planted("msl check", cmd, CONTROL, BAD, post=post)
    shaders = sorted(f for f in os.listdir(shader_dir) if f.endswith(".metal"))
    for f in shaders:
        path = os.path.join(shader_dir, f)
        ok, err = compile_file(cmd, path, post)
        print("msl check: %-36s %s" % (f, "ok" if ok else "REJECTED"))
        if not ok:
            print(err[-4000:])
            failed += 1
    print("msl check: %d shader(s), %s" % (len(shaders), "FAILED" if failed else "all accepted"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
