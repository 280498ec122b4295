"""Hints in errors: a layout that looks transposed says so (and the fix it
names works), shapes valid in both layouts still run, float64 is told which
dtypes the argument takes (checked against what the library takes), and a
bfloat16 array numpy cannot read through DLPack is told how to pass it."""
from __future__ import annotations

import re

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import _hints, reference
from numerics import BF16, F16, F32, assert_close, randn

DROPIN = "scaled_dot_product_attention"


def _error(exc, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert type(info.value) is exc, type(info.value)
    return info.value


def _transposed(e, op, argument, shapes, fix):
    """e is the layout hint of ``op`` naming ``argument``, every shape in
    ``shapes`` and the fix ``fix``."""
    msg = str(e)
    assert e.op == op and e.argument == argument, (e.op, e.argument, msg)
    assert msg.startswith(op + ": ") and "The layout looks transposed" in msg, msg
    for shape in shapes:
        assert str(tuple(shape)) in msg, (shape, msg)
    assert fix in msg, msg


def _blhd(rng, b, l, h, d, dtype):
    return randn(rng, (b, l, h, d), dtype)


def test_dropin_names_the_transposed_query(cpu, rng):
    """[B, L, H, D] tensors where the drop-in expects [B, H, L, D]: 8 heads
    over 24 query and 40 key positions read as 24 heads over 40 (not a
    multiple); transposing as the hint says gives torch's result."""
    q, k, v = _blhd(rng, 1, 24, 8, 64, BF16), _blhd(rng, 1, 40, 4, 64, BF16), _blhd(rng, 1, 40, 4, 64, BF16)
    for gqa in (False, True):
        e = _error(fm.InvalidValueError, fm.scaled_dot_product_attention, q, k, v, enable_gqa=gqa, registry=cpu)
        _transposed(e, DROPIN, "query", [q.shape, k.shape], "swap axes 1 and 2 of query, key and value")
        assert ("and pass enable_gqa=True" in str(e)) == (not gqa), str(e)
    qt, kt, vt = (x.swapaxes(1, 2) for x in (q, k, v))
    out = fm.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True, registry=cpu)
    assert_close(out, reference.attention(qt, kt, vt), BF16, "after the hint's transpose")


def test_dropin_hint_with_torch_and_a_mask(cpu, rng):
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 16, 4, 64)  # [B, L, H, D] with L = qL = kL: the heads fit either way
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool).tril()
    e = _error(fm.InvalidValueError, fm.scaled_dot_product_attention, q, q, q, mask, registry=cpu)
    _transposed(e, DROPIN, "query", [tuple(q.shape)], "x.transpose(1, 2)")
    assert "attn_mask shape (2, 1, 16, 16) does not broadcast" in str(e)
    # Rank 3 ([L, H, D] for [H, L, D]) names axes 0 and 1.
    q3 = torch.randn(24, 8, 64)
    k3 = torch.randn(40, 8, 64)
    e = _error(fm.InvalidValueError, fm.scaled_dot_product_attention, q3, k3, k3, registry=cpu)
    _transposed(e, DROPIN, "query", [tuple(q3.shape), tuple(k3.shape)], "swap axes 0 and 1")


def test_ambiguous_shapes_run_as_torch_runs_them(cpu, rng):
    """Shapes valid in both layouts are no error: [B, H, L, D] is what they
    mean, as torch reads them (no hint can know better)."""
    torch = pytest.importorskip("torch")
    q, k, v = (randn(rng, (1, 8, 8, 64), F32) for _ in range(3))
    out = fm.scaled_dot_product_attention(q, k, v, is_causal=True, registry=cpu)
    want = torch.nn.functional.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)),
                                                            is_causal=True)
    assert_close(out, want.numpy(), F32, "ambiguous shapes")
    assert_close(fm.sdpa(q, k, v, registry=cpu), reference.attention(q, k, v), F32, "sdpa")


