"""flash-attn 3's flash_attn_combine (a host routine): num_splits partial
attentions over disjoint key sets merged into the attention over their union,
checked against the float64 pairwise merge (reference.merge_lse) folded over
the splits, against attention computed over all the keys at once, and bad
inputs refused with exact error types."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F16, assert_close, randn

F32 = np.dtype(np.float32)


def _folded(o, lse):
    """reference.merge_lse over the splits: o [S, B, L, H, D], lse [S, B, L, H]
    -> (out [B, L, H, D], lse [B, L, H]) in float64."""
    acc_o, acc_l = np.zeros(o.shape[1:]), np.full(np.swapaxes(lse[0], -1, -2).shape, -np.inf)  # no key yet
    for s in range(o.shape[0]):
        acc_o, acc_l = reference.merge_lse(acc_o, acc_l, o[s], np.swapaxes(lse[s], -1, -2))
    return acc_o, np.swapaxes(acc_l, -1, -2)


@pytest.mark.parametrize("splits", [1, 2, 3, 17])
@pytest.mark.parametrize("out_dtype", [None, F32, F16, BF16])
def test_matches_the_pairwise_merge(rng, splits, out_dtype):
    o = rng.standard_normal((splits, 3, 5, 4, 40)).astype(F32)
    lse = (3 * rng.standard_normal((splits, 3, 5, 4))).astype(F32)
    lse[splits // 2:, :1] = -np.inf  # rows with empty splits; with one split, rows that saw nothing
    out, got_lse = fm.flash_attn_combine(o, lse, out_dtype=out_dtype)
    e_out, e_lse = _folded(o, lse)
    assert out.dtype == (F32 if out_dtype is None else out_dtype) and got_lse.dtype == F32
    assert out.shape == (3, 5, 4, 40) and got_lse.shape == (3, 5, 4)
    assert_close(out, e_out, out.dtype if out.dtype != F32 else F32, f"combine {splits} {out_dtype}")
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(e_lse))
    fin = np.isfinite(e_lse)
    np.testing.assert_allclose(got_lse[fin], e_lse[fin], rtol=1e-6, atol=1e-6)
    if splits == 1:
        assert not out[:1].any()  # every split of those rows saw no key


def test_recovers_attention_over_all_keys(rng):
    """Splitting the keys of a sequence into chunks, attending each with the
    LSE and combining gives the attention over all the keys."""
    q = randn(rng, (2, 3, 4, 64), BF16)
    k, v = randn(rng, (2, 40, 2, 64), BF16), randn(rng, (2, 40, 2, 64), BF16)
    parts = [fm.flash_attn_func(q, k[:, a:b], v[:, a:b], return_attn_probs=True, registry="cpu")
             for a, b in ((0, 7), (7, 25), (25, 40))]
    o = np.stack([np.asarray(p[0]).astype(F32) for p in parts])
    lse = np.stack([np.swapaxes(np.asarray(p[1]), 1, 2) for p in parts])  # [S, B, L, H]
    out, got_lse = fm.flash_attn_combine(o, lse, out_dtype=BF16)
    e_out, e_lse = reference.flash_attn(q, k, v)
    assert_close(out, e_out, BF16, "combine of three key chunks")
    np.testing.assert_allclose(got_lse, np.swapaxes(e_lse, 1, 2), rtol=2e-3, atol=2e-3)


def test_out_is_filled_in_place(rng):
    o = rng.standard_normal((2, 1, 3, 2, 8)).astype(F32)
    lse = rng.standard_normal((2, 1, 3, 2)).astype(F32)
    dest = np.empty((1, 3, 2, 8), F16)
    got, _ = fm.flash_attn_combine(o, lse, out=dest, out_dtype=np.float16)
    assert got is dest
    np.testing.assert_array_equal(dest, fm.flash_attn_combine(o, lse, out_dtype=np.float16)[0])


def test_torch_in_torch_out(rng):
    torch = pytest.importorskip("torch")
    o = torch.randn(3, 2, 4, 2, 16)
    lse = torch.randn(3, 2, 4, 2)
    out, lse_out = fm.flash_attn_combine(o, lse, out_dtype=torch.bfloat16)
    assert isinstance(out, torch.Tensor) and isinstance(lse_out, torch.Tensor)
    e_out, _ = _folded(o.numpy(), lse.numpy())
    assert_close(out.float().numpy().astype(np.float64), e_out, np.dtype(ml_dtypes.bfloat16), "torch combine")


@pytest.mark.parametrize("args,exc,argument,text", [
    (dict(out_partial=np.zeros((2, 3, 8), F16)), fm.InvalidTypeError, "out_partial", "out_partial must be float32"),
    (dict(lse_partial=np.zeros((2, 3), np.float64)), fm.InvalidTypeError, "lse_partial", "lse_partial must be float32"),
    (dict(lse_partial=np.zeros((2, 4), F32)), fm.InvalidValueError, "lse_partial", "must be [2, 3]"),
    (dict(out_partial=np.zeros((0, 3, 8), F32), lse_partial=np.zeros((0, 3), F32)), fm.InvalidValueError,
     "out_partial", "num_splits >= 1"),
    (dict(out_partial=np.zeros((2,), F32), lse_partial=np.zeros((), F32)), fm.InvalidValueError, "out_partial",
     "num_splits >= 1"),
    (dict(out_dtype=np.int32), fm.InvalidTypeError, "out_dtype", "out_dtype must be float32, float16 or bfloat16"),
    (dict(out=np.zeros((3, 8), F16)), fm.InvalidTypeError, None, "out dtype float16 must be float32"),
    (dict(out=np.zeros((3, 9), F32)), fm.InvalidValueError, None, "out shape (3, 9) must be (3, 8)"),
])
def test_bad_inputs(args, exc, argument, text):
    kw = dict(out_partial=np.zeros((2, 3, 8), F32), lse_partial=np.zeros((2, 3), F32))
    kw.update(args)
    with pytest.raises(exc) as e:
        fm.flash_attn_combine(**kw)
    assert "flash_attn_combine" in str(e.value) and text in str(e.value), str(e.value)
    if argument:
        assert e.value.argument == argument
