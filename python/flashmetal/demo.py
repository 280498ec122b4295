"""`make demo`: what runs here (flashmetal.info()), then prefill and decode on
the default backend, each line checked against the float64 reference
(PASS/FAIL at the test tolerance), with timings."""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np

from . import reference
from ._info import info
from .decode import flash_attn_decode
from .prefill import flash_attn_prefill
from .registry import Registry


# (atol, rtol) of each output dtype (the tests' tolerances, tests/python/numerics.py); decode returns float32, held to float32's.
_TOLERANCE = {"bfloat16": (5e-3, 2e-2), "float16": (1e-3, 5e-3), "float32": (1e-5, 1e-4)}
_failures: list[str] = []


def _verdict(what: str, out: np.ndarray, expected: np.ndarray, dtype_name: str) -> str:
    atol, rtol = _TOLERANCE[dtype_name]
    ok, ratio = reference.close(out, expected, atol, rtol)
    if not ok:
        _failures.append(what)
    return f"{'PASS' if ok else 'FAIL'} (err/tol {ratio:.2f})"


def _median_ms(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm-up: pipeline creation, page faults
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def demo_prefill(reg: Registry, rng: np.random.Generator, length: int, runs: int) -> None:
    b, hq, hkv, d = 1, 16, 8, 128
    bf16 = np.dtype(ml_dtypes.bfloat16)
    q = rng.standard_normal((b, hq, length, d)).astype(bf16)
    k = rng.standard_normal((b, hkv, length, d)).astype(bf16)
    v = rng.standard_normal((b, hkv, length, d)).astype(bf16)
    for causal in (False, True):
        out = flash_attn_prefill(q, k, v, causal=causal, registry=reg)
        exp = reference.attention(q, k, v, causal=causal)
        err = float(np.max(np.abs(out.astype(np.float64) - exp)))
        what = f"prefill bf16 B={b} Hq={hq} Hkv={hkv} L={length} D={d} causal={causal!s:5}"
        verdict = _verdict(what, out, exp, "bfloat16")
        ms = _median_ms(lambda: flash_attn_prefill(q, k, v, causal=causal, registry=reg), runs)
        flops = 4.0 * b * hq * length * length * d * (0.5 if causal else 1.0)
        print(f"{what}: max|err|={err:.2e} {verdict}  {ms:8.2f} ms  {flops / ms / 1e6:7.1f} GFLOP/s")


def demo_decode(reg: Registry, rng: np.random.Generator, kv_len: int, runs: int) -> None:
    hq, hkv, d, cap = 16, 8, 256, kv_len + 64  # a cache with spare slots
    q = rng.standard_normal((hq, d)).astype(np.float32)
    for dtype in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        k = rng.standard_normal((hkv, cap, d)).astype(dtype)
        v = rng.standard_normal((hkv, cap, d)).astype(dtype)
        out = flash_attn_decode(q, k, v, kv_len, registry=reg)
        exp = reference.attention(q[None, :, None, :], k[None, :, :kv_len], v[None, :, :kv_len])[0, :, 0]
        err = float(np.max(np.abs(out.astype(np.float64) - exp)))
        what = f"decode  {dtype.name:8} Hq={hq} Hkv={hkv} kv_len={kv_len} D={d}"
        verdict = _verdict(what, out, exp, "float32")
        ms = _median_ms(lambda: flash_attn_decode(q, k, v, kv_len, registry=reg), runs)
        gbs = 2.0 * hkv * kv_len * d * dtype.itemsize / ms / 1e6
        print(f"{what}: max|err|={err:.2e} {verdict}  {ms:8.2f} ms  {gbs:7.1f} GB/s of K/V")


def print_info(reg: Registry) -> None:
    about = info(reg)
    for key, value in about.items():
        print(f"  {key:17} {value}")
    if reg.backend == "cpu" and about["cpu_isa_portable"]:
        print("  WARNING: the cpu kernels run their portable C path (no AVX-512 / NEON path for this CPU, or "
              "FLASHMETAL_CPU_ISA=portable): expect several times lower GFLOP/s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--kv-len", type=int, default=32768)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    reg = Registry(args.backend)
    print(f"flashmetal demo on backend '{reg.backend}'")
    print_info(reg)
    rng = np.random.default_rng(0)
    demo_prefill(reg, rng, args.length, args.runs)
    demo_decode(reg, rng, args.kv_len, args.runs)
    if _failures:
        print(f"FAIL: {len(_failures)} line(s) outside the tolerance")
        return 1
    print("all lines PASS")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
