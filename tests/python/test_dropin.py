"""scaled_dot_product_attention as a drop-in for torch's (numpy side; torch's own
outputs: test_dropin_torch.py): the signature, argument types, both causal
conventions, any head dim, qL > kL, broadcast masks, and the general kernel's
extension (float16, softcap, explicit q_offset, window) on every backend."""
from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import flashmetal as fm
from conftest import SIMULATED
from flashmetal import attention, reference
from numerics import BF16, F16, F32, assert_close, qkv

SDPA = fm.scaled_dot_product_attention


def small(registry, big, little):
    """Simulated kernels cost ~11 ns per q*k*d: keep sim shapes small."""
    return little if registry.backend in SIMULATED else big


# ---- the general kernel's extension (SdpaExtParams) -------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("d", [32, 80, 96, 200])
@pytest.mark.parametrize("q_offset,causal,window,softcap", [
    (0, True, None, 0.0),      # torch's top-left causal
    (-3, True, None, 0.0),     # rows before key 0: zeros
    (None, True, 4, 0.0),      # bottom-right + window
    (2, False, 5, 0.0),        # window without causal
    (None, False, None, 2.5),  # softcap
    (1, True, 3, 1.5),         # all of them
])
def test_sdpa_extension(registry, rng, dtype, d, q_offset, causal, window, softcap):
    ql, kl = 7, 11
    q, k, v = qkv(rng, dtype, h=4, hkv=2, ql=ql, kl=kl + 3, d=d)
    out = fm.sdpa(q, k, v, causal=causal, kv_len=kl, q_offset=q_offset, window=window, softcap=softcap,
                  registry=registry)
    off = kl - ql if q_offset is None else q_offset
    exp = reference.attention(q, k[:, :, :kl], v[:, :, :kl], causal=causal, q_offset=off, window=window,
                              softcap=softcap)
    assert_close(out, exp, dtype, f"{registry.backend} {dtype} d={d}")
    if q_offset == -3:
        assert not np.any(out[:, :, :3].astype(np.float32)), "rows before key 0 must be exact zeros"


def test_sdpa_extension_with_mask(registry, rng):
    q, k, v = qkv(rng, F16, ql=5, kl=9, d=48)
    keep = rng.random((1, 1, 5, 9)) < 0.7
    m = np.where(keep, rng.uniform(-1, 1, keep.shape), -np.inf).astype(F16)
    out = fm.sdpa(q, k, v, mask=m, causal=True, q_offset=2, window=4, softcap=3.0, registry=registry)
    exp = reference.attention(q, k, v, mask=m, causal=True, q_offset=2, window=4, softcap=3.0)
    assert_close(out, exp, F16)


# ---- the signature ------------------------------------------------------------------------------

