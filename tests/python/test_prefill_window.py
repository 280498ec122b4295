"""The prefill's in-kernel sliding window
(``flash_attn_prefill(window=)``; no mask is built, key tiles outside every
row's window are skipped) and auto-blk (a caller mask without blk gets its
blk built by the library where it pays), on every backend, against the
float64 reference and bit for bit against the mask/blk paths."""
from __future__ import annotations

import numpy as np
import functools
import pytest

import flashmetal as fm
from flashmetal import reference
import numerics
from numerics import BF16, F16, assert_bits_equal, assert_close


@pytest.fixture(scope="module")
def sim():
    with fm.Registry("sim") as reg:
        yield reg


qkv = functools.partial(numerics.qkv, hkv=1, ql=40, kl=72)


@pytest.mark.parametrize("d,dtype", [(64, BF16), (192, F16), (512, BF16)])
@pytest.mark.parametrize("causal,q_offset,window,softcap", [
    (True, None, 9, 0.0),    # bottom-right causal window (a KV-cache chunk)
    (False, 0, 13, 0.0),     # top-left, window without causal: every key tile left of the window skipped
    (True, 20, 5, 3.0),      # explicit offset, softcap
])
def test_window_matches_reference(registry, rng, d, dtype, causal, q_offset, window, softcap):
    q, k, v = qkv(rng, dtype, d=d)
    out = fm.flash_attn_prefill(q, k, v, causal=causal, q_offset=q_offset, window=window, softcap=softcap,
                                registry=registry)
    off = 72 - 40 if q_offset is None else q_offset
    exp = reference.attention(q, k, v, causal=causal, q_offset=off, window=window, softcap=softcap)
    assert_close(out, exp, dtype, f"{registry.backend} D={d} window={window}")


@pytest.mark.parametrize("d", [64, 512])
@pytest.mark.parametrize("causal", [False, True])
def test_window_bit_identical_to_mask_and_blk(registry, rng, d, causal):
    """The in-kernel window, the window mask, and the mask with its blk give
    the same bits (a key tile a row cannot see leaves its state unchanged)."""
    q, k, v = qkv(rng, BF16, ql=48, kl=80, d=d)
    off = 80 - 48
    got = fm.flash_attn_prefill(q, k, v, causal=causal, q_offset=off, window=11, registry=registry)
    mask = fm.build_mask(48, 80, causal=causal, window=11, q_offset=off, registry=registry)
    masked = fm.flash_attn_prefill(q, k, v, mask=mask, causal=causal, q_offset=off, registry=registry)
    blk = fm.build_blk(mask, d, registry=registry)
    skipped = fm.flash_attn_prefill(q, k, v, mask=mask, blk=blk, causal=causal, q_offset=off, registry=registry)
    assert_bits_equal(got, masked, "window vs mask")
    assert_bits_equal(got, skipped, "window vs mask + blk")


def test_window_with_a_mask(registry, rng):
    """The window combines with a caller's broadcast mask (both apply)."""
    q, k, v = qkv(rng, F16, ql=33, kl=50, d=96)
    keep = rng.random((1, 1, 1, 50)) < 0.8
    keep[..., -1] = True
    out = fm.flash_attn_prefill(q, k, v, mask=keep, causal=True, window=7, registry=registry)
    exp = reference.attention(q, k, v, mask=keep, causal=True, q_offset=50 - 33, window=7)
    assert_close(out, exp, F16)


@pytest.mark.parametrize("d", [64, 512])
def test_window_tiles_outside_are_never_loaded(registry, rng, d):
    """Keys left of every row's window hold NaN: a kernel that loaded their
    tiles into its products would return NaN (0 * NaN), so a finite result
    equal to the reference proves they were skipped."""
    q, k, v = qkv(rng, BF16, ql=8, kl=96, d=d)
    # rows at 88..95, window 20: keys >= 69 are seen; 0..63 lie in tiles wholly outside (BK 16 and 64).
    exp = reference.attention(q, k, v, causal=True, q_offset=88, window=20)
    k[:, :, :64], v[:, :, :64] = np.nan, np.nan
    out = fm.flash_attn_prefill(q, k, v, causal=True, window=20, registry=registry)
    assert_close(out, exp, BF16, f"{registry.backend}: NaN outside the window")


