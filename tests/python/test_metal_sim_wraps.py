"""The Metal host on metal-sim: how often it wraps host memory in an
MTLBuffer and how many command buffers it makes, per call, per batch scope
and for library-allocated tensors (Registry.empty) across decode steps; and
that no wrap outlives the memory it wraps."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import flashmetal as fm
from conftest import BACKENDS
from flashmetal import reference
from flashmetal.registry import metal_sim_counters
from metal_sim_delta import delta
from numerics import F16, F32, assert_close, randn

pytestmark = pytest.mark.skipif("metal-sim" not in BACKENDS, reason="this build has no metal-sim backend")
H, HKV, CAP, D = 4, 2, 512, 64


@pytest.fixture
def msim() -> fm.Registry:
    # A registry per test: its scratch pool starts empty.
    r = fm.Registry("metal-sim")
    yield r
    r.close()


def library(reg, a):
    """A copy of `a` in library memory."""
    out = reg.empty(a.shape, a.dtype)
    out[...] = a
    return out


def decode(reg, q, k, v, n, out=None):
    return fm.flash_attn_decode(q, k, v, n, out=out, registry=reg)


def test_a_call_wraps_each_tensor_once_in_one_command_buffer(msim, rng):
    """Prefill over library tensors: the first call wraps q, k, v, out and
    its scratch once each; the next call wraps nothing; both make one
    command buffer and copy nothing."""
    q, k, v = (library(msim, randn(rng, (1, n, 64, D), F16)) for n in (H, HKV, HKV))
    out = msim.empty(q.shape, F16)
    first = metal_sim_counters()
    fm.flash_attn_prefill(q, k, v, out=out, registry=msim)
    c1 = delta(first)
    second = metal_sim_counters()
    fm.flash_attn_prefill(q, k, v, out=out, registry=msim)
    c2 = delta(second)
    assert_close(out, reference.attention(q, k, v), F16, "prefill")
    assert c1["command_buffers"] == c2["command_buffers"] == 1 and c1["commits"] == c2["commits"] == 1, (c1, c2)
    assert c1["wraps"] >= 4, c1
    assert c2["wraps"] == 0 and c2["bytes_wrapped"] == 0, c2
    assert c1["copy_buffers"] == c2["copy_buffers"] == 0, (c1, c2)


def test_decode_steps_over_a_library_cache_wrap_nothing(msim, rng):
    """16 decode steps over a library-allocated cache, query and output:
    after the first step no step wraps, copies or allocates a buffer, each
    makes one command buffer, and each result is right."""
    k, v = library(msim, randn(rng, (HKV, CAP, D), F16)), library(msim, randn(rng, (HKV, CAP, D), F16))
    q, out = msim.empty((H, D), F32), msim.empty((H, D), F32)
    decode(msim, q, k, v, 1, out=out)
    before = metal_sim_counters()
    for step in range(16):
        q[...] = randn(rng, q.shape, F32)
        decode(msim, q, k, v, 300 + step, out=out)
        assert_close(out, reference.decode(q, k, v, 300 + step), F32, f"step {step}")
    c = delta(before)
    assert c["wraps"] == 0 and c["bytes_wrapped"] == 0 and c["copy_buffers"] == 0, c
    assert c["command_buffers"] == 16 and c["commits"] == 16, c


def test_decode_steps_over_a_library_cache_wrap_only_their_own_arrays(msim, rng):
    """Per step, a numpy query and a new output are wrapped (2 wraps at
    most), the cache never: the count does not grow with the cache."""
    k, v = library(msim, randn(rng, (HKV, CAP, D), F16)), library(msim, randn(rng, (HKV, CAP, D), F16))
    decode(msim, randn(rng, (H, D), F32), k, v, 1)
    before = metal_sim_counters()
    for step in range(16):
        decode(msim, randn(rng, (H, D), F32), k, v, 300 + step)
    c = delta(before)
    assert c["wraps"] <= 2 * 16 and c["bytes_wrapped"] <= 2 * 16 * 2 * 16384, c


@pytest.mark.parametrize("steps", [1, 16])
def test_a_batch_scope_is_one_command_buffer_that_wraps_each_tensor_once(msim, rng, steps):
    """Decode steps in one batch scope over one numpy cache, query and
    output: one command buffer, and the cache, query and output wrapped
    once whatever the number of steps (the scratch blocks of the steps are
    the registry's own, wrapped once and reused by the next scope)."""
    k, v = randn(rng, (HKV, CAP, D), F16), randn(rng, (HKV, CAP, D), F16)
    q, out = randn(rng, (H, D), F32), np.zeros((H, D), F32)
    with msim.batch():  # fills the scratch pool
        for step in range(steps):
            decode(msim, q, k, v, 100 + step)
    before = metal_sim_counters()
    with msim.batch():
        for step in range(steps):
            decode(msim, q, k, v, 300 + step, out=out)
    c = delta(before)
    assert_close(out, reference.decode(q, k, v, 300 + steps - 1), F32, "last step")
    assert c["command_buffers"] == 1 and c["commits"] == 1 and c["encoders"] == 1, c
    assert c["dispatches"] == 2 * steps and c["barriers"] == 2 * steps - 1, c
    assert 1 <= c["wraps"] <= 4, c  # k, v, q, out (fewer where they share pages)
    assert c["copy_buffers"] == 0 and c["live_command_buffers"] == 0, c


def test_a_freed_library_allocation_is_never_reached_through_a_stale_wrap(msim, rng):
    """A library cache is freed and another of a different length takes
    its place (often at the same address): the new one gets its own wrap,
    and decode reads the new memory, never the old."""
    seen_reuse = False
    for attempt in range(6):
        cap = CAP * (attempt % 3 + 1)
        k, v = library(msim, randn(rng, (HKV, cap, D), F16)), library(msim, randn(rng, (HKV, cap, D), F16))
        q = randn(rng, (H, D), F32)
        assert_close(decode(msim, q, k, v, cap - 3), reference.decode(q, k, v, cap - 3), F32, f"cap {cap}")
        address = k.ctypes.data
        del k, v
        gc.collect()
        k2 = library(msim, randn(rng, (HKV, cap + CAP, D), F16))
        v2 = library(msim, randn(rng, (HKV, cap + CAP, D), F16))
        before = metal_sim_counters()
        got = decode(msim, q, k2, v2, cap + CAP - 1)
        c = delta(before)
        assert_close(got, reference.decode(q, k2, v2, cap + CAP - 1), F32, f"after free, cap {cap}")
        assert c["wraps"] >= 2 and c["bytes_wrapped"] >= k2.nbytes + v2.nbytes, c
        seen_reuse |= k2.ctypes.data == address
        del k2, v2
        gc.collect()
    if not seen_reuse:
        pytest.skip("the allocator never reused an address: nothing to show")