def test_torch_positional_order(registry, rng):
    """torch's positional order: (q, k, v, attn_mask, dropout_p, is_causal)."""
    q, k, v = qkv(rng, BF16)
    pos = SDPA(q, k, v, None, 0.0, True, registry=registry)
    kw = SDPA(query=q, key=k, value=v, attn_mask=None, dropout_p=0.0, is_causal=True, registry=registry)
    exp = reference.attention(q, k, v, causal=True, q_offset=0)
    assert_close(pos, exp, BF16, "positional")
    assert np.array_equal(pos.view(np.uint16), kw.view(np.uint16))


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(dropout_p=0.1), ValueError, r"dropout_p must be 0.0 .* got 0.1"),
    (dict(dropout_p="0"), TypeError, "dropout_p must be a float, got str"),
    (dict(scale=True), TypeError, "scale must be a float or None, got bool"),
    (dict(scale=float("inf")), ValueError, "scale must be finite, got inf"),
    (dict(scale=float("nan")), ValueError, "scale must be finite, got nan"),
    (dict(is_causal=1), TypeError, "is_causal must be a bool, got int"),
    (dict(enable_gqa="yes"), TypeError, "enable_gqa must be a bool, got str"),
    (dict(window=2.5), TypeError, "window must be an int or None, got float"),
    (dict(window=0), ValueError, "window must be > 0 and fit in int32, got 0"),
    (dict(window=2**31), ValueError, "window must be > 0 and fit in int32, got 2147483648"),
    (dict(window=2**70), ValueError, r"window \(1180591620717411303424\) is out of the int64 range"),
    (dict(kv_len=True), TypeError, "kv_len must be an int or None, got bool"),
    (dict(kv_len=0), ValueError, r"kv_len must be in 1..9 \(key's sequence length\), got 0"),
    (dict(kv_len=10), ValueError, r"kv_len must be in 1..9 \(key's sequence length\), got 10"),
    (dict(softcap=None), TypeError, "softcap must be a float, got NoneType"),
    (dict(softcap=-1.0), ValueError, r"softcap must be 0 \(off\) or a finite value > 0, got -1.0"),
    (dict(softcap=float("inf")), ValueError, r"softcap must be 0 \(off\) or a finite value > 0, got inf"),
    (dict(align="bottom-right"), ValueError, "align must be 'top_left' or 'bottom_right'"),
    (dict(sinks=np.zeros(3, np.float32)), ValueError, r"sinks must have shape \[2\] \(query's heads\), got \[3\]"),
])
def test_argument_errors(cpu, rng, kwargs, exc, msg):
    """Each argument's type (Python's) and value (the library's,
    fm_plan_attention) errors name the function, the argument and the value."""
    q, k, v = qkv(rng, BF16, h=2, hkv=2, ql=4, kl=9)
    with pytest.raises(exc, match="^scaled_dot_product_attention: " + msg) as e:
        SDPA(q, k, v, registry=cpu, **kwargs)
    assert e.value.argument == next(iter(kwargs)), e.value.argument


def _shapes(q, k, v):
    return (np.zeros(q, BF16), np.zeros(k, BF16), np.zeros(v, BF16))


@pytest.mark.parametrize("args,kwargs,exc,argument,msg", [
    (_shapes((1, 2, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8)) + (None,), dict(), None, None, None),
    ((np.zeros((1, 2, 3, 8), np.int32),) + _shapes((1,), (1, 2, 5, 8), (1, 2, 5, 8))[1:], dict(), TypeError,
     "query", "query dtype int32 is not supported"),
    ((np.zeros((1, 2, 3, 8), BF16), np.zeros((1, 2, 5, 8), F16), np.zeros((1, 2, 5, 8), BF16)), dict(), TypeError,
     "key", "key dtype float16 does not match query dtype bfloat16"),
    (_shapes((1, 2, 3, 8), (1, 2, 5, 8), (8,)), dict(), ValueError, "value",
     r"query, key and value must all have rank 4 \[B, H, L, D\] \(or 3: \[H, L, D\]\); value has shape \(8,\)"),
    (_shapes((8,), (8,), (8,)), dict(), ValueError, "query", r"query has shape \(8,\)"),
    (_shapes((2, 3, 8), (2, 5, 8), (2, 6, 8)), dict(), ValueError, "key",
     r"key \(1, 2, 5, 8\) must be \[B, Hkv, kL, D\] with D = 8 \(query's head dim\) and value \(1, 2, 6, 8\)"),
    (_shapes((1, 2, 3, 8), (1, 2, 5, 4), (1, 2, 5, 4)), dict(), ValueError, "key", "with D = 8"),
    (_shapes((2, 2, 3, 8), (3, 2, 5, 8), (3, 2, 5, 8)), dict(), ValueError, "key",
     r"the batch axes \(all but the last three\) of query \(2, 2, 3, 8\), key \(3, 2, 5, 8\) and value "
     r"\(3, 2, 5, 8\) do not broadcast together"),
    (_shapes((1, 4, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8)), dict(), ValueError, "enable_gqa",
     "query has 4 heads and key 2; pass enable_gqa=True"),
    (_shapes((1, 4, 3, 8), (1, 3, 5, 8), (1, 3, 5, 8)), dict(enable_gqa=True), ValueError, "key",
     r"query heads \(4\) must be a multiple of key heads \(3\)"),
    (_shapes((1, 2, 3, 8), (1, 2, 5, 8), (1, 2, 5, 0)), dict(), ValueError, "value",
     r"value shape \(1, 2, 5, 0\) has an empty head dim"),
    (_shapes((1, 2, 3, 0), (1, 2, 5, 0), (1, 2, 5, 4)), dict(), ValueError, "query",
     r"query shape \(1, 2, 3, 0\) has an empty head dim"),
])
def test_shape_errors(cpu, args, kwargs, exc, argument, msg):
    """The shapes the front door takes (the library's rule, fm_plan_attention),
    each refusal naming the argument; the first case runs."""
    if exc is None:
        assert SDPA(*args, registry=cpu, **kwargs).shape == (1, 2, 3, 8)
        return
    with pytest.raises(exc, match=msg) as e:
        SDPA(*args, registry=cpu, **kwargs)
    assert e.value.op == "scaled_dot_product_attention" and e.value.argument == argument, (e.value.op,
                                                                                            e.value.argument)


