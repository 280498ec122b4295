// conformance.cpp — conformance tests and micro-benchmarks of the simulator.
//   build-sim/sim-conformance           run the suite
//   build-sim/sim-conformance --bench   print simulator costs
// Ends with "N passed, M failed"; exits non-zero on any failure.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../../Sources/FlashMetalSim/include/fmsim.h"
#include "test_kernels.h"

extern "C" double fmsim_bench_switch_ns(long iters);
extern "C" const char *fmsim_context_switch_kind(void);

static int g_pass = 0, g_fail = 0;
static bool g_scramble = false;

static void check(bool ok, const char *name, const std::string &detail = "") {
    if (ok) g_pass++;
    else g_fail++;
    printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", name, detail.empty() ? "" : ": ", detail.c_str());
}

struct Run {
    std::vector<FMSimBinding> b;
    std::vector<FMSimConstant> c;
    std::vector<FMSimTGMemory> t;
    uint32_t grid[3] = {1, 1, 1}, threads[3] = {1, 1, 1};
    int workers = 1;
    int scramble = 0;
    uint64_t seed = 0;
    char err[1024] = {0};
    template <class T> Run &buf(int i, std::vector<T> &v) {
        b.push_back({i, 0, v.data(), uint64_t(v.size() * sizeof(T))});
        return *this;
    }
    template <class T> Run &bytes(int i, const T &v) {
        b.push_back({i, 1, (void *)&v, sizeof(T)});
        return *this;
    }
    Run &g(uint32_t x, uint32_t y = 1, uint32_t z = 1) { grid[0] = x; grid[1] = y; grid[2] = z; return *this; }
    Run &tg(uint32_t x, uint32_t y = 1, uint32_t z = 1) { threads[0] = x; threads[1] = y; threads[2] = z; return *this; }
    int go(const char *k) {
        FMSimDispatch d{};
        d.name = k;
        d.constants = c.data(); d.n_constants = int(c.size());
        d.bindings = b.data(); d.n_bindings = int(b.size());
        d.tg_memory = t.data(); d.n_tg_memory = int(t.size());
        for (int i = 0; i < 3; i++) { d.grid[i] = grid[i]; d.threads[i] = threads[i]; }
        d.workers = workers;
        d.scramble = scramble || g_scramble;
        d.seed = seed;
        return fmsim_dispatch(&d, err, sizeof err);
    }
};

static bool contains(const char *s, const char *w) { return strstr(s, w) != nullptr; }

static void t_tg_reduce() {
    const int G = 5, N = 256;
    std::vector<float> in(G * N), out(G, -1.0f);
    for (int i = 0; i < G * N; i++) in[i] = float((i * 37) % 101) - 50.0f;
    Run r;
    r.buf(0, in).buf(1, out).g(G).tg(N);
    r.workers = 2;
    int st = r.go("t_tg_reduce");
    bool ok = st == 0;
    for (int gi = 0; gi < G && ok; gi++) {
        double s = 0;
        for (int i = 0; i < N; i++) s += double(in[gi * N + i]);
        ok = std::fabs(s - double(out[gi])) < 1e-3;
    }
    check(ok, "threadgroup reduction with barriers (5 groups x 256, 2 workers)", r.err);
}

