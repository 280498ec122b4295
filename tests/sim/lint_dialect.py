#!/usr/bin/env python3
"""lint_dialect.py — reject dialect violations in Resources/shaders/*.metal.

The shaders compile twice: by the Metal compiler and as C++20 for the
simulator (docs/SIMULATOR.md). Constructs that only one side understands, or that
mean different things on the two sides, are rejected here:

  raw-tg-array      threadgroup T x[n]           -> TG_ARRAY(T, x, n)
  raw-builtin       [[thread_position_in_grid]]  -> BUILTIN(thread_position_in_grid)
  raw-attribute     [[function_constant(i)]], [[threadgroup(i)]], [[host_name(..)]]
                                                 -> FUNCTION_CONSTANT / TG_BUFFER / INSTANTIATE_KERNEL
  half-literal      1.0H                         -> 1.0h
  alias-vector-cast vec<float, 4>(x) or an alias of a vector type called as a
                    constructor (a bitcast on the host) -> float4(x)
  buffer-order      [[buffer(i)]] of a kernel must be 0, 1, 2, ... in parameter order
  include           shaders include "dialect.h" only (never <metal_stdlib> or host files)
  double            no `double` (MSL has none; the host would compute in it silently)
  tg-array-scope    TG_ARRAY only inside a kernel's body (MSL allows threadgroup
                    variables only at kernel scope; the host would share one
                    array per call site between unrelated callers)
  kernel-param      every kernel parameter is attributed: [[buffer(i)]], TG_BUFFER
                    or BUILTIN (an unattributed one has no binding on Metal)
  builtin-type      BUILTIN parameters are uint / ushort, or uint2/3 / ushort2/3 for
                    positions and sizes in the grid (MSL's declared types)
  c-pointer-cast    no C-style casts to a pointer type: they cross address spaces
                    silently (clang accepts them, Metal does not); write
                    reinterpret_cast, which the MSL check holds to one address space
  gated-arg         a kernel argument declared [[buffer(i), function_constant(c)]]
                    does not exist when c is false (Metal binds nothing there):
                    the kernel reads or copies it only where c holds, as the
                    condition of an enclosing `if`, or before `?` / `&&` in the
                    same statement (c, or a constant that implies it: a
                    disjunct of c's FUNCTION_CONSTANT_EXPR, or an
                    FUNCTION_CONSTANT_EXPR that is a conjunction with c in it).
                    Pass `c ? arg : nullptr` on to helpers.

Usage: lint_dialect.py DIR...   |   lint_dialect.py --self-test
"""
import os
import re
import sys

BUILTINS = (
    "thread_position_in_grid thread_position_in_threadgroup threadgroup_position_in_grid "
    "threads_per_threadgroup threadgroups_per_grid threads_per_grid thread_index_in_threadgroup "
    "thread_index_in_simdgroup simdgroup_index_in_threadgroup threads_per_simdgroup "
    "simdgroups_per_threadgroup thread_execution_width quadgroup_index_in_threadgroup "
    "thread_index_in_quadgroup dispatch_threads_per_threadgroup"
).split()
VEC_NAMES = r"(?:float|half|bfloat|int|uint|short|ushort|char|uchar|long|ulong|bool)[234]"

RE_TG_ARRAY = re.compile(r"\bthreadgroup\s+(?:const\s+)?[A-Za-z_][\w:<>,\s]*?[\s*&]\s*([A-Za-z_]\w*)\s*\[(?!\[)")
RE_BUILTIN = re.compile(r"\[\[\s*(" + "|".join(BUILTINS) + r")\s*\]\]")
RE_RAW_ATTR = re.compile(r"\[\[\s*(function_constant|threadgroup|host_name)\s*\(")
RE_HALF_H = re.compile(r"(?<![\w.])(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?H\b")
RE_VEC_CALL = re.compile(r"\b(?:metal::)?vec\s*<[^<>;()]*>\s*\(")
RE_ALIAS_USING = re.compile(r"\busing\s+([A-Za-z_]\w*)\s*=\s*(?:metal::)?(?:vec\s*<|" + VEC_NAMES + r"\b)")
RE_ALIAS_TYPEDEF = re.compile(r"\btypedef\s+(?:metal::)?(?:vec\s*<[^;]*>|" + VEC_NAMES + r")\s+([A-Za-z_]\w*)\s*;")
# Headers the embed step inlines into a shader's source (Sources/ShaderEmbedder):
# flashmetal_kernels.h and every header beside the shaders.
INLINED_HEADERS = {"flashmetal_kernels.h"} | {
    f for f in os.listdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "Resources", "shaders"))
    if f.endswith(".h") and f != "dialect.h"}
