"""Leaks: 10^5 repeated cheap calls keep RSS flat (read from
/proc/self/statm); registries and library-owned blk buffers are freed."""
from __future__ import annotations

import os

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import _loader
from numerics import BF16, F32, randn

PAGE = os.sysconf("SC_PAGE_SIZE")
pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc/self/statm")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _growth(fn, n: int) -> tuple[int, int]:
    """RSS growth over the second half of n calls (the first half warms up
    allocator arenas, pipeline caches and the like)."""
    for _ in range(n // 2):
        fn()
    a = rss()
    for _ in range(n - n // 2):
        fn()
    return rss() - a, n - n // 2


MB = 1 << 20


@pytest.mark.slow
def test_repeated_calls_rss_flat(cpu, rng):
    ffi, lib = _loader.load()
    q, k, v = randn(rng, (2, 64), F32), randn(rng, (1, 16, 64), F32), randn(rng, (1, 16, 64), F32)
    pq = randn(rng, (1, 1, 8, 64), BF16)
    err = ffi.new("FMError *")
    t = ffi.new("FMTensor *")
    calls = [
        ("decode", lambda: fm.flash_attn_decode(q, k, v, 16, registry=cpu)),  # library-owned tmp each call
        ("prefill", lambda: fm.flash_attn_prefill(pq, pq, pq, registry=cpu)),
        ("value error", lambda: _swallow(lambda: fm.flash_attn_decode(q, k, v, 17, registry=cpu))),
        ("type error", lambda: _swallow(lambda: fm.flash_attn_prefill(pq.astype(F32), pq, pq, registry=cpu))),
        ("alloc+free blk", lambda: (lib.fm_alloc_blk(300, 300, 64, t, err), lib.fm_free_blk(t, err))),
        ("registry", lambda: fm.Registry("cpu").close()),
    ]
    total = 0
    report = []
    for name, fn in calls:
        grew, n = _growth(fn, 40_000 if name != "registry" else 10_000)
        total += 2 * n
        report.append(f"{name}: {grew / MB:+.2f} MiB over {n}")
        assert grew < 2 * MB, f"{name}: RSS grew {grew / MB:.1f} MiB over {n} calls ({report})"
    print("; ".join(report))
    assert total >= 100_000


def test_registry_handles_are_released():
    """A destroyed registry is gone from the live set (a second destroy is an
    error, not a double free), and many create/destroy cycles do not grow RSS."""
    ffi, lib = _loader.load()
    h = ffi.new("FMRegistry **")
    err = ffi.new("FMError *")
    assert lib.fm_create_registry(b"cpu", h, err) == 0
    assert lib.fm_destroy_registry(h[0]) == 0
    assert lib.fm_destroy_registry(h[0]) == 1
    grew, n = _growth(lambda: (lib.fm_create_registry(b"cpu", h, err), lib.fm_destroy_registry(h[0])), 20_000)
    assert grew < 2 * MB, f"RSS grew {grew / MB:.1f} MiB over {n} registry create/destroy"


def test_big_buffers_are_freed(cpu, rng):
    """Calls whose library-side allocations are large (decode tmp of 8 MiB,
    a 1 MiB blk) return that memory."""
    q = randn(rng, (1, 64, 512), F32)
    k = randn(rng, (1, 8, 4, 512), F32)
    mask = np.zeros((1000, 1000), BF16)

    def fn():
        fm.flash_attn_decode(q, k, k, 4, registry=cpu)
        fm.build_blk(mask, 512, registry=cpu)

    grew, n = _growth(fn, 400)
    assert grew < 16 * MB, f"RSS grew {grew / MB:.1f} MiB over {n} calls with large temporaries"


def _swallow(fn):
    try:
        fn()
    except (ValueError, TypeError):
        pass