static void t_collectives(int n) {
    std::vector<float> in(n), out(15 * n, -999.0f);
    std::vector<uint32_t> uout(4 * n, 12345u);
    for (int i = 0; i < n; i++) in[i] = float((i * 13) % 17) - 8.0f + 0.25f * float(i % 3);
    Run r;
    r.buf(0, in).buf(1, out).buf(2, uout).tg(n);
    int st = r.go("t_collectives");
    check(st == 0, ("collectives run, " + std::to_string(n) + " threads").c_str(), r.err);
    if (st) return;
    const char *names[15] = {"simd_sum", "simd_max", "simd_min", "simd_product", "simd_prefix_inclusive_sum",
                             "simd_prefix_exclusive_sum", "simd_shuffle", "simd_shuffle_xor", "simd_shuffle_up",
                             "simd_shuffle_down", "simd_broadcast", "simd_broadcast_first",
                             "simd_shuffle_rotate_down", "simd_sum(half)", "simd_sum(float4)"};
    bool okop[15];
    for (int o = 0; o < 15; o++) okop[o] = true;
    bool ok_ballot = true, ok_any = true, ok_all = true, ok_umax = true;
    for (int t = 0; t < n; t++) {
        int base = t / 32 * 32, lanes = std::min(32, n - base), l = t - base;
        auto X = [&](int lane) -> double { return static_cast<double>(in[base + lane]); };
        auto live = [&](int lane) { return lane >= 0 && lane < lanes; };
        double sum = 0, prod = 1, mx = -1e30, mn = 1e30, inc = 0, exc = 0;
        for (int k = 0; k < lanes; k++) {
            sum += X(k); prod *= X(k); mx = std::max(mx, (double)X(k)); mn = std::min(mn, (double)X(k));
            if (k <= l) inc += X(k);
            if (k < l) exc += X(k);
        }
        // half sum in lane order, each add rounded to half
        half hs = half(X(0));
        for (int k = 1; k < lanes; k++) hs = hs + half(X(k));
        int sh = (l * 7 + 3) % 32;
        double expect[15] = {sum, mx, mn, prod, inc, exc,
                             live(sh) ? X(sh) : X(l),
                             live(l ^ 5) ? X(l ^ 5) : X(l),
                             live(l - 3) ? X(l - 3) : X(l),
                             live(l + 3) ? X(l + 3) : X(l),
                             live(2) ? X(2) : X(l),
                             X(0),
                             live((l + 1) & 31) ? X((l + 1) & 31) : X(l),
                             (double)(float)hs,
                             sum + 1000.0 * lanes};
        for (int o = 0; o < 15; o++) {
            double got = double(out[o * n + t]);
            double tol = o == 3 ? std::fabs(expect[o]) * 1e-5 + 1e-6 : 1e-3 + 1e-6 * std::fabs(expect[o]);
            if (!(std::fabs(got - expect[o]) <= tol)) {
                if (okop[o]) printf("  %s thread %d: got %g want %g\n", names[o], t, got, expect[o]);
                okop[o] = false;
            }
        }
        uint32_t ballot = 0;
        bool anyv = false, allv = true;
        uint32_t umax = 0;
        for (int k = 0; k < lanes; k++) {
            if (X(k) > 0) ballot |= 1u << k;
            anyv |= X(k) > 100;
            allv &= X(k) > -100;
            umax = std::max(umax, uint32_t(base + k));
        }
        ok_ballot &= uout[t] == ballot;
        ok_any &= uout[n + t] == (anyv ? 1u : 0u);
        ok_all &= uout[2 * n + t] == (allv ? 1u : 0u);
        ok_umax &= uout[3 * n + t] == umax;
    }
    std::string sfx = " (" + std::to_string(n) + " threads)";
    for (int o = 0; o < 15; o++) check(okop[o], (std::string(names[o]) + sfx).c_str());
    check(ok_ballot, ("simd_ballot" + sfx).c_str());
    check(ok_any, ("simd_any" + sfx).c_str());
    check(ok_all, ("simd_all" + sfx).c_str());
    check(ok_umax, ("simd_max(uint)" + sfx).c_str());
}

template <class T> static void t_mma(const char *kname, int M, int K, double tol, const char *label) {
    std::vector<T> A(M * K), B(K * M), C(M * M, T(-1.0f));
    for (int i = 0; i < M * K; i++) A[i] = T(float((i * 7) % 13) * 0.125f - 0.75f);
    for (int i = 0; i < K * M; i++) B[i] = T(float((i * 5) % 11) * 0.25f - 1.25f);
    TParams p{uint(M), uint(K), 0, 0.0f};
    Run r;
    r.buf(0, A).buf(1, B).buf(2, C).bytes(3, p).tg(32 * (M / 8) * (M / 8));
    int st = r.go(kname);
    bool ok = st == 0;
    double worst = 0;
    for (int i = 0; i < M && ok; i++)
        for (int j = 0; j < M; j++) {
            double s = 0;
            for (int k = 0; k < K; k++) s += double(float(A[i * K + k])) * double(float(B[k * M + j]));
            double e = std::fabs(double(float(C[i * M + j])) - s);
            worst = std::max(worst, e / (1.0 + std::fabs(s)));
        }
    ok = ok && worst <= tol;
    char d[1200];
    snprintf(d, sizeof d, "worst rel err %.2e %s", worst, r.err);
    check(ok, label, d);
}