RE_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
RE_KERNEL = re.compile(r"\bkernel\s+void\s+([A-Za-z_]\w*)\s*\(")
RE_BUFFER = re.compile(r"\[\[\s*buffer\s*\(\s*(\d+)\s*\)")
RE_DOUBLE = re.compile(r"\bdouble\b")
RE_TG_ARRAY_USE = re.compile(r"\bTG_ARRAY\s*\(")
RE_BUILTIN_PARAM = re.compile(r"^\s*(?:const\s+)?([A-Za-z_]\w*)\s+[A-Za-z_]\w*\s+BUILTIN\s*\(\s*(\w+)\s*\)\s*$")
RE_C_PTR_CAST = re.compile(r"\(\s*(?:const\s+)?(?:(?:device|constant|threadgroup|thread)\s+)?(?:const\s+)?"
                           r"[A-Za-z_][\w:]*(?:\s*<[^()<>;]*>)?\s*(?:const\s*)?\*+\s*\)\s*[\w(]")
RE_GATED_PARAM = re.compile(r"([A-Za-z_]\w*)\s*\[\[\s*buffer\s*\(\s*\d+\s*\)\s*,\s*"
                            r"function_constant\s*\(\s*([A-Za-z_]\w*)\s*\)\s*\]\]")
RE_FC_EXPR = re.compile(r"\bFUNCTION_CONSTANT_EXPR\s*\(\s*\w+\s*,\s*([A-Za-z_]\w*)\s*,")
RE_IF = re.compile(r"\bif\s*\(")
# Builtins MSL also declares as 2-/3-vectors; the others are scalars only.
VECTOR_BUILTINS = {"thread_position_in_grid", "thread_position_in_threadgroup", "threadgroup_position_in_grid",
                   "threads_per_threadgroup", "threadgroups_per_grid", "threads_per_grid",
                   "dispatch_threads_per_threadgroup"}


