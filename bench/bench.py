"""flashmetal cpu vs torch CPU SDPA vs numpy, side by side in one process.

Run by `make bench`. Every case times its peers interleaved (one run of each
peer per round, after a warm-up), and reports medians; the machine is shared
and noisy, so compare ratios within one run only. Writes bench/RESULTS.md and
bench/ratios.png.

    python bench/bench.py [--runs N] [--quick] [--only prefill,window,decode,overhead]

On x86-64 with more than AVX2 the prefill and decode cases run a second time
in a child process as an AVX2-only machine would: FLASHMETAL_CPU_ISA=avx2 for
flashmetal, and torch capped the same way (ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2). RESULTS.md keeps one
table per machine class. The FMA ceiling comes from bench/fma_peak.c (built
here with clang), measured before and after the cases (the higher is used).
"""
from __future__ import annotations

import argparse
import gc
import inspect
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

# Idle BLAS threads spin for a long time after each call (OpenBLAS: ~2^28
# cycles by default) and would steal the cores from the next peer in the
# interleaved rounds; this only shortens the idle spin, not numpy's compute.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import numpy as np  # noqa: E402


def _private_library_copy() -> None:
    """Loads a private copy of libflashmetal: other jobs in the shared tree may
    `make python` (overwriting the package's .so in place) during a long run."""
    import importlib.util
    import shutil
    import tempfile
    if os.environ.get("FLASHMETAL_LIB"):
        return
    spec = importlib.util.find_spec("flashmetal")
    if spec is None or not spec.submodule_search_locations:
        return
    pkg = Path(list(spec.submodule_search_locations)[0])
    name = "libflashmetal.dylib" if sys.platform == "darwin" else "libflashmetal.so"
    if not (pkg / name).is_file():
        return
    tmp = Path(tempfile.mkdtemp(prefix="flashmetal-bench-"))
    shutil.copy2(pkg / name, tmp / name)
    shutil.copy2(pkg / "flashmetal.h", tmp / "flashmetal.h")
    os.environ["FLASHMETAL_LIB"] = str(tmp / name)
    os.environ["FLASHMETAL_HEADER"] = str(tmp / "flashmetal.h")


_private_library_copy()

import flashmetal as fm  # noqa: E402
from flashmetal import _loader  # noqa: E402
from flashmetal._arrays import BF16, F16, F32  # noqa: E402

HERE = Path(__file__).resolve().parent

try:
    import torch
    TORCH = torch.__version__
    torch.set_num_threads(os.cpu_count() or 1)
except Exception:  # noqa: BLE001 - any import failure means "not installed"
    torch = None
    TORCH = None

TORCH_DT = {}
if torch is not None:
    TORCH_DT = {BF16: torch.bfloat16, F16: torch.float16, F32: torch.float32}

DTNAME = {BF16: "bf16", F16: "f16", F32: "f32"}


def rand(rng, shape, dt):
    return rng.standard_normal(shape, dtype=np.float32).astype(dt)


def to_torch(a, dt):
    return torch.from_numpy(np.ascontiguousarray(a.astype(np.float32))).to(TORCH_DT[dt])


class Timings(dict):
    """Median seconds per peer; .raw keeps every round's seconds."""
    raw: dict


def timed(fns: dict, runs: int, burst: int = 1) -> Timings:
    """Median seconds per call per peer; peers run interleaved, one warm-up each.

    burst == 1: one call after a 20 ms idle pause (a single call on a quiet
    machine). burst > 1: after the pause one untimed call, then `burst`
    back-to-back calls timed together (a decode loop, token after token)."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(runs):
        for k, f in fns.items():
            time.sleep(0.02)  # let the previous peer's spinning threads go idle
            if burst > 1:
                f()
            t0 = time.perf_counter()
            for _ in range(burst):
                f()
            times[k].append((time.perf_counter() - t0) / burst)
    out = Timings({k: statistics.median(v) for k, v in times.items()})
    out.raw = times
    return out


# ---- numpy peer: plain float32 attention --------------------------------------

def np_softmax_rows(s):
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def np_prefill(q, k, v, *, causal=False, mask=None):
    """q [B, H, L, D], k/v [B, Hkv, L, D] in any float dtype -> f32 [B, H, L, D]."""
    qf, kf, vf = (x.astype(np.float32) for x in (q, k, v))
    b, h, ql, d = qf.shape
    hkv, kl = kf.shape[1], kf.shape[2]
    g = h // hkv
    qg = qf.reshape(b, hkv, g * ql, d)
    s = (qg @ kf.transpose(0, 1, 3, 2)) * np.float32(1 / math.sqrt(d))
    s = s.reshape(b, hkv, g, ql, kl)
    if causal:
        off = kl - ql
        s += np.where(np.arange(kl)[None, :] <= off + np.arange(ql)[:, None], 0, -np.inf).astype(np.float32)
    if mask is not None:
        s += mask.astype(np.float32)
    np_softmax_rows(s)
    return (s.reshape(b, hkv, g * ql, kl) @ vf).reshape(b, h, ql, d)


def np_decode(q, k, v):
    """q [H, D] f32, k/v [Hkv, L, D] -> [H, D]."""
    kf, vf = k.astype(np.float32, copy=False), v.astype(np.float32, copy=False)
    h, d = q.shape
    hkv = kf.shape[0]
    qg = q.reshape(hkv, h // hkv, d)
    s = (qg @ kf.transpose(0, 2, 1)) * np.float32(1 / math.sqrt(d))
    np_softmax_rows(s)
    return (s @ vf).reshape(h, d)


# ---- machine ceilings -------------------------------------------------------------

def parallel_read(arrays):
    """A function reading `arrays` once, one numpy thread per core: a bitwise
    OR over 64-bit words (numpy's float sum is not memory-bound on a busy
    core, and float views of 16-bit data could hit denormal slow paths)."""
    n = os.cpu_count() or 1
    parts = [p for a in arrays for p in np.array_split(a.reshape(-1).view(np.uint64), n)]
    per = [parts[i::n] for i in range(n)]

    def work(ps):
        for p in ps:
            np.bitwise_or.reduce(p)

    def one():
        ths = [threading.Thread(target=work, args=(ps,)) for ps in per]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
    return one


def read_bandwidth(runs=5) -> float:
    """GB/s of a read-only pass over 512 MiB, one numpy thread per core: the
    better of a float sum and parallel_read's OR."""
    a = np.ones(128 << 20, dtype=np.float32)
    parts = np.array_split(a, os.cpu_count() or 1)

    def fsum():
        ths = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
    t = timed({"sum": fsum, "or": parallel_read([a])}, runs)
    return a.nbytes / min(t.values()) / 1e9