def test_prefill_both_or_only_the_caches_transposed(cpu, rng):
    q, k, v = _blhd(rng, 1, 24, 8, 64, BF16), _blhd(rng, 1, 40, 4, 64, BF16), _blhd(rng, 1, 40, 4, 64, BF16)
    e = _error(fm.InvalidValueError, fm.flash_attn_prefill, q, k, v, causal=True, registry=cpu)
    _transposed(e, "flash_attn_prefill", "q", [q.shape, k.shape], "or pass layout='blhd'")
    out = fm.flash_attn_prefill(q, k, v, causal=True, layout="blhd", registry=cpu)
    want = reference.attention(q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), causal=True, q_offset=16)
    assert_close(out.swapaxes(1, 2), want, BF16, "layout='blhd' as the hint says")
    # q right, k and v from a token-major cache ([B, kL, Hkv, D]): only they
    # are named.
    qh, kc = randn(rng, (1, 6, 20, 64), BF16), randn(rng, (1, 40, 3, 64), BF16)
    e = _error(fm.InvalidValueError, fm.flash_attn_prefill, qh, kc, kc, registry=cpu)
    _transposed(e, "flash_attn_prefill", "k", [kc.shape], "with k and v read as [B, L, H, D]")
    assert "swap axes 1 and 2 of k and v (torch: x.transpose(1, 2); numpy: x.swapaxes(1, 2))" in str(e)
    assert "layout=" not in str(e)
    # Both readings fit: both are named, the whole transpose first.
    e = _error(fm.InvalidValueError, fm.flash_attn_prefill, q.swapaxes(1, 2), k, v, registry=cpu)
    assert re.search(r"with q, k and v read as .*; or with k and v read as", str(e)), str(e)
    # sdpa: the same hint.
    qf, kf = q.astype(F32), k.astype(F32)
    e = _error(fm.InvalidValueError, fm.sdpa, qf, kf, kf, registry=cpu)
    _transposed(e, "sdpa", "q", [qf.shape, kf.shape], "swap axes 1 and 2 of q, k and v")


def test_prefill_rows_beyond_the_keys_name_q_not_an_unpassed_q_offset(cpu, rng):
    q, k = randn(rng, (1, 2, 12, 64), BF16), randn(rng, (1, 2, 8, 64), BF16)
    e = _error(fm.InvalidValueError, fm.flash_attn_prefill, q, k, k, causal=True, registry=cpu)
    assert e.argument == "q" and "q_offset (" not in str(e) and "looks transposed" not in str(e)
    assert "q has 12 query rows, more than the 8 keys" in str(e)
    e = _error(fm.InvalidValueError, fm.flash_attn_prefill, q, k, k, q_offset=0, causal=True, registry=cpu)
    assert e.argument == "q_offset"  # passed: the library's own message stands


def test_no_hint_when_the_transpose_does_not_fit_either(cpu, rng):
    q, k = randn(rng, (1, 4, 6, 64), BF16), randn(rng, (1, 3, 8, 64), BF16)
    e = _error(fm.InvalidValueError, fm.flash_attn_prefill, q, k, k, registry=cpu)
    assert "transposed" not in str(e) and str(e).endswith("the q heads (4) must be a multiple of the k heads (3)")
    e = _error(fm.InvalidValueError, fm.scaled_dot_product_attention, q, k, k, enable_gqa=True, registry=cpu)
    assert "transposed" not in str(e) and str(e).endswith("must be a multiple of key heads (3)")


def test_no_layout_hint_for_quantized_caches(cpu, rng):
    """A QuantizedKV's shape is its leading shape (no head-dim axis): an error
    of a call over codes says what is wrong, never "swap axes 0 and 1 of
    k_cache", which no shape of the codes would fix."""
    kc, vc = fm.KVCodec(64, 4).empty((2, 16, 2)), fm.KVCodec(64, 4).empty((2, 16, 2))
    q = randn(rng, (2, 1, 4, 64), F16)
    calls = [(dict(q=randn(rng, (2, 1, 4, 128), F16), cache_seqlens=3), "codec head_dim 64 must equal q's head dim 128"),
             (dict(cache_seqlens=np.array([17, 1], np.int32)), "cache_seqlens[0] = 17 is out of range [0, 16]"),
             (dict(k=randn(rng, (2, 2, 2, 64), F16), v=randn(rng, (2, 2, 2, 64), F16),
                   cache_seqlens=np.array([15, 1], np.int32)), "exceeds the cache capacity")]
    for kw, says in calls:
        kw = {"q": q, **kw}
        e = _error(fm.InvalidValueError, fm.flash_attn_with_kvcache, k_cache=kc, v_cache=vc, registry=cpu, **kw)
        assert says in str(e) and "transposed" not in str(e), str(e)