static void t_mma_transpose() {
    std::vector<float> A(64), Bt(64), C(64);
    for (int i = 0; i < 64; i++) { A[i] = float(i % 9) - 4.0f; Bt[i] = float((i * 3) % 7) - 3.0f; }
    Run r;
    r.buf(0, A).buf(1, Bt).buf(2, C).tg(32);
    int st = r.go("t_mma_t_float");
    bool ok = st == 0;
    for (int i = 0; i < 8 && ok; i++)
        for (int j = 0; j < 8; j++) {
            float s = 0;
            for (int k = 0; k < 8; k++) s += A[i * 8 + k] * Bt[j * 8 + k];
            ok = ok && C[j * 8 + i] == s;  // C stored transposed
        }
    check(ok, "simdgroup_load/store transpose + same-type MMA", r.err);
}

static void t_layout() {
    std::vector<float> out(64, -1.0f);
    Run r;
    r.buf(0, out).tg(32);
    int st = r.go("t_layout");
    std::vector<int> seen(64, 0);
    bool ok = st == 0;
    for (int i = 0; i < 64 && ok; i++) {
        int v = int(out[i]);
        if (v < 0 || v >= 64) { ok = false; break; }
        seen[v]++;
        // lane = v/2, k = v%2 must own (row i/8, col i%8)
        int lane = v / 2, k = v % 2, q = lane / 4;
        int row = (q & 4) + ((lane / 2) % 4), col = (q & 2) * 2 + (lane % 2) * 2 + k;
        ok = ok && row == i / 8 && col == i % 8;
    }
    for (int i = 0; i < 64; i++) ok = ok && seen[i] == 1;
    check(ok, "simdgroup_matrix fragment layout covers all 64 elements once (MLX layout)", r.err);
}

static void t_missing_barrier() {
    const int N = 256;
    std::vector<float> out(N);
    Run r;
    r.buf(0, out).tg(N);
    r.scramble = 0;
    int st = r.go("t_with_barrier");
    bool ok = st == 0;
    for (int i = 1; i < N; i++) ok = ok && out[i] == float(i - 1);
    check(ok, "neighbour read with a barrier is correct (scrambled too)", r.err);
    // The racy kernel passes by luck in thread order...
    if (!g_scramble) {
        Run o;
        o.buf(0, out).tg(N);
        st = o.go("t_missing_barrier");
        bool lucky = st == 0;
        for (int i = 1; i < N; i++) lucky = lucky && out[i] == float(i - 1);
        check(lucky, "missing barrier goes unnoticed in thread order (expected)", o.err);
    }
    // ...and is caught under the scrambled schedule.
    Run s;
    s.buf(0, out).tg(N);
    s.scramble = 1;
    s.seed = 12345;
    st = s.go("t_missing_barrier");
    int bad = 0;
    for (int i = 1; i < N; i++) bad += !(out[i] == float(i - 1));
    check(st == 0 && bad > 0, "missing barrier caught under the scrambled schedule",
          std::to_string(bad) + " of 255 reads saw poison");
}

static void t_divergent() {
    std::vector<float> out(64);
    Run r;
    r.buf(0, out).tg(64);
    int st = r.go("t_divergent_barrier");
    check(st == FMSIM_ERROR_KERNEL && contains(r.err, "divergent threadgroup_barrier"), "divergent barrier diagnosed",
          r.err);
}

static void t_deadlock() {
    std::vector<float> out(32);
    Run r;
    r.buf(0, out).tg(32);
    int st = r.go("t_deadlock");
    bool ok = st == FMSIM_ERROR_KERNEL && (contains(r.err, "deadlock") || contains(r.err, "divergence"));
    check(ok, "deadlock diagnosed with a census", r.err);
}

