"""Random calls for the reliability contract: sinks beside any mask on the
drop-in (against a float64 reference), torch tensor subclasses as inputs and
masks (a CausalBias means its alignment; any other subclass whose storage is
not its value is refused, never read), and a table rewritten by another
thread while calls run (each call is refused or equals the checked table's
result). Each case either matches the reference or raises a flashmetal.Error."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F16, F32, assert_close, randn
from test_sinks import _reference as sinks_reference

CASES = settings(max_examples=30, deadline=None, database=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))


@CASES
@given(b=st.integers(1, 2), hkv=st.sampled_from([1, 2]), g=st.sampled_from([1, 2]), ql=st.integers(1, 9),
       kl=st.integers(1, 20), dt=st.sampled_from([BF16, F16]), kind=st.sampled_from(["bool", "additive", "none"]),
       causal=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_sinks_beside_any_mask(registry, b, hkv, g, ql, kl, dt, kind, causal, seed):
    rng = np.random.default_rng(seed)
    h = hkv * g
    q, k, v = randn(rng, (b, h, ql, 64), dt), randn(rng, (b, hkv, kl, 64), dt), randn(rng, (b, hkv, kl, 64), dt)
    sinks = (rng.standard_normal(h) * 2).astype(np.float32)
    keep = rng.random((b, 1, ql, kl)) < 0.7
    mask = {"bool": keep, "additive": np.where(keep, 0.0, -np.inf).astype(dt), "none": None}[kind]
    vis = keep if kind != "none" else np.ones_like(keep)
    if causal:
        vis = vis & (np.arange(kl)[None, :] <= np.arange(ql)[:, None] + (kl - ql))
    call = lambda: fm.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=True,  # noqa: E731
                                                   sinks=sinks, align="bottom_right", registry=registry)
    if ql > kl and causal:  # rows before the first key: sdpa's route, which has no sinks: refused, never dropped
        with pytest.raises(fm.UnsupportedFeatureError, match="sinks are applied by the prefill kernel only"):
            call()
        return
    got = call()
    assert_close(got, sinks_reference(q, k, v, sinks, vis=vis), dt, f"sinks with a {kind} mask")


torch = pytest.importorskip("torch")
import torch.nn.attention.bias as tbias  # noqa: E402


class _Lazy(torch.Tensor):
    """A subclass whose value is computed by torch_function, not its storage."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        return super().__torch_function__(func, types, args, kwargs or {})


@CASES
@given(where=st.sampled_from(["mask", "query"]),
       kind=st.sampled_from(["plain", "parameter", "lazy", "upper_left", "lower_right"]),
       ql=st.integers(1, 6), kl=st.integers(6, 12), seed=st.integers(0, 2**32 - 1))
def test_tensor_subclasses(registry, where, kind, ql, kl, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=gen) for s in ((1, 2, ql, 64), (1, 2, kl, 64), (1, 2, kl, 64)))
    as64 = lambda t: t.detach().float().numpy()  # noqa: E731
    if where == "mask":
        if kind in ("upper_left", "lower_right"):
            mask = getattr(tbias, f"causal_{kind}")(ql, kl)
            off = 0 if kind == "upper_left" else kl - ql
            want = reference.attention(as64(q), as64(k), as64(v), causal=True, q_offset=off)
        else:
            base = torch.zeros(ql, kl)
            mask = {"plain": base, "parameter": torch.nn.Parameter(base, requires_grad=False),
                    "lazy": base.as_subclass(_Lazy)}[kind]
            want = reference.attention(as64(q), as64(k), as64(v))
        call = lambda: fm.scaled_dot_product_attention(q, k, v, mask, registry=registry)  # noqa: E731
    else:
        if kind in ("upper_left", "lower_right"):
            return  # a CausalBias is a mask, not a tensor of values
        qq = {"plain": q, "parameter": torch.nn.Parameter(q, requires_grad=False), "lazy": q.as_subclass(_Lazy)}[kind]
        want = reference.attention(as64(q), as64(k), as64(v))
        call = lambda: fm.scaled_dot_product_attention(qq, k, v, registry=registry)  # noqa: E731
    if kind == "lazy":
        with pytest.raises(fm.InvalidTypeError):
            call()
        return
    with torch.no_grad():
        out = call()
    assert_close(out.float().numpy(), want, F32, f"{kind} {where}")


@CASES
@given(bad=st.sampled_from([-1, 7, 2**31 - 1, -2**31]), calls=st.integers(3, 8), seed=st.integers(0, 2**32 - 1))
def test_block_table_rewritten_during_calls(registry, bad, calls, seed):
    rng = np.random.default_rng(seed)
    pages, ps, hkv, d = 4, 16, 1, 64
    kc, vc = randn(rng, (pages, ps, hkv, d), BF16), randn(rng, (pages, ps, hkv, d), BF16)
    q = randn(rng, (1, 1, 2, d), BF16)
    good = np.array([[2, 0, 3, 1]], np.int32)
    table = good.copy()
    lens = np.array([40], np.int32)
    want = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=good, registry=registry)
    stop = threading.Event()
    flips = np.random.default_rng(seed + 1)  # a Generator is not shared between threads

    def flip() -> None:
        while not stop.is_set():
            table[0, int(flips.integers(0, 4))] = bad
            table[:] = good

    t = threading.Thread(target=flip)
    t.start()
    try:
        for _ in range(calls):
            try:
                got = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, registry=registry)
            except fm.Error:
                continue  # the copy it checked held the bad entry
            assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    finally:
        stop.set()
        t.join()
