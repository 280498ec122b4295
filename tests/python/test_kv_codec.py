"""The quantized-KV codec (KVCodec / QuantizedKV) on every backend, against
the float64 reference written from the math (flashmetal.quant_reference):
codes, norms, packing and dequantize; cpu and sim bit-identical; quality on
N(0, 1) rows against each width's Lloyd–Max distortion; the embedded tables
are the generator's output; bad arguments name the function and argument."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import flashmetal as fm
import head_dim_tables
from conftest import BACKENDS
from flashmetal import _lloyd_max, quant_reference as qr
from numerics import BF16, F16, F32, assert_bits_equal

WIDTHS = (2, 3, 4, 5, 6, 8)
HEAD_DIMS = head_dim_tables.CODEC
DTYPES = (F32, F16, BF16)
TABLES = Path(__file__).resolve().parents[2] / "Resources" / "shaders" / "kv_codec_tables.h"
# Where the float32 kernels and the float64 reference may pick different
# neighbours: u within this distance of a boundary.
NEAR_BOUNDARY = 1e-6


def rows(rng, shape, dtype, scale=1.0):
    """Gaussian rows with a few outlier coordinates, rounded to dtype."""
    x = rng.standard_normal(shape) * scale
    x[..., 3] *= 8.0
    return x.astype(np.float32).astype(dtype)


def near_boundary(u, bits):
    b = _lloyd_max.design(bits)[1]
    i = np.clip(np.searchsorted(b, u), 1, b.size - 1)
    return np.minimum(np.abs(u - b[i - 1]), np.abs(u - b[i])) < NEAR_BOUNDARY


# ---- the Lloyd–Max design and its embedded tables --------------------------

def test_tables_header_is_the_generators_output():
    """Resources/shaders/kv_codec_tables.h is what `python -m
    flashmetal._lloyd_max` writes (regenerate it with that command)."""
    assert TABLES.read_text() == _lloyd_max.render_header()


@pytest.mark.parametrize("bits", _lloyd_max.WIDTHS)
def test_float32_tables_mirror_exactly(bits):
    """Every embedded table is its negated reverse in float32 (c[L-1-x] =
    -c[x]): the AVX-512 8-bit lookup reads only the upper half and negates."""
    c = _lloyd_max.design(bits)[0].astype(np.float32)
    assert np.array_equal(c[::-1], -c)


@pytest.mark.parametrize("bits,expected", [(2, 0.1175), (3, 0.0345), (4, 0.0095)])
def test_lloyd_max_distortion_is_the_known_value(bits, expected):
    assert round(_lloyd_max.design(bits)[2], 4) == expected


def test_lloyd_max_two_bit_centroids_are_max_1960():
    c, b, _ = _lloyd_max.design(2)
    np.testing.assert_allclose(c, [-1.5104, -0.4528, 0.4528, 1.5104], atol=1e-4)
    np.testing.assert_array_equal(b[1], 0.0)


@pytest.mark.parametrize("bits", WIDTHS)
def test_lloyd_max_design_is_a_fixed_point_and_its_distortion_integrates(bits):
    """Every centroid is its cell's conditional mean and the distortion is the
    integral of (x - Q(x))^2 phi, both by numerical integration."""
    c, b, dist = _lloyd_max.design(bits)
    assert np.all(np.diff(c) > 0) and np.array_equal(c, -c[::-1])
    np.testing.assert_array_equal(b, 0.5 * (c[:-1] + c[1:]))
    # 64-point Gauss–Legendre on every cell (the tails cut at ±12).
    t, wt = np.polynomial.legendre.leggauss(64)
    ends = np.concatenate([[-12.0], b, [12.0]])
    lo, hi = ends[:-1, None], ends[1:, None]
    x = 0.5 * (hi - lo) * t + 0.5 * (hi + lo)
    w = 0.5 * (hi - lo) * wt * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    assert np.sum((x - c[:, None]) ** 2 * w) == pytest.approx(dist, rel=1e-9)
    np.testing.assert_allclose(np.sum(x * w, 1) / np.sum(w, 1), c, rtol=1e-9)


def test_signs_are_splitmix64():
    """The first outputs of splitmix64 from state 0 (the published sequence)."""
    assert qr.splitmix64(0, 3) == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    np.testing.assert_array_equal(qr.signs(0, 3), [-1.0, 1.0, 1.0])


# ---- encode and dequantize against the reference ---------------------------

@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_matches_reference(registry, rng, dtype, d, bits):
    codec = fm.KVCodec(d, bits, seed=12345)
    x = rows(rng, (2, 3, 2, d), dtype)
    x0 = x.copy()
    q = codec.encode(x, registry=registry)
    assert q.shape == (2, 3, 2) and q.codes.shape == (2, 3, 2, codec.row_bytes)
    assert q.norms.shape == (2, 3, 2, d // qr.BLOCKS[d]) and q.norms.dtype == np.float32
    assert_bits_equal(x, x0, "x is not changed")
    codes, norms, u = qr.encode(x.astype(np.float64), bits, 12345)
    np.testing.assert_allclose(q.norms, norms, rtol=1e-6, atol=0)
    got = qr.unpack(q.codes, bits, d)
    near = near_boundary(u, bits)
    bad = (got != codes) & ~near
    assert not bad.any(), f"{registry.backend}: {int(bad.sum())} codes differ away from a boundary"
    assert near.mean() < 1e-2  # the exemption stays rare
    # The packing is the documented one, padding zeros included.
    np.testing.assert_array_equal(q.codes, qr.pack(got, bits))


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_dequantize_matches_reference(registry, rng, d, bits):
    codec = fm.KVCodec(d, bits, seed=7)
    q = codec.encode(rows(rng, (5, 3, d), F32, scale=3.0), registry=registry)
    codes0, norms0 = q.codes.copy(), q.norms.copy()
    xhat = q.dequantize(registry=registry)
    assert xhat.shape == (5, 3, d) and xhat.dtype == np.float32
    expected = qr.decode(qr.unpack(q.codes, bits, d), q.norms, bits, 7)
    scale = np.sqrt(np.mean(expected ** 2))
    np.testing.assert_allclose(xhat, expected, rtol=1e-5, atol=1e-6 * scale)
    assert_bits_equal(q.codes, codes0, "codes are not changed")
    assert_bits_equal(q.norms, norms0, "norms are not changed")


def test_dequantize_into_out(registry, rng):
    codec = fm.KVCodec(128, 4)
    q = codec.encode(rows(rng, (4, 128), F32), registry=registry)
    out = np.full((4, 128), np.nan, np.float32)
    assert q.dequantize(out=out, registry=registry) is out
    assert_bits_equal(out, q.dequantize(registry=registry), "out= gives the same bits")


def test_special_rows(registry):
    """A zero row: norm 0, every code the tie at 0 (the lower middle centroid),
    zeros back. A row holding inf or NaN dequantizes to non-finite values only
    in its own blocks."""
    codec = fm.KVCodec(80, 4, seed=3)
    x = np.zeros((3, 80), np.float32)
    x[1, 20] = np.inf
    x[2, 70] = np.nan
    x[1:, :16] = 1.0
    q = codec.encode(x, registry=registry)
    codes = qr.unpack(q.codes, 4, 80)
    assert np.all(q.norms[0] == 0) and np.all(codes[0] == 7)
    xhat = q.dequantize(registry=registry)
    assert np.array_equal(xhat[0], np.zeros(80))  # zeros of either sign
    assert np.all(np.isfinite(xhat[1:, :16]))
    assert not np.any(np.isfinite(xhat[1, 16:32])) and not np.any(np.isfinite(xhat[2, 64:80]))


def test_empty_rows_and_storage(registry):
    codec = fm.KVCodec(96, 3, seed=1)
    q = codec.encode(np.zeros((0, 4, 96), BF16), registry=registry)
    assert q.shape == (0, 4) and q.dequantize(registry=registry).shape == (0, 4, 96)
    cache = codec.empty((2, 16, 4))
    assert cache.shape == (2, 16, 4) and cache.codes.shape == (2, 16, 4, 48) and cache.norms.shape == (2, 16, 4, 3)
    assert cache.nbytes == 2 * 16 * 4 * codec.bytes_per_row()
    assert np.array_equal(cache.dequantize(registry=registry), np.zeros((2, 16, 4, 96)))
    paged = codec.empty([5, 8, 2])
    assert paged.shape == (5, 8, 2)


@pytest.mark.parametrize("d,bits,row_bytes,num_blocks", [
    (64, 2, 16, 1), (80, 3, 32, 5), (80, 4, 48, 5), (96, 5, 64, 3), (128, 3, 48, 1), (128, 4, 64, 1),
    (192, 6, 144, 3), (256, 8, 256, 1), (512, 5, 320, 1)])
def test_layout(d, bits, row_bytes, num_blocks):
    codec = fm.KVCodec(d, bits)
    assert (codec.row_bytes, codec.num_blocks, codec.block) == (row_bytes, num_blocks, d // num_blocks)
    assert row_bytes == qr.row_bytes(d, bits)


@pytest.mark.skipif(not {"cpu", "sim"} <= set(BACKENDS), reason="needs the cpu and sim backends")
@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_cpu_and_sim_are_bit_identical(rng, d, bits):
    codec = fm.KVCodec(d, bits, seed=2**64 - 1)
    x = rows(rng, (3, 2, d), F32, scale=1e-3)
    x[0, 0] = 0.0
    x[1, 1] *= 1e30
    x[2, 0] = rng.integers(-3, 4, size=d)  # small integers: exact sums, u on or near boundaries
    cpu, sim = codec.encode(x, registry="cpu"), codec.encode(x, registry="sim")
    assert_bits_equal(cpu.codes, sim.codes, f"codes D={d} bits={bits}")
    assert_bits_equal(cpu.norms, sim.norms, f"norms D={d} bits={bits}")
    assert_bits_equal(cpu.dequantize(registry="cpu"), cpu.dequantize(registry="sim"), f"dequantize D={d} bits={bits}")


@pytest.mark.parametrize("bits", WIDTHS)
def test_quality_on_gaussian_rows(registry, rng, bits):
    """Mean ||x - x̂||² / ||x||² over N(0, 1) rows at D = 128 is the width's
    Lloyd–Max distortion within 1.15x either way."""
    x = rng.standard_normal((1024, 128)).astype(np.float32)
    xhat = fm.KVCodec(128, bits, seed=99).encode(x, registry=registry).dequantize(registry=registry)
    ratio = float(np.mean(np.sum((x - xhat) ** 2, -1) / np.sum(x * x, -1))) / _lloyd_max.design(bits)[2]
    assert 1 / 1.15 <= ratio <= 1.15, f"{registry.backend} {bits} bits: {ratio:.3f}x the Lloyd–Max distortion"


def test_pickle_round_trip(rng):
    import pickle
    q = fm.KVCodec(192, 6, seed=2**63 + 5).encode(rows(rng, (3, 192), F32), registry="cpu")
    back = pickle.loads(pickle.dumps(q))
    assert back.codec == q.codec and back.codec.row_bytes == q.codec.row_bytes
    assert_bits_equal(back.dequantize(registry="cpu"), q.dequantize(registry="cpu"), "pickled cache")


def test_seed_changes_the_rotation(registry, rng):
    x = rows(rng, (8, 128), F32)
    a = fm.KVCodec(128, 4, seed=0).encode(x, registry=registry)
    b = fm.KVCodec(128, 4, seed=1).encode(x, registry=registry)
    assert not np.array_equal(a.codes, b.codes)
    np.testing.assert_allclose(a.norms, b.norms, rtol=1e-6)


# ---- errors -----------------------------------------------------------------

@pytest.mark.parametrize("args,kwargs,exc,words", [
    ((100, 4), {}, fm.InvalidValueError, ("head_dim", "100")),
    ((32, 4), {}, fm.InvalidValueError, ("head_dim", "32")),
    ((128, 7), {}, fm.InvalidValueError, ("bits", "7")),
    ((128, 1), {}, fm.InvalidValueError, ("bits", "1")),
    ((128, 4.0), {}, fm.InvalidTypeError, ("bits", "4.0")),
    ((128.0, 4), {}, fm.InvalidTypeError, ("head_dim",)),
    ((128, 4), {"seed": -1}, fm.InvalidValueError, ("seed", "-1")),
    ((128, 4), {"seed": 2**64}, fm.InvalidValueError, ("seed",)),
    ((128, 4), {"seed": 1.5}, fm.InvalidTypeError, ("seed",)),
])
def test_bad_codec(args, kwargs, exc, words):
    with pytest.raises(exc) as e:
        fm.KVCodec(*args, **kwargs)
    assert e.value.op == "KVCodec" and str(e.value).startswith("KVCodec: ")
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("x,exc,words", [
    (np.zeros((2, 128), np.int32), fm.InvalidTypeError, ("x", "int32")),
    (np.zeros((2, 128), np.uint8), fm.InvalidTypeError, ("x", "uint8")),
    (np.zeros((2, 64), np.float32), fm.InvalidValueError, ("x", "128")),
    (np.float32(1.0), fm.InvalidValueError, ("x",)),
])
def test_bad_encode_input(registry, x, exc, words):
    with pytest.raises(exc) as e:
        fm.KVCodec(128, 4).encode(x, registry=registry)
    assert e.value.op == "KVCodec.encode"
    for w in words:
        assert w in str(e.value)


def test_bad_dequantize_storage(registry):
    codec = fm.KVCodec(128, 4)
    good = codec.empty((3,))
    with pytest.raises(fm.InvalidValueError, match="out shape"):
        good.dequantize(out=np.empty((3, 64), np.float32), registry=registry)


@pytest.mark.parametrize("codes, norms, exc, arg, words", [
    ("short", None, fm.InvalidValueError, "codes", ("row_bytes 64", "[3, 32]")),
    (None, "lead", fm.InvalidValueError, "norms", ("[2, 1]", "[3, 1]")),
    (None, "blocks", fm.InvalidValueError, "norms", ("num_blocks 1",)),
    ("f32", None, fm.InvalidTypeError, "codes", ("float32", "uint8")),
    ("i32", None, fm.InvalidTypeError, "codes", ("int32", "uint8")),
    (None, "f16", fm.InvalidTypeError, "norms", ("float16", "float32")),
    (None, "f64", fm.InvalidTypeError, "norms", ("float64", "float32")),
    ("list", None, fm.InvalidTypeError, "codes", ("array", "list")),
])
def test_quantized_kv_refuses_storage_that_does_not_fit_its_codec(codes, norms, exc, arg, words):
    """QuantizedKV checks its storage when it is made (codes uint8 [*shape,
    row_bytes], norms float32 [*shape, num_blocks]), so no later call reads
    mismatched arrays."""
    codec = fm.KVCodec(128, 4)
    good = codec.empty((3,))
    c = {None: good.codes, "short": good.codes[:, :32], "f32": good.codes.astype(np.float32),
         "i32": good.codes.astype(np.int32), "list": good.codes.tolist()}[codes]
    n = {None: good.norms, "lead": good.norms[:2], "blocks": np.zeros((3, 2), np.float32),
         "f16": good.norms.astype(np.float16), "f64": good.norms.astype(np.float64)}[norms]
    with pytest.raises(exc) as e:
        fm.QuantizedKV(codec, c, n)
    assert e.value.op == "QuantizedKV" and e.value.argument == arg, (e.value.op, e.value.argument)
    for w in words:
        assert w in str(e.value), str(e.value)
    with pytest.raises(fm.InvalidTypeError, match="QuantizedKV: codec"):
        fm.QuantizedKV("codec", good.codes, good.norms)


def test_quantized_kv_over_torch_storage_reads_it_in_place(registry):
    torch = pytest.importorskip("torch")
    codec = fm.KVCodec(64, 4)
    x = np.random.default_rng(5).standard_normal((4, 64)).astype(np.float32)
    enc = codec.encode(x, registry=registry)
    t = fm.QuantizedKV(codec, torch.from_numpy(enc.codes), torch.from_numpy(enc.norms))
    assert np.array_equal(t.dequantize(registry=registry), enc.dequantize(registry=registry))
    with pytest.raises(fm.InvalidTypeError, match="codes dtype int16 must be uint8"):
        fm.QuantizedKV(codec, torch.zeros((4, codec.row_bytes), dtype=torch.int16), torch.from_numpy(enc.norms))