# ---- cases --------------------------------------------------------------------------

class Row:
    def __init__(self, group, name, metric_name, work, secs, note=""):
        self.group, self.name, self.metric_name = group, name, metric_name
        self.work = work  # FLOPs (prefill) or bytes (decode)
        self.secs = secs  # peer -> seconds or None
        self.raw = getattr(secs, "raw", None) or {}  # peer -> seconds of every round
        self.note = note

    def ratio_range(self, peer="torch"):
        """(min, max) over the rounds of peer time / flashmetal time."""
        a, b = self.raw.get("flashmetal"), self.raw.get(peer)
        if not a or not b:
            return None
        rs = [y / x for x, y in zip(a, b)]
        return min(rs), max(rs)

    def to_json(self):
        return {"group": self.group, "name": self.name, "metric_name": self.metric_name, "work": self.work,
                "secs": dict(self.secs), "raw": self.raw, "note": self.note}

    @staticmethod
    def from_json(d):
        t = Timings(d["secs"])
        t.raw = d.get("raw") or {}
        return Row(d["group"], d["name"], d["metric_name"], d["work"], t, d.get("note", ""))

    def metric(self, peer):
        s = self.secs.get(peer)
        return None if s is None else self.work / s / 1e9

    def ratio(self, peer="torch"):
        a, b = self.secs.get("flashmetal"), self.secs.get(peer)
        return None if a is None or b is None else b / a


def prefill_cases(reg, runs, quick, with_numpy=True):
    """bf16/f16 through flash_attn_prefill; float32 through the front door's
    sdpa route (fm.sdpa), as a float32 user reaches it."""
    rows = []
    hq, hkv = 16, 8
    ls = [512] if quick else [512, 2048]
    for L in ls:
        for D in (64, 128, 256):
            for dt in (BF16, F16, F32):
                rng = np.random.default_rng(0)
                q, k, v = rand(rng, (1, hq, L, D), dt), rand(rng, (1, hkv, L, D), dt), rand(rng, (1, hkv, L, D), dt)
                out = np.empty_like(q)
                tq, tk, tv = (to_torch(x, dt) for x in (q, k, v)) if torch else (None,) * 3
                for causal in (False, True):
                    if dt == F32:
                        fns = {"flashmetal": lambda: fm.sdpa(q, k, v, causal=causal, out=out, registry=reg)}
                    else:
                        fns = {"flashmetal": lambda: fm.flash_attn_prefill(q, k, v, causal=causal, q_offset=0,
                                                                          out=out, registry=reg)}
                    if torch:
                        fns["torch"] = lambda: torch.nn.functional.scaled_dot_product_attention(
                            tq, tk, tv, is_causal=causal, enable_gqa=True)
                    if with_numpy:
                        fns["numpy"] = lambda: np_prefill(q, k, v, causal=causal)
                    secs = timed(fns, runs)
                    flops = 4 * hq * D * (L * (L + 1) / 2 if causal else L * L)
                    r = Row("prefill", f"L={L} D={D} {DTNAME[dt]} {'causal' if causal else 'full'}",
                            "GFLOP/s", flops, secs)
                    rows.append(r)
                    print_row(r, flush=True)
                del q, k, v, out, tq, tk, tv
                gc.collect()
    return rows