def test_decode_caches_token_major(cpu, rng):
    q = randn(rng, (2, 8, 64), F32)
    kc, vc = randn(rng, (2, 40, 2, 64), BF16), randn(rng, (2, 40, 2, 64), BF16)
    e = _error(fm.InvalidValueError, fm.flash_attn_decode, q, kc, vc, kv_len=30, registry=cpu)
    _transposed(e, "flash_attn_decode", "k_cache", [kc.shape], "swap axes 1 and 2 of k_cache and v_cache")
    kt, vt = kc.swapaxes(1, 2), vc.swapaxes(1, 2)
    assert_close(fm.flash_attn_decode(q, kt, vt, kv_len=30, registry=cpu), reference.decode(q, kt, vt, 30), F32,
                 "after the hint's transpose")


def test_flash_attn_func_head_major_given(cpu, rng):
    """flash-attn's functions take [B, L, H, D]; [B, H, L, D] is the transpose."""
    q, k = randn(rng, (1, 8, 24, 64), F16), randn(rng, (1, 2, 40, 64), F16)
    e = _error(fm.InvalidValueError, fm.flash_attn_func, q, k, k, registry=cpu)
    _transposed(e, "flash_attn_func", "q", [q.shape, k.shape], "read as [B, H, L, D]")


def test_kvcache_head_major_caches_given(cpu, rng):
    """flash_attn_with_kvcache's caches are [B, cap, Hkv, D]; a head-major
    cache (Hugging Face's) is named, and transposing it as the hint says
    gives the reference."""
    q = randn(rng, (2, 1, 8, 64), BF16)
    kc, vc = randn(rng, (2, 2, 40, 64), BF16), randn(rng, (2, 2, 40, 64), BF16)
    e = _error(fm.InvalidValueError, fm.flash_attn_with_kvcache, q, kc, vc, cache_seqlens=30, registry=cpu)
    _transposed(e, "flash_attn_with_kvcache", "k_cache", [kc.shape], "swap axes 1 and 2 of k_cache and v_cache")
    kt, vt = kc.swapaxes(1, 2), vc.swapaxes(1, 2)
    out = fm.flash_attn_with_kvcache(q, kt, vt, cache_seqlens=30, registry=cpu)
    assert_close(out[:, 0], reference.decode(q[:, 0].astype(F32), kc, vc, 30), BF16, "after the hint's transpose")


# --- dtypes ---------------------------------------------------------------------------------------------------------

def _call(op, arg, dtype, cpu, rng):
    """Calls public function ``op`` with argument ``arg`` (as its messages
    name it) of ``dtype``, the other tensors of the same dtype when they
    can take it (the rules say "q's dtype"), else of one they take."""
    io = dtype if dtype in (F32, F16, BF16) else F32

    def r(shape, dt):
        return randn(rng, shape, dt) if dt in (F32, F16, BF16) else np.zeros(shape, dt)

    if op == "flash_attn_prefill":
        qkv = {n: r((1, 2, 16, 64), dtype if n == arg else io) for n in "qkv"}
        mask = r((16, 16), dtype) if arg == "mask" else None
        return fm.flash_attn_prefill(qkv["q"], qkv["k"], qkv["v"], mask=mask, registry=cpu)
    if op in ("sdpa", DROPIN):
        names = ("q", "k", "v") if op == "sdpa" else ("query", "key", "value")
        qkv = {n: r((1, 2, 16, 64), dtype if n == arg else io) for n in names}
        if op == DROPIN:
            return fm.scaled_dot_product_attention(*qkv.values(), registry=cpu)
        mask = r((16, 16), dtype) if arg == "mask" else None
        return fm.sdpa(*qkv.values(), mask=mask, registry=cpu)
    if op == "flash_attn_decode":
        q = r((2, 64), dtype if arg == "q" else F32)
        kc, vc = (r((2, 16, 64), dtype if n == arg else io) for n in ("k_cache", "v_cache"))
        return fm.flash_attn_decode(q, kc, vc, kv_len=16, registry=cpu)
    if op in ("flash_attn_func", "flash_attn_with_kvcache"):
        q = r((1, 4, 2, 64), dtype if arg == "q" else io)
        names = ("k", "v") if op == "flash_attn_func" else ("k_cache", "v_cache")
        k, v = (r((1, 16, 2, 64), dtype if n == arg else io) for n in names)
        if op == "flash_attn_func":
            return fm.flash_attn_func(q, k, v, registry=cpu)
        return fm.flash_attn_with_kvcache(q, k, v, cache_seqlens=8, registry=cpu)
    if op == "flash_attn_varlen_func":
        qkv = {n: r((16, 2, 64), dtype if n == arg else io) for n in "qkv"}
        return fm.flash_attn_varlen_func(*qkv.values(), [0, 16], [0, 16], 16, 16, registry=cpu)
    if op == "build_blk":
        return fm.build_blk(r((32, 32), dtype), 64)
    if op == "KVCodec.encode":
        return fm.KVCodec(64, 4).encode(r((2, 16, 64), dtype))
    raise AssertionError(op)


