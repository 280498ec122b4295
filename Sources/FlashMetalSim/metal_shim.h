// metal_shim.h — a host-only stand-in for <metal_stdlib>, enough for the
// flashmetal kernels to compile as C++20 (clang >= 15) and run in the fiber
// simulator. Never seen by the Metal compiler: shaders include dialect.h,
// which includes this file only when __METAL_VERSION__ is not defined.
//
// Compile with: -std=c++20 -Xclang -ffloat16-excess-precision=none
//               -Wno-unknown-attributes -Werror=double-promotion
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cfloat>
#include <cmath>
#include <limits>
#include <source_location>
#include <tuple>
#include <type_traits>
#include <utility>

#include "simulator.h"

// The counted copy of the kernels (compiled with FMSIM_COUNTED_COPY and
// load/store tracing, see counters.h) puts every shim definition in an inline
// namespace: its template instances then have names of their own and never
// merge at link time with the plain copy's (which stay untraced). Source-level
// names are the same in both.
#ifdef FMSIM_COUNTED_COPY
#define FMSIM_VARIANT_BEGIN inline namespace counted {
#define FMSIM_VARIANT_END }
#define FMSIM_COUNT_OP(kind) ::fmsim::count_op(kind)
#else
#define FMSIM_VARIANT_BEGIN
#define FMSIM_VARIANT_END
#define FMSIM_COUNT_OP(kind) ((void)0)
#endif

#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wuser-defined-literals"
#pragma clang diagnostic ignored "-Wreserved-user-defined-literal"

// ---- scalar types ----------------------------------------------------------
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;

