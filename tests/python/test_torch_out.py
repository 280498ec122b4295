"""out=<torch tensor> on flash_attn_prefill, flash_attn_decode and sdpa, as on
the serving functions: the caller's tensor is filled in place and returned,
with the same dtype / shape / contiguity / overlap checks as a numpy `out`."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from conftest import BACKENDS
from flashmetal import reference
from numerics import BF16, F16, F32, assert_bits_equal, assert_close, randn

torch = pytest.importorskip("torch")


def as_torch(a):
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == BF16 else torch.from_numpy(a)


def as_np(t):
    return t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()


def cases(rng, dtype):
    """(name, call(out, registry), out shape, out torch dtype, float64 expected)."""
    b, h, hkv, ql, kl, d = 1, 4, 2, 20, 33, 64
    q, k, v = randn(rng, (b, h, ql, d), dtype), randn(rng, (b, hkv, kl, d), dtype), randn(rng, (b, hkv, kl, d), dtype)
    qd = randn(rng, (b, h, d), F32)
    tq, tk, tv = as_torch(q), as_torch(k), as_torch(v)
    tdt = {BF16: torch.bfloat16, F16: torch.float16}[dtype]
    return [
        ("flash_attn_prefill", lambda out, reg: fm.flash_attn_prefill(tq, tk, tv, causal=True, out=out, registry=reg),
         q.shape, tdt, reference.attention(q, k, v, causal=True, q_offset=kl - ql)),
        ("sdpa", lambda out, reg: fm.sdpa(tq, tk, tv, causal=True, out=out, registry=reg),
         q.shape, tdt, reference.attention(q, k, v, causal=True, q_offset=kl - ql)),
        ("flash_attn_decode", lambda out, reg: fm.flash_attn_decode(as_torch(qd), tk, tv, 29, out=out, registry=reg),
         qd.shape, torch.float32, reference.decode(qd, k, v, 29)),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_torch_out_is_filled_in_place_and_returned(rng, backend, dtype):
    reg = fm.Registry(backend)
    for name, call, shape, tdt, expected in cases(rng, dtype):
        out = torch.full(shape, float("nan"), dtype=tdt)
        res = call(out, reg)
        assert res is out, f"{name}: returns the caller's tensor"
        got = as_np(out)
        assert_close(got, expected, got.dtype, f"{backend} {name} torch out")
        assert_bits_equal(got, np.asarray(call(None, reg)), f"{name}: out= vs a fresh result")
    reg.close()


def test_torch_out_is_checked_like_numpy(rng):
    for name, call, shape, tdt, _ in cases(rng, F16):
        for bad, cls, pattern in (
                (torch.empty(shape, dtype=torch.float64), TypeError, "out dtype float64 is not supported"),
                (torch.empty(shape[:-1] + (shape[-1] + 1,), dtype=tdt), ValueError, "out shape"),
                (torch.empty(shape[:-1] + (2 * shape[-1],), dtype=tdt)[..., ::2], ValueError, "out must be C-contiguous"),
                ([0.0], TypeError, "out must be a numpy.ndarray or a torch CPU tensor, got list")):
            with pytest.raises(cls, match=f"^{name}: {pattern}"):
                call(bad, "cpu")


def test_torch_out_overlapping_an_input_is_refused(rng):
    q = as_torch(randn(rng, (1, 2, 8, 64), F16))
    before = q.clone()
    for fn in (fm.flash_attn_prefill, fm.sdpa):
        with pytest.raises(ValueError, match="out and q overlap in memory"):
            fn(q, q, q, out=q, registry="cpu")
    assert torch.equal(q, before)