static void t_constants() {
    std::vector<int> out(4, -1);
    Run r;
    r.buf(0, out).tg(4);
    r.c = {{10, 1, 1}, {11, 0, 21}};
    int st = r.go("t_constants");
    check(st == 0 && out[0] == 1 && out[1] == 21 && out[2] == 42 && out[3] == 1,
          "function constants (bool, int, derived EXPR, is_defined)", r.err);
    Run u;
    u.buf(0, out).tg(4);
    u.c = {{10, 1, 1}};
    st = u.go("t_constants");
    check(st == FMSIM_ERROR_KERNEL && contains(u.err, "t_mul") && contains(u.err, "not set"),
          "unset function constant errors", u.err);
    Run w;
    w.buf(0, out).tg(4);
    w.c = {{10, 0, 1}, {11, 0, 3}};
    st = w.go("t_constants");
    check(st == FMSIM_ERROR_KERNEL && contains(w.err, "declared bool"), "constant of the wrong kind errors", w.err);
}

static void t_tgmem() {
    std::vector<float> out(4, 0.0f);
    Run r;
    r.buf(0, out).tg(64);
    r.t = {{0, 1024}};
    int st = r.go("t_tgmem_ok");
    check(st == 0 && std::isnan(out[0]) && std::isnan(out[1]) && std::isnan(out[2]) && out[3] == 12.0f,
          "threadgroup memory poisoned with NaN on entry; TG_BUFFER bound", r.err);
    Run o;
    o.buf(0, out).tg(64);
    o.t = {{0, 1024}};
    st = o.go("t_tgmem_over");
    check(st == FMSIM_ERROR_KERNEL && contains(o.err, "32 KiB"), "threadgroup memory over 32 KiB errors", o.err);
    Run d;
    d.buf(0, out).tg(64);
    d.t = {{0, 40000}};
    st = d.go("t_tgmem_ok");
    check(st == FMSIM_ERROR_INVALID && contains(d.err, "32 KiB"), "threadgroup lengths over 32 KiB rejected", d.err);
}

static void t_builtins() {
    const uint32_t gx = 3, gy = 2, gz = 2, tx = 4, ty = 3, tz = 5;
    uint32_t total = gx * gy * gz * tx * ty * tz;
    std::vector<uint32_t> out(total * 4, 0xffffffffu);
    TParams p{7, 0, 0, 0.0f};
    Run r;
    r.buf(0, out).bytes(1, p).g(gx, gy, gz).tg(tx, ty, tz);
    r.workers = 2;
    int st = r.go("t_builtins");
    bool ok = st == 0;
    for (uint32_t z = 0; z < gz * tz && ok; z++)
        for (uint32_t y = 0; y < gy * ty; y++)
            for (uint32_t x = 0; x < gx * tx; x++) {
                uint32_t idx = (z * gy * ty + y) * gx * tx + x;
                uint32_t lin = (z % tz) * tx * ty + (y % ty) * tx + x % tx;
                ok = ok && out[idx * 4 + 0] == x + 100 * y + 10000 * z;
                ok = ok && out[idx * 4 + 1] == x / tx + 100 * (y / ty) + 10000 * (z / tz);
                ok = ok && out[idx * 4 + 2] == x % tx + 100 * (y % ty) + 10000 * (z % tz);
                ok = ok && out[idx * 4 + 3] == lin % 32 + 1000 * ((tx * ty * tz + 31) / 32) + 7;
            }
    check(ok, "builtins in a 3-D grid (ids, sizes, lanes)", r.err);
}

static void t_numerics() {
    std::vector<float> out(12, -1.0f);
    std::vector<uint32_t> uout(2, 0);
    Run r;
    r.buf(0, out).buf(1, uout).tg(32);
    int st = r.go("t_numerics");
    check(st == 0, "numerics kernel runs", r.err);
    check(out[0] == 2048.0f && out[1] == 2049.0f, "half rounds per op (2048h + 1h == 2048h)");
    check(out[2] == 5.0f, "float4(half4) converts per element");
    check(out[3] == 1234.0f && out[4] == 1.0f, "float4(float2, s, s) concatenates; float4(s) splats");
    check(out[5] == float(1 - 10 + 200 + 3000), "int4(float4) converts (truncates) per element");
    check(uout[0] == 0x3f800000u, "as_type<uint>(1.0f)");
    check(out[6] == 1.0f + 20.0f + 100.0f + 2000.0f, "select on a vector mask");
    check(out[7] == 1.0f && out[8] == 0.0f, "any/all on vector comparisons");
    check(out[9] == 8.0f + 1.0f + 2.0f + 3.0f, "fast::/precise:: math and max overloads");
    check(out[10] == 1.0f && out[11] == float(0xc000), "bfloat in a kernel: RNE tie and bits");
    check(uout[1] == 79u, "uint2 constructor");
}