namespace metal {
FMSIM_VARIANT_BEGIN

// bfloat: 16-bit storage, round-to-nearest-even narrowing. As strict as MSL
// 3.1 (which rejects `bfloat b = 1.0f;` and math functions on bfloat): every
// conversion to or from another type is explicit, and arithmetic is only
// bfloat with bfloat (computed in float, rounded once). Mixed expressions
// must convert first: `float(b) * x`.
struct bfloat {
    uint16_t bits;
    static constexpr uint16_t from_float(float f) {
        uint32_t u = __builtin_bit_cast(uint32_t, f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40); // quiet NaN
        u += 0x7fffu + ((u >> 16) & 1u);
        return uint16_t(u >> 16);
    }
    static constexpr bfloat from_bits(uint16_t b) { bfloat r{}; r.bits = b; return r; }
    bfloat() = default;
    explicit constexpr bfloat(float f) : bits(from_float(f)) {}
    explicit constexpr bfloat(half h) : bits(from_float(float(h))) {}
    template <class U, std::enable_if_t<std::is_integral_v<U>, int> = 0>
    explicit constexpr bfloat(U u) : bits(from_float(float(u))) {}
    template <class U, std::enable_if_t<std::is_same_v<U, double>, int> = 0>
    bfloat(U) = delete;  // MSL has no double
    explicit constexpr operator float() const { return __builtin_bit_cast(float, uint32_t(bits) << 16); }
    explicit constexpr operator half() const { return half(float(*this)); }
    bfloat operator-() const { return from_bits(uint16_t(bits ^ 0x8000u)); }
    bfloat operator+() const { return *this; }
};
// clang-format off: clang-format cannot parse `operator op##=`
#define FMSIM_BF_OP(op)                                                                                  \
    inline bfloat operator op(bfloat a, bfloat b) { return bfloat(float(a) op float(b)); }               \
    inline bfloat &operator op##=(bfloat &a, bfloat b) { return a = bfloat(float(a) op float(b)); }
// clang-format on
FMSIM_BF_OP(+)
FMSIM_BF_OP(-)
FMSIM_BF_OP(*)
FMSIM_BF_OP(/)
#undef FMSIM_BF_OP
#define FMSIM_BF_CMP(op) \
    inline bool operator op(bfloat a, bfloat b) { return float(a) op float(b); }
FMSIM_BF_CMP(<)
FMSIM_BF_CMP(>)
FMSIM_BF_CMP(<=)
FMSIM_BF_CMP(>=)
FMSIM_BF_CMP(==)
FMSIM_BF_CMP(!=)
#undef FMSIM_BF_CMP

// half literals: 1.0h
inline constexpr half operator""h(long double v) { return half(float(v)); }
inline constexpr half operator""h(unsigned long long v) { return half(float(v)); }

// ---- vectors -----------------------------------------------------------------
template <class T, int N> using vec = T __attribute__((ext_vector_type(N)));

template <class V> struct vec_traits { static constexpr int n = 0; using elem = V; };
template <class T, int N> struct vec_traits<T __attribute__((ext_vector_type(N)))> {
    static constexpr int n = N;
    using elem = T;
};
template <class V> inline constexpr int vec_n = vec_traits<std::remove_cvref_t<V>>::n;
template <class V> using vec_elem = typename vec_traits<std::remove_cvref_t<V>>::elem;

// Two-element fragment storage for types ext_vector_type cannot hold.
template <class T> struct pair2 {
    T v[2];
    T &operator[](int i) { return v[i]; }
    const T &operator[](int i) const { return v[i]; }
};
template <class T> struct elem2 { using type = vec<T, 2>; };
template <> struct elem2<bfloat> { using type = pair2<bfloat>; };

template <class T, class S> inline constexpr T fm_cvt(const S &s) {
    if constexpr (std::is_same_v<T, bfloat>) return bfloat(float(s));
    else if constexpr (std::is_same_v<S, bfloat>) return T(float(s));
    else return T(s);
}
template <class T, int N, class A> inline void fm_put(vec<T, N> &r, int &i, const A &a) {
    if constexpr (vec_n<A> == 0) r[i++] = fm_cvt<T>(a);
    else for (int k = 0; k < vec_n<A>; k++) r[i++] = fm_cvt<T>(vec_elem<A>(a[k]));
}
template <class A> inline constexpr int fm_count = vec_n<A> == 0 ? 1 : vec_n<A>;

// float4(...) and friends: zero, splat, per-element conversion, concatenation.
template <class T, int N, class... A> inline vec<T, N> fmsim_make(const A &...a) {
    if constexpr (sizeof...(A) == 0) {
        return vec<T, N>{};
    } else if constexpr (sizeof...(A) == 1 && ((vec_n<A> == 0) && ...)) {
        return (vec<T, N>)(fm_cvt<T>(a...));
    } else if constexpr (sizeof...(A) == 1 && ((vec_n<A> == N) && ...)) {
        const auto &v0 = std::get<0>(std::forward_as_tuple(a...));
        vec<T, N> r;
        for (int i = 0; i < N; i++) r[i] = fm_cvt<T>(v0[i]);
        return r;
    } else {
        static_assert((fm_count<A> + ...) == N, "vector constructor: component count does not match");
        vec<T, N> r{};
        int i = 0;
        (fm_put<T, N>(r, i, a), ...);
        return r;
    }
}

// ---- type utilities ---------------------------------------------------------
using std::conditional_t;
using std::enable_if_t;
using std::is_same_v;
using std::is_integral_v;
using std::is_signed_v;
using std::is_unsigned_v;
template <class T> inline constexpr bool is_floating_point_v =
    std::is_floating_point_v<T> || std::is_same_v<T, half> || std::is_same_v<T, bfloat>;
template <class T> struct numeric_limits : std::numeric_limits<T> {};
template <> struct numeric_limits<half> {
    static constexpr half max() { return half(65504.0f); }
    static constexpr half lowest() { return half(-65504.0f); }
    static constexpr half min() { return half(6.103515625e-05f); }
    static constexpr half epsilon() { return half(0.0009765625f); }
    static constexpr half infinity() { return half(__builtin_inff()); }
    static constexpr half quiet_NaN() { return half(__builtin_nanf("")); }
};
template <> struct numeric_limits<bfloat> {
    static constexpr bfloat max() { return bfloat::from_bits(0x7f7f); }
    static constexpr bfloat lowest() { return bfloat::from_bits(0xff7f); }
    static constexpr bfloat min() { return bfloat::from_bits(0x0080); }
    static constexpr bfloat epsilon() { return bfloat::from_bits(0x3c00); }
    static constexpr bfloat infinity() { return bfloat::from_bits(0x7f80); }
    static constexpr bfloat quiet_NaN() { return bfloat::from_bits(0x7fc0); }
};

template <class T, class U> inline T as_type(const U &u) {
    static_assert(sizeof(T) == sizeof(U), "as_type: sizes differ");
    T t;
    __builtin_memcpy(&t, &u, sizeof t);
    return t;
}

// ---- math --------------------------------------------------------------------
// The float overloads are templates taking exactly float: libc++ (Apple's C++
// library) also declares float overloads of the C math functions at global
// scope, which kernels see beside `using namespace metal;`. Two non-template
// float overloads would make every call ambiguous; a template loses the tie
// to libc++'s (same function, same result) and beats libstdc++'s double one.
template <class T> concept fm_f32 = std::is_same_v<T, float>;
#define FMSIM_UNARY_SPECIAL(name, fexpr)                                             \
    template <fm_f32 F> inline F name(F x) { FMSIM_COUNT_OP(::fmsim::OP_SPECIAL); return fexpr; } \
    inline half name(half x) { return half(name(float(x))); }                        \
    template <class V, std::enable_if_t<(vec_n<V> > 0), int> = 0> inline V name(V v) { \
        V r;                                                                         \
        for (int i = 0; i < vec_n<V>; i++) r[i] = name(vec_elem<V>(v[i]));           \
        return r;                                                                    \
    }
#define FMSIM_UNARY(name, fexpr)                                                     \
    template <fm_f32 F> inline F name(F x) { return fexpr; }                         \
    inline half name(half x) { return half(name(float(x))); }                        \
    template <class V, std::enable_if_t<(vec_n<V> > 0), int> = 0> inline V name(V v) { \
        V r;                                                                         \
        for (int i = 0; i < vec_n<V>; i++) r[i] = name(vec_elem<V>(v[i]));           \
        return r;                                                                    \
    }
FMSIM_UNARY_SPECIAL(exp, __builtin_expf(x))
FMSIM_UNARY_SPECIAL(exp2, __builtin_exp2f(x))
FMSIM_UNARY_SPECIAL(exp10, __builtin_powf(10.0f, x))
FMSIM_UNARY_SPECIAL(log, __builtin_logf(x))
FMSIM_UNARY_SPECIAL(log2, __builtin_log2f(x))
FMSIM_UNARY_SPECIAL(log10, __builtin_log10f(x))
FMSIM_UNARY_SPECIAL(sqrt, __builtin_sqrtf(x))
FMSIM_UNARY_SPECIAL(rsqrt, 1.0f / __builtin_sqrtf(x))
FMSIM_UNARY(fabs, __builtin_fabsf(x))
FMSIM_UNARY(abs, __builtin_fabsf(x))
FMSIM_UNARY(floor, __builtin_floorf(x))
FMSIM_UNARY(ceil, __builtin_ceilf(x))
FMSIM_UNARY(round, __builtin_roundf(x))
FMSIM_UNARY(rint, __builtin_rintf(x))
FMSIM_UNARY(trunc, __builtin_truncf(x))
FMSIM_UNARY_SPECIAL(sin, __builtin_sinf(x))
FMSIM_UNARY_SPECIAL(cos, __builtin_cosf(x))
FMSIM_UNARY_SPECIAL(tan, __builtin_tanf(x))
FMSIM_UNARY_SPECIAL(tanh, __builtin_tanhf(x))
FMSIM_UNARY_SPECIAL(sinh, __builtin_sinhf(x))
FMSIM_UNARY_SPECIAL(cosh, __builtin_coshf(x))
FMSIM_UNARY_SPECIAL(erf, __builtin_erff(x))
FMSIM_UNARY(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == x ? 0.0f : x)))
FMSIM_UNARY(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
FMSIM_UNARY(fract, x - __builtin_floorf(x))
#undef FMSIM_UNARY
#undef FMSIM_UNARY_SPECIAL

#define FMSIM_BINARY(name, fexpr)                                                          \
    template <fm_f32 F> inline F name(F x, F y) { return fexpr; }                          \
    inline half name(half x, half y) { return half(name(float(x), float(y))); }             \
    template <class V, std::enable_if_t<(vec_n<V> > 0), int> = 0> inline V name(V a, V b) { \
        V r;                                                                               \
        for (int i = 0; i < vec_n<V>; i++) r[i] = name(vec_elem<V>(a[i]), vec_elem<V>(b[i])); \
        return r;                                                                          \
    }
FMSIM_BINARY(fmax, __builtin_fmaxf(x, y))
FMSIM_BINARY(fmin, __builtin_fminf(x, y))
FMSIM_BINARY(pow, __builtin_powf(x, y))
FMSIM_BINARY(powr, __builtin_powf(x, y))
FMSIM_BINARY(fmod, __builtin_fmodf(x, y))
FMSIM_BINARY(copysign, __builtin_copysignf(x, y))
FMSIM_BINARY(step, y < x ? 0.0f : 1.0f)
FMSIM_BINARY(divide, x / y)
#undef FMSIM_BINARY

// max/min: floats follow fmax/fmin; integers compare.
inline float max(float a, float b) { return __builtin_fmaxf(a, b); }
inline float min(float a, float b) { return __builtin_fminf(a, b); }
inline half max(half a, half b) { return half(__builtin_fmaxf(float(a), float(b))); }
inline half min(half a, half b) { return half(__builtin_fminf(float(a), float(b))); }
#define FMSIM_IMINMAX(T)                                  \
    inline T max(T a, T b) { return a > b ? a : b; }      \
    inline T min(T a, T b) { return a < b ? a : b; }
FMSIM_IMINMAX(int)
FMSIM_IMINMAX(uint)
FMSIM_IMINMAX(short)
FMSIM_IMINMAX(ushort)
FMSIM_IMINMAX(long)
FMSIM_IMINMAX(ulong)
#undef FMSIM_IMINMAX
template <class V, std::enable_if_t<(vec_n<V> > 0), int> = 0> inline V max(V a, V b) {
    V r;
    for (int i = 0; i < vec_n<V>; i++) r[i] = max(vec_elem<V>(a[i]), vec_elem<V>(b[i]));
    return r;
}
template <class V, std::enable_if_t<(vec_n<V> > 0), int> = 0> inline V min(V a, V b) {
    V r;
    for (int i = 0; i < vec_n<V>; i++) r[i] = min(vec_elem<V>(a[i]), vec_elem<V>(b[i]));
    return r;
}
template <class T> inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <fm_f32 F> inline F fma(F a, F b, F c) { return __builtin_fmaf(a, b, c); }
inline half fma(half a, half b, half c) { return half(__builtin_fmaf(float(a), float(b), float(c))); }
template <class V, std::enable_if_t<(vec_n<V> > 0), int> = 0> inline V fma(V a, V b, V c) {
    V r;
    for (int i = 0; i < vec_n<V>; i++) r[i] = fma(vec_elem<V>(a[i]), vec_elem<V>(b[i]), vec_elem<V>(c[i]));
    return r;
}
template <class T, class S> inline T mix(T x, T y, S a) { return x + (y - x) * a; }
template <class V> inline vec_elem<V> dot(V a, V b) {
    vec_elem<V> s = vec_elem<V>(0);
    for (int i = 0; i < vec_n<V>; i++) s += a[i] * b[i];
    return s;
}
template <class V> inline vec_elem<V> length(V a) { return sqrt(dot(a, a)); }
template <fm_f32 F> inline bool isnan(F x) { return x != x; }
inline bool isnan(half x) { return x != x; }
template <fm_f32 F> inline bool isinf(F x) { return __builtin_isinf(x); }
inline bool isinf(half x) { return __builtin_isinf(float(x)); }
template <fm_f32 F> inline bool isfinite(F x) { return __builtin_isfinite(x); }
inline bool isfinite(half x) { return __builtin_isfinite(float(x)); }
template <fm_f32 F> inline bool signbit(F x) { return __builtin_signbit(x); }

namespace fast {
using metal::exp; using metal::exp2; using metal::log; using metal::log2; using metal::sqrt;
using metal::rsqrt; using metal::fabs; using metal::abs; using metal::tanh; using metal::sin;
using metal::cos; using metal::pow; using metal::powr; using metal::max; using metal::min;
using metal::fmax; using metal::fmin; using metal::floor; using metal::ceil; using metal::clamp;
using metal::divide;
} // namespace fast
namespace precise {
using metal::exp; using metal::exp2; using metal::log; using metal::log2; using metal::sqrt;
using metal::rsqrt; using metal::fabs; using metal::abs; using metal::tanh; using metal::sin;
using metal::cos; using metal::pow; using metal::powr; using metal::max; using metal::min;
using metal::fmax; using metal::fmin; using metal::floor; using metal::ceil; using metal::clamp;
using metal::divide;
} // namespace precise

// ---- select / any / all -----------------------------------------------------
template <class T> inline T select(T a, T b, bool c) { return c ? b : a; }
template <class V, class M, std::enable_if_t<(vec_n<V> > 0 && vec_n<M> == vec_n<V>), int> = 0>
inline V select(V a, V b, M c) {
    V r;
    for (int i = 0; i < vec_n<V>; i++) r[i] = c[i] ? b[i] : a[i];
    return r;
}
inline bool any(bool b) { return b; }
inline bool all(bool b) { return b; }
template <class M, std::enable_if_t<(vec_n<M> > 0), int> = 0> inline bool any(M m) {
    for (int i = 0; i < vec_n<M>; i++) if (m[i]) return true;
    return false;
}
template <class M, std::enable_if_t<(vec_n<M> > 0), int> = 0> inline bool all(M m) {
    for (int i = 0; i < vec_n<M>; i++) if (!m[i]) return false;
    return true;
}

// ---- barriers ------------------------------------------------------------------
enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4,
                                  mem_threadgroup_imageblock = 8 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(unsigned(a) | unsigned(b)); }
