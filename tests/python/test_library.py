"""The built library: its exported C ABI and its guards against bad calls."""
from __future__ import annotations

import ctypes

import pytest
from exports import exported_symbols

from flashmetal import _loader
from cabi import err_text

EXPORTED = ["fm_create_registry", "fm_destroy_registry", "fm_registry_backend", "fm_registry_defers_work",
            "fm_dispatch_prefill", "fm_version", "fm_begin_batch", "fm_end_batch", "fm_abi_version",
            "fm_status_string", "fm_supported_head_dims", "fm_runs_head_dims", "fm_max_head_dim",
            "fm_kernel_instantiations", "fm_route_attention", "fm_plan_attention"]


def test_exports():
    syms = exported_symbols(_loader.library_path())
    missing = [s for s in EXPORTED if s not in syms]
    assert not missing, f"missing exports: {missing}"
    # The loader's own view (dlsym), independent of nm and the object format.
    lib = ctypes.CDLL(str(_loader.library_path()))
    assert all(getattr(lib, s, None) is not None for s in EXPORTED)


def test_every_cdef_function_resolves():
    ffi, lib = _loader.load()
    for name in EXPORTED:
        assert getattr(lib, name) is not None
    assert ffi.string(lib.fm_version()).decode().count(".") == 2


def test_null_and_stale_handles():
    ffi, lib = _loader.load()
    err = ffi.new("FMError *")
    opts = ffi.new("FMPrefillOptions *")
    st = lib.fm_dispatch_prefill(ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL,
                                 opts, err)
    assert st == 1 and b"registry is null" in err_text(err)
    h = ffi.new("FMRegistry **")
    assert lib.fm_create_registry(b"cpu", h, err) == 0
    st = lib.fm_dispatch_prefill(h[0], ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL,
                                 opts, err)
    assert st == 1 and b"flash_attn_prefill: q is null" in err_text(err)
    assert lib.fm_destroy_registry(h[0]) == 0
    assert lib.fm_destroy_registry(h[0]) == 1  # double destroy is an error, not a crash
    st = lib.fm_dispatch_prefill(h[0], ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL,
                                 opts, err)
    assert st == 1 and b"not a live registry" in err_text(err)
    assert lib.fm_create_registry(b"cpu", ffi.NULL, err) == 1
    assert lib.fm_destroy_registry(ffi.NULL) == 0


def test_error_fields_truncation():
    """FMError's fields are NUL-terminated and truncated to fit; a NULL
    FMError is allowed."""
    ffi, lib = _loader.load()
    err = ffi.new("FMError *")
    h = ffi.new("FMRegistry **")
    assert lib.fm_create_registry(b"x" * 5000, h, err) == 1
    assert err.status == 1 and ffi.string(err.op) == b"create_registry"
    assert len(ffi.string(err.message)) == len(err.message) - 1
    assert lib.fm_create_registry(b"no-such-backend", h, ffi.NULL) == 1


def test_error_fields_name_the_public_op_and_argument():
    """public_op in, (status, op, argument, message) out: the op is the
    caller's public function and the message carries no op prefix."""
    ffi, lib = _loader.load()
    h = ffi.new("FMRegistry **")
    assert lib.fm_create_registry(b"cpu", h, ffi.NULL) == 0
    opts = ffi.new("FMPrefillOptions *")
    for public, want in ((None, b"flash_attn_prefill"), (b"scaled_dot_product_attention", b"scaled_dot_product_attention")):
        err = ffi.new("FMError *")
        name = None if public is None else ffi.new("char[]", public)
        if name is not None:
            err.public_op = name
        st = lib.fm_dispatch_prefill(h[0], ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, opts, err)
        assert st == err.status == lib.FM_ERROR_VALUE
        assert ffi.string(err.op) == want and ffi.string(err.argument) == b"q"
        assert ffi.string(err.message) == b"q is null"
    ok = ffi.new("FMError *")
    assert lib.fm_begin_batch(h[0], ok) == 0 and lib.fm_end_batch(h[0], ok) == 0
    assert (ok.status, ffi.string(ok.op), ffi.string(ok.argument), ffi.string(ok.message)) == (0, b"", b"", b"")
    lib.fm_destroy_registry(h[0])


@pytest.mark.parametrize("nbytes", [0, 100])
def test_undersized_buffer_is_refused(nbytes):
    ffi, lib = _loader.load()
    err = ffi.new("FMError *")
    h = ffi.new("FMRegistry **")
    assert lib.fm_create_registry(b"cpu", h, err) == 0
    buf = ffi.new("char[]", 4096)
    ts = []
    for shape in ([1, 1, 16, 64], [1, 1, 16, 64], [1, 1, 16, 64], [1, 1, 16, 64]):
        t = ffi.new("FMTensor *")
        t.data = buf
        t.nbytes = 16 * 64 * 2
        t.dtype = 2
        t.ndim = 4
        for i, d in enumerate(shape):
            t.shape[i] = d
        ts.append(t)
    ts[1].nbytes = nbytes
    opts = ffi.new("FMPrefillOptions *")
    opts.scale = 0.125
    st = lib.fm_dispatch_prefill(h[0], ts[0], ts[1], ts[2], ffi.NULL, ffi.NULL, ts[3], opts, err)
    assert st == 1 and b"k buffer too small" in err_text(err), err_text(err)
    lib.fm_destroy_registry(h[0])


def test_batch_scope(registry, rng):
    import flashmetal as fm
    from flashmetal import reference
    from numerics import BF16, assert_close, randn

    q, k, v = (randn(rng, (1, 2, 16, 64), BF16) for _ in range(3))
    with registry.batch():
        with registry.batch():
            out = fm.flash_attn_prefill(q, k, v, registry=registry)
    assert_close(out, reference.attention(q, k, v), BF16, "batched")
    with pytest.raises(ValueError, match="end_batch: no batch is open"):
        registry._call("fm_end_batch")