static void t_bf16_rne() {
    struct C { uint32_t in; uint16_t want; const char *what; } cases[] = {
        {0x3f808000u, 0x3f80, "tie, even below -> down"},
        {0x3f818000u, 0x3f82, "tie, odd below -> up"},
        {0x3f808001u, 0x3f81, "above tie -> up"},
        {0x3f807fffu, 0x3f80, "below tie -> down"},
        {0xbf818000u, 0xbf82, "negative tie -> even"},
        {0x7f7fffffu, 0x7f80, "FLT_MAX rounds to inf"},
        {0x7f800000u, 0x7f80, "inf stays inf"},
        {0x00010000u, 0x0001, "subnormal exact"},
    };
    bool ok = true;
    for (auto &c : cases) {
        float f;
        memcpy(&f, &c.in, 4);
        uint16_t got = bfloat(f).bits;
        if (got != c.want) { ok = false; printf("  bf16 %08x: got %04x want %04x (%s)\n", c.in, got, c.want, c.what); }
    }
    float nan = std::nanf("");
    uint16_t nb = bfloat(nan).bits;
    ok = ok && (nb & 0x7f80) == 0x7f80 && (nb & 0x7f) != 0;
    uint32_t snan_bits = 0x7f800001u;  // signalling NaN with low payload must stay NaN
    float snan;
    memcpy(&snan, &snan_bits, 4);
    nb = bfloat(snan).bits;
    ok = ok && (nb & 0x7f80) == 0x7f80 && (nb & 0x7f) != 0;
    check(ok, "bfloat round-to-nearest-even ties, overflow, NaN");
}

static void t_atomics() {
    std::vector<uint32_t> counter(1, 0);
    std::vector<float> fsum(1, 0.0f);
    Run r;
    r.buf(0, counter).buf(1, fsum).g(64).tg(64);
    r.workers = 2;
    int st = r.go("t_atomics");
    check(st == 0 && counter[0] == 64 * 64 && fsum[0] == 0.5f * 64 * 64, "device atomics across groups and workers",
          r.err);
}

static void t_early_exit() {
    std::vector<float> out(32, -1.0f);
    Run r;
    r.buf(0, out).tg(32);
    int st = r.go("t_early_exit");
    bool ok = st == 0;
    for (int i = 0; i < 20; i++) ok = ok && out[i] == 20.0f;
    for (int i = 20; i < 32; i++) ok = ok && out[i] == -1.0f;
    check(ok, "early-returning threads leave barriers and collectives to the live ones", r.err);
}

static void t_errors() {
    std::vector<float> out(4);
    Run r;
    r.buf(0, out).tg(4);
    int st = r.go("no_such_kernel");
    check(st == FMSIM_ERROR_UNKNOWN_KERNEL && contains(r.err, "no_such_kernel"), "unknown kernel errors", r.err);
    Run b;
    b.buf(31, out).tg(4);
    st = b.go("t_layout");
    check(st == FMSIM_ERROR_INVALID && contains(b.err, "out of range"), "binding index 31 is out of range", b.err);
    Run c;
    c.buf(5, out).tg(4);
    st = c.go("t_layout");
    check(st == FMSIM_ERROR_INVALID && contains(c.err, "no buffer parameter"), "binding beyond the kernel's parameters",
          c.err);
    Run t;
    t.buf(0, out).tg(2048);
    st = t.go("t_layout");
    check(st == FMSIM_ERROR_INVALID, "more than 1024 threads per group rejected", t.err);
    TParams p{};
    Run s;
    std::vector<uint32_t> o2(16);
    s.buf(0, o2);
    s.b.push_back({1, 1, &p, 4});
    st = s.go("t_builtins");
    check(st == FMSIM_ERROR_INVALID && contains(s.err, "struct"), "short parameter struct rejected", s.err);
    check(fmsim_has_kernel("t_layout") == 1 && fmsim_has_kernel("nope") == 0, "fmsim_has_kernel");
}