inline void threadgroup_barrier(mem_flags, std::source_location l = std::source_location::current()) {
    ::fmsim::threadgroup_barrier(::fmsim::Site::from(l));
}
inline void simdgroup_barrier(mem_flags, std::source_location l = std::source_location::current()) {
    ::fmsim::simdgroup_barrier(::fmsim::Site::from(l));
}

// ---- SIMD collectives ------------------------------------------------------------
template <class T> struct fm_lane_in { T x; int32_t arg; };
template <class T> using fm_comb = void (*)(void *const *, void *const *, uint32_t);
template <class T> inline const T &fm_in(void *const *in, int l) { return static_cast<fm_lane_in<T> *>(in[l])->x; }
template <class T> inline int32_t fm_arg(void *const *in, int l) { return static_cast<fm_lane_in<T> *>(in[l])->arg; }
template <class T> inline T &fm_out(void *const *out, int l) { return *static_cast<T *>(out[l]); }
template <class T>
inline T fm_collective(T x, int32_t arg, ::fmsim::CombineFn fn, const char *what, const std::source_location &l) {
    fm_lane_in<T> in{x, arg};
    T out;
    ::fmsim::collective(&in, &out, fn, what, ::fmsim::Site::from(l));
    return out;
}
#define FMSIM_LIVE(l) for (int l = 0; l < 32; l++) if ((mask >> l) & 1)
template <class T> T fm_op_sum(T a, T b) { return a + b; }
template <class T> T fm_op_prod(T a, T b) { return a * b; }
template <class T> T fm_op_max(T a, T b) { return max(a, b); }
template <class T> T fm_op_min(T a, T b) { return min(a, b); }
template <class T> T fm_op_and(T a, T b) { return a & b; }
template <class T> T fm_op_or(T a, T b) { return a | b; }
template <class T> T fm_op_xor(T a, T b) { return a ^ b; }
template <class T, T (*OP)(T, T)> void fm_reduce(void *const *in, void *const *out, uint32_t mask) {
    int first = __builtin_ctz(mask);
    T acc = fm_in<T>(in, first);
    FMSIM_LIVE(l) if (l != first) acc = OP(acc, fm_in<T>(in, l));
    FMSIM_LIVE(l) fm_out<T>(out, l) = acc;
}
template <class T, bool Inclusive> void fm_prefix_sum(void *const *in, void *const *out, uint32_t mask) {
    T acc = T(0);
    FMSIM_LIVE(l) {
        T x = fm_in<T>(in, l);
        if (Inclusive) { acc = acc + x; fm_out<T>(out, l) = acc; }
        else { fm_out<T>(out, l) = acc; acc = acc + x; }
    }
}
// mode: 0 shuffle/broadcast (absolute lane), 1 xor, 2 up, 3 down, 4 rotate down, 5 rotate up
template <class T, int Mode> void fm_shuffle(void *const *in, void *const *out, uint32_t mask) {
    FMSIM_LIVE(l) {
        int a = fm_arg<T>(in, l), src;
        switch (Mode) {
        case 0: src = a; break;
        case 1: src = l ^ a; break;
        case 2: src = l - a; break;
        case 3: src = l + a; break;
        case 4: src = (l + a) & 31; break;
        default: src = (l - a) & 31; break;
        }
        bool ok = src >= 0 && src < 32 && ((mask >> src) & 1);
        fm_out<T>(out, l) = ok ? fm_in<T>(in, src) : fm_in<T>(in, l);
    }
}
template <class T> void fm_bcast_first(void *const *in, void *const *out, uint32_t mask) {
    int first = __builtin_ctz(mask);
    FMSIM_LIVE(l) fm_out<T>(out, l) = fm_in<T>(in, first);
}
inline void fm_ballot(void *const *in, void *const *out, uint32_t mask) {
    uint64_t v = 0;
    FMSIM_LIVE(l) if (fm_in<bool>(in, l)) v |= uint64_t(1) << l;
    FMSIM_LIVE(l) fm_out<uint64_t>(out, l) = v;
}
#undef FMSIM_LIVE

