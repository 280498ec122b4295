"""One semantics across ops, typed errors with their fields, argument checks,
the ABI version check and the typed facade."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import _loader, _native, reference
from flashmetal._arrays import tensor
from numerics import BF16, F16, F32, assert_close, randn
from cabi import err_text


def test_error_hierarchy_carries_op_and_status(cpu):
    lib = _native.lib()
    q = np.zeros((1, 1, 1, 600), BF16)
    with pytest.raises(fm.Error) as e:
        fm.flash_attn_prefill(q, q, q, registry=cpu)
    assert isinstance(e.value, ValueError) and isinstance(e.value, fm.InvalidValueError)
    assert e.value.op == "flash_attn_prefill" and e.value.status == lib.FM_ERROR_VALUE
    with pytest.raises(TypeError) as e:
        fm.flash_attn_prefill(q.astype(F32), q, q, registry=cpu)
    assert isinstance(e.value, fm.InvalidTypeError) and e.value.status == lib.FM_ERROR_TYPE
    assert issubclass(fm.BackendError, fm.Error) and issubclass(fm.BackendError, RuntimeError)
    assert issubclass(fm.InternalError, RuntimeError)


def test_errors_carry_the_argument_from_the_library(cpu):
    """The library's error fields reach the exception as they are: the
    argument is the public function's parameter name."""
    q = np.zeros((1, 1, 1, 600), BF16)
    with pytest.raises(fm.InvalidValueError) as e:
        fm.flash_attn_prefill(q, q, q, registry=cpu)
    assert e.value.argument == "q" and "head_dim" in str(e.value)
    k = np.zeros((2, 8, 64), F32)
    with pytest.raises(ValueError) as e:
        fm.flash_attn_decode(np.zeros((4, 64), F32), k, k, kv_len=9, registry=cpu)
    assert e.value.argument == "kv_len"
    kc = np.zeros((1, 32, 2, 64), BF16)
    with pytest.raises(fm.InvalidValueError) as e:
        fm.flash_attn_with_kvcache(np.zeros((1, 1, 3, 64), BF16), kc, kc, cache_seqlens=5, registry=cpu)
    assert e.value.op == "flash_attn_with_kvcache" and e.value.argument == "q"
    assert "must be a multiple of the k_cache heads" in str(e.value)


def test_an_inner_public_function_names_the_outer_one(cpu):
    """A public function run by another (the front door runs prefill,
    decode or sdpa) names the outer one in every error, library or Python."""
    q = np.zeros((1, 1, 1, 600), BF16)
    with _native.running("scaled_dot_product_attention"):
        with pytest.raises(fm.InvalidValueError) as e:
            fm.flash_attn_prefill(q, q, q, registry=cpu)
        assert e.value.op == "scaled_dot_product_attention"
        with pytest.raises(fm.InvalidValueError) as e:
            fm.sdpa(q, q, q, window=0, registry=cpu)
        assert e.value.op == "scaled_dot_product_attention" and e.value.argument == "window"
    with pytest.raises(fm.InvalidValueError) as e:
        fm.flash_attn_prefill(q, q, q, registry=cpu)
    assert e.value.op == "flash_attn_prefill"


def test_messages_name_the_public_function_and_kv_len(cpu):
    q = np.zeros((4, 64), F32)
    k = np.zeros((2, 8, 64), F32)
    with pytest.raises(ValueError) as e:
        fm.flash_attn_decode(q, k, k, kv_len=9, registry=cpu)
    assert str(e.value) == "flash_attn_decode: kv_len (9) must be <= the cache capacity (8)"
    with pytest.raises(ValueError, match=r"^sdpa: kv_len \(9\) must be <= the cache capacity \(8\)$"):
        fm.sdpa(np.zeros((1, 1, 2, 8), F32), np.zeros((1, 1, 8, 8), F32), np.zeros((1, 1, 8, 8), F32), kv_len=9,
                registry=cpu)