@pytest.mark.parametrize("q,k,route", [
    ((0, 2, 3, 8), (0, 2, 5, 8), "an empty batch, head or query axis"),
    ((1, 2, 0, 8), (1, 2, 5, 8), "an empty batch, head or query axis"),
    ((1, 2, 3, 8), (1, 2, 0, 8), "no keys"),
])
def test_empty_calls(cpu, q, k, route):
    """An empty axis gives an empty result and no keys zeros, as torch's,
    with no kernel run."""
    out = SDPA(np.ones(q, F32), np.ones(k, F32), np.ones(k, F32), registry=cpu)
    assert out.shape == q and not np.any(out)
    assert fm.last_route().kernel == "none" and fm.last_route().reason.startswith(route)


def test_scale_and_gqa_are_keyword_only(cpu, rng):
    q, k, v = qkv(rng, F32)
    with pytest.raises(TypeError, match="positional"):
        SDPA(q, k, v, None, 0.0, False, 0.5)


def test_gqa_needs_enable_gqa(cpu, rng):
    q, k, v = qkv(rng, F32, h=4, hkv=2)
    with pytest.raises(ValueError, match="query has 4 heads and key 2; pass enable_gqa=True"):
        SDPA(q, k, v, registry=cpu)
    out = SDPA(q, k, v, enable_gqa=True, registry=cpu)
    assert_close(out, reference.attention(q, k, v), F32)


def test_rank3_inputs(cpu, rng):
    q, k, v = qkv(rng, F16, ql=5, kl=9)
    out = SDPA(q[0], k[0], v[0], is_causal=True, registry=cpu)
    assert out.shape == q[0].shape
    assert_close(out, reference.attention(q, k, v, causal=True)[0], F16)


# ---- causal conventions, head dims, qL > kL: every route ----------------------------------------

@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("ql,kl", [(5, 12), (12, 12), (12, 5)])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("causal", [False, True])
def test_alignments(registry, rng, dtype, ql, kl, align, causal):
    q, k, v = qkv(rng, dtype, ql=ql, kl=kl)
    out = SDPA(q, k, v, is_causal=causal, align=align, registry=registry)
    off = 0 if align == "top_left" else kl - ql
    assert_close(out, reference.attention(q, k, v, causal=causal, q_offset=off), dtype,
                 f"{fm.last_route()} {align} causal={causal}")


def test_top_left_is_torch_tril(cpu, rng):
    """is_causal with qL < kL: query i sees keys 0..i only (torch's tril), not the bottom-right band."""
    q, k, v = qkv(rng, F32, ql=2, kl=6)
    out = SDPA(q, k, v, is_causal=True, registry=cpu)
    first_key_only = v[:, :, :1].astype(np.float64)
    assert_close(out[:, :, :1], first_key_only, F32, "row 0 sees key 0 only")