// The element types MSL's simd_* functions take: scalars or vectors of
// float, half and the 8/16/32-bit integers (no bfloat, bool, long or double);
// the bitwise reductions take the integers only. T is deduced from the
// argument, so nothing converts silently.
template <class T> inline constexpr bool fm_simd_int =
    std::is_same_v<T, int> || std::is_same_v<T, uint> || std::is_same_v<T, short> || std::is_same_v<T, ushort> ||
    std::is_same_v<T, char> || std::is_same_v<T, signed char> || std::is_same_v<T, uchar>;
template <class T> inline constexpr bool fm_simd_num = fm_simd_int<T> || std::is_same_v<T, float> || std::is_same_v<T, half>;
template <class T> concept fm_simd_t = fm_simd_num<vec_elem<T>>;
template <class T> concept fm_simd_i = fm_simd_int<vec_elem<T>>;
#define FMSIM_LOC std::source_location l = std::source_location::current()
template <fm_simd_t T> inline T simd_sum(T x, FMSIM_LOC) { return fm_collective(x, 0, fm_reduce<T, fm_op_sum<T>>, "simd_sum", l); }
template <fm_simd_t T> inline T simd_product(T x, FMSIM_LOC) { return fm_collective(x, 0, fm_reduce<T, fm_op_prod<T>>, "simd_product", l); }
template <fm_simd_t T> inline T simd_max(T x, FMSIM_LOC) { return fm_collective(x, 0, fm_reduce<T, fm_op_max<T>>, "simd_max", l); }
template <fm_simd_t T> inline T simd_min(T x, FMSIM_LOC) { return fm_collective(x, 0, fm_reduce<T, fm_op_min<T>>, "simd_min", l); }
template <fm_simd_i T> inline T simd_and(T x, FMSIM_LOC) { return fm_collective(x, 0, fm_reduce<T, fm_op_and<T>>, "simd_and", l); }
template <fm_simd_i T> inline T simd_or(T x, FMSIM_LOC) { return fm_collective(x, 0, fm_reduce<T, fm_op_or<T>>, "simd_or", l); }
template <fm_simd_i T> inline T simd_xor(T x, FMSIM_LOC) { return fm_collective(x, 0, fm_reduce<T, fm_op_xor<T>>, "simd_xor", l); }
template <fm_simd_t T> inline T simd_prefix_inclusive_sum(T x, FMSIM_LOC) { return fm_collective(x, 0, fm_prefix_sum<T, true>, "simd_prefix_inclusive_sum", l); }
template <fm_simd_t T> inline T simd_prefix_exclusive_sum(T x, FMSIM_LOC) { return fm_collective(x, 0, fm_prefix_sum<T, false>, "simd_prefix_exclusive_sum", l); }
template <fm_simd_t T> inline T simd_shuffle(T x, ushort lane, FMSIM_LOC) { return fm_collective(x, lane, fm_shuffle<T, 0>, "simd_shuffle", l); }
template <fm_simd_t T> inline T simd_broadcast(T x, ushort lane, FMSIM_LOC) { return fm_collective(x, lane, fm_shuffle<T, 0>, "simd_broadcast", l); }
template <fm_simd_t T> inline T simd_shuffle_xor(T x, ushort m, FMSIM_LOC) { return fm_collective(x, m, fm_shuffle<T, 1>, "simd_shuffle_xor", l); }
template <fm_simd_t T> inline T simd_shuffle_up(T x, ushort d, FMSIM_LOC) { return fm_collective(x, d, fm_shuffle<T, 2>, "simd_shuffle_up", l); }
template <fm_simd_t T> inline T simd_shuffle_down(T x, ushort d, FMSIM_LOC) { return fm_collective(x, d, fm_shuffle<T, 3>, "simd_shuffle_down", l); }
template <fm_simd_t T> inline T simd_shuffle_rotate_down(T x, ushort d, FMSIM_LOC) { return fm_collective(x, d, fm_shuffle<T, 4>, "simd_shuffle_rotate_down", l); }
template <fm_simd_t T> inline T simd_shuffle_rotate_up(T x, ushort d, FMSIM_LOC) { return fm_collective(x, d, fm_shuffle<T, 5>, "simd_shuffle_rotate_up", l); }
template <fm_simd_t T> inline T simd_broadcast_first(T x, FMSIM_LOC) { return fm_collective(x, 0, fm_bcast_first<T>, "simd_broadcast_first", l); }

