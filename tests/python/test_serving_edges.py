"""The serving API as a strict flash-attn user meets it: gaps a
review found (torch bfloat16 through every function and feature at the new
head dims, a torch `out`, q rows no sequence owns, dtype and scale errors)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from serving_cases import BACKENDS, SIMULATED, BF16, F16, assert_out_lse, cu, paged, randn, registry, sinks_for

KV = "flash_attn_with_kvcache"


def as_torch(torch, a: np.ndarray):
    """A torch CPU tensor holding a's values (bfloat16 through its bits)."""
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def from_torch(torch, t) -> np.ndarray:
    return t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()


@pytest.mark.parametrize("backend,d", [(b, d) for b in BACKENDS for d in ([96] if b in SIMULATED else [80, 96, 192])])
def test_torch_bfloat16_through_every_function(rng, backend, d):
    """torch bf16 in, torch out (out bf16, lse float32), for flash_attn_func,
    flash_attn_varlen_func and flash_attn_with_kvcache (paged, appending, with
    window, softcap and sinks; prefill and decode rows), against the float64
    reference; the torch caches are appended in place, nothing else changes."""
    torch = pytest.importorskip("torch")
    reg, h, hkv = registry(backend), 4, 2
    sinks = sinks_for(rng, h)
    feats = dict(causal=True, window_size=(7, 0), softcap=4.0)

    q, k, v = (randn(rng, s, BF16) for s in ((2, 5, h, d), (2, 9, hkv, d), (2, 9, hkv, d)))
    tq = as_torch(torch, q)
    out, lse, probs = fm.flash_attn_func(tq, as_torch(torch, k), as_torch(torch, v), return_attn_probs=True,
                                         sinks=torch.from_numpy(sinks), registry=reg, **feats)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and probs.numel() == 0
    assert_out_lse(from_torch(torch, out), lse.numpy(), *reference.flash_attn(q, k, v, sinks=sinks, **feats),
                   BF16, f"{backend} func d={d}")
    assert np.array_equal(from_torch(torch, tq), q), "q was modified"

    ql, kl = [2, 4], [3, 11]
    qv, kv_, vv = (randn(rng, (sum(n), hh, d), BF16) for n, hh in ((ql, h), (kl, hkv), (kl, hkv)))
    out, lse, _ = fm.flash_attn_varlen_func(as_torch(torch, qv), as_torch(torch, kv_), as_torch(torch, vv),
                                            torch.tensor(cu(ql)), torch.tensor(cu(kl)), max(ql), max(kl),
                                            return_attn_probs=True, sinks=sinks, registry=reg, **feats)
    assert tuple(lse.shape) == (h, sum(ql))
    assert_out_lse(from_torch(torch, out), lse.numpy(),
                   *reference.flash_attn_varlen(qv, kv_, vv, cu(ql), cu(kl), sinks=sinks, **feats),
                   BF16, f"{backend} varlen d={d}")

    lengths = [5, 17]
    ks = [randn(rng, (n, hkv, d), BF16) for n in lengths]
    vs = [randn(rng, (n, hkv, d), BF16) for n in lengths]
    (kc, vc), table = paged(rng, [ks, vs], 16, room=2)
    tkc, tvc = as_torch(torch, kc), as_torch(torch, vc)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    for q_len in (3, 1):  # prefill rows, then the decode kernel
        qk = randn(rng, (2, q_len, h, d), BF16)
        kn, vn = randn(rng, (2, 1, hkv, d), BF16), randn(rng, (2, 1, hkv, d), BF16)
        e_out, e_lse = reference.flash_attn_kvcache(qk, kc, vc, k=kn, v=vn, cache_seqlens=seqlens.numpy(),
                                                    block_table=table, sinks=sinks, **feats)
        out, lse = fm.flash_attn_with_kvcache(as_torch(torch, qk), tkc, tvc, as_torch(torch, kn),
                                              as_torch(torch, vn), cache_seqlens=seqlens,
                                              block_table=torch.from_numpy(table), sinks=sinks,
                                              return_softmax_lse=True, registry=reg, **feats)
        kc, vc = reference.kv_append(kc, vc, kn, vn, seqlens.numpy(), table)
        assert np.array_equal(from_torch(torch, tkc), kc) and np.array_equal(from_torch(torch, tvc), vc)
        assert_out_lse(from_torch(torch, out), lse.numpy(), e_out, e_lse, BF16, f"{backend} kvcache qL={q_len}")
        assert seqlens.tolist() == lengths  # not modified
        seqlens = torch.tensor([n + 1 for n in seqlens.tolist()], dtype=torch.int32)
        lengths = seqlens.tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_len", [1, 3])
