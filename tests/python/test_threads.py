"""Thread safety: 8 Python threads share one registry and run mixed
ops for a bounded time; every result is bit-equal to the single-threaded one;
the GIL is released while kernels run; the pipeline cache under contention."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import flashmetal as fm
from numerics import BF16, F16, F32, randn

THREADS = 8


def _jobs(rng, small: bool):
    """(name, fn(registry) -> array) pairs covering every op and many
    distinct pipeline keys (dtype x head dim x constants)."""
    jobs = []
    dims = (64,) if small else (64, 128, 256, 512)
    for d in dims:
        for dt in (BF16, F16):
            q, k, v = randn(rng, (1, 2, 20, d), dt), randn(rng, (1, 1, 40, d), dt), randn(rng, (1, 1, 40, d), dt)
            for causal in (False, True):
                jobs.append((f"prefill d{d} {dt} c{causal}",
                             lambda r, q=q, k=k, v=v, c=causal: fm.flash_attn_prefill(q, k, v, causal=c, q_offset=20,
                                                                                       registry=r)))
            m = fm.build_mask(20, 40, causal=True, window=7, q_offset=20, dtype=dt)
            jobs.append((f"prefill mask d{d} {dt}",
                         lambda r, q=q, k=k, v=v, m=m: fm.flash_attn_prefill(q, k, v, mask=m, registry=r)))
            jobs.append((f"blk d{d} {dt}", lambda r, m=m, d=d: fm.build_blk(m, d, registry=r)))
        for kv in (F32, F16, BF16):
            q, k, v = randn(rng, (4, d), F32), randn(rng, (2, 100, d), kv), randn(rng, (2, 100, d), kv)
            jobs.append((f"vec d{d} {kv}", lambda r, q=q, k=k, v=v: fm.flash_attn_decode(q, k, v, 77, registry=r)))
            jobs.append((f"vec fwht d{d} {kv}",
                         lambda r, q=q, k=k, v=v: fm.flash_attn_decode(q, k, v, 90, window=9, fwht=True, registry=r)))
    jobs.append(("mask", lambda r: fm.build_mask(33, 70, causal=True, window=5, q_offset=30, registry=r)))
    if not small:
        for dt in (F32, BF16):
            q, k = randn(rng, (1, 2, 9, 40), dt), randn(rng, (1, 1, 30, 40), dt)
            jobs.append((f"sdpa {dt}", lambda r, q=q, k=k: fm.sdpa(q, k, k, registry=r)))
    jobs.append(("error", lambda r: _error(r)))
    return jobs


def _error(r):
    try:
        fm.flash_attn_prefill(np.zeros((1, 1, 2, 64), BF16), np.zeros((1, 1, 1, 64), BF16),
                              np.zeros((1, 1, 1, 64), BF16), causal=True, registry=r)
    except ValueError as e:
        return np.frombuffer(str(e).encode(), np.uint8)
    raise AssertionError("expected ValueError")


def _hammer(registry, jobs, seconds):
    expected = {name: fn(registry) for name, fn in jobs}  # single-threaded results
    stop = time.monotonic() + seconds
    errors: list[str] = []
    counts = [0] * THREADS

    def worker(i):
        rng = np.random.default_rng(i)
        try:
            while time.monotonic() < stop:
                name, fn = jobs[int(rng.integers(len(jobs)))]
                got = fn(registry)
                if got.tobytes() != expected[name].tobytes():
                    errors.append(f"thread {i}: {name} differs from the single-threaded run")
                counts[i] += 1
        except Exception as e:  # noqa: BLE001
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[:5]
    assert min(counts) > 0, counts
    return sum(counts)


@pytest.mark.slow
def test_mixed_ops_cpu(cpu, rng):
    n = _hammer(cpu, _jobs(rng, small=False), 4.0)
    print(f"cpu: {n} calls from {THREADS} threads")


@pytest.mark.slow
def test_mixed_ops_sim(rng):
    try:
        sim = fm.Registry("sim")
    except ValueError:
        pytest.skip("no sim backend")
    jobs = []
    for name, fn in _jobs(rng, small=True):
        try:
            fn(sim)
        except fm.BackendError:  # an op the simulator does not have yet
            continue
        jobs.append((name, fn))
    n = _hammer(sim, jobs, 2.0)
    print(f"sim: {n} calls from {THREADS} threads")
    sim.close()


def test_pipeline_cache_contention(rng):
    """A fresh registry; 8 threads start at once on the same set of distinct
    pipeline keys in different orders. Every result must equal the
    single-threaded one from another registry (a pipeline made twice or a
    torn cache entry would show up as a wrong kernel or a crash)."""
    jobs = _jobs(rng, small=False)
    with fm.Registry("cpu") as ref:
        expected = {name: fn(ref) for name, fn in jobs}
    for _ in range(3):
        fresh = fm.Registry("cpu")
        barrier = threading.Barrier(THREADS)
        errors: list[str] = []

        def worker(i):
            order = list(range(len(jobs)))
            np.random.default_rng(i).shuffle(order)
            barrier.wait()
            for j in order:
                name, fn = jobs[j]
                try:
                    if fn(fresh).tobytes() != expected[name].tobytes():
                        errors.append(f"{name} differs")
                except Exception as e:  # noqa: BLE001
                    errors.append(f"{name}: {type(e).__name__}: {e}")

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        fresh.close()
        assert not errors, errors[:5]


@pytest.mark.slow
def test_gil_released(cpu, rng):
    """A Python thread keeps counting while one long kernel runs: with the GIL
    held during the call it could not run at all."""
    q, k, v = randn(rng, (1, 8, 2048, 128), F16), randn(rng, (1, 8, 8192, 128), F16), randn(rng, (1, 8, 8192, 128), F16)
    t0 = time.perf_counter()
    fm.flash_attn_prefill(q, k, v, registry=cpu)
    alone = time.perf_counter() - t0
    ticks = [0]
    running = threading.Event()
    done = threading.Event()

    def counter():
        running.set()
        while not done.is_set():
            ticks[0] += 1

    th = threading.Thread(target=counter)
    th.start()
    running.wait()
    before = ticks[0]
    t0 = time.perf_counter()
    fm.flash_attn_prefill(q, k, v, registry=cpu)
    during = ticks[0] - before
    elapsed = time.perf_counter() - t0
    done.set()
    th.join()
    print(f"kernel {alone * 1e3:.0f} ms alone, {elapsed * 1e3:.0f} ms with a counting thread; {during} ticks during it")
    # The interpreter switch interval is 5 ms: a GIL held for the whole call
    # would allow only the ticks before the call took the GIL.
    assert alone > 0.05, "the kernel is too short to show anything"
    assert during > 10_000, f"only {during} counter ticks during a {elapsed:.2f} s kernel: GIL held?"
