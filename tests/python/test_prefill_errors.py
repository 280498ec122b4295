"""Every prefill error path: exact exception type, message naming the op and value."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
import numerics
from numerics import BF16, F16, F32, randn

OP = "flash_attn_prefill"


@pytest.fixture
def qkv(rng):
    return numerics.qkv(rng, BF16, h=4, ql=8, kl=16)


def raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert msg.startswith(OP + ":"), msg
    assert match in msg, msg


def test_dtypes(cpu, rng, qkv):
    q, k, v = qkv
    raises(TypeError, "k dtype bfloat16 does not match q dtype float32", fm.flash_attn_prefill,
           q.astype(F32), k, v, registry=cpu)
    raises(TypeError, "k dtype float16 does not match q dtype bfloat16", fm.flash_attn_prefill,
           q, k.astype(F16), v, registry=cpu)
    raises(TypeError, "mask must be bfloat16 (additive) or bool, got float16", fm.flash_attn_prefill,
           q, k, v, mask=np.zeros((8, 16), F16), registry=cpu)
    raises(TypeError, "dtype int64 is not supported", fm.flash_attn_prefill,
           np.zeros((1, 4, 8, 64), np.int64), k, v, registry=cpu)
    raises(TypeError, "out dtype float16 does not match q dtype bfloat16", fm.flash_attn_prefill,
           q, k, v, out=np.zeros(q.shape, F16), registry=cpu)


def test_shapes(cpu, rng, qkv):
    q, k, v = qkv
    raises(ValueError, "q must have rank 4", fm.flash_attn_prefill, q[0], k, v, registry=cpu)
    raises(ValueError, "k must have rank 4", fm.flash_attn_prefill, q, k[0], v, registry=cpu)
    raises(ValueError, "v shape [1, 2, 15, 64] must equal k shape [1, 2, 16, 64]",
           fm.flash_attn_prefill, q, k, v[:, :, :15], registry=cpu)
    raises(ValueError, "k head_dim (128) must equal q head_dim (64)", fm.flash_attn_prefill,
           q, randn(rng, (1, 2, 16, 128), BF16), randn(rng, (1, 2, 16, 128), BF16), registry=cpu)
    raises(ValueError, "k batch (2) must equal q batch (1)", fm.flash_attn_prefill,
           q, np.concatenate([k, k]), np.concatenate([v, v]), registry=cpu)
    raises(ValueError, "the q heads (4) must be a multiple of the k heads (3)", fm.flash_attn_prefill,
           q, randn(rng, (1, 3, 16, 64), BF16), randn(rng, (1, 3, 16, 64), BF16), registry=cpu)
    raises(ValueError, "head_dim must be in 1...512, got 600", fm.flash_attn_prefill,
           randn(rng, (1, 4, 8, 600), BF16), randn(rng, (1, 2, 16, 600), BF16),
           randn(rng, (1, 2, 16, 600), BF16), registry=cpu)
    raises(ValueError, "the cache capacity must be > 0, got 0", fm.flash_attn_prefill, q, k[:, :, :0], v[:, :, :0],
           registry=cpu)
    # No query row, head or sequence: an empty result (test_reports.py).
    assert fm.flash_attn_prefill(q[:, :, :0], k, v, registry=cpu).shape == q[:, :, :0].shape
    raises(ValueError, "out shape [1, 4, 8, 32] must be [1, 4, 8, 64] (q's shape with v's head dim)",
           fm.flash_attn_prefill, q, k, v, out=np.zeros((1, 4, 8, 32), BF16), registry=cpu)


def test_masks(cpu, rng, qkv):
    q, k, v = qkv
    raises(ValueError, "mask shape [8, 15] must be [8, 16]", fm.flash_attn_prefill,
           q, k, v, mask=np.zeros((8, 15), BF16), registry=cpu)
    raises(ValueError, "mask shape [1, 2, 8, 16] must be [1, 4, 8, 16]", fm.flash_attn_prefill,
           q, k, v, mask=np.zeros((1, 2, 8, 16), BF16), registry=cpu)
    raises(ValueError, "mask must have rank 2 or 3 or 4", fm.flash_attn_prefill,
           q, k, v, mask=np.zeros((16,), BF16), registry=cpu)
    raises(ValueError, "blk requires mask", fm.flash_attn_prefill,
           q, k, v, blk=np.zeros(32, np.uint8), registry=cpu)
    raises(ValueError, "blk requires a rank-2", fm.flash_attn_prefill,
           q, k, v, mask=np.zeros((1, 4, 8, 16), BF16), blk=np.zeros(32, np.uint8), registry=cpu)
    raises(ValueError, "blk shape [0] must be [NQ, NK] = [1, 1]",
           fm.flash_attn_prefill, q, k, v, mask=np.zeros((8, 16), BF16), blk=np.zeros(0, np.uint8), registry=cpu)
    raises(TypeError, "blk must be uint8, got bool", fm.flash_attn_prefill,
           q, k, v, mask=np.zeros((8, 16), BF16), blk=np.zeros(32, bool), registry=cpu)


def test_options(cpu, rng, qkv):
    q, k, v = qkv
    raises(ValueError, "q_offset (9) + q_len (8) must be <= kv_len (16)", fm.flash_attn_prefill,
           q, k, v, q_offset=9, causal=True, registry=cpu)
    raises(ValueError, "q_offset (9) + q_len (8) must be <= kv_len (16)", fm.flash_attn_prefill,
           q, k, v, q_offset=9, window=4, registry=cpu)
    raises(ValueError, "q_offset must be >= 0, got -1", fm.flash_attn_prefill,
           q, k, v, q_offset=-1, registry=cpu)
    raises(ValueError, "kv_len (17) must be <= the cache capacity (16)", fm.flash_attn_prefill,
           q, k, v, kv_len=17, registry=cpu)
    raises(ValueError, "kv_len must be > 0, got 0", fm.flash_attn_prefill, q, k, v, kv_len=0, registry=cpu)
    raises(ValueError, "q_offset (4294967296) is out of the int32 range", fm.flash_attn_prefill,
           q, k, v, q_offset=2**32, registry=cpu)
    raises(ValueError, "scale must be finite, got nan", fm.flash_attn_prefill,
           q, k, v, scale=float("nan"), registry=cpu)
    raises(ValueError, "softcap must be 0 (off) or a finite value > 0, got -1.0", fm.flash_attn_prefill,
           q, k, v, softcap=-1.0, registry=cpu)
    raises(ValueError, "layout must be 'bhld' or 'blhd', got 'bshd'", fm.flash_attn_prefill,
           q, k, v, layout="bshd", registry=cpu)


def test_out_checks(cpu, rng, qkv):
    q, k, v = qkv
    ro = np.zeros(q.shape, BF16)
    ro.flags.writeable = False
    raises(ValueError, "out is read-only", fm.flash_attn_prefill, q, k, v, out=ro, registry=cpu)
    raises(ValueError, "out must be C-contiguous", fm.flash_attn_prefill,
           q, k, v, out=np.zeros((1, 4, 64, 8), BF16).transpose(0, 1, 3, 2), registry=cpu)
    raises(ValueError, "out and q overlap in memory; the call writes out", fm.flash_attn_prefill,
           q, k, v, out=q, registry=cpu)
    raises(TypeError, "out must be a numpy.ndarray or a torch CPU tensor, got list", fm.flash_attn_prefill,
           q, k, v, out=[0.0], registry=cpu)


def test_registry_errors():
    with pytest.raises(ValueError, match="create_registry: unknown or unavailable backend 'gpu'"):
        fm.Registry("gpu")
    with pytest.raises(TypeError, match="create_registry: backend must be a str"):
        fm.Registry(3)  # type: ignore[arg-type]
    r = fm.Registry("cpu")
    r.close()
    q = np.zeros((1, 1, 1, 64), BF16)
    with pytest.raises(ValueError, match="flash_attn_prefill: registry is closed"):
        fm.flash_attn_prefill(q, q, q, registry=r)


def test_env_override(monkeypatch):
    monkeypatch.setenv("FLASHMETAL_BACKEND", "cpu")
    assert fm.Registry("auto").backend == "cpu"
    monkeypatch.setenv("FLASHMETAL_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="'nonsense' \\(from FLASHMETAL_BACKEND for 'auto'\\)"):
        fm.Registry("auto")