struct simd_vote {
    using vote_t = ulong;
    vote_t v;
    explicit constexpr operator vote_t() const { return v; }
    constexpr bool all() const { return v == 0xffffffffull; }
    constexpr bool any() const { return v != 0; }
};
inline simd_vote simd_ballot(bool b, FMSIM_LOC) {
    fm_lane_in<bool> in{b, 0};
    uint64_t out;
    ::fmsim::collective(&in, &out, fm_ballot, "simd_ballot", ::fmsim::Site::from(l));
    return simd_vote{out};
}
inline bool simd_any(bool b, FMSIM_LOC) {
    fm_lane_in<bool> in{b, 0};
    uint64_t out;
    ::fmsim::collective(&in, &out, fm_ballot, "simd_any", ::fmsim::Site::from(l));
    return out != 0;
}
inline void fm_all_comb(void *const *in, void *const *out, uint32_t mask) {
    bool v = true;
    for (int l = 0; l < 32; l++) if (((mask >> l) & 1) && !fm_in<bool>(in, l)) v = false;
    for (int l = 0; l < 32; l++) if ((mask >> l) & 1) fm_out<bool>(out, l) = v;
}
inline bool simd_all(bool b, FMSIM_LOC) { return fm_collective(b, 0, fm_all_comb, "simd_all", l); }

// ---- simdgroup_matrix<T, 8, 8> --------------------------------------------------
// Lane l holds row (q & 4) + ((l / 2) % 4), columns c and c + 1 with
// c = (q & 2) * 2 + (l % 2) * 2 and q = l / 4 (the layout MLX documents).
inline void fm_frag_rc(uint lane, int &r, int &c) {
    uint q = lane / 4;
    r = int((q & 4) + ((lane / 2) % 4));
    c = int((q & 2) * 2 + (lane % 2) * 2);
}
inline uint fm_lane() { return ::fmsim::tl_ids->lane; }

template <class T, int R, int C> struct simdgroup_matrix;
template <class T> struct simdgroup_matrix<T, 8, 8> {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat>,
                  "simdgroup_matrix holds float, half or bfloat (MSL 3.1)");
    using storage = typename elem2<T>::type;
    storage e;
    simdgroup_matrix() : e{} {}
    explicit simdgroup_matrix(T d) : e{} { // a diagonal matrix
        int r, c;
        fm_frag_rc(fm_lane(), r, c);
        e[0] = r == c ? d : T(0);
        e[1] = r == c + 1 ? d : T(0);
    }
    storage &thread_elements() { return e; }
    const storage &thread_elements() const { return e; }
};
template <class T, int R, int C> inline simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) {
    simdgroup_matrix<T, R, C> m;
    m.e[0] = v;
    m.e[1] = v;
    return m;
}
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