def strip_comments(src):
    """Blank out comments and string literals, keeping line breaks."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"' and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            out.append('"' + " " * (j - i - 1) + ('"' if j < n else ""))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def matching(code, j, open_c, close_c):
    """Index just past the bracket that closes the one before position j."""
    depth = 1
    while j < len(code) and depth:
        depth += {open_c: 1, close_c: -1}.get(code[j], 0)
        j += 1
    return j


def split_params(plist):
    """Top-level comma split of a parameter list (templates and attributes nest)."""
    out, depth, cur = [], 0, ""
    for c in plist:
        if c in "(<[":
            depth += 1
        elif c in ")>]":
            depth -= 1
        if c == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += c
    if cur.strip():
        out.append(cur)
    return out


def line_of(text, pos):
    return text.count("\n", 0, pos) + 1


def split_top(expr, op):
    """Top-level split of an expression on an operator (parentheses nest)."""
    out, depth, cur, i = [], 0, "", 0
    while i < len(expr):
        c = expr[i]
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0 and expr.startswith(op, i):
            out.append(cur)
            cur, i = "", i + len(op)
            continue
        cur += c
        i += 1
    out.append(cur)
    return [part.strip() for part in out]


def unparen(expr):
    expr = expr.strip()
    while expr.startswith("(") and matching(expr, 1, "(", ")") == len(expr):
        expr = expr[1:-1].strip()
    return expr


def constant_guards(code):
    """{constant: the constants whose truth implies it}, from FUNCTION_CONSTANT_EXPR
    definitions: each disjunct of `c = a || b` implies c; `g = c && d` implies c."""
    guards = {}
    for m in RE_FC_EXPR.finditer(code):
        end = matching(code, m.end(), "(", ")")
        expr = unparen(code[m.end():end - 1])
        name = m.group(1)
        ors = [unparen(x) for x in split_top(expr, "||")]
        ands = [unparen(x) for x in split_top(expr, "&&")]
        if len(ors) > 1 and all(re.fullmatch(r"[A-Za-z_]\w*", x) for x in ors):
            guards.setdefault(name, set()).update(ors)
        if len(ands) > 1:
            for x in ands:
                if re.fullmatch(r"[A-Za-z_]\w*", x):
                    guards.setdefault(x, set()).add(name)
    return guards


def if_scopes(body):
    """[(start, end, [conjuncts of the condition])] of every `if` in a body."""
    scopes = []
    for m in RE_IF.finditer(body):
        close = matching(body, m.end(), "(", ")")
        conds = [unparen(x) for x in split_top(body[m.end():close - 1], "&&")]
        k = close
        while k < len(body) and body[k].isspace():
            k += 1
        end = matching(body, k + 1, "{", "}") if body[k:k + 1] == "{" else body.find(";", k) + 1
        scopes.append((close, end, conds))
    return scopes


def gated_uses(body, pname, guards):
    """Positions in a kernel body where the gated argument pname is used unguarded."""
    bad = []
    scopes = if_scopes(body)
    for m in re.finditer(r"(?<![\w.>])%s\b" % re.escape(pname), body):
        start = max(body.rfind(c, 0, m.start()) for c in ";{}") + 1
        stmt = body[start:m.start()]
        if any(re.search(r"\b%s\s*(?:\?|&&)" % re.escape(g), stmt) for g in guards):
            continue
        if any(a <= m.start() < b and any(c in guards for c in conds) for a, b, conds in scopes):
            continue
        bad.append(m.start())
    return bad


def lint_text(text, name="<text>"):
    errors = []
    raw = text
    code = strip_comments(text)

    def err(pos, rule, msg):
        errors.append("%s:%d: [%s] %s" % (name, line_of(code, pos), rule, msg))

    for m in RE_INCLUDE.finditer(raw):
        inc = m.group(2)
        if m.group(1) == "<" or os.path.basename(inc) != "dialect.h":
            if m.group(1) == '"' and os.path.basename(inc) in INLINED_HEADERS:
                continue  # the shared param structs and the shaders' own headers (inlined by the embed step)
            err(m.start(), "include", "shaders include \"dialect.h\" only, not %s" % inc)
    for m in RE_TG_ARRAY.finditer(code):
        err(m.start(), "raw-tg-array", "raw threadgroup array '%s': use TG_ARRAY(T, %s, n)" % (m.group(1), m.group(1)))
    for m in RE_BUILTIN.finditer(code):
        err(m.start(), "raw-builtin", "raw [[%s]]: use BUILTIN(%s)" % (m.group(1), m.group(1)))
    for m in RE_RAW_ATTR.finditer(code):
        repl = {"function_constant": "FUNCTION_CONSTANT", "threadgroup": "TG_BUFFER",
                "host_name": "INSTANTIATE_KERNEL"}[m.group(1)]
        err(m.start(), "raw-attribute", "raw [[%s(...)]]: use %s" % (m.group(1), repl))
    for m in RE_HALF_H.finditer(code):
        err(m.start(), "half-literal", "uppercase half literal '%s': write it with a lowercase h" % m.group(0))
    for m in RE_VEC_CALL.finditer(code):
        err(m.start(), "alias-vector-cast", "vec<...>(x) is a bitcast on the host: use the concrete name (float4(x))")
    aliases = set(RE_ALIAS_USING.findall(code)) | set(RE_ALIAS_TYPEDEF.findall(code))
    for a in sorted(aliases):
        for m in re.finditer(r"(?<![\w.>:])" + re.escape(a) + r"\s*\(", code):
            err(m.start(), "alias-vector-cast",
                "'%s(...)' constructs through an alias of a vector type (a bitcast on the host): "
                "use the concrete name" % a)
    kernel_bodies = []
    for m in RE_KERNEL.finditer(code):
        j = matching(code, m.end(), "(", ")")
        plist = code[m.end():j - 1]
        idx = [int(b) for b in RE_BUFFER.findall(plist)]
        if idx != list(range(len(idx))):
            err(m.start(), "buffer-order",
                "kernel %s binds buffers %s: parameter position must equal the buffer index (0, 1, 2, ...)"
                % (m.group(1), idx))
        for prm in split_params(plist):
            text_p = " ".join(prm.split())
            if not re.search(r"\[\[\s*buffer\s*\(|\bTG_BUFFER\s*\(|\bBUILTIN\s*\(", text_p):
                err(m.start(), "kernel-param", "kernel %s: parameter '%s' has no [[buffer(i)]], TG_BUFFER or BUILTIN"
                    % (m.group(1), text_p))
            if "BUILTIN" in text_p:
                b = RE_BUILTIN_PARAM.match(text_p)
                allowed = {"uint", "ushort"}
                if b and b.group(2) in VECTOR_BUILTINS:
                    allowed |= {"uint2", "uint3", "ushort2", "ushort3"}
                if not b or b.group(1) not in allowed:
                    err(m.start(), "builtin-type", "kernel %s: '%s': MSL declares this builtin as %s"
                        % (m.group(1), text_p, " / ".join(sorted(allowed))))
        body = code.find("{", j)
        if body >= 0 and code[j:body].strip() == "":
            body_end = matching(code, body + 1, "{", "}")
            kernel_bodies.append((body, body_end))
            implied = constant_guards(code)
            for g in RE_GATED_PARAM.finditer(plist):
                pname, const = g.group(1), g.group(2)
                guards = {const} | implied.get(const, set())
                for pos in gated_uses(code[body:body_end], pname, guards):
                    err(body + pos, "gated-arg", "kernel %s reads '%s' ([[function_constant(%s)]]) where %s may be "
                        "false and nothing is bound: guard it (`if (%s)`, `%s ? %s : nullptr`)"
                        % (m.group(1), pname, const, const, const, const, pname))
    for m in RE_TG_ARRAY_USE.finditer(code):
        if not any(a < m.start() < b for a, b in kernel_bodies):
            err(m.start(), "tg-array-scope", "TG_ARRAY outside a kernel body: declare it in the kernel and pass "
                "a threadgroup pointer")
    for m in RE_DOUBLE.finditer(code):
        err(m.start(), "double", "MSL has no double: use float")
    for m in RE_C_PTR_CAST.finditer(code):
        err(m.start(), "c-pointer-cast", "C-style pointer cast '%s': it may cross address spaces unchecked; "
            "use reinterpret_cast" % " ".join(m.group(0).split()))
    return errors


def lint_dirs(dirs):
    errors, files = [], 0
    for d in dirs:
        if not os.path.isdir(d):
            continue
        for f in sorted(os.listdir(d)):
            if f.endswith(".metal"):
                files += 1
                p = os.path.join(d, f)
                with open(p, encoding="utf-8") as fh:
                    errors += lint_text(fh.read(), p)
    for e in errors:
        print(e)
    print("dialect lint: %d file(s), %d violation(s)" % (files, len(errors)))
    return 1 if errors else 0


GOOD = r'''
#include "dialect.h"
using namespace metal;
FUNCTION_CONSTANT(bool, has_mask, 300)
FUNCTION_CONSTANT(bool, has_win, 301)
FUNCTION_CONSTANT_EXPR(bool, any_ext, has_mask || has_win)
FUNCTION_CONSTANT_EXPR(bool, masked_win, (has_win && has_mask))
// a comment with threadgroup float x[4]; and [[thread_position_in_grid]] and 1.0H
template <typename T>
kernel void good(const device T *a [[buffer(0)]], device float *o [[buffer(1)]],
                 const device float *m [[buffer(2), function_constant(has_mask)]],
                 constant uint *e [[buffer(3), function_constant(any_ext)]],
                 TG_BUFFER(half, scratch, 0), uint tid BUILTIN(thread_index_in_threadgroup),
                 uint3 g BUILTIN(threadgroup_position_in_grid), ushort lane BUILTIN(thread_index_in_simdgroup)) {
    TG_ARRAY(float, buf, 64);
    threadgroup float *p = buf;
    threadgroup float *s = reinterpret_cast<threadgroup float *>(scratch + 8);
    half h = 1.0h;
    float4 v = float4(h);
    buf[tid] = (v.x * p[0]) + s[g.x] * float(lane);
    const device float *mm = has_mask ? m : nullptr;
    if (has_mask) {
        buf[0] = m[tid] + mm[0];
    }
    if (g.y > 0 && has_mask) buf[1] = m[0];
    const float y = has_mask && m[0] > 0.0f ? 1.0f : 0.0f;
    const uint w = has_win ? e[0] : 0u;
    if (masked_win) buf[2] = m[1] + y + float(w);
}
INSTANTIATE_KERNEL("good", good, float)
'''

BAD = {
    "raw-tg-array": "kernel void k(device float *o [[buffer(0)]]) {\n  threadgroup float tile[64];\n}\n",
    "raw-builtin": "kernel void k(device float *o [[buffer(0)]], uint3 gid [[thread_position_in_grid]]) {}\n",
    "half-literal": "kernel void k(device half *o [[buffer(0)]]) { o[0] = 1.0H; }\n",
    "alias-vector-cast": "kernel void k(device float4 *o [[buffer(0)]]) { o[0] = vec<float, 4>(int4(1)); }\n",
    "alias-vector-cast ": "using V4 = float4;\nkernel void k(device float4 *o [[buffer(0)]]) { o[0] = V4(int4(1)); }\n",
    "raw-attribute": "constant bool m [[function_constant(3)]];\n",
    "buffer-order": "kernel void k(device float *a [[buffer(1)]], device float *b [[buffer(0)]]) {}\n",
    "include": "#include <metal_stdlib>\n",
    "double": "kernel void k(device float *o [[buffer(0)]]) { double d = 1.0; o[0] = float(d); }\n",
    "tg-array-scope": "inline float helper(uint i) { TG_ARRAY(float, t, 32); return t[i]; }\n",
    "kernel-param": "kernel void k(device float *o [[buffer(0)]], constant uint &n) { o[0] = float(n); }\n",
    "builtin-type": "kernel void k(device float *o [[buffer(0)]], int tid BUILTIN(thread_index_in_threadgroup)) {}\n",
    "builtin-type ": "kernel void k(device float *o [[buffer(0)]], uint3 l BUILTIN(thread_index_in_simdgroup)) {}\n",
    "c-pointer-cast": "kernel void k(device float *o [[buffer(0)]]) {\n  TG_ARRAY(float, t, 32);\n"
                      "  thread float *p = (thread float *)t;\n  o[0] = p[0];\n}\n",
    "c-pointer-cast ": "kernel void k(device half *o [[buffer(0)]]) { device float *f = (device float *)(o + 2); }\n",
    "gated-arg": "FUNCTION_CONSTANT(bool, has_mask, 300)\n"
                 "kernel void k(device float *o [[buffer(0)]], const device float *m [[buffer(1), "
                 "function_constant(has_mask)]]) {\n  const device float *p = m;\n  o[0] = has_mask ? p[0] : 0.0f;\n}\n",
    "gated-arg ": "FUNCTION_CONSTANT(bool, has_mask, 300)\n"
                  "kernel void k(device float *o [[buffer(0)]], const device float *m [[buffer(1), "
                  "function_constant(has_mask)]]) {\n  if (has_mask) o[0] = 1.0f; else o[0] = m[0];\n}\n",
    "gated-arg  ": "FUNCTION_CONSTANT(bool, has_mask, 300)\nFUNCTION_CONSTANT(bool, has_win, 301)\n"
                   "kernel void k(device float *o [[buffer(0)]], const device float *m [[buffer(1), "
                   "function_constant(has_mask)]]) {\n  o[0] = has_win ? m[0] : 0.0f;\n}\n",
}


def self_test():
    ok = True
    good = lint_text(GOOD, "good.metal")
    if good:
        ok = False
        print("self-test: the good snippet was rejected:", *good, sep="\n  ")
    for rule, snippet in BAD.items():
        errs = lint_text(snippet, "bad.metal")
        hit = any("[%s]" % rule.strip() in e for e in errs)
        print("self-test %-18s %s" % (rule.strip(), "rejected" if hit else "NOT REJECTED"))
        ok &= hit
    print("dialect lint self-test:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    sys.exit(lint_dirs(sys.argv[1:] or ["Resources/shaders"]))
