"""flash_attn_func / flash_attn_varlen_func numerics against the
float64 serving reference, on cpu with every head dim and on sim with small
shapes: every feature x dtype x head dim x GQA, ragged and paged batches."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import qkv_of_shapes as qkv
from serving_cases import (BACKENDS, SIMULATED, BF16, BK, BQ, DTYPES, F16, HEAD_DIMS, assert_out_lse, cu, paged, randn,
                           registry, sinks_for, with_sinks)

FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(5, 3)),
    "causal_window": dict(causal=True, window_size=(7, -1)),
    "left_open_window": dict(window_size=(-1, 2)),
    "softcap": dict(softcap=2.5),
    "sinks": dict(sinks=True),
    "all": dict(causal=True, window_size=(9, 0), softcap=4.0, sinks=True),
}


def features(rng, name: str, heads: int) -> dict:
    return with_sinks(rng, FEATURES[name], heads)


def func_cases():
    """cpu: every head dim x dtype x feature; sim: two head dims (one not a
    power of two) and every feature, bf16, plus f16 once."""
    cases = []
    for backend in BACKENDS:
        if backend in SIMULATED:
            cases += [(backend, d, BF16, f) for d in (64, 80) for f in FEATURES]
            cases += [(backend, 96, F16, "all")]
        else:
            cases += [(backend, d, dt, f) for d in HEAD_DIMS for dt in DTYPES for f in FEATURES]
            cases += [(backend, 512, BF16, f) for f in ("causal", "all")]
    return cases


def shapes(backend: str) -> dict:
    """Small on the simulator (a prefill tile is slow there)."""
    if backend in SIMULATED:
        return dict(b=1, h=2, hkv=1, ql=9, kl=21)
    return dict(b=2, h=4, hkv=2, ql=37, kl=53)


@pytest.mark.parametrize("backend,d,dtype,feature", func_cases())
def test_func_features(rng, backend, d, dtype, feature):
    s = shapes(backend)
    q, k, v = qkv(rng, (s["b"], s["ql"], s["h"], d), (s["b"], s["kl"], s["hkv"], d), dtype)
    kw = features(rng, feature, s["h"])
    out, lse, probs = fm.flash_attn_func(q, k, v, return_attn_probs=True, registry=registry(backend), **kw)
    assert out.shape == q.shape and out.dtype == dtype and probs.shape == (0,)
    e_out, e_lse = reference.flash_attn(q, k, v, **kw)
    assert_out_lse(out, lse, e_out, e_lse, dtype, f"{backend} d={d} {dtype} {feature}")


@pytest.mark.parametrize("backend,d,dtype,feature", [c for c in func_cases() if c[1] in (64, 80, 96, 192, 512)])
def test_func_one_query_row_uses_decode(rng, backend, d, dtype, feature):
    """seqlen_q == 1 goes to the decode kernel (float32 q): same semantics."""
    s = shapes(backend)
    q, k, v = qkv(rng, (s["b"], 1, s["h"], d), (s["b"], s["kl"], s["hkv"], d), dtype)
    kw = features(rng, feature, s["h"])
    out, lse, _ = fm.flash_attn_func(q, k, v, return_attn_probs=True, registry=registry(backend), **kw)
    e_out, e_lse = reference.flash_attn(q, k, v, **kw)
    assert_out_lse(out, lse, e_out, e_lse, dtype, f"{backend} decode d={d} {feature}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 1), (6, 2)])
def test_func_gqa_and_mqa(rng, backend, h, hkv):
    ql, kl = (7, 12) if backend in SIMULATED else (40, 70)
    q, k, v = qkv(rng, (1, ql, h, 64), (1, kl, hkv, 64), BF16)
    out, lse, _ = fm.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, registry=registry(backend))
    assert_out_lse(out, lse, *reference.flash_attn(q, k, v, causal=True), BF16, f"{backend} H={h} Hkv={hkv}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_func_more_queries_than_keys_gives_zero_rows(rng, backend):
    """Bottom-right causal with qL > kL: the first qL - kL rows see no key:
    exact zeros, LSE -inf; with a sink the LSE is the sink and the output 0."""
    q, k, v = qkv(rng, (1, 6, 2, 64), (1, 2, 2, 64), F16)
    reg = registry(backend)
    out, lse, _ = fm.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, registry=reg)
    assert np.all(np.asarray(out)[0, :4] == 0) and np.all(np.asarray(lse)[0, :, :4] == -np.inf)
    assert_out_lse(out, lse, *reference.flash_attn(q, k, v, causal=True), F16, backend)
    sinks = np.array([0.5, -1.0], np.float32)
    out, lse, _ = fm.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, sinks=sinks, registry=reg)
    assert np.all(np.asarray(out)[0, :4] == 0)
    np.testing.assert_array_equal(np.asarray(lse)[0, :, 0], sinks)
    assert_out_lse(out, lse, *reference.flash_attn(q, k, v, causal=True, sinks=sinks), F16, backend)


def ragged(backend: str) -> tuple[list[int], list[int]]:
    """(q lengths, k lengths) around the tiles: 1, tile-1, tile, tile+1,
    long; an empty key sequence; fewer keys than queries once."""
    if backend in SIMULATED:
        return [1, BQ - 1, 3], [BK + 1, BK - 1, 0]
    return [1, BQ - 1, BQ, BQ + 1, 100, 5, 20], [1, BK - 1, BK, BK + 1, 130, 0, 9]


VARLEN_FEATURES = ["plain", "causal", "causal_window", "all"]


@pytest.mark.parametrize("backend,d,dtype,feature",
                         [(b, d, dt, f) for b in BACKENDS
                          for d, dt in ([(64, BF16)] if b in SIMULATED else [(64, BF16), (96, F16), (128, F16),
                                                                       (192, BF16), (256, BF16)])
                          for f in VARLEN_FEATURES])
def test_varlen_ragged(rng, backend, d, dtype, feature):
    ql, kl = ragged(backend)
    h, hkv = 4, 2
    q, k, v = qkv(rng, (sum(ql), h, d), (sum(kl), hkv, d), dtype)
    cq, ck = cu(ql), cu(kl)
    kw = features(rng, feature, h)
    out, lse, _ = fm.flash_attn_varlen_func(q, k, v, cq, ck, max(ql), max(kl), return_attn_probs=True,
                                            registry=registry(backend), **kw)
    assert out.shape == q.shape and lse.shape == (h, sum(ql))
    assert_out_lse(out, lse, *reference.flash_attn_varlen(q, k, v, cq, ck, **kw), dtype,
                   f"{backend} varlen d={d} {feature}")


@pytest.mark.parametrize("backend,page_size",
                         [(b, p) for b in BACKENDS for p in ([16, 32] if b in SIMULATED else [16, 32, 64, 128, 256])])
def test_varlen_paged_shuffled_tables(rng, backend, page_size):
    ql, kl = ragged(backend)
    h, hkv, d = 4, 2, 64
    q = randn(rng, (sum(ql), h, d), BF16)
    ks = [randn(rng, (n, hkv, d), BF16) for n in kl]
    vs = [randn(rng, (n, hkv, d), BF16) for n in kl]
    (k_cache, v_cache), table = paged(rng, [ks, vs], page_size)
    cq, ck = cu(ql), cu(kl)
    out, lse, _ = fm.flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, max(ql), max(kl), causal=True,
                                            return_attn_probs=True, block_table=table,
                                            registry=registry(backend))
    packed_k, packed_v = np.concatenate(ks), np.concatenate(vs)
    e_out, e_lse = reference.flash_attn_varlen(q, packed_k, packed_v, cq, ck, causal=True)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{backend} varlen paged {page_size}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_lse_merge_of_two_key_halves(rng, backend):
    """Attention over keys [0, a) and [a, kL) of every sequence, merged with
    their LSEs, reproduces the one-shot result (sinks counted in one half)."""
    ql, kl = ([3, 5], [10, 7]) if backend in SIMULATED else ([20, 33, 1], [50, 40, 17])
    h, hkv, d = 4, 2, 64
    q, k, v = qkv(rng, (sum(ql), h, d), (sum(kl), hkv, d), F16)
    sinks = sinks_for(rng, h)
    reg = registry(backend)
    cq, ck = cu(ql), cu(kl)
    kw = dict(softcap=3.0, return_attn_probs=True, registry=reg)
    one_out, one_lse, _ = fm.flash_attn_varlen_func(q, k, v, cq, ck, max(ql), max(kl), sinks=sinks, **kw)
    cut = [n // 3 for n in kl]
    first = np.concatenate([np.arange(ck[b], ck[b] + cut[b]) for b in range(len(kl))])
    second = np.concatenate([np.arange(ck[b] + cut[b], ck[b + 1]) for b in range(len(kl))])
    ca, cb = cu(cut), cu([n - c for n, c in zip(kl, cut)])
    oa, la, _ = fm.flash_attn_varlen_func(q, k[first], v[first], cq, ca, max(ql), max(cut), sinks=sinks, **kw)
    ob, lb, _ = fm.flash_attn_varlen_func(q, k[second], v[second], cq, cb, max(ql), max(kl), **kw)
    merged, merged_lse = reference.merge_lse(oa.astype(np.float64), la, ob.astype(np.float64), lb)
    assert_out_lse(merged, merged_lse, one_out.astype(np.float64), one_lse.astype(np.float64), F16,
                   f"{backend} merged vs one-shot", merged=True)
    e_out, e_lse = reference.flash_attn_varlen(q, k, v, cq, ck, softcap=3.0, sinks=sinks)
    assert_out_lse(merged, merged_lse, e_out, e_lse, F16, f"{backend} merged vs reference", merged=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_func_torch_in_torch_out(rng, backend):
    torch = pytest.importorskip("torch")
    q, k, v = qkv(rng, (1, 9, 2, 64), (1, 12, 2, 64), BF16)
    tq, tk, tv = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in (q, k, v))
    out, lse, probs = fm.flash_attn_func(tq, tk, tv, causal=True, return_attn_probs=True,
                                         registry=registry(backend))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and tuple(out.shape) == q.shape
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and tuple(lse.shape) == (1, 2, 9)
    assert isinstance(probs, torch.Tensor) and probs.numel() == 0
    o = out.view(torch.int16).numpy().view(BF16)
    assert_out_lse(o, lse.numpy(), *reference.flash_attn(q, k, v, causal=True), BF16, backend)


def test_return_conventions_follow_flash_attn(rng):
    """out alone by default; (out, lse, S_dmask) with return_attn_probs."""
    q, k, v = qkv(rng, (1, 4, 2, 64), (1, 4, 2, 64), BF16)
    out = fm.flash_attn_func(q, k, v, registry="cpu")
    assert isinstance(out, np.ndarray) and out.shape == q.shape
    res = fm.flash_attn_varlen_func(q[0], k[0], v[0], cu([4]), cu([4]), 4, 4, registry="cpu")
    assert isinstance(res, np.ndarray) and res.shape == q[0].shape
    assert len(fm.flash_attn_varlen_func(q[0], k[0], v[0], cu([4]), cu([4]), 4, 4, return_attn_probs=True,
                                         registry="cpu")) == 3