def window_cases(reg, runs, quick):
    hq, hkv, D, W = 16, 8, 256, 512
    L = 1024 if quick else 2048
    dt = BF16
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, (1, hq, L, D), dt), rand(rng, (1, hkv, L, D), dt), rand(rng, (1, hkv, L, D), dt)
    if hasattr(fm, "build_mask"):
        m = fm.build_mask(L, L, causal=True, window=W, dtype=dt, registry=reg)
    else:
        t = np.arange(L)[:, None]
        p = np.arange(L)[None, :]
        m = np.where((p <= t) & (t - p < W), 0.0, -np.inf).astype(dt)
    blk = fm.build_blk(m, D, registry=reg) if hasattr(fm, "build_blk") else None
    out = np.empty_like(q)
    visible = int(np.sum(np.isfinite(m.astype(np.float32))))
    flops = 4 * hq * D * visible
    keep = np.isfinite(m.astype(np.float32))
    # The baseline skips nothing: one bool mask per head (auto-blk only builds a
    # blk for a mask shared by every batch and head, which the next row shows).
    keep_per_head = np.ascontiguousarray(np.broadcast_to(keep, (1, hq, L, L)))
    fns = {"flashmetal": lambda: fm.flash_attn_prefill(q, k, v, mask=keep_per_head, out=out, registry=reg),
           "flashmetal+auto": lambda: fm.flash_attn_prefill(q, k, v, mask=keep, out=out, registry=reg)}
    if blk is not None:
        fns["flashmetal+blk"] = lambda: fm.flash_attn_prefill(q, k, v, mask=m, blk=blk, out=out, registry=reg)
    in_kernel = "window" in inspect.signature(fm.flash_attn_prefill).parameters
    if in_kernel:
        fns["flashmetal+window"] = lambda: fm.flash_attn_prefill(q, k, v, causal=True, window=W, out=out,
                                                                registry=reg)
    if torch:
        tq, tk, tv = (to_torch(x, dt) for x in (q, k, v))
        tm = torch.from_numpy(np.isfinite(m.astype(np.float32)))
        fns["torch"] = lambda: torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=tm, enable_gqa=True)
    fns["numpy"] = lambda: np_prefill(q, k, v, mask=m)
    secs = timed(fns, runs)
    rows = []
    base = {p: s for p, s in secs.items() if p not in ("flashmetal+auto", "flashmetal+blk", "flashmetal+window")}
    r = Row("window", f"L={L} D={D} bf16 window={W} bool mask per head, no blk", "GFLOP/s", flops, base)
    rows.append(r)
    print_row(r)
    ra = Row("window", f"L={L} D={D} bf16 window={W} one shared bool mask (auto-blk)", "GFLOP/s", flops,
             dict(base, flashmetal=secs["flashmetal+auto"]),
             note=f"speed-up over no blk {secs['flashmetal'] / secs['flashmetal+auto']:.2f}x")
    rows.append(ra)
    print_row(ra)
    if blk is not None:
        b = dict(base, flashmetal=secs["flashmetal+blk"])
        rb = Row("window", f"L={L} D={D} bf16 window={W} mask + blk", "GFLOP/s", flops, b,
                 note=f"blk speed-up {secs['flashmetal'] / secs['flashmetal+blk']:.2f}x")
        rows.append(rb)
        print_row(rb)
    if in_kernel:
        w = dict(base, flashmetal=secs["flashmetal+window"])
        rw = Row("window", f"L={L} D={D} bf16 window={W} in-kernel window", "GFLOP/s", flops, w,
                 note=f"speed-up over no blk {secs['flashmetal'] / secs['flashmetal+window']:.2f}x")
        rows.append(rw)
        print_row(rw)
    return rows


DECODE_BURST = 10