_DTYPE_WORDS = {"float32": F32, "float16": F16, "bfloat16": BF16, "bool": np.dtype(bool), "uint8": np.dtype(np.uint8)}


def _listed(text):
    return {_DTYPE_WORDS[w] for w in re.findall(r"float32|float16|bfloat16|bool|uint8", text)}


@pytest.mark.parametrize("op, arg", sorted(_hints.TAKES))
def test_float64_is_told_what_the_argument_takes(cpu, rng, op, arg):
    """float64 is refused plainly with the argument's dtypes, and those are
    exactly what the library takes: each listed dtype runs, every other
    dtype the library knows is refused."""
    takes = _hints.TAKES[(op, arg)]
    e = _error(fm.InvalidTypeError, _call, op, arg, np.dtype(np.float64), cpu, rng)
    msg = str(e)
    assert e.op == op and e.argument == _hints.argument_name(arg), (e.op, e.argument)
    assert msg.startswith(f"{op}: {arg} is float64, which flashmetal does not support"), msg
    assert f"{arg} takes {takes}" in msg and "bool or uint8" not in msg.replace(takes, ""), msg
    listed = _listed(takes)
    for dt in _DTYPE_WORDS.values():
        if dt in listed:
            _call(op, arg, dt, cpu, rng)
        else:
            with pytest.raises(fm.InvalidTypeError):
                _call(op, arg, dt, cpu, rng)


def test_an_argument_without_an_entry_gets_every_dtype(cpu):
    e = _hints.unsupported_dtype("someop", "x", np.dtype(np.float64))
    assert isinstance(e, fm.InvalidTypeError) and "x takes float32, float16 or bfloat16 data" in str(e)
    e = _error(fm.InvalidTypeError, fm.sdpa, np.zeros((1, 2, 4, 64), np.int64), np.zeros((1, 2, 4, 64), F32),
               np.zeros((1, 2, 4, 64), F32), registry=cpu)
    assert str(e) == "sdpa: q dtype int64 is not supported; q takes float32, float16 or bfloat16"


def test_float64_torch_tensor(cpu):
    torch = pytest.importorskip("torch")
    t = torch.zeros(1, 2, 4, 64, dtype=torch.float64)
    e = _error(fm.InvalidTypeError, fm.scaled_dot_product_attention, t, t, t, registry=cpu)
    assert e.argument == "query" and "query is float64, which flashmetal does not support" in str(e)
    assert "query takes float32, float16 or bfloat16" in str(e)


def test_mlx_bfloat16_is_told_how_to_pass_its_bits(cpu, rng):
    mx = pytest.importorskip("mlx.core")
    q = mx.array(randn(rng, (1, 2, 8, 64), F32)).astype(mx.bfloat16)
    e = _error(fm.InvalidTypeError, fm.scaled_dot_product_attention, q, q, q, registry=cpu)
    msg = str(e)
    assert e.op == DROPIN and e.argument == "query", msg
    assert "query is a bfloat16 mlx.core.array" in msg and "view(mx.uint16)" in msg, msg
    assert "flashmetal.integrations.mlx.scaled_dot_product_attention" in msg, msg
    # The route it names works and gives the attention.
    bits = np.asarray(q.view(mx.uint16)).view(BF16)
    out = fm.scaled_dot_product_attention(bits, bits, bits, registry=cpu)
    assert_close(out, reference.attention(bits, bits, bits), BF16, "MLX bits as ml_dtypes.bfloat16")