static double bench_kernel(const char *k, int threads, int iters, bool with_out) {
    std::vector<float> out(1024);
    TParams p{0, 0, iters, 0.0f};
    Run r;
    if (with_out) r.buf(0, out).bytes(1, p);
    else r.bytes(0, p);
    r.tg(threads);
    auto t0 = std::chrono::steady_clock::now();
    int st = r.go(k);
    auto t1 = std::chrono::steady_clock::now();
    if (st) printf("bench %s failed: %s\n", k, r.err);
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / iters;
}

static int bench() {
    printf("context switch (%s): %.1f ns\n", fmsim_context_switch_kind(), fmsim_bench_switch_ns(2000000));
    bench_kernel("b_barrier", 128, 100, false);
    printf("threadgroup_barrier, 128 fibers: %.2f us\n", bench_kernel("b_barrier", 128, 20000, false) / 1000.0);
    printf("threadgroup_barrier, 1024 fibers: %.2f us\n", bench_kernel("b_barrier", 1024, 2000, false) / 1000.0);
    printf("simd_sum, per SIMD group: %.2f us\n", bench_kernel("b_simd", 32, 50000, true) / 1000.0);
    printf("simd_sum, 128 threads (4 groups), per SIMD group: %.2f us\n",
           bench_kernel("b_simd", 128, 20000, true) / 4000.0);
    printf("8x8 MMA float, per SIMD group: %.2f us\n", bench_kernel("b_mma", 32, 50000, true) / 1000.0);
    return 0;
}

