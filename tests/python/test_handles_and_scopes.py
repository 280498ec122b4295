"""Handles that are never
reused, scratch that lives exactly as long as its work, blk geometry checks,
and the arrays a batch keeps alive."""
from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import _native, reference
from flashmetal._arrays import tensor
from numerics import BF16, F16, F32, assert_close, randn
from cabi import err_text


def _err():
    return _native.ffi().new("FMError *")


def test_destroyed_registry_handle_is_never_another_registry():
    ffi, lib = _native.ffi(), _native.lib()
    handles = []
    for _ in range(3):
        h = ffi.new("FMRegistry **")
        assert lib.fm_create_registry(b"cpu", h, ffi.NULL) == lib.FM_OK
        handles.append(h[0])
    stale = handles[0]
    assert lib.fm_destroy_registry(stale) == lib.FM_OK
    fresh = ffi.new("FMRegistry **")
    assert lib.fm_create_registry(b"cpu", fresh, ffi.NULL) == lib.FM_OK
    assert fresh[0] not in handles, "a handle value was handed out twice"
    err = _err()
    assert lib.fm_begin_batch(stale, err) == lib.FM_ERROR_VALUE
    assert b"not a live registry" in err_text(err)
    assert lib.fm_destroy_registry(stale) == lib.FM_ERROR_VALUE  # double destroy
    defers = ffi.new("int32_t *", 7)
    assert lib.fm_registry_defers_work(stale, defers, err) == lib.FM_ERROR_VALUE
    assert b"not a live registry" in err_text(err) and defers[0] == 7
    name = ffi.new("char[]", b"garbage")
    assert lib.fm_registry_backend(stale, name, 8) == lib.FM_ERROR_VALUE
    assert ffi.string(name) == b"", "an error must not leave a message where the name goes"
    for h in handles[1:] + [fresh[0]]:  # the live ones are untouched
        assert lib.fm_begin_batch(h, err) == lib.FM_OK
        assert lib.fm_end_batch(h, err) == lib.FM_OK
        assert lib.fm_destroy_registry(h) == lib.FM_OK


def test_stale_blk_descriptor_cannot_free_or_feed_a_live_buffer(cpu):
    ffi, lib = _native.ffi(), _native.lib()
    err = _err()
    t1 = ffi.new("FMTensor *")
    assert lib.fm_alloc_blk(64, 64, 128, t1, err) == lib.FM_OK
    assert t1.tag != 0
    stale = ffi.new("FMTensor *")
    ffi.memmove(stale, t1, ffi.sizeof("FMTensor"))  # a copy of the descriptor
    assert lib.fm_free_blk(t1, err) == lib.FM_OK
    assert t1.tag == 0 and t1.data == ffi.NULL
    # Allocate until malloc hands the freed address out again (usually at once).
    live = []
    for _ in range(64):
        t = ffi.new("FMTensor *")
        assert lib.fm_alloc_blk(64, 64, 128, t, err) == lib.FM_OK
        live.append(t)
        if t.data == stale.data:
            break
    reused = live[-1]
    assert lib.fm_free_blk(stale, err) == lib.FM_ERROR_VALUE, "stale copy freed a live buffer"
    assert b"free_blk:" in err_text(err) and b"not a live buffer" in err_text(err)
    m = fm.build_mask(64, 64, causal=True, registry=cpu)
    st = lib.fm_dispatch_blk(cpu._handle, tensor(ffi, m), stale, 128, err)
    assert st == lib.FM_ERROR_VALUE and b"not a live fm_alloc_blk buffer" in err_text(err)
    assert lib.fm_dispatch_blk(cpu._handle, tensor(ffi, m), reused, 128, err) == lib.FM_OK
    for t in live:
        assert lib.fm_free_blk(t, err) == lib.FM_OK


@pytest.fixture
def prefill_inputs(rng):
    q = randn(rng, (1, 2, 64, 128), BF16)
    k = randn(rng, (1, 2, 64, 128), BF16)
    return q, k, randn(rng, (1, 2, 64, 128), BF16)


def test_blk_for_another_head_dim_is_refused(registry, prefill_inputs):
    q, k, v = prefill_inputs
    m = fm.build_mask(64, 64, causal=True, registry=registry)
    good = fm.build_blk(m, 128, registry=registry)
    out = fm.flash_attn_prefill(q, k, v, mask=m, blk=good, registry=registry)
    assert_close(out, reference.attention(q, k, v, mask=m.astype(np.float64)), BF16, "blk for d=128")
    with pytest.raises(fm.InvalidValueError, match=r"blk shape \[8, 8\] must be \[NQ, NK\] = \[2, 4\]") as e:
        fm.flash_attn_prefill(q, k, v, mask=m, blk=fm.build_blk(m, 512, registry=registry), registry=registry)
    assert e.value.op == "flash_attn_prefill"
    bigger = fm.build_mask(128, 128, causal=True, registry=registry)
    with pytest.raises(ValueError, match=r"flash_attn_prefill: blk shape \[4, 8\]"):
        fm.flash_attn_prefill(q, k, v, mask=m, blk=fm.build_blk(bigger, 128, registry=registry), registry=registry)