def last_level_cache_bytes() -> int | None:
    """The largest cpu cache of this machine (Linux sysfs), or None."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        t = f.read_text().strip()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
        try:
            sizes.append(int(t.rstrip("KMG")) * mult)
        except ValueError:
            pass
    return max(sizes) if sizes else None


# A generation loop runs every layer's decode in turn, so each call finds its
# layer's K and V in memory, not in the last-level cache: the loop rows rotate
# over enough copies of the cache ("layers") to exceed that cache four times.
# Timing back-to-back calls on one 8-32 MiB cache measured the L3 instead
# (on the shared build VM, after the 20 ms pause one thread read a 16 MiB
# buffer at 24 -> 37 -> 56 -> 63 -> 72 -> 77 GB/s in six passes while the L3
# refilled, and the same case's median moved between 20 and 34 GB/s from run
# to run).
LOOP_WORKING_SET = max(128 << 20, 4 * (last_level_cache_bytes() or 64 << 20))


def loop_layers(nbytes: int) -> int:
    return max(1, -(-LOOP_WORKING_SET // nbytes))


def per_layer(t: Timings, layers: int) -> Timings:
    out = Timings({k: v / layers for k, v in t.items()})
    out.raw = {k: [x / layers for x in v] for k, v in t.raw.items()}
    return out


def decode_cases(reg, runs, quick, with_numpy=True):
    rows = []
    if not hasattr(fm, "flash_attn_decode"):
        print("decode: flashmetal.flash_attn_decode not available in this build")
        return rows
    hq, hkv = 16, 8
    for kvl in ((4096,) if quick else (4096, 32768)):
        for D in (128, 256, 512):
            for dt in (F32, F16, BF16):
                rng = np.random.default_rng(2)
                q = rand(rng, (hq, D), F32)
                nbytes = 2 * hkv * kvl * D * np.dtype(dt).itemsize
                layers = loop_layers(nbytes)
                # Every layer's K and V in one buffer, as a serving KV pool holds
                # them: on Linux nearly all of it then sits on transparent
                # hugepages. (Separate 8 MiB arrays have about a quarter of
                # their bytes on 4 KiB pages; on the build VM that decoded 12%
                # slower, from page walks: kv=4096 D=128 bf16, one process.)
                pool = np.empty((2, layers, hkv, kvl, D), dt)
                pool[0, :] = rand(rng, (hkv, kvl, D), dt)
                pool[1, :] = rand(rng, (hkv, kvl, D), dt)
                ks, vs = list(pool[0]), list(pool[1])
                k, v = ks[0], vs[0]
                out = np.empty_like(q)

                def fm_step(ks=ks, vs=vs):
                    for kl, vl in zip(ks, vs):
                        fm.flash_attn_decode(q, kl, vl, kvl, out=out, registry=reg)
                # the same K and V read once, in the same rounds: a ceiling under the same load
                loop_fns = {"flashmetal": fm_step, "read": parallel_read(ks + vs)}
                fns = {"flashmetal": lambda: fm.flash_attn_decode(q, k, v, kvl, out=out, registry=reg),
                       "read": parallel_read([k, v])}
                if torch:
                    tdt = TORCH_DT[dt]
                    tks, tvs = [to_torch(x, dt) for x in ks], [to_torch(x, dt) for x in vs]
                    tq = torch.from_numpy(q).reshape(1, hq, 1, D)

                    def torch_one(tk, tv):
                        return torch.nn.functional.scaled_dot_product_attention(
                            tq.to(tdt), tk.unsqueeze(0), tv.unsqueeze(0), enable_gqa=True).float()

                    def torch_step(tks=tks, tvs=tvs):
                        for tk, tv in zip(tks, tvs):
                            torch_one(tk, tv)
                    loop_fns["torch"] = torch_step
                    fns["torch"] = lambda: torch_one(tks[0], tvs[0])
                name = f"kv={kvl} D={D} K/V {DTNAME[dt]}"
                # In a loop first (numpy is too slow to repeat), then single calls.
                steps = -(-DECODE_BURST // layers)
                loop = Row("decode-loop", name, "GB/s", nbytes,
                           per_layer(timed(loop_fns, runs, burst=steps), layers), note=f"{layers} layers")
                if with_numpy:
                    fns["numpy"] = lambda: np_decode(q, k, v)
                single = Row("decode", name, "GB/s", nbytes, timed(fns, runs))
                for r in (single, loop):
                    rows.append(r)
                    print_row(r, flush=True)
                del k, v, ks, vs, pool, loop_fns, fns
                if torch:
                    del tks, tvs
                gc.collect()
    return rows


# ---- per-call overhead ---------------------------------------------------------------

OVERHEAD_CHILD = r"""
import sys, time, statistics, json
import numpy as np
import flashmetal as fm
from flashmetal import _arrays
reg = fm.Registry("cpu")
H, HKV, D = 16, 8, 128
q = np.ones((H, D), np.float32); k = np.ones((HKV, 1, D), np.float32); v = np.ones((HKV, 1, D), np.float32)
out = np.empty_like(q)
ffi, lib = reg._ffi, reg._lib

def per_call(f, n=2000, reps=7):
    for _ in range(200): f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n): f()
        ts.append((time.perf_counter() - t0) / n)
    return statistics.median(ts) * 1e6