// As in MSL, the pointer's element type is the matrix's (no conversion).
template <class T>
inline void simdgroup_load(simdgroup_matrix<T, 8, 8> &m, const std::type_identity_t<T> *src, ulong elements_per_row = 8,
                           vec<ulong, 2> origin = vec<ulong, 2>{0, 0}, bool transpose = false) {
    int r, c;
    fm_frag_rc(fm_lane(), r, c);
    for (int k = 0; k < 2; k++) {
        ulong row = transpose ? origin.y + ulong(c + k) : origin.y + ulong(r);
        ulong col = transpose ? origin.x + ulong(r) : origin.x + ulong(c + k);
        m.e[k] = src[row * elements_per_row + col];
    }
}
template <class T>
inline void simdgroup_store(const simdgroup_matrix<T, 8, 8> &m, std::type_identity_t<T> *dst, ulong elements_per_row = 8,
                            vec<ulong, 2> origin = vec<ulong, 2>{0, 0}, bool transpose = false) {
    int r, c;
    fm_frag_rc(fm_lane(), r, c);
    for (int k = 0; k < 2; k++) {
        ulong row = transpose ? origin.y + ulong(c + k) : origin.y + ulong(r);
        ulong col = transpose ? origin.x + ulong(r) : origin.x + ulong(c + k);
        dst[row * elements_per_row + col] = m.e[k];
    }
}
struct fm_mma_in { const void *a, *b, *c; };
template <class TD, class TA, class TB, class TC>
void fm_mma(void *const *in, void *const *out, uint32_t mask) {
    if (mask != 0xffffffffu) ::fmsim::fail("simdgroup_multiply_accumulate needs all 32 lanes of the SIMD group (live mask %08x)", mask);
    float A[8][8], B[8][8], Cm[8][8];
    for (int l = 0; l < 32; l++) {
        const fm_mma_in &x = static_cast<const fm_lane_in<fm_mma_in> *>(in[l])->x;
        int r, c;
        fm_frag_rc(uint(l), r, c);
        for (int k = 0; k < 2; k++) {
            A[r][c + k] = float(static_cast<const simdgroup_matrix<TA, 8, 8> *>(x.a)->e[k]);
            B[r][c + k] = float(static_cast<const simdgroup_matrix<TB, 8, 8> *>(x.b)->e[k]);
            Cm[r][c + k] = x.c ? float(static_cast<const simdgroup_matrix<TC, 8, 8> *>(x.c)->e[k]) : 0.0f;
        }
    }
    for (int l = 0; l < 32; l++) {
        int r, c;
        fm_frag_rc(uint(l), r, c);
        auto &D = *static_cast<simdgroup_matrix<TD, 8, 8> *>(out[l]);
        for (int k = 0; k < 2; k++) {
            float s = Cm[r][c + k];
            for (int j = 0; j < 8; j++) s = __builtin_fmaf(A[r][j], B[j][c + k], s);
            D.e[k] = fm_cvt<TD>(s);
        }
    }
}
// The per-lane operation count of an MMA of element type T (counted copy).
template <class T> constexpr int fm_mma_op() {
    return std::is_same_v<T, float> ? ::fmsim::OP_MMA_F32 : std::is_same_v<T, half> ? ::fmsim::OP_MMA_F16
                                                                                   : ::fmsim::OP_MMA_BF16;
}
// One element type for all four operands: the kernels never mix them, so
// the simulator does not have to model how a mixed-type MMA rounds.
template <class T>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<T, 8, 8> &d, const std::type_identity_t<simdgroup_matrix<T, 8, 8>> &a,
                                          const std::type_identity_t<simdgroup_matrix<T, 8, 8>> &b,
                                          const std::type_identity_t<simdgroup_matrix<T, 8, 8>> &c, FMSIM_LOC) {
    FMSIM_COUNT_OP(fm_mma_op<T>());
    fm_lane_in<fm_mma_in> in{{&a, &b, &c}, 0};
    simdgroup_matrix<T, 8, 8> out;
    ::fmsim::collective(&in, &out, fm_mma<T, T, T, T>, "simdgroup_multiply_accumulate", ::fmsim::Site::from(l));
    d = out;
}
template <class T>
inline void simdgroup_multiply(simdgroup_matrix<T, 8, 8> &d, const std::type_identity_t<simdgroup_matrix<T, 8, 8>> &a,
                               const std::type_identity_t<simdgroup_matrix<T, 8, 8>> &b, FMSIM_LOC) {
    FMSIM_COUNT_OP(fm_mma_op<T>());
    fm_lane_in<fm_mma_in> in{{&a, &b, nullptr}, 0};
    simdgroup_matrix<T, 8, 8> out;
    ::fmsim::collective(&in, &out, fm_mma<T, T, T, T>, "simdgroup_multiply", ::fmsim::Site::from(l));
    d = out;
}
#undef FMSIM_LOC

