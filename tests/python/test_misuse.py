"""Misuse from the outside: misuse a first version let
through (a blk for a mask of another shape with the same tile counts, a
backend name with a NUL, argument types that escaped as bare Python errors,
FLASHMETAL_BACKEND=auto)."""
from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import flashmetal as fm
from flashmetal import _native, reference
from flashmetal._arrays import tensor

from conftest import BACKENDS
from cabi import err_text

BF16 = ml_dtypes.bfloat16


def _inputs():
    rng = np.random.default_rng(12)
    q = rng.standard_normal((1, 1, 8, 64)).astype(BF16)
    k = rng.standard_normal((1, 1, 32, 64)).astype(BF16)
    # A [8, 17] mask whose right-edge tile hides key 16 and the first tile
    # hides keys 0..7; a [8, 32] all-zero mask has the same tile counts
    # (1 x 2 for head dim 64) but classes [[2, 2]] ("skip the mask add").
    m = np.zeros((8, 17), BF16)
    m[:, 16] = -np.inf
    m[:, :8] = -np.inf
    return q, k, m


@pytest.mark.parametrize("backend", BACKENDS)
def test_blk_of_another_mask_shape_is_refused(backend):
    q, k, m = _inputs()
    other = fm.build_blk(np.zeros((8, 32), BF16), 64, registry=backend)
    assert other.shape == fm.build_blk(m, 64, registry=backend).shape  # the shape check alone passes
    with pytest.raises(fm.InvalidValueError, match=r"flash_attn_prefill: blk was built for head_dim 64 and a "
                                                    r"\[8, 32\] mask, not head_dim 64 and a \[8, 17\] mask"):
        fm.flash_attn_prefill(q, k, k, mask=m, kv_len=17, blk=other, registry=backend)
    # The blk built for this mask is accepted and bit-identical to no blk,
    # and both match the float64 reference.
    own = fm.flash_attn_prefill(q, k, k, mask=m, kv_len=17, blk=fm.build_blk(m, 64, registry=backend),
                                registry=backend)
    none = fm.flash_attn_prefill(q, k, k, mask=m, kv_len=17, registry=backend)
    assert own.tobytes() == none.tobytes()
    want = reference.attention(q, k[:, :, :17], k[:, :, :17], mask=m, scale=1 / 8)
    np.testing.assert_allclose(own.astype(np.float64), want, atol=3e-2, rtol=3e-2)
    # A copy is caller memory: only its shape can be checked (documented).
    assert fm.blk.made_for(np.array(other)) is None


def test_tagged_blk_filled_for_another_mask_is_refused(cpu):
    """Through the C ABI: a blk allocated for a [8, 17] mask may not be
    filled from a [8, 32] one (prefill would trust its provenance)."""
    ffi, lib = _native.ffi(), _native.lib()
    err = ffi.new("FMError *")
    t = ffi.new("FMTensor *")
    assert lib.fm_alloc_blk(8, 17, 64, t, err) == lib.FM_OK
    try:
        st = lib.fm_dispatch_blk(cpu._handle, tensor(ffi, np.zeros((8, 32), BF16)), t, 64, err)
        assert st == lib.FM_ERROR_VALUE
        assert (b"flash_attn_prefill_blk: blk_out was built for head_dim 64 and a [8, 17] mask, "
                b"not head_dim 64 and a [8, 32] mask") in err_text(err)
        _, _, m = _inputs()
        assert lib.fm_dispatch_blk(cpu._handle, tensor(ffi, m), t, 64, err) == lib.FM_OK
    finally:
        assert lib.fm_free_blk(t, err) == lib.FM_OK


def test_backend_name_with_nul_is_refused():
    with pytest.raises(fm.InvalidValueError, match="create_registry: backend name contains a NUL"):
        fm.Registry("cpu\0sim")
    q, k, _ = _inputs()
    with pytest.raises(fm.InvalidValueError, match="NUL"):
        fm.flash_attn_prefill(q, k, k, registry="cpu\0x")


def test_bad_argument_types_are_flashmetal_errors(cpu):
    q, k, _ = _inputs()
    with pytest.raises(fm.InvalidValueError, match=r"flash_attn_prefill: layout must be .* got \[.bhld.\]"):
        fm.flash_attn_prefill(q, k, k, layout=["bhld"], registry=cpu)
    with pytest.raises(fm.InvalidTypeError, match="supported_head_dims: op must be a str, got int"):
        fm.supported_head_dims(5)
    with pytest.raises(fm.InvalidTypeError, match="supported_head_dims: op must be a str, got list"):
        fm.supported_head_dims(["flash_attn_vec"])


def test_flashmetal_backend_auto_means_default():
    code = "import flashmetal as fm; print(fm.Registry('auto').backend)"

    def backend_of_auto(**env):
        base = {k: v for k, v in os.environ.items() if k != "FLASHMETAL_BACKEND"}
        r = subprocess.run([sys.executable, "-c", code], env=dict(base, **env), capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    assert backend_of_auto(FLASHMETAL_BACKEND="auto") == backend_of_auto() != ""


def test_closing_a_default_registry_does_not_poison_later_calls():
    q = np.ones((2, 64), np.float32)
    k = np.ones((2, 16, 64), np.float32)
    with fm.default_registry("cpu") as r:
        fm.flash_attn_decode(q, k, k, 16, registry=r)
    out = fm.flash_attn_decode(q, k, k, 16, registry="cpu")  # a fresh default, not "registry is closed"
    np.testing.assert_array_equal(out, np.ones((2, 64), np.float32))
    assert fm.default_registry("cpu") is fm.default_registry("cpu") is not r