res = {}
res["end_to_end"] = per_call(lambda: fm.flash_attn_decode(q, k, v, 1, out=out, registry=reg))
res["end_to_end_default_registry"] = per_call(lambda: fm.flash_attn_decode(q, k, v, 1, out=out))
# the C call alone, arguments prebuilt once
qa, ka, va = (_arrays.as_input(x, "x", "x") for x in (q, k, v))
tq, tk, tv, to = (_arrays.tensor(ffi, x) for x in (qa, ka, va, out))
opts = ffi.new("FMVecOptions *"); opts.scale = 1 / D ** 0.5; opts.mask_type = 1; opts.kv_len = 1
err = ffi.new("FMError *")
fn = lib.fm_dispatch_vec
h = reg._handle
res["c_call"] = per_call(lambda: fn(h, tq, tk, tv, ffi.NULL, ffi.NULL, to, opts, err))
name = ffi.new("char[]", 64)
res["cffi_trivial_call"] = per_call(lambda: lib.fm_registry_backend(h, name, 64))
res["as_input_x3"] = per_call(lambda: [_arrays.as_input(x, "x", "x") for x in (q, k, v)])
res["tensor_x4"] = per_call(lambda: [_arrays.tensor(ffi, x) for x in (qa, ka, va, out)])
res["ffi_new_opts_err"] = per_call(lambda: (ffi.new("FMVecOptions *"), ffi.new("FMError *")))
res["check_out"] = per_call(lambda: _arrays.check_out(out, "x", q.shape, np.dtype(np.float32), [qa, ka, va]))
res["default_registry_lookup"] = per_call(lambda: fm.default_registry())
print(json.dumps(res))
"""


def overhead(quick):
    import json
    res = {}
    for label, env in (("threads=default", {}), ("threads=1", {"FLASHMETAL_NUM_THREADS": "1"})):
        r = subprocess.run([sys.executable, "-c", OVERHEAD_CHILD], capture_output=True, text=True,
                           env=dict(os.environ, FLASHMETAL_BACKEND="cpu", **env), timeout=600)
        if r.returncode != 0:
            print("overhead child failed:", r.stderr[-2000:])
            return None
        res[label] = json.loads(r.stdout.strip().splitlines()[-1])
    return res


# ---- output -------------------------------------------------------------------------

PEERS = ["flashmetal", "torch", "numpy"]
# The interleaved ceiling of the decode cases (parallel_read of the case's K and V).
READ = "read"


def fmt_ms(s):
    return "not installed" if s is None else f"{s * 1e3:.2f}"


def fmt_num(x, nd=0):
    return "—" if x is None else f"{x:.{nd}f}"


def print_row(r: Row, flush=True):
    parts = [f"{r.group:8s} {r.name:38s}"]
    for p in PEERS:
        s = r.secs.get(p)
        parts.append(f"{p} {fmt_ms(s):>9s} ms {fmt_num(r.metric(p)):>5s} {r.metric_name}"
                     if s is not None else f"{p} {'not installed' if p == 'torch' and torch is None else '—'}")
    rt = r.ratio()
    parts.append(f"x{rt:.2f}" if rt else "")
    if r.secs.get(READ):
        parts.append(f"read {fmt_num(r.metric(READ))} {r.metric_name}")
    if r.note:
        parts.append(r.note)
    print(" | ".join(parts), flush=flush)


GROUPS = [("prefill", "Prefill (B=1, Hq=16, Hkv=8; bf16/f16 flash_attn_prefill, f32 the sdpa route)"),
          ("window", "Sliding-window mask prefill"),
          ("decode", "Decode, single calls (Q f32 [16, D], Hkv=8; GB/s = K+V bytes read / time)"),
          ("decode-loop", "Decode in a loop, as a generation loop runs it: back-to-back calls over the "
                          "caches of enough layers to exceed the last-level cache 4x (at least "
                          f"{DECODE_BURST} calls per sample; times and GB/s per call; numpy not repeated)")]


def table_lines(rows):
    lines = []
    for g, title in GROUPS:
        rs = [r for r in rows if r.group == g]
        if not rs:
            continue
        mn = rs[0].metric_name
        rd = any(r.secs.get(READ) for r in rs)
        lines += [f"### {title}", "",
                  f"| case | flashmetal ms | {mn} | torch ms | {mn} | numpy ms | {mn} | vs torch "
                  "| vs torch, rounds min-max | vs numpy |" + (" read K+V GB/s | flashmetal / read |" if rd else ""),
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if rd else "")]
        for r in rs:
            cells = [r.name + (f" ({r.note})" if r.note else "")]
            for p in PEERS:
                s = r.secs.get(p)
                cells += [fmt_ms(s) if (s is not None or p == "torch") else "—",
                          fmt_num(r.metric(p), 1 if g.startswith("decode") else 0)]
            rt, rn, rr = r.ratio("torch"), r.ratio("numpy"), r.ratio_range()
            cells += [f"{rt:.2f}x" if rt else "—", f"{rr[0]:.2f}-{rr[1]:.2f}" if rr else "—",
                      f"{rn:.2f}x" if rn else "—"]
            if rd:
                f = r.metric(READ)
                cells += [fmt_num(f, 1), f"{100 * r.metric('flashmetal') / f:.0f}%" if f else "—"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def overhead_lines(ov):
    d, o = ov["threads=default"], ov["threads=1"]
    lines = ["### Per-call overhead: decode with kv_len = 1 (H=16, Hkv=8, D=128, f32)", "",
             "µs per call, median of 7 x 2000 calls.", "",
             "| part | default threads | FLASHMETAL_NUM_THREADS=1 |", "|---|---:|---:|"]
    names = [("end_to_end", "flash_attn_decode(..., registry=reg), end to end"),
             ("end_to_end_default_registry", "same, default registry (registry=None)"),
             ("c_call", "fm_dispatch_vec via cffi, args prebuilt (Swift validate + dispatch + kernel + pool)"),
             ("cffi_trivial_call", "a trivial cffi call (fm_registry_backend)"),
             ("as_input_x3", "as_input (np.asarray + ascontiguousarray) x3"),
             ("tensor_x4", "FMTensor building x4 (ffi.new + shape copy)"),
             ("ffi_new_opts_err", "ffi.new options + error buffer"),
             ("check_out", "check_out (incl. np.may_share_memory x3)"),
             ("default_registry_lookup", "default_registry() lookup (lock + dict)")]
    for key, label in names:
        lines.append(f"| {label} | {d[key]:.1f} | {o[key]:.1f} |")
    py = d["end_to_end"] - d["c_call"]
    lines += ["", f"Python wrapper share (end to end minus the C call): {py:.1f} µs; "
              f"thread-pool share (C call, default minus 1 thread): {d['c_call'] - o['c_call']:.1f} µs. "
              f"Target < 30 µs end to end: **{'met' if d['end_to_end'] < 30 else 'missed'}** "
              f"({d['end_to_end']:.1f} µs).", ""]
    return lines


def _verdict(ok):
    return "**met**" if ok else "**missed**"


def _ratio_target(rows, pick, need, label):
    rs = [r for r in rows if r.group == "prefill" and pick(r) and r.ratio() is not None]
    if not rs:
        return []
    worst = min(rs, key=lambda r: r.ratio())
    return [f"- {label} >= {need}x torch in every case: {_verdict(worst.ratio() >= need)} "
            f"(worst {worst.ratio():.2f}x, {worst.name}; best {max(r.ratio() for r in rs):.2f}x)"]


def _decode_target(rows, bw):
    out = []
    for group, how in (("decode-loop", "in a loop"), ("decode", "single calls")):
        dec = [r for r in rows if r.group == group]
        if not dec:
            continue
        frac = {r.name: r.metric("flashmetal") / bw for r in dec}
        bad = [n for n, f in frac.items() if f < 0.8]
        out.append(f"- decode ({how}) >= 80% of the measured {bw:.1f} GB/s for f32, f16 and bf16 at 4k and "
                   f"32k keys: {_verdict(not bad)} (range {100 * min(frac.values()):.0f}-"
                   f"{100 * max(frac.values()):.0f}%" + (f"; below: {', '.join(bad)}" if bad else "") + ")")
        same = {r.name: r.metric("flashmetal") / r.metric(READ) for r in dec if r.secs.get(READ)}
        if same:
            bad = [n for n, f in same.items() if f < 0.8]
            out.append(f"- decode ({how}) >= 80% of a read of the same K and V timed in the same rounds (the "
                       f"ceiling under the same load): {_verdict(not bad)} (range {100 * min(same.values()):.0f}-"
                       f"{100 * max(same.values()):.0f}%" + (f"; below: {', '.join(bad)}" if bad else "") + ")")
    return out


def targets_lines(m):
    rows, peak, bw = m["rows"], m["peak"], m["bw"]
    out = ["### Targets (this run)", ""]
    if m["isa"] == "avx2":
        out += _ratio_target(rows, lambda r: "bf16 full" in r.name, 1.0, "prefill bf16 full")
        out += _ratio_target(rows, lambda r: "bf16 causal" in r.name, 1.2, "prefill bf16 causal")
        out += _ratio_target(rows, lambda r: " f16 " in r.name, 1.4, "prefill f16")
        out += _ratio_target(rows, lambda r: " f32 " in r.name, 1.0, "prefill float32 (sdpa route)")
    else:
        need = 2.0 if m["isa"] == "avx512bf16" else 1.0
        out += _ratio_target(rows, lambda r: " bf16 " in r.name, need, "prefill bf16")
        out += _ratio_target(rows, lambda r: " bf16 " not in r.name, 1.0, "prefill f16 and float32")
    big = [r for r in rows if r.group == "prefill" and r.name.startswith("L=2048 D=256") and "full" in r.name]
    if big and peak:
        fr = {r.name: r.metric("flashmetal") / peak for r in big}
        bf = [f for n, f in fr.items() if "bf16" in n]
        out.append(f"- >= 75% of the measured FMA peak ({peak:.0f} GFLOP/s) on the largest full case "
                   f"(L=2048 D=256 bf16): {_verdict(bool(bf) and bf[0] >= 0.75)} ("
                   + ", ".join(f"{n.split()[2]} {100 * f:.0f}%" for n, f in fr.items()) + ")")
    out += _decode_target(rows, bw)
    win = [r for r in rows if r.group == "window"]
    for r in win[1:]:
        sp = win[0].secs["flashmetal"] / r.secs["flashmetal"]
        how = r.name.split("window=")[1].split(" ", 1)[1]
        out.append(f"- window-512 prefill, {how}, >= 2x the per-head mask without blk: {_verdict(sp >= 2)} "
                   f"({sp:.2f}x)")
    return out + [""]


def class_title(m):
    if m["isa"] == "avx2" and m.get("capped"):
        return ("x86-64 AVX2 + FMA + F16C only (measured on this machine capped to AVX2: "
                "FLASHMETAL_CPU_ISA=avx2; torch with ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, "
                "MKL_ENABLE_INSTRUCTIONS=AVX2, in a child process)")
    return {"avx512bf16": "x86-64 AVX-512 + AVX512-BF16", "avx512": "x86-64 AVX-512 (no BF16)",
            "avx512vbmi": "x86-64 AVX-512 + VBMI (no BF16)",
            "avx2": "x86-64 AVX2 + FMA + F16C", "neon": "arm64 NEON"}.get(m["isa"], m["isa"])


def class_lines(m):
    lines = [f"## Machine class: {class_title(m)}", "",
             f"flashmetal ISA path **{m['isa']}**; torch CPU capability **{m['torch_cap']}**. Ceilings measured "
             f"in this run: FMA peak **{fmt_num(m['peak'])} GFLOP/s** ({os.cpu_count()} threads, "
             f"bench/fma_peak.c on {m['peak_isa']} vectors), read bandwidth **{m['bw']:.1f} GB/s** "
             "(numpy sum, one thread per core).", ""]
    lines += table_lines(m["rows"])
    if m.get("ov"):
        lines += overhead_lines(m["ov"])
    return lines + targets_lines(m)


def kept_sections(path, measured_titles=()):
    """Sections titled '## Kept: ...' of the previous RESULTS.md, verbatim
    (results of other machines or earlier versions that this run cannot
    redo), but a class's previous run where this run measured that class."""
    if not path.is_file():
        return []
    stale = tuple(f"## Kept: {t}, the previous run of this class" for t in measured_titles)
    out, keep = [], False
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            keep = line.startswith("## Kept:") and not line.startswith(stale)
        if keep:
            out.append(line)
    return out + ([""] if out else [])