// ---- atomics ------------------------------------------------------------------------
enum memory_order { memory_order_relaxed = __ATOMIC_RELAXED, memory_order_seq_cst = __ATOMIC_SEQ_CST };
template <class T> struct atomic { T v; };
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
template <class T> inline T *fm_av(volatile atomic<T> *o) { return const_cast<T *>(&o->v); }
template <class T, class U> inline void atomic_store_explicit(volatile atomic<T> *o, U v, memory_order) {
    T w = T(v);
    __atomic_store(fm_av(o), &w, __ATOMIC_SEQ_CST);
}
template <class T> inline T atomic_load_explicit(volatile atomic<T> *o, memory_order) {
    T r;
    __atomic_load(fm_av(o), &r, __ATOMIC_SEQ_CST);
    return r;
}
template <class T, class U> inline T atomic_exchange_explicit(volatile atomic<T> *o, U v, memory_order) {
    T w = T(v), r;
    __atomic_exchange(fm_av(o), &w, &r, __ATOMIC_SEQ_CST);
    return r;
}
template <class T, class U>
inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T> *o, T *expected, U desired, memory_order,
                                                  memory_order) {
    T w = T(desired);
    return __atomic_compare_exchange(fm_av(o), expected, &w, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
template <class T, class F> inline T fm_atomic_rmw(volatile atomic<T> *o, F f) {
    T old;
    __atomic_load(fm_av(o), &old, __ATOMIC_RELAXED);
    T nw = f(old);
    while (!__atomic_compare_exchange(fm_av(o), &old, &nw, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) nw = f(old);
    return old;
}
#define FMSIM_ATOMIC_RMW(name, expr)                                                      \
    template <class T, class U> inline T name(volatile atomic<T> *o, U v, memory_order) { \
        T w = T(v);                                                                       \
        return fm_atomic_rmw(o, [w](T a) { return T(expr); });                           \
    }
FMSIM_ATOMIC_RMW(atomic_fetch_add_explicit, a + w)
FMSIM_ATOMIC_RMW(atomic_fetch_sub_explicit, a - w)
// clang-format off: clang-format reads `a & w` as a reference declaration
FMSIM_ATOMIC_RMW(atomic_fetch_and_explicit, a & w)
// clang-format on
FMSIM_ATOMIC_RMW(atomic_fetch_or_explicit, a | w)
FMSIM_ATOMIC_RMW(atomic_fetch_xor_explicit, a ^ w)
FMSIM_ATOMIC_RMW(atomic_fetch_min_explicit, a < w ? a : w)
FMSIM_ATOMIC_RMW(atomic_fetch_max_explicit, a > w ? a : w)
#undef FMSIM_ATOMIC_RMW

FMSIM_VARIANT_END
} // namespace metal

using metal::bfloat;

// ---- vector typedefs -----------------------------------------------------------------
#define FMSIM_VEC(T, name)                  \
    typedef metal::vec<T, 2> name##2;       \
    typedef metal::vec<T, 3> name##3;       \
    typedef metal::vec<T, 4> name##4;
FMSIM_VEC(float, float)
FMSIM_VEC(half, half)
FMSIM_VEC(int, int)
FMSIM_VEC(uint, uint)
FMSIM_VEC(short, short)
FMSIM_VEC(ushort, ushort)
FMSIM_VEC(char, char)
FMSIM_VEC(uchar, uchar)
FMSIM_VEC(long, long)
FMSIM_VEC(ulong, ulong)
FMSIM_VEC(bool, bool)
#undef FMSIM_VEC

// ---- kernel plumbing: builtins, function constants, threadgroup memory -----------
namespace fmsim {
FMSIM_VARIANT_BEGIN

// A builtin converts only to the types MSL declares it with: uint or ushort,
// and for the grid/threadgroup positions and sizes also their 2-/3-vectors.
// Anything else (int, long, ulong, float...) stops at the static_assert.
template <bool Vec> struct builtin_val {
    uint32_t x, y, z;
    template <class T> operator T() const {
        using E = ::metal::vec_elem<T>;
        constexpr bool elem_ok = std::is_same_v<E, uint32_t> || std::is_same_v<E, uint16_t>;
        constexpr bool shape_ok = ::metal::vec_n<T> == 0 || (Vec && (::metal::vec_n<T> == 2 || ::metal::vec_n<T> == 3));
        static_assert(elem_ok && shape_ok, "BUILTIN parameter: MSL declares this builtin as uint or ushort"
                                           " (uint2/uint3/ushort2/ushort3 for positions and sizes)");
        if constexpr (::metal::vec_n<T> == 0) return T(x);
        else if constexpr (::metal::vec_n<T> == 2) return T{E(x), E(y)};
        else return T{E(x), E(y), E(z)};
    }
};
using builtin_vec = builtin_val<true>;
using builtin_scalar = builtin_val<false>;
inline const ThreadIds &ids() { return *tl_ids; }
inline builtin_vec builtin_thread_position_in_threadgroup() { auto &i = ids(); return {i.tid[0], i.tid[1], i.tid[2]}; }
inline builtin_vec builtin_threadgroup_position_in_grid() { auto &i = ids(); return {i.tgid[0], i.tgid[1], i.tgid[2]}; }
inline builtin_vec builtin_threads_per_threadgroup() { auto &i = ids(); return {i.tpg[0], i.tpg[1], i.tpg[2]}; }
inline builtin_vec builtin_threadgroups_per_grid() { auto &i = ids(); return {i.ngroups[0], i.ngroups[1], i.ngroups[2]}; }
inline builtin_vec builtin_thread_position_in_grid() {
    auto &i = ids();
    return {i.tgid[0] * i.tpg[0] + i.tid[0], i.tgid[1] * i.tpg[1] + i.tid[1], i.tgid[2] * i.tpg[2] + i.tid[2]};
}
inline builtin_vec builtin_threads_per_grid() {
    auto &i = ids();
    return {i.ngroups[0] * i.tpg[0], i.ngroups[1] * i.tpg[1], i.ngroups[2] * i.tpg[2]};
}
inline builtin_scalar builtin_thread_index_in_threadgroup() { return {ids().linear, 0, 0}; }
inline builtin_scalar builtin_thread_index_in_simdgroup() { return {ids().lane, 0, 0}; }
inline builtin_scalar builtin_simdgroup_index_in_threadgroup() { return {ids().simd, 0, 0}; }
inline builtin_scalar builtin_threads_per_simdgroup() { return {32, 0, 0}; }
inline builtin_scalar builtin_simdgroups_per_threadgroup() { return {ids().nsimd, 0, 0}; }
inline builtin_scalar builtin_thread_execution_width() { return {32, 0, 0}; }

template <class T, int I> struct fconst {
    const char *name;
    operator T() const { return static_cast<T>(constant_value(I, std::is_same_v<T, bool>, name)); }
    static constexpr int index = I;
};

template <class T, int I> struct tg_buf {
    T *p;
    using elem = T;
    static constexpr int index = I;
    operator T *() const { return p; }
    template <class Ix, std::enable_if_t<std::is_integral_v<Ix>, int> = 0> T &operator[](Ix i) const { return p[i]; }
};
template <class P> struct is_tg_buf : std::false_type {};
template <class T, int I> struct is_tg_buf<tg_buf<T, I>> : std::true_type {};

template <class P> inline P bind_arg(const BoundArgs &a, int i) {
    if constexpr (is_tg_buf<P>::value) {
        return P{static_cast<typename P::elem *>(tg_buffer(P::index))};
    } else if constexpr (std::is_pointer_v<P>) {
        return reinterpret_cast<P>(a.ptr[i]);
    } else {
        static_assert(std::is_reference_v<P>, "kernel parameters must be pointers, references, TG_BUFFER or BUILTIN");
        return *reinterpret_cast<std::remove_reference_t<P> *>(a.ptr[i]);
    }
}
template <class L, class Tup, size_t K> constexpr bool invocable_first() {
    return []<size_t... I>(std::index_sequence<I...>) {
        return std::is_invocable_v<L, std::tuple_element_t<I, Tup>...>;
    }(std::make_index_sequence<K>{});
}
template <class L, class Tup, size_t K = 0> constexpr size_t required_params() {
    if constexpr (invocable_first<L, Tup, K>()) return K;
    else {
        static_assert(K < std::tuple_size_v<Tup>, "kernel is not callable with its own parameters");
        return required_params<L, Tup, K + 1>();
    }
}
// alignof what a buffer parameter points or refers to (1 for void).
template <class P> constexpr uint32_t param_align() {
    using E = std::remove_cv_t<std::remove_reference_t<std::remove_pointer_t<P>>>;
    if constexpr (std::is_void_v<E>) return 1;
    else return uint32_t(alignof(E));
}
template <class Fn> struct fn_params;
template <class... P> struct fn_params<void(P...)> { using type = std::tuple<P...>; };

template <class L, class Tup, size_t... I> void invoke_kernel(const BoundArgs &a) {
    L{}(bind_arg<std::tuple_element_t<I, Tup>>(a, int(I))...);
}
template <class L, class Tup, size_t... I> constexpr auto make_invoke(std::index_sequence<I...>) {
    return &invoke_kernel<L, Tup, I...>;
}
template <class Fn, class L> int register_fn(const char *name, L) {
    using Tup = typename fn_params<Fn>::type;
    constexpr size_t K = required_params<L, Tup>();
    static_assert(K <= 31, "at most 31 bound parameters");
    static KernelEntry e;
    e.name = name;
    e.n_params = int(K);
    [&]<size_t... I>(std::index_sequence<I...>) {
        ((e.kinds[I] = is_tg_buf<std::tuple_element_t<I, Tup>>::value ? 2
                       : std::is_pointer_v<std::tuple_element_t<I, Tup>> ? 0 : 1,
          e.ref_sizes[I] = std::is_reference_v<std::tuple_element_t<I, Tup>>
                               ? uint32_t(sizeof(std::remove_reference_t<std::tuple_element_t<I, Tup>>)) : 0,
          e.aligns[I] = param_align<std::tuple_element_t<I, Tup>>()),
         ...);
    }(std::make_index_sequence<K>{});
    e.invoke = make_invoke<L, Tup>(std::make_index_sequence<K>{});
#ifdef FMSIM_COUNTED_COPY
    e.counted = true;
#endif
    register_kernel(&e);
    return 0;
}
FMSIM_VARIANT_END
} // namespace fmsim

template <class T, int I> inline bool is_function_constant_defined(const fmsim::fconst<T, I> &) {
    return fmsim::constant_defined(I);
}

#pragma clang diagnostic pop

// ---- dialect expansions on the host (used by dialect.h) ---------------------------
#define FMSIM_CAT2(a, b) a##b
#define FMSIM_CAT(a, b) FMSIM_CAT2(a, b)
#define FMSIM_BUILTIN(attr) = ::fmsim::builtin_##attr()
#define FMSIM_FUNCTION_CONSTANT(T, name, idx) static const ::fmsim::fconst<T, idx> name{#name};
#define FMSIM_FUNCTION_CONSTANT_EXPR(T, name, expr)                        \
    struct fmsim_fce_##name {                                              \
        operator T() const { return static_cast<T>(expr); }                \
    };                                                                     \
    static const fmsim_fce_##name name{};
// clang-format off: clang-format cannot parse a reference-to-array declarator in a macro
#define FMSIM_TG_ARRAY(T, name, n)                                                                         \
    T(&name)[(n)] = *static_cast<T(*)[(n)]>(::fmsim::tg_array(                                            \
        []() -> const void * { static const char fmsim_key = 0; return &fmsim_key; }(), sizeof(T[(n)]),   \
        alignof(T), #name, ::fmsim::Site::from(std::source_location::current())))
// clang-format on
#define FMSIM_TG_BUFFER(T, name, idx) ::fmsim::tg_buf<T, idx> name
#define FMSIM_INSTANTIATE_KERNEL(hname, f, ...)                                                            \
    [[maybe_unused]] static const int FMSIM_CAT(fmsim_registered_, __COUNTER__) =                          \
        ::fmsim::register_fn<decltype(f<__VA_ARGS__>)>(hname, [](auto &&...fmsim_a)                        \
            -> decltype(f<__VA_ARGS__>(static_cast<decltype(fmsim_a) &&>(fmsim_a)...)) {                  \
            return f<__VA_ARGS__>(static_cast<decltype(fmsim_a) &&>(fmsim_a)...);                         \
        });

// Address spaces and the kernel keyword vanish on the host. These come last:
// `thread` would otherwise break <thread> and friends. Include std headers
// BEFORE this file.
#define device
#define constant
#define threadgroup
#define thread
#define kernel

// MSL-style vector constructors (splat, conversion, concatenation). Only the
// concrete names are macros: `vec<float, 4>(x)` or a template alias would be
// a clang vector cast (a bitcast for same-size types) — the lint rejects it.
#define float2(...) ::metal::fmsim_make<float, 2>(__VA_ARGS__)
#define float3(...) ::metal::fmsim_make<float, 3>(__VA_ARGS__)
#define float4(...) ::metal::fmsim_make<float, 4>(__VA_ARGS__)
#define half2(...) ::metal::fmsim_make<half, 2>(__VA_ARGS__)
#define half3(...) ::metal::fmsim_make<half, 3>(__VA_ARGS__)
#define half4(...) ::metal::fmsim_make<half, 4>(__VA_ARGS__)
#define int2(...) ::metal::fmsim_make<int, 2>(__VA_ARGS__)
#define int3(...) ::metal::fmsim_make<int, 3>(__VA_ARGS__)
#define int4(...) ::metal::fmsim_make<int, 4>(__VA_ARGS__)
#define uint2(...) ::metal::fmsim_make<uint, 2>(__VA_ARGS__)
#define uint3(...) ::metal::fmsim_make<uint, 3>(__VA_ARGS__)
#define uint4(...) ::metal::fmsim_make<uint, 4>(__VA_ARGS__)
#define short2(...) ::metal::fmsim_make<short, 2>(__VA_ARGS__)
#define short4(...) ::metal::fmsim_make<short, 4>(__VA_ARGS__)
#define ushort2(...) ::metal::fmsim_make<ushort, 2>(__VA_ARGS__)
#define ushort3(...) ::metal::fmsim_make<ushort, 3>(__VA_ARGS__)
#define ushort4(...) ::metal::fmsim_make<ushort, 4>(__VA_ARGS__)
#define uchar4(...) ::metal::fmsim_make<uchar, 4>(__VA_ARGS__)
#define char4(...) ::metal::fmsim_make<char, 4>(__VA_ARGS__)
#define ulong2(...) ::metal::fmsim_make<ulong, 2>(__VA_ARGS__)
#define long2(...) ::metal::fmsim_make<long, 2>(__VA_ARGS__)