// The decode reduce (plain and FWHT-undo) must not depend on its threadgroup
// size: the dispatcher asks for 1024 threads, a Metal pipeline may allow
// fewer. Every multiple of 32 gives the float64 combination of the partials
// (to float rounding) and the same bits as 1024 threads; row 1 is a row
// that saw no key (S == 0, zero partials, as the main kernel writes) and must
// come out zero.
static void t_vec_reduce_group_sizes() {
    const uint32_t nrows = 3, nwg = 32;
    for (int D : {64, 512}) {
        std::vector<float> tmp(size_t(nrows) * nwg * (D + 2));
        uint64_t st = 0x9e3779b97f4a7c15ull * uint64_t(D);
        auto uni = [&] { st = st * 6364136223846793005ull + 1442695040888963407ull; return float(st >> 40) / 16777216.0f; };
        // Row 1 sees no key: S = 0 everywhere, and its O partials are
        // unspecified (NaN here): the reduce must not read them.
        for (size_t i = 0; i < size_t(nrows) * nwg * D; i++) tmp[i] = i / (size_t(nwg) * D) == 1 ? std::nanf("") : 4.0f * uni() - 2.0f;
        float *sm = tmp.data() + size_t(nrows) * nwg * D;
        for (uint32_t r = 0; r < nrows; r++)
            for (uint32_t w = 0; w < nwg; w++) {
                sm[(r * nwg + w) * 2] = r == 1 ? 0.0f : 1.0f + 30.0f * uni();
                sm[(r * nwg + w) * 2 + 1] = r == 1 ? -1.70141173e38f * 0.6931472f : 8.0f * uni() - 4.0f;
            }
        std::vector<uint8_t> signs(D / 8);
        for (auto &b : signs) b = uint8_t(uni() * 256.0f);
        for (int fwht = 0; fwht < 2; fwht++) {
            // float64 expectation
            std::vector<double> want(size_t(nrows) * D, 0.0);
            for (uint32_t r = 0; r < nrows; r++) {
                double m = -1e300, s = 0.0;
                for (uint32_t w = 0; w < nwg; w++) m = std::max(m, double(sm[(r * nwg + w) * 2 + 1]));
                std::vector<double> f(nwg);
                for (uint32_t w = 0; w < nwg; w++) {
                    f[w] = std::exp(double(sm[(r * nwg + w) * 2 + 1]) - m);
                    s += f[w] * double(sm[(r * nwg + w) * 2]);
                }
                double *y = &want[size_t(r) * D];
                for (int d = 0; d < D; d++) {
                    for (uint32_t w = 0; w < nwg; w++) y[d] += double(tmp[(size_t(r) * nwg + w) * D + d]) * f[w];
                    y[d] = s == 0.0 ? 0.0 : y[d] / s;
                }
                if (!fwht) continue;
                for (int h = 1; h < D; h <<= 1)
                    for (int i = 0; i < D; i++)
                        if (!(i & h)) { double a = y[i], b = y[i + h]; y[i] = a + b; y[i + h] = a - b; }
                for (int d = 0; d < D; d++) y[d] *= ((signs[d >> 3] >> (d & 7)) & 1 ? -1.0 : 1.0) / std::sqrt(double(D));
            }
            const std::string name = std::string(fwht ? "flash_attn_vec_reduce_tq_hb_undo_dk" : "flash_attn_vec_reduce_dk") +
                                     std::to_string(D);
            std::vector<float> ref;
            for (uint32_t threads : {1024u, 32u, 96u, 160u, 512u}) {
                std::vector<float> out(size_t(nrows) * D, std::nanf(""));
                FlashAttnVecReduceParams p{nrows, uint32_t(D)};
                Run r;
                r.bytes(0, p).buf(1, tmp).buf(2, out).bytes(3, nwg).g(nrows).tg(threads);
                if (fwht) {
                    r.buf(4, signs);
                    r.c = {{500, 1, 1}, {504, 1, 0}, {505, 1, 0}, {506, 1, 0}, {509, 1, 0}, {510, 1, 0}};
                    r.t = {{0, uint32_t(D * 4)}};
                } else {
                    // plain reduce, no sinks or lse; tmp aligned; float32 out
                    r.c = {{500, 1, 0}, {504, 1, 0}, {505, 1, 0}, {506, 1, 0}, {509, 1, 0}, {510, 1, 0}};
                }
                r.workers = 2;
                int rc = r.go(name.c_str());
                double worst = 0.0;
                bool zeros = true;
                for (size_t i = 0; i < out.size(); i++) {
                    worst = std::max(worst, std::fabs(double(out[i]) - want[i]) / (1e-6 + 1e-5 * std::fabs(want[i])));
                    if (i / D == 1 && out[i] != 0.0f) zeros = false;
                }
                if (ref.empty()) ref = out;
                const bool same = memcmp(ref.data(), out.data(), out.size() * sizeof(float)) == 0;
                check(rc == 0 && worst <= 1.0 && zeros && same,
                      (name + " with " + std::to_string(threads) + " threads per group: float64 result, same bits as 1024, "
                              "no-key row zeros").c_str(),
                      rc ? r.err : "worst " + std::to_string(worst) + "x tolerance" + (same ? "" : ", bits differ"));
            }
        }
    }
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--bench")) return bench();
    const char *e = getenv("FLASHMETAL_SIM_SCRAMBLE");
    g_scramble = e && *e && strcmp(e, "0") != 0;
    if (g_scramble) printf("(scrambled schedule: FLASHMETAL_SIM_SCRAMBLE=%s)\n", e);
    t_tg_reduce();
    t_collectives(32);
    t_collectives(48);
    t_collectives(128);
    t_mma<float>("t_mma_float", 8, 8, 1e-6, "8x8 float matmul through simdgroup MMA");
    t_mma<float>("t_mma_float", 32, 32, 1e-6, "32x32 float matmul through simdgroup MMA");
    t_mma<half>("t_mma_half", 8, 8, 2e-3, "8x8 half matmul through simdgroup MMA");
    t_mma<half>("t_mma_half", 32, 32, 2e-3, "32x32 half matmul through simdgroup MMA");
    t_mma<bfloat>("t_mma_bfloat", 8, 8, 8e-3, "8x8 bfloat matmul through simdgroup MMA");
    t_mma<bfloat>("t_mma_bfloat", 32, 32, 8e-3, "32x32 bfloat matmul through simdgroup MMA");
    t_mma_transpose();
    t_layout();
    t_missing_barrier();
    t_divergent();
    t_deadlock();
    t_constants();
    t_tgmem();
    t_builtins();
    t_numerics();
    t_bf16_rne();
    t_atomics();
    t_early_exit();
    t_errors();
    t_vec_reduce_group_sizes();
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