def previous_run_sections(path, measured_titles=()):
    """The class sections of the previous RESULTS.md retitled '## Kept: ...':
    a partial run (--only without prefill) keeps the tables it did not redo,
    a full run those of the machine classes it did not measure (sessions run
    on different CPUs; each class's latest tables stay)."""
    if not path.is_file():
        return []
    text = path.read_text().splitlines()
    # RESULTS.md says when and where it ran in its "Generated by" line; a file
    # without one (CODES_RESULTS.md) says it inside each section.
    made = next((ln for ln in text if ln.startswith("Generated by")), None)
    where = ""
    if made is not None:
        when = made.split("(", 1)[1].split(",", 1)[0]
        machine = made.split("Machine:", 1)[-1].split("`")[1] if "`" in made.split("Machine:", 1)[-1] else "?"
        rerun = "; its decode rows predate the decode in the sections above" if not measured_titles else ""
        where = f" ({when}, `{machine}`{rerun})"
    out, inside = [], False
    for line in text:
        if line.startswith("## "):
            title = line[len("## Machine class: "):]
            inside = line.startswith("## Machine class:") and title not in measured_titles
            if inside:
                line = f"## Kept: {title}, the previous run of this class{where}"
        if inside:
            out.append(line)
    return out


def write_results(measured, args, elapsed):
    partial = "prefill" not in args.only.split(",")
    lines = ["# flashmetal cpu benchmarks", ""]
    lines += [f"Generated by `make bench` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"{elapsed:.0f} s). Machine: {platform.machine()}, {os.cpu_count()} cores, "
              f"`{cpu_model()}`; torch {TORCH or 'not installed'} "
              f"({torch.get_num_threads() if torch else '-'} threads); numpy {np.__version__}.",
              "",
              f"Each case: one warm-up, then {args.runs} rounds running every peer once (interleaved); "
              "medians; 20 ms pause before each timed call so the previous peer's idle "
              "threads stop spinning (decode is also timed in a loop of back-to-back calls over several "
              "layers' caches, as a generation loop reads them, after the pause and one untimed pass). "
              "The machine is shared with other jobs (here: other engineers' builds and tests on the "
              "same 2 cores), so absolute times move between runs; only ratios within one run are "
              "meaningful, and the noise line of each class gives "
              "the spread of the flashmetal/torch ratio over the rounds. Ratio = torch time / "
              "flashmetal time (> 1: flashmetal faster). numpy = plain float32 attention (inputs "
              "converted to f32; not run in the capped child).", ""]
    lines += [f"Load average (1 min, `uptime`) at the start {LOAD_AT_START:.2f}, at the end "
              f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores: above ~1 other jobs shared the cores.", ""]
    if partial:
        lines += [f"This run measured only: {args.only} (`bench.py --only {args.only}`); the prefill tables "
                  "are the previous full run's, kept below.", ""]
    for m in measured:
        lines += class_lines(m)
    # A partial run keeps every class's previous tables; a full run those of the other classes.
    measured_titles = set() if partial else {class_title(m) for m in measured}
    lines += previous_run_sections(HERE / "RESULTS.md", measured_titles)
    lines += kept_sections(HERE / "RESULTS.md", measured_titles)
    (HERE / "RESULTS.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(rows):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"plot: matplotlib not available ({e}); no PNG written")
        return
    rs = [r for r in rows if r.ratio() is not None]
    if not rs:
        return
    fig, ax = plt.subplots(figsize=(10, max(4, 0.28 * len(rs))))
    names = [f"{r.group}: {r.name}" for r in rs]
    vals = [r.ratio() for r in rs]
    colors = ["tab:green" if v >= (1.5 if r.group.startswith("decode") else 1.0) else "tab:red"
              for v, r in zip(vals, rs)]
    y = np.arange(len(rs))
    ax.barh(y, vals, color=colors)
    ax.set_yticks(y, names, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.8)
    ax.axvline(1.5, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("torch time / flashmetal time (log; > 1 = flashmetal faster)")
    ax.set_title("flashmetal cpu vs torch CPU SDPA")
    fig.tight_layout()
    fig.savefig(HERE / "ratios.png", dpi=110)
    print(f"wrote {HERE / 'ratios.png'}")


def fm_isa():
    """The cpu ISA path, from the library flashmetal loaded (ctypes, same file)."""
    try:
        import ctypes
        _loader.load()
        lib = ctypes.CDLL(str(_loader.library_path()))
        lib.fm_cpu_isa.restype = ctypes.c_int
        lib.fm_cpu_isa_name.restype = ctypes.c_char_p
        lib.fm_cpu_isa_name.argtypes = [ctypes.c_int]
        return lib.fm_cpu_isa_name(lib.fm_cpu_isa()).decode()
    except Exception:  # noqa: BLE001
        return "unknown"


def notes(path):
    """The hand-written "## Notes" section of a previous results file, if
    any, as lines to append to the new one (a results file keeps it when the
    tables are measured again)."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    at = text.find("\n## Notes")
    return [text[at + 1:].rstrip("\n"), ""] if at >= 0 else []


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


AVX2_ENV = {"FLASHMETAL_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def torch_capability():
    try:
        return torch.backends.cpu.get_cpu_capability() if torch else "not installed"
    except Exception:  # noqa: BLE001
        return "unknown"


_PEAK_EXE = None


def fma_peak(isa):
    """GFLOP/s of bench/fma_peak.c on all cores with the ISA's vectors (None
    if no C compiler)."""
    import shutil
    import tempfile
    global _PEAK_EXE
    vec = "avx512" if isa.startswith("avx512") else isa
    if _PEAK_EXE is None:
        cc = shutil.which("clang") or shutil.which("cc") or "/opt/swift/usr/bin/clang"
        exe = Path(tempfile.mkdtemp(prefix="fma-peak-")) / "fma_peak"
        r = subprocess.run([cc, "-O2", "-pthread", str(HERE / "fma_peak.c"), "-o", str(exe)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            print("fma_peak: could not build:", r.stderr[-500:])
            return None, vec
        _PEAK_EXE = exe
    r = subprocess.run([str(_PEAK_EXE), vec, str(os.cpu_count() or 1)], capture_output=True, text=True)
    return (float(r.stdout.strip()) if r.returncode == 0 else None), vec


def measure_class(reg, args, only, child=False):
    """Every case of one ISA path; ceilings before and after (the higher)."""
    isa = fm_isa()
    print(f"flashmetal cpu ISA path {isa}; torch {TORCH or 'not installed'} (capability {torch_capability()}); "
          f"numpy {np.__version__}", flush=True)
    peak0, vec = fma_peak(isa)
    bw = read_bandwidth()
    print(f"FMA peak {peak0} GFLOP/s ({vec}), read bandwidth {bw:.1f} GB/s", flush=True)
    rows = []
    if "prefill" in only:
        rows += prefill_cases(reg, args.runs, args.quick, with_numpy=not child)
    if "window" in only and not child:
        rows += window_cases(reg, args.runs, args.quick)
    if "decode" in only:
        rows += decode_cases(reg, args.runs, args.quick, with_numpy=not child)
    peak1, _ = fma_peak(isa)
    peaks = [p for p in (peak0, peak1) if p]
    ov = overhead(args.quick) if "overhead" in only and not child else None
    return {"isa": isa, "torch_cap": torch_capability(), "peak": max(peaks) if peaks else None,
            "peak_isa": vec, "bw": max(bw, read_bandwidth()), "rows": rows, "ov": ov, "capped": child}


def capped_avx2_class(args):
    """The same cases in a child process capped to AVX2 (flashmetal and torch)."""
    import json
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--runs", str(args.runs), "--only", args.only]
    if args.quick:
        cmd.append("--quick")
    r = subprocess.run(cmd, env=dict(os.environ, **AVX2_ENV), stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        print("avx2 child failed")
        return None
    m = json.loads(r.stdout.strip().splitlines()[-1])
    m["rows"] = [Row.from_json(d) for d in m["rows"]]
    return m


LOAD_AT_START = os.getloadavg()[0]


def main():
    import json
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small shapes only (smoke test)")
    ap.add_argument("--only", default="prefill,window,decode,overhead")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-avx2", action="store_true", help="skip the run capped to AVX2")
    args = ap.parse_args()
    args.runs = max(args.runs, 5) if not args.quick else args.runs
    only = set(args.only.split(","))
    t0 = time.time()
    reg = fm.Registry("cpu")
    if args.child:  # progress to stderr; the last stdout line is the JSON result
        out, sys.stdout = sys.stdout, sys.stderr
        m = measure_class(reg, args, only, child=True)
        sys.stdout = out
        m["rows"] = [r.to_json() for r in m["rows"]]
        print(json.dumps(m))
        return
    measured = [measure_class(reg, args, only)]
    if not args.no_avx2 and measured[0]["isa"].startswith("avx512"):
        m = capped_avx2_class(args)
        if m:
            measured.append(m)
    write_results(measured, args, time.time() - t0)
    plot([r for m in measured[:1] for r in m["rows"]])


if __name__ == "__main__":
    main()