@pytest.mark.parametrize("d", [32, 48, 80, 96, 128, 160, 192, 256, 320, 512, 520])
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("ql", [9, 40])
def test_every_head_dim(registry, rng, d, dtype, ql):
    """Any head dim up to 512 on the tiled prefill (the next tile up, with the
    true D: no copy), above it the general kernel."""
    q, k, v = qkv(rng, dtype, h=4, hkv=2, ql=ql, kl=small(registry, 53, 41), d=d)
    out = SDPA(q, k, v, is_causal=True, enable_gqa=True, registry=registry)
    route = fm.last_route()
    assert route.kernel == ("flash_attn_prefill" if d <= 512 else "sdpa"), route
    assert out.shape == q.shape and out.flags.c_contiguous
    assert_close(out, reference.attention(q, k, v, causal=True), dtype, str(route))


def test_head_dim_on_the_wide_tile_with_mask_window_and_cache(registry, rng):
    """A head dim between 256 and 512 (the 512 tile with the true D) keeps
    every other feature: mask, window, kv_len, scale, softcap; the caches'
    rows past kv_len are never read."""
    q, k, v = qkv(rng, BF16, h=2, hkv=1, ql=36, kl=50, d=320)
    k[:, :, 44:] = np.nan
    v[:, :, 44:] = np.nan
    keep = rng.random((1, 1, 36, 44)) < 0.8
    keep[..., 0] = True
    out = SDPA(q, k, v, keep, is_causal=True, enable_gqa=True, kv_len=44, align="bottom_right", window=9,
               scale=0.2, softcap=4.0, registry=registry)
    assert fm.last_route().kernel == "flash_attn_prefill"
    exp = reference.attention(q, k[:, :, :44], v[:, :, :44], mask=keep, causal=True, q_offset=8, window=9,
                              scale=0.2, softcap=4.0)
    assert_close(out, exp, BF16)


def test_more_queries_than_keys_bf16(registry, rng):
    """Cross-attention with more query rows than keys (qL 512 over kL 257,
    smaller on the simulators) runs on the tiled prefill; with a window the
    rows' positions matter and those past the keys take sdpa."""
    ql, kl = small(registry, (512, 257), (40, 17))
    q, k, v = qkv(rng, BF16, ql=ql, kl=kl, d=64)
    out = SDPA(q, k, v, registry=registry)
    assert fm.last_route().kernel == "flash_attn_prefill"
    assert_close(out, reference.attention(q, k, v), BF16)
    out = SDPA(q, k, v, window=ql - 1, registry=registry)  # the last row's window holds the last key
    assert fm.last_route().kernel == "sdpa"
    assert f"rows with a window at positions 0..{ql - 1} outside the {kl} keys" in fm.last_route().reason
    assert_close(out, reference.attention(q, k, v, q_offset=0, window=ql - 1), BF16)


def test_explain_names_the_route_without_running(cpu, rng, monkeypatch):
    q, k, v = qkv(rng, BF16, d=600)
    with monkeypatch.context() as m:
        m.setattr(attention, "_run", lambda *a: pytest.fail("explain ran a kernel"))
        route = fm.explain(q, k, v, is_causal=True)
    assert route.kernel == "sdpa" and "head dim 600" in route.reason
    assert isinstance(route, fm.Route) and str(route).startswith("sdpa: ")
    SDPA(q, k, v, is_causal=True, registry=cpu)
    assert fm.last_route() == route
    assert fm.explain(q[:, :, :1], k, v, align="bottom_right").kernel == "sdpa"  # D=600: no decode kernel
    q64, k64, v64 = qkv(rng, BF16, ql=1)
    assert fm.explain(q64, k64, v64, is_causal=True, align="bottom_right").kernel == "flash_attn_decode"
    # top-left causal puts the one row at position 0: not the decode kernel's newest position
    assert fm.explain(q64, k64, v64, is_causal=True).kernel == "flash_attn_prefill"