def test_torch_out_is_filled_in_place_and_returned(rng, backend, q_len):
    """flash_attn_with_kvcache(out=<torch tensor>) writes the caller's tensor
    and returns it (as a numpy `out` is), with the lse beside it."""
    torch = pytest.importorskip("torch")
    q, kc, vc = randn(rng, (2, q_len, 4, 64), F16), randn(rng, (2, 24, 2, 64), F16), randn(rng, (2, 24, 2, 64), F16)
    seqlens = np.array([7, 24], np.int32)
    out = torch.full(q.shape, float("nan"), dtype=torch.float16)
    res, lse = fm.flash_attn_with_kvcache(torch.from_numpy(q), torch.from_numpy(kc), torch.from_numpy(vc),
                                          cache_seqlens=seqlens, out=out, causal=True, return_softmax_lse=True,
                                          registry=registry(backend))
    assert res is out
    assert_out_lse(out.numpy(), lse.numpy(), *reference.flash_attn_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                                                          causal=True), F16, backend)
    with pytest.raises(fm.InvalidValueError, match=rf"^{KV}: out must be C-contiguous"):
        fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                   out=torch.empty(2, q_len, 4, 128, dtype=torch.float16)[..., :64], registry="cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_q_rows_past_the_last_sequence(rng, backend):
    """q may hold more tokens than cu_seqlens_q[-1] (a batch padded to a fixed
    size, as flash-attn allows): those rows belong to no sequence and read as
    rows that see nothing (0, lse -inf), never uninitialised memory; the
    sequences' rows are unaffected."""
    ql, kl, pad = [2, 3], [6, 4], 3
    q = randn(rng, (sum(ql) + pad, 4, 64), F16)
    q[sum(ql):] = np.nan  # rows no sequence owns: never read
    k, v = randn(rng, (sum(kl), 2, 64), F16), randn(rng, (sum(kl), 2, 64), F16)
    np.full(q.shape, np.nan, F16)  # a freed block of NaNs where the output may land
    out, lse, _ = fm.flash_attn_varlen_func(q, k, v, cu(ql), cu(kl), max(ql), max(kl), causal=True,
                                            return_attn_probs=True, registry=registry(backend))
    assert np.array_equal(out[sum(ql):], np.zeros_like(out[sum(ql):]))
    assert np.all(lse[:, sum(ql):] == -np.inf), lse[:, sum(ql):]
    e_out, e_lse = reference.flash_attn_varlen(q[:sum(ql)], k, v, cu(ql), cu(kl), causal=True)
    assert_out_lse(out[:sum(ql)], lse[:, :sum(ql)], e_out, e_lse, F16, backend)


@pytest.mark.parametrize("q_len", [1, 3])
def test_q_and_cache_dtypes_must_match_on_both_routes(rng, q_len):
    """bf16 q over f16 caches is the same error whether the call takes the
    decode kernel (one row) or the prefill kernel; float32 q stays the decode
    route's own dtype."""
    q, kc = randn(rng, (2, q_len, 4, 64), BF16), randn(rng, (2, 8, 2, 64), F16)
    with pytest.raises(fm.InvalidTypeError, match=rf"^{KV}: k_cache dtype float16 does not match q dtype bfloat16"):
        fm.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=5, registry="cpu")
    with pytest.raises(fm.InvalidTypeError, match=r"^flash_attn_func: k dtype float16 does not match q dtype bfloat16"):
        fm.flash_attn_func(q, kc, kc, registry="cpu")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_softmax_scale_is_named_as_the_caller_wrote_it(rng, bad):
    q, k = randn(rng, (1, 3, 2, 64), F16), randn(rng, (1, 3, 2, 64), F16)
    calls = {
        "flash_attn_func": lambda: fm.flash_attn_func(q, k, k, softmax_scale=bad, registry="cpu"),
        "flash_attn_varlen_func": lambda: fm.flash_attn_varlen_func(q[0], k[0], k[0], cu([3]), cu([3]), 3, 3,
                                                                    softmax_scale=bad, registry="cpu"),
        KV: lambda: fm.flash_attn_with_kvcache(q[:, :1], k, k, softmax_scale=bad, registry="cpu"),
    }
    for op, call in calls.items():
        with pytest.raises(fm.InvalidValueError, match=rf"^{op}: softmax_scale must be finite"):
            call()


def test_a_bool_is_not_an_integer_argument(rng):
    """operator.index takes True as 1: `window=True` or `max_seqlen_q=True`
    is a caller's mistake, refused as a TypeError naming the argument."""
    q = randn(rng, (1, 3, 2, 64), F16)
    calls = {
        "flash_attn_prefill": (r"window", lambda: fm.flash_attn_prefill(q, q, q, causal=True, window=True,
                                                                         layout="blhd", registry="cpu")),
        "flash_attn_func": (r"window_size\[0\]", lambda: fm.flash_attn_func(q, q, q, window_size=(True, 0),
                                                                           registry="cpu")),
        "flash_attn_varlen_func": (r"max_seqlen_q", lambda: fm.flash_attn_varlen_func(
            q[0], q[0], q[0], cu([3]), cu([3]), True, 3, registry="cpu")),
        KV: (r"num_splits", lambda: fm.flash_attn_with_kvcache(q, q, q, num_splits=True, registry="cpu")),
    }
    for op, (name, call) in calls.items():
        with pytest.raises(fm.InvalidTypeError, match=rf"^{op}: {name} must be an integer, got True"):
            call()