def test_tagged_blk_remembers_its_geometry(cpu, prefill_inputs):
    """A blk from fm_alloc_blk for head dim 64 has the d=128 shape (same
    tiles) but is refused by a d=128 prefill by its provenance."""
    q, k, v = prefill_inputs
    ffi, lib = _native.ffi(), _native.lib()
    err = _err()
    m = fm.build_mask(64, 64, causal=True, registry=cpu)
    blk = ffi.new("FMTensor *")
    assert lib.fm_alloc_blk(64, 64, 64, blk, err) == lib.FM_OK
    try:
        assert lib.fm_dispatch_blk(cpu._handle, tensor(ffi, m), blk, 64, err) == lib.FM_OK
        out = np.empty_like(q)
        opts = _native.options("FMPrefillOptions", scale=0.1, layout=lib.FM_LAYOUT_BHLD)
        st = lib.fm_dispatch_prefill(cpu._handle, tensor(ffi, q), tensor(ffi, k), tensor(ffi, v), tensor(ffi, m),
                                     blk, tensor(ffi, out), opts, err)
        assert st == lib.FM_ERROR_VALUE
        assert b"blk was built for head_dim 64 and a [64, 64] mask, not head_dim 128" in err_text(err)
    finally:
        assert lib.fm_free_blk(blk, err) == lib.FM_OK


_SCRATCH_PROBE = """
import resource, sys
import numpy as np
import flashmetal as fm
reg = fm.Registry("cpu")
q = np.zeros((64, 512), np.float32)
k = np.zeros((64, 8, 512), np.float32)
out = np.empty_like(q)
fm.flash_attn_decode(q, k, k, 8, out=out, registry=reg)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with reg.batch():
    for _ in range(50):
        fm.flash_attn_decode(q, k, k, 8, out=out, registry=reg)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(grown / (1024 * 1024 if sys.platform == "darwin" else 1024))  # MiB
"""


def test_synchronous_batch_keeps_no_scratch():
    """50 decodes needing 4 MiB of library scratch each, inside one batch:
    cpu has run each when it returns, so the peak RSS grows by about one
    scratch, not 200 MiB (a batch that kept every call's scratch). A fresh process,
    so the peak is not an earlier test's."""
    r = subprocess.run([sys.executable, "-c", _SCRATCH_PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    grown_mib = float(r.stdout.strip().splitlines()[-1])
    assert grown_mib < 64, f"peak RSS grew by {grown_mib:.0f} MiB inside a batch"


def test_close_inside_a_batch_loses_nothing(registry_name, rng):
    reg = fm.Registry(registry_name)
    q = randn(rng, (4, 64), F32)
    k = randn(rng, (2, 40, 64), F32)
    v = randn(rng, (2, 40, 64), F32)
    with reg.batch():
        out = fm.flash_attn_decode(q, k, v, 40, registry=reg)
        reg.close()  # ends the open scope: the work has run, nothing leaks
    assert reg._handle is None
    # Decode is held to the f16 tolerance.
    assert_close(out, reference.decode(q, k, v, 40, scale=1 / 8), F16, "decode inside a batch closed early")
    with pytest.raises(ValueError, match="flash_attn_decode: registry is closed"):
        fm.flash_attn_decode(q, k, v, 40, registry=reg)


@pytest.fixture(params=["cpu", "sim"])
def registry_name(request):
    return request.param


def test_batch_keeps_temporary_copies_until_it_ends(registry_name, rng):
    """A deferring backend reads inputs at commit, so the contiguous
    copy Python makes of a strided input must outlive the call."""
    reg = fm.Registry(registry_name)
    q = randn(rng, (4, 128), F32)[:, ::2]  # strided: the library gets a copy
    k = randn(rng, (2, 16, 64), F32)
    with reg.batch():
        fm.flash_attn_decode(q, k, k, 16, registry=reg)
        assert reg._batch_keep == [], "a synchronous backend keeps nothing inside a batch"
    reg._defers_work = True  # as Metal: the work runs at the end of the scope
    with reg.batch():
        with reg.batch():
            fm.flash_attn_decode(q, k, k, 16, registry=reg)
        kept = [a for call in reg._batch_keep for a in call if a is not None]
        assert any(a.shape == q.shape and a.flags.c_contiguous and a is not q for a in kept), \
            "the temporary copy of q is not held by the open batch"
    assert reg._batch_keep == []
    fm.flash_attn_decode(q, k, k, 16, registry=reg)
    assert reg._batch_keep == [], "outside a batch nothing is kept"
    reg.close()
    gc.collect()


def test_the_library_says_which_backends_defer_work(registry):
    """Only the Metal backend (metal, and metal-sim on Linux) runs a batch
    scope's work at its end; Python keeps a scope's arrays alive only there."""
    ffi, lib = _native.ffi(), _native.lib()
    defers = ffi.new("int32_t *", 7)
    err = _err()
    assert lib.fm_registry_defers_work(registry._handle, defers, err) == lib.FM_OK
    assert defers[0] == (1 if registry.backend in ("metal", "metal-sim") else 0)
    assert registry._defers_work is bool(defers[0])
    assert lib.fm_registry_defers_work(registry._handle, ffi.NULL, err) == lib.FM_ERROR_VALUE
    assert ffi.string(err.argument) == b"out"