# ---- masks broadcast as torch's ------------------------------------------------------------------

MASK_SHAPES = [(1, 2, 6, 20), (2, 1, 6, 20), (2, 1, 1, 20), (2, 6, 20), (6, 20), (20,), (6, 1), (1, 1, 1, 1)]


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("shape", MASK_SHAPES)
@pytest.mark.parametrize("kind", ["bool", "float32", "float64"])
def test_broadcast_masks(registry, rng, dtype, shape, kind):
    q, k, v = qkv(rng, dtype, b=2)
    keep = rng.random(shape) < 0.7
    keep[..., 0] = True
    if kind == "bool":
        m = keep
    else:
        m = np.where(keep, rng.uniform(-1, 1, shape), -np.inf).astype(kind)
    out = SDPA(q, k, v, m, registry=registry)
    exp = reference.attention(q, k, v, mask=m if kind == "bool" else m.astype(dtype))
    assert_close(out, exp, dtype, f"{fm.last_route()} mask {shape} {kind}")


def test_mask_broadcast_reads_in_place(rng):
    """No dense [B, H, qL, kL] copy: a [B, 1, qL, kL] mask of the I/O dtype is
    passed as is, and an expanded (stride-0) one collapses back to its data."""
    io = np.dtype(BF16)
    m = np.zeros((2, 1, 6, 20), io)
    op = attention._mask_operand(m, io, (2, 4, 6, 20), 20)
    assert op.shape == (2, 1, 6, 20) and np.shares_memory(op, m)
    expanded = np.broadcast_to(np.zeros((2, 1, 1, 20), bool), (2, 4, 6, 20))
    op = attention._mask_operand(expanded, io, (2, 4, 6, 20), 20)
    assert op.shape == (2, 1, 1, 20)
    key_broadcast = attention._mask_operand(np.zeros((6, 1), np.float32), io, (2, 4, 6, 20), 20)
    assert key_broadcast.shape == (1, 1, 6, 20) and key_broadcast.dtype == io


def test_hf_min_mask_saturates(registry, rng):
    """A float32 mask holding finfo(float32).min given to bfloat16 inputs: the
    conversion saturates to bfloat16's finite min (a cast would give -inf,
    i.e. 'masked'), so a row of only such keys still sees them, as torch does."""
    q, k, v = qkv(rng, BF16, ql=4, kl=16)
    m = np.zeros((4, 16), np.float32)
    m[1, :] = np.finfo(np.float32).min
    m[2, 5:] = np.finfo(np.float32).min
    out = SDPA(q, k, v, m, registry=registry)
    exp = reference.attention(q, k, v, mask=np.where(m < 0, float(ml_dtypes.finfo(BF16).min), 0.0))
    rows = [0, 2, 3]  # row 2 mixes 0 and the min bias
    assert_close(out[:, :, rows], exp[:, :, rows], BF16)
    # Row 1 sees only min-bias keys. The operand stays finite (a cast would make it -inf, "masked").
    # What the kernels then return for it differs (cpu: softmax(s), sim: zeros, reference and
    # torch: the uniform average, s lost to rounding at |c| ~ 3e38): the prefill kernels' business.
    op = attention._mask_operand(m, BF16, (1, 2, 4, 16), 16)
    assert np.isfinite(op.astype(np.float32)).all()
    assert op[0, 0, 1, 0] == ml_dtypes.finfo(BF16).min


def test_mask_over_whole_cache_with_kv_len(cpu, rng):
    q, k, v = qkv(rng, F16, ql=3, kl=20)
    m = rng.random((3, 20)) < 0.8
    m[:, 0] = True
    out = SDPA(q, k, v, m, kv_len=12, align="bottom_right", registry=cpu)
    assert_close(out, reference.attention(q, k[:, :, :12], v[:, :, :12], mask=m[:, :12]), F16)