@pytest.mark.parametrize("fn,arg,value", [
    ("prefill", "q_offset", 7.9), ("prefill", "kv_len", 15.5), ("decode", "kv_len", 15.5),
    ("decode", "window", 2.5), ("mask", "q_offset", 7.9), ("mask", "kv_len", 15.5), ("mask", "window", 2.5),
])
def test_fractional_integers_are_type_errors(cpu, fn, arg, value):
    q4 = np.zeros((1, 2, 8, 64), BF16)
    k4 = np.zeros((1, 2, 16, 64), BF16)
    calls = {
        "prefill": (lambda **kw: fm.flash_attn_prefill(q4, k4, k4, registry=cpu, **kw), "flash_attn_prefill"),
        "decode": (lambda **kw: fm.flash_attn_decode(np.zeros((2, 64), F32), np.zeros((2, 16, 64), F32),
                                                     np.zeros((2, 16, 64), F32), kw.pop("kv_len", 16),
                                                     registry=cpu, **kw), "flash_attn_decode"),
        "mask": (lambda **kw: fm.build_mask(8, kw.pop("kv_len", 16), registry=cpu, **kw), "build_mask"),
    }
    call, op = calls[fn]
    with pytest.raises(fm.InvalidTypeError, match=rf"^{op}: {arg} must be an integer, got {value}$"):
        call(**{arg: value})


@pytest.mark.parametrize("arg,value,what", [
    ("scale", 1e-50, "rounds to 0 in float32"), ("softcap", 1e-50, "rounds to 0 in float32"),
    ("scale", 1e50, "overflows float32"), ("softcap", 1e300, "overflows float32"),
])
def test_floats_float32_cannot_hold_are_errors(cpu, arg, value, what):
    q = np.zeros((1, 2, 8, 64), BF16)
    with pytest.raises(fm.InvalidValueError, match="^" + re.escape(f"flash_attn_prefill: {arg} ({value!r}) {what}") + "$"):
        fm.flash_attn_prefill(q, q, q, registry=cpu, **{arg: value})
    with pytest.raises(fm.InvalidValueError, match="^" + re.escape(f"flash_attn_decode: {arg} ({value!r}) {what}") + "$"):
        fm.flash_attn_decode(np.zeros((2, 64), F32), np.zeros((2, 4, 64), F32), np.zeros((2, 4, 64), F32), 4,
                             registry=cpu, **{arg: value})


def test_scale_true_is_a_type_error(cpu):
    q = np.zeros((1, 1, 4, 8), F32)
    with pytest.raises(fm.InvalidTypeError, match="^sdpa: scale must be a real number, got True$"):
        fm.sdpa(q, q, q, scale=True, registry=cpu)


def test_registry_accepts_a_backend_name(rng):
    q = randn(rng, (1, 2, 4, 16), F32)
    by_name = fm.sdpa(q, q, q, registry="cpu")
    assert np.array_equal(by_name, fm.sdpa(q, q, q, registry=fm.default_registry("cpu")))
    with pytest.raises(fm.InvalidTypeError, match="^sdpa: registry must be a Registry or a backend name, got int$"):
        fm.sdpa(q, q, q, registry=3)
    with pytest.raises(ValueError, match="create_registry: unknown or unavailable backend 'gpu'"):
        fm.sdpa(q, q, q, registry="gpu")


def test_one_causal_convention(registry, rng):
    """qL < kL: flash_attn_prefill (default q_offset), sdpa and build_mask all
    put the queries bottom-right, and none is causal unless asked."""
    q = randn(rng, (1, 2, 8, 64), BF16)
    k = randn(rng, (1, 2, 24, 64), BF16)
    v = randn(rng, (1, 2, 24, 64), BF16)
    exp = reference.attention(q, k, v, causal=True, q_offset=16)
    assert_close(fm.flash_attn_prefill(q, k, v, causal=True, registry=registry), exp, BF16, "prefill")
    assert_close(fm.sdpa(q, k, v, causal=True, registry=registry), exp, BF16, "sdpa")
    full = reference.attention(q, k, v, causal=False)
    assert_close(fm.flash_attn_prefill(q, k, v, registry=registry), full, BF16, "prefill default")
    assert_close(fm.sdpa(q, k, v, registry=registry), full, BF16, "sdpa default")
    top_left = reference.attention(q, k, v, causal=True, q_offset=0)
    assert_close(fm.flash_attn_prefill(q, k, v, causal=True, q_offset=0, registry=registry), top_left, BF16, "tl")
    m = fm.build_mask(8, 24, causal=True, registry=registry)  # bottom-right by default too
    assert np.array_equal(m.astype(np.float64), reference.mask_additive(8, 24, causal=True, q_offset=16))