@pytest.mark.parametrize("window,err,msg", [
    (0, ValueError, "flash_attn_prefill: window must be > 0, got 0"),
    (-3, ValueError, "flash_attn_prefill: window must be > 0, got -3"),
    (2.5, TypeError, "flash_attn_prefill: window must be an integer, got 2.5"),
])
def test_bad_window(cpu, rng, window, err, msg):
    q, k, v = qkv(rng, BF16)
    with pytest.raises(err) as e:
        fm.flash_attn_prefill(q, k, v, window=window, registry=cpu)
    assert str(e.value) == msg


# ---- auto-blk --------------------------------------------------------------------------------

def window_mask(ql, kl, window, dtype=BF16):
    t = kl - ql + np.arange(ql)[:, None]
    return np.where(t - np.arange(kl)[None, :] < window, 0.0, -np.inf).astype(dtype)


@pytest.mark.parametrize("shape", [(40, 96), (1, 1, 40, 96), (1, 40, 96)])
@pytest.mark.parametrize("d", [64, 512])
@pytest.mark.parametrize("kind", ["additive", "bool"])
def test_auto_blk_bit_identical_to_explicit_blk(registry, rng, shape, d, kind):
    """A mask shared by every (batch, head), without blk: the library builds
    the blk; the result is the explicit blk path's, bit for bit."""
    q, k, v = qkv(rng, BF16, b=2, ql=40, kl=96, d=d)
    mask = window_mask(40, 96, 17)
    if kind == "bool":
        mask = mask == 0
    auto = fm.flash_attn_prefill(q, k, v, mask=mask.reshape(shape), registry=registry)
    explicit = fm.flash_attn_prefill(q, k, v, mask=mask, blk=fm.build_blk(mask, d, registry=registry),
                                     registry=registry)
    assert_bits_equal(auto, explicit, f"{registry.backend} auto-blk {shape}")
    assert_close(auto, reference.attention(q, k, v, mask=mask), BF16)


def test_bool_blk_equals_additive_blk(registry, rng):
    """The blk pre-pass reads a bool mask as 0 / -inf."""
    mask = window_mask(70, 100, 23)
    mask[5:9, :] = -np.inf  # rows that see nothing
    for d in (64, 512):
        assert np.array_equal(fm.build_blk(mask == 0, d, registry=registry), fm.build_blk(mask, d, registry=registry))


def test_auto_blk_skips_masked_tiles_where_it_pays(sim, rng):
    """On the sim a key tile that is loaded and multiplied with NaN values
    turns the output NaN even where P = 0; with a blk the all -inf tiles are
    skipped. A shared additive or bool mask gets auto-blk (finite); a
    per-head mask (no single blk) and a problem of one row tile of two key
    tiles do not (NaN): the rule of PrefillDispatcher.autoBlkMinKeyTiles /
    autoBlkMinTiles."""
    q, k, v = qkv(rng, BF16, ql=40, kl=96)
    mask = window_mask(40, 96, 17)  # keys 0..40 invisible to every row: tiles 0-1 all -inf
    exp = reference.attention(q, k, v, mask=mask)
    v[:, :, :32] = np.nan

    def run(m, qq=q, kk=k, vv=v):
        return fm.flash_attn_prefill(qq, kk, vv, mask=m, registry=sim).astype(np.float32)

    assert_close(run(mask), exp, BF16, "auto-blk")
    assert_close(run(mask > -np.inf), exp, BF16, "auto-blk of a bool mask")
    assert np.isnan(run(np.broadcast_to(mask, (1, 2, 40, 96)).copy())).any(), "a per-head mask: no shared blk"
    small = window_mask(8, 32, 10)  # rows at 24..31 see keys >= 15: key tile 0 is all -inf
    assert np.isnan(run(small, q[:, :, :8].copy(), k[:, :, :32].copy(), v[:, :, :32].copy())).any(), \
        "2 tiles: no blk"