# ---- window on the prefill route: in the kernel, no mask ------------------------------------------

@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_window_prefill_builds_no_mask(registry, rng, monkeypatch, align, causal, with_mask):
    """The window goes into the prefill kernel: no [qL, kL] mask or blk is
    built, alone or beside a caller's broadcast mask."""
    from flashmetal import blk as blk_module, mask as mask_module
    for mod, name in ((mask_module, "build_mask"), (blk_module, "build_blk")):
        monkeypatch.setattr(mod, name, lambda *a, **k: pytest.fail("a window mask was built"))
    ql, kl = small(registry, (300, 400), (40, 70))
    q, k, v = qkv(rng, BF16, h=2, hkv=1, ql=ql, kl=kl)
    keep = None
    if with_mask:
        keep = rng.random((1, 1, 1, kl)) < 0.9  # a padding mask, read in place
        keep[..., -1] = True
    out = SDPA(q, k, v, keep, is_causal=causal, window=37, align=align, enable_gqa=True, registry=registry)
    route = fm.last_route()
    assert route.kernel == "flash_attn_prefill" and "window in the kernel" in route.reason, route
    off = 0 if align == "top_left" else kl - ql
    assert_close(out, reference.attention(q, k, v, mask=keep, causal=causal, q_offset=off, window=37), BF16)


def test_numpy_only_never_imports_torch():
    code = ("import sys, numpy as np, flashmetal as fm\n"
            "q = np.ones((1, 2, 3, 64), np.float32)\n"
            "fm.scaled_dot_product_attention(q, q, q, registry=fm.Registry('cpu'))\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- info() and the demo ------------------------------------------------------------------------

def test_info_reads_the_loaded_library(registry):
    about = fm.info(registry)
    assert about["backend"] == registry.backend
    assert about["cpu_isa"] in ("portable", "avx2", "avx512", "avx512vbmi", "avx512bf16", "neon")
    assert about["library_version"] and about["threads"] >= 1
    from flashmetal import _loader, _native
    assert about["library"] == str(_loader.library_path())
    assert about["abi_version"] == _native.constant("FM_ABI_VERSION") == fm.abi_version()
    assert about["library_version"] == fm.__version__


def test_demo_warns_on_the_portable_path_and_passes():
    env = dict(os.environ, FLASHMETAL_CPU_ISA="portable", FLASHMETAL_BACKEND="cpu", FLASHMETAL_NUM_THREADS="3")
    run = subprocess.run([sys.executable, "-m", "flashmetal.demo", "--length", "64", "--kv-len", "256",
                          "--runs", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "cpu_isa           portable" in run.stdout and "threads           3" in run.stdout
    assert "WARNING: the cpu kernels run their portable C path" in run.stdout
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(("prefill", "decode"))]
    assert len(lines) == 5 and all(" PASS " in ln for ln in lines), run.stdout


class _DLPackOnly:
    """An array seen only through DLPack (as jax or cupy-on-host arrays are)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class _ArrayInterfaceOnly:
    def __init__(self, a):
        self.__array_interface__ = a.__array_interface__
        self._keep = a


def test_dlpack_and_array_interface_objects(cpu, rng):
    q, k, v = qkv(rng, F16, ql=5, kl=9)
    exp = reference.attention(q, k, v, causal=True)
    for wrap in (_DLPackOnly, _ArrayInterfaceOnly):
        out = SDPA(wrap(q), wrap(k), wrap(v), is_causal=True, registry=cpu)
        assert isinstance(out, np.ndarray)
        assert_close(out, exp, F16, wrap.__name__)
    from flashmetal import _interop
    assert np.shares_memory(_interop.to_numpy(_DLPackOnly(q), "t", "q"), q)
    with pytest.raises(TypeError, match="^scaled_dot_product_attention: query dtype object is not supported"):
        SDPA(object(), k, v, registry=cpu)