def test_abi_version_and_status_strings():
    ffi, lib = _native.ffi(), _native.lib()
    assert fm.abi_version() == lib.FM_ABI_VERSION == lib.fm_abi_version()
    assert ffi.string(lib.fm_status_string(lib.FM_ERROR_TYPE)) == b"FM_ERROR_TYPE"
    assert ffi.string(lib.fm_status_string(lib.FM_ERROR_INTERRUPTED)) == b"FM_ERROR_INTERRUPTED"
    assert ffi.string(lib.fm_status_string(lib.FM_ERROR_UNSUPPORTED)) == b"FM_ERROR_UNSUPPORTED"
    assert ffi.string(lib.fm_status_string(12345)) == b"unknown status"
    assert fm.__version__ == ffi.string(lib.fm_version()).decode()


def test_loader_refuses_a_header_of_another_abi(tmp_path: Path):
    text = _loader.header_path().read_text()
    assert "enum { FM_ABI_VERSION = " in text
    bad = tmp_path / "flashmetal.h"
    bad.write_text(text.replace("enum { FM_ABI_VERSION = ", "enum { FM_ABI_VERSION = 9000 + "))
    env = dict(os.environ, FLASHMETAL_HEADER=str(bad))
    r = subprocess.run([sys.executable, "-c", "import flashmetal; flashmetal.Registry('cpu')"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "implements ABI version" in r.stderr and "rebuild" in r.stderr, r.stderr


def test_supported_head_dims_come_from_the_library():
    assert fm.supported_head_dims("flash_attn_prefill") == (64, 80, 96, 128, 192, 256, 512)
    assert fm.supported_head_dims("flash_attn_prefill_f32") == (64, 80, 96, 128, 192, 256, 512)
    assert fm.supported_head_dims("flash_attn_decode") == (64, 80, 96, 128, 192, 256, 512, 576)
    assert fm.supported_head_dims("flash_attn_vec") == fm.supported_head_dims("flash_attn_decode")  # alias
    assert fm.supported_head_dims("kv_codec") == (64, 80, 96, 128, 192, 256, 512)
    assert _native.max_head_dim("flash_attn_decode") == _native.max_head_dim("flash_attn_vec") == 576
    with pytest.raises(ValueError, match="supported_head_dims: op must be 'flash_attn_prefill', "
                                         "'flash_attn_prefill_f32', 'flash_attn_decode' .* or 'kv_codec'"):
        fm.supported_head_dims("nope")


@pytest.mark.parametrize("op,d,dv,runs", [
    ("flash_attn_prefill", 192, 128, True), ("flash_attn_prefill", 40, 59, True),
    ("flash_attn_prefill", 576, 512, True), ("flash_attn_prefill", 576, 576, False),
    ("flash_attn_prefill", 512, 128, True), ("flash_attn_prefill", 576, 500, False),
    ("flash_attn_prefill", 600, 128, False), ("flash_attn_prefill", 300, 300, True),
    ("flash_attn_prefill", 512, 512, True), ("flash_attn_prefill", 0, 64, False),
    ("flash_attn_prefill_f32", 576, 512, False), ("flash_attn_prefill_f32", 192, 128, True),
    ("flash_attn_decode", 576, 512, True), ("flash_attn_vec", 64, 600, False), ("flash_attn_decode", 512, 64, True),
])
def test_runs_head_dims_comes_from_the_library(op, d, dv, runs):
    """fm_runs_head_dims answers by the rules the dispatchers validate (the
    front door routes value head dims of their own by it)."""
    assert _native.runs_head_dims(op, d, dv) is runs


def test_runs_head_dims_errors_name_the_query():
    ffi, err = _native.ffi(), _native.ffi().new("FMError *")
    out = ffi.new("int32_t *")
    assert _native.lib().fm_runs_head_dims(b"nope", 64, 64, out, err) == _native.lib().FM_ERROR_VALUE
    assert err_text(err).startswith(b"runs_head_dims: op must be 'flash_attn_prefill'")
    assert _native.lib().fm_runs_head_dims(b"flash_attn_prefill", 64, 64, ffi.NULL, err) == _native.lib().FM_ERROR_VALUE
    assert err_text(err) == b"runs_head_dims: out is null"


def test_no_op_is_causal_unless_asked(registry):
    """One default for causal across the ops: off. build_mask gives an
    all-zero mask, decode sees every key either way."""
    assert np.array_equal(fm.build_mask(4, 6, registry=registry).astype(np.float64), np.zeros((4, 6)))
    rng = np.random.default_rng(3)
    q, k = randn(rng, (2, 64), F32), randn(rng, (1, 16, 64), F32)
    a = fm.flash_attn_decode(q, k, k, kv_len=16, registry=registry)
    b = fm.flash_attn_decode(q, k, k, kv_len=16, causal=True, registry=registry)
    assert_close(a, reference.attention(q[None, :, None], k[None], k[None])[0, :, 0], F32, "decode default")
    assert np.array_equal(a, b)


def test_max_head_dim_comes_from_the_library():
    """fm_max_head_dim: the sdpa limit (SdpaCapability.maxHeadDim) and the
    largest listed head dim of the other ops; the front door asks the library
    rather than keeping its own copy: its router (fm_route_attention) refuses
    a head dim above it."""
    assert _native.max_head_dim("sdpa") == 65536
    for op in ("flash_attn_prefill", "flash_attn_vec"):
        assert _native.max_head_dim(op) == max(fm.supported_head_dims(op))
    with pytest.raises(ValueError, match="^max_head_dim: op must be .*got 'nope'"):
        _native.max_head_dim("nope")
    ffi, err = _native.ffi(), _native.ffi().new("FMError *")
    assert _native.lib().fm_max_head_dim(b"sdpa", ffi.NULL, err) == _native.lib().FM_ERROR_VALUE
    assert err_text(err) == b"max_head_dim: out is null"
    q = np.zeros((1, 1, 2, 65537), np.float32)
    with pytest.raises(ValueError, match="^scaled_dot_product_attention: head dim 65537 is above 65536"):
        fm.scaled_dot_product_attention(q, q, q, registry="cpu")


def test_package_is_typed_and_acyclic():
    pkg = Path(fm.__file__).parent
    assert (pkg / "py.typed").is_file()
    # registry.py imports no op module: no cycle through it.
    src = (pkg / "registry.py").read_text()
    for mod in ("prefill", "decode", "sdpa", "mask", "blk", "attention"):
        assert f"from .{mod} import" not in src and f"from . import {mod}" not in src
    for mod in ("prefill", "decode", "sdpa", "mask", "blk"):
        assert "._ffi" not in (pkg / f"{mod}.py").read_text() and "._lib" not in (pkg / f"{mod}.py").read_text()


def test_pyproject_version_is_the_headers():
    """The package version is dynamic: python/setup.py reads FM_VERSION of the header."""
    import subprocess
    import sys
    pydir = Path(__file__).resolve().parents[2] / "python"
    assert re.search(r'^dynamic\s*=\s*\["version"\]', (pydir / "pyproject.toml").read_text(), re.M)
    out = subprocess.run([sys.executable, "setup.py", "--version"], cwd=pydir, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out and out[-1] == fm.__version__, f"setup.py {out} != FM_VERSION {fm.__version__}"


def test_route_attention_is_the_front_doors_rule():
    """fm_route_attention (the C ABI's router) gives the route explain()
    reports, refuses sinks no kernel can apply with FM_ERROR_UNSUPPORTED
    naming the argument, and checks its own arguments."""
    ffi, lib = _native.ffi(), _native.lib()

    def route(**kw):
        fields = dict(dtype=lib.FM_DTYPE_BF16, head_dim=64, head_dim_v=64, window=0, query_rows=1, keys=40,
                      query_offset=39, mask=0, mask_is_key_ranges=0, causal=1, sinks=0)
        fields.update(kw)
        out, err = ffi.new("FMRoute *"), ffi.new("FMError *")
        status = lib.fm_route_attention(ffi.new("FMRouteCall *", fields), out, err)
        return status, int(out.kernel), ffi.string(out.reason).decode(), err

    status, kernel, reason, _ = route()
    assert (status, kernel) == (lib.FM_OK, lib.FM_ROUTE_DECODE) and "split-KV decode" in reason
    q = np.zeros((1, 2, 1, 64), BF16)
    k = np.zeros((1, 2, 40, 64), BF16)
    assert reason == fm.explain(q, k, k, is_causal=True, align="bottom_right").reason
    status, kernel, reason, _ = route(dtype=lib.FM_DTYPE_F16, head_dim=300, head_dim_v=300, query_rows=40,
                                      keys=40, query_offset=0)
    assert (status, kernel, reason) == (lib.FM_OK, lib.FM_ROUTE_PREFILL, "tiled flash attention")
    status, kernel, reason, _ = route(dtype=lib.FM_DTYPE_F16, head_dim=520, head_dim_v=520, query_rows=8, keys=40,
                                      query_offset=32)
    assert (status, kernel) == (lib.FM_OK, lib.FM_ROUTE_SDPA) and "head dim 520 (prefill runs 1...512)" in reason
    status, _, _, err = route(query_rows=4, keys=2, query_offset=-2, sinks=1)
    assert status == lib.FM_ERROR_UNSUPPORTED
    assert ffi.string(err.argument) == b"sinks" and b"sinks are applied by the prefill kernel only" in \
        ffi.string(err.message)
    status, _, _, err = route(dtype=lib.FM_DTYPE_I32)
    assert status == lib.FM_ERROR_TYPE and ffi.string(err.op) == b"scaled_dot_product_attention"
    status, _, _, err = route(query_rows=0)
    assert status == lib.FM_ERROR_VALUE and ffi.string(err.argument) == b"call"
    assert lib.fm_route_attention(ffi.NULL, ffi.new("FMRoute *"), ffi.NULL) == lib.FM_ERROR_VALUE


def test_plan_attention_is_the_front_doors_contract():
    """fm_plan_attention (the C ABI's check of a front-door call) reads the
    descriptors' dtypes and shapes: a rank-3 call is batch 1, align
    bottom_right puts query row 0 at kv_len - qL, an empty axis and no keys
    run no kernel; every refusal names the argument."""
    ffi, lib = _native.ffi(), _native.lib()

    def plan(q=(2, 3, 8), k=(2, 7, 8), v=(2, 7, 4), sinks=None, dtypes=(BF16, BF16, BF16), **kw):
        arrays = [np.zeros(s, d) for s, d in zip((q, k, v), dtypes)] + [None if sinks is None else
                                                                          np.zeros(sinks, np.float32)]
        call = ffi.new("FMAttentionCall *", kw)
        out, err = ffi.new("FMAttentionPlan *"), ffi.new("FMError *")
        status = lib.fm_plan_attention(*(tensor(ffi, a) for a in arrays), call, out, err)
        return status, out, ffi.string(err.argument).decode(), ffi.string(err.message).decode()

    status, out, _, _ = plan(has_kv_len=1, kv_len=5, bottom_right=1)
    assert status == lib.FM_OK and out.kind == lib.FM_PLAN_RUN
    got = [int(getattr(out, f)) for f in ("batch", "heads", "kv_heads", "query_rows", "head_dim", "head_dim_v",
                                          "capacity", "keys", "query_offset")]
    assert got == [1, 2, 2, 3, 8, 4, 7, 5, 2]
    status, out, _, _ = plan(q=(1, 4, 3, 8), k=(1, 2, 7, 8), v=(1, 2, 7, 8), enable_gqa=1)
    assert status == lib.FM_OK and (out.heads, out.kv_heads, out.query_offset) == (4, 2, 0)
    status, out, _, _ = plan(q=(2, 0, 8))
    assert status == lib.FM_OK and out.kind == lib.FM_PLAN_EMPTY
    status, out, _, _ = plan(k=(2, 0, 8), v=(2, 0, 8))
    assert status == lib.FM_OK and out.kind == lib.FM_PLAN_NO_KEYS and b"no keys" in ffi.string(out.reason)
    for kw, argument, text in [
        (dict(has_scale=1, scale=float("nan")), "scale", "scale must be finite, got nan"),
        (dict(softcap=-2.0), "softcap", "softcap must be 0 (off) or a finite value > 0, got -2.0"),
        (dict(has_window=1, window=-1), "window", "window must be > 0 and fit in int32, got -1"),
        (dict(has_window=1, window=2**31), "window", "got 2147483648"),
        (dict(has_kv_len=1, kv_len=8), "kv_len", "kv_len must be in 1..7 (key's sequence length), got 8"),
        (dict(has_causal_bias=1, bias_query_rows=3, bias_keys=6), "attn_mask", "not this call's (3, 7)"),
        (dict(k=(2, 7, 8), v=(1, 7, 8)), "key", "key (1, 2, 7, 8) must be [B, Hkv, kL, D]"),
        (dict(q=(4, 3, 8)), "enable_gqa", "query has 4 heads and key 2"),
        (dict(q=(3, 3, 8), enable_gqa=1), "key", "query heads (3) must be a multiple of key heads (2)"),
        (dict(sinks=(2, 1)), "sinks", "sinks must have shape [2] (query's heads), got [2, 1]"),
        (dict(dtypes=(np.int32, BF16, BF16)), "query", "query must be float32, float16 or bfloat16, got int32"),
        (dict(dtypes=(F16, F16, BF16)), "value", "value dtype bfloat16 does not match query dtype float16"),
        (dict(q=(1, 2, 3, 8)), "key", "query, key and value must all have rank 4"),
    ]:
        status, _, arg, message = plan(**kw)
        assert status != lib.FM_OK and arg == argument and text in message, (kw, arg, message)
    q = np.zeros((2, 3, 8), BF16)
    assert lib.fm_plan_attention(tensor(ffi, q), tensor(ffi, q), tensor(ffi, q), ffi.NULL, ffi.NULL,
                                 ffi.new("FMAttentionPlan *"), ffi.NULL) == lib.FM_ERROR_VALUE


def test_route_attention_refuses_values_beyond_int32():
    """Sizes and offsets beyond int32 (the kernels' range) are value errors;
    before, the router's sums of them overflowed and trapped the process.
    In a subprocess: a crash fails this test, not the run."""
    from subprocess_run import run_python
    run_python("""
        from flashmetal import _native
        ffi, lib = _native.ffi(), _native.lib()
        base = dict(dtype=lib.FM_DTYPE_BF16, head_dim=64, head_dim_v=64, window=0, query_rows=1, keys=40,
                    query_offset=39, mask=0, mask_is_key_ranges=0, causal=1, sinks=1)
        for field, value in (("query_rows", 2**63 - 1), ("keys", 2**62), ("head_dim", 2**31), ("head_dim_v", 2**40),
                             ("query_offset", 2**63 - 1), ("query_offset", -2**63)):
            out, err = ffi.new("FMRoute *"), ffi.new("FMError *")
            status = lib.fm_route_attention(ffi.new("FMRouteCall *", dict(base, **{field: value})), out, err)
            assert status == lib.FM_ERROR_VALUE and ffi.string(err.argument) == b"call", (field, status)
            assert field.encode() in ffi.string(err.message), ffi.string(err.message)
        out, err = ffi.new("FMRoute *"), ffi.new("FMError *")
        edge = dict(base, query_rows=2**31 - 1, keys=2**31 - 1, query_offset=2**31 - 1, window=2**31 - 1, sinks=0)
        assert lib.fm_route_attention(ffi.new("FMRouteCall *", edge), out, err) == lib.FM_OK
    """)
