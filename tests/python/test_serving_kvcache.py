"""flash_attn_with_kvcache numerics against the float64 serving
reference: per-sequence cache lengths, contiguous and paged caches, append
then attend, LSE merge, and a paged decode loop; cpu and sim."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import assert_bits_equal
from serving_cases import (BACKENDS, SIMULATED, BF16, BK, DTYPES, F16, F32, assert_out_lse, paged, randn, registry, sinks_for,
                           with_sinks)

SEQ_FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(6, 0)),
    "softcap_sinks": dict(softcap=3.0, sinks=True),
}


def kv_rows(rng, lengths, hkv, d, dtype):
    return [randn(rng, (n, hkv, d), dtype) for n in lengths], [randn(rng, (n, hkv, d), dtype) for n in lengths]


def contiguous(rows: list[np.ndarray], cap: int, rng) -> np.ndarray:
    """[B, cap, Hkv, D] with sequence b's rows first and noise after them."""
    cache = randn(rng, (len(rows), cap) + rows[0].shape[1:], rows[0].dtype)
    for b, r in enumerate(rows):
        cache[b, :len(r)] = r
    return cache


def lengths_for(backend: str) -> list[int]:
    """Cache lengths around the key tile, one empty sequence."""
    return [BK + 1, 3, 0] if backend in SIMULATED else [1, BK - 1, BK, BK + 1, 150, 0]


def kw_for(rng, name: str, heads: int) -> dict:
    return with_sinks(rng, SEQ_FEATURES[name], heads)


CASES = [(b, ql, d, dt, f) for b in BACKENDS
         for ql in (1, 5)
         for d, dt in ([(64, BF16)] if b in SIMULATED else [(64, BF16), (80, F16), (128, BF16), (192, F16), (256, BF16)])
         for f in SEQ_FEATURES]


@pytest.mark.parametrize("backend,ql,d,dtype,feature", CASES)
def test_cache_seqlens_contiguous_and_paged(rng, backend, ql, d, dtype, feature):
    """Each sequence its own length and bottom-right offset; the same call
    through a shuffled paged cache gives the same answer."""
    lengths = lengths_for(backend)
    h, hkv, b = 4, 2, len(lengths)
    ks, vs = kv_rows(rng, lengths, hkv, d, dtype)
    q = randn(rng, (b, ql, h, d), dtype)
    kw = kw_for(rng, feature, h)
    seqlens = np.array(lengths, np.int32)
    reg = registry(backend)
    kc, vc = contiguous(ks, max(lengths) + 7, rng), contiguous(vs, max(lengths) + 7, rng)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, return_softmax_lse=True,
                                          registry=reg, **kw)
    e_out, e_lse = reference.flash_attn_kvcache(q, kc, vc, cache_seqlens=seqlens, **kw)
    assert_out_lse(out, lse, e_out, e_lse, dtype, f"{backend} contiguous qL={ql} d={d} {feature}")
    (kp, vp), table = paged(rng, [ks, vs], 16 if backend in SIMULATED else 32)
    out_p, lse_p = fm.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table,
                                              return_softmax_lse=True, registry=reg, **kw)
    assert_out_lse(out_p, lse_p, e_out, e_lse, dtype, f"{backend} paged qL={ql} d={d} {feature}")


@pytest.mark.parametrize("backend,page_size", [(b, p) for b in BACKENDS
                                               for p in ([16, 64] if b in SIMULATED else [16, 48, 64, 128, 256])])
@pytest.mark.parametrize("ql", [1, 3])
def test_page_sizes(rng, backend, page_size, ql):
    lengths = [page_size - 1, page_size, page_size + 1, 2 * page_size + 5]
    if backend in SIMULATED:
        lengths = lengths[:2]
    ks, vs = kv_rows(rng, lengths, 2, 64, F16)
    (kp, vp), table = paged(rng, [ks, vs], page_size)
    q = randn(rng, (len(lengths), ql, 4, 64), F16)
    seqlens = np.array(lengths, np.int32)
    out, lse = fm.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table, causal=True,
                                          return_softmax_lse=True, registry=registry(backend))
    e_out, e_lse = reference.flash_attn_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table, causal=True)
    assert_out_lse(out, lse, e_out, e_lse, F16, f"{backend} page_size={page_size} qL={ql}")


def test_cache_seqlens_int_and_none_read_every_slot(rng):
    """An int is every sequence's length; None is the whole cache."""
    q = randn(rng, (2, 3, 2, 64), BF16)
    kc, vc = randn(rng, (2, 20, 2, 64), BF16), randn(rng, (2, 20, 2, 64), BF16)
    e12 = reference.flash_attn_kvcache(q, kc, vc, cache_seqlens=12)
    assert_out_lse(fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=12, registry="cpu"), None, e12[0], None,
                   BF16, "int")
    assert_out_lse(fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=[12, 12], registry="cpu"), None, e12[0],
                   None, BF16, "list")
    e20 = reference.flash_attn_kvcache(q, kc, vc)
    assert_out_lse(fm.flash_attn_with_kvcache(q, kc, vc, registry="cpu"), None, e20[0], None, BF16, "None")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paging", [False, True])
@pytest.mark.parametrize("ql,n_new", [(1, 1), (3, 3), (2, 5)])
def test_append_then_attend_equals_attend_on_longer_cache(rng, backend, paging, ql, n_new):
    """k/v written at cache_seqlens, then attended: the caches equal the
    reference append, the output is bit-identical to attending the updated
    cache with the longer lengths, and within tolerance of the reference."""
    lengths = [5, 0, BK + 2] if backend in SIMULATED else [5, 0, BK - 1, 40]
    h, hkv, d = 4, 2, 64
    ks, vs = kv_rows(rng, lengths, hkv, d, BF16)
    b = len(lengths)
    if paging:
        (kc, vc), table = paged(rng, [ks, vs], 16, room=n_new)
    else:
        kc, vc, table = contiguous(ks, max(lengths) + n_new + 2, rng), contiguous(vs, max(lengths) + n_new + 2, rng), None
    q = randn(rng, (b, ql, h, d), BF16)
    k_new, v_new = randn(rng, (b, n_new, hkv, d), BF16), randn(rng, (b, n_new, hkv, d), BF16)
    seqlens = np.array(lengths, np.int32)
    seqlens_before = seqlens.copy()
    exp_k, exp_v = reference.kv_append(kc, vc, k_new, v_new, seqlens, table)
    e_out, e_lse = reference.flash_attn_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=seqlens,
                                                block_table=table, causal=True)
    reg = registry(backend)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                          causal=True, return_softmax_lse=True, registry=reg)
    np.testing.assert_array_equal(seqlens, seqlens_before)  # cache_seqlens is not modified
    assert_bits_equal(kc, exp_k, "k_cache after append")
    assert_bits_equal(vc, exp_v, "v_cache after append")
    again, again_lse = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens + n_new, block_table=table,
                                                  causal=True, return_softmax_lse=True, registry=reg)
    assert_bits_equal(out, again, "append+attend vs attend on the longer cache")
    assert_bits_equal(lse, again_lse, "lse")
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{backend} append paging={paging} qL={ql} n={n_new}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ql", [1, 4])
def test_lse_merge_of_two_cache_halves(rng, backend, ql):
    """Two halves of each sequence's keys in two caches, merged with their
    LSEs, reproduce the one-shot call (sinks joined once, in one half)."""
    lengths = [9, 20] if backend in SIMULATED else [9, 70, 33, 1]
    h, hkv, d = 4, 2, 128 if backend not in SIMULATED else 64
    ks, vs = kv_rows(rng, lengths, hkv, d, F16)
    cut = [n // 2 for n in lengths]
    q = randn(rng, (len(lengths), ql, h, d), F16)
    sinks = sinks_for(rng, h)
    reg = registry(backend)

    def run(krows, vrows, **kw):
        n = [len(r) for r in krows]
        cap = max(n) + 1
        return fm.flash_attn_with_kvcache(q, contiguous(krows, cap, rng), contiguous(vrows, cap, rng),
                                          cache_seqlens=np.array(n, np.int32), softcap=5.0,
                                          return_softmax_lse=True, registry=reg, **kw)
    one, one_lse = run(ks, vs, sinks=sinks)
    oa, la = run([k[:c] for k, c in zip(ks, cut)], [v[:c] for v, c in zip(vs, cut)], sinks=sinks)
    ob, lb = run([k[c:] for k, c in zip(ks, cut)], [v[c:] for v, c in zip(vs, cut)])
    merged, merged_lse = reference.merge_lse(oa, la, ob, lb)
    assert_out_lse(merged, merged_lse, one.astype(np.float64), one_lse.astype(np.float64), F16, "merge vs one", merged=True)
    e_out, e_lse = reference.flash_attn_kvcache(q, contiguous(ks, max(lengths), rng),
                                                contiguous(vs, max(lengths), rng),
                                                cache_seqlens=np.array(lengths), softcap=5.0, sinks=sinks)
    assert_out_lse(merged, merged_lse, e_out, e_lse, F16, "merge vs reference", merged=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_loop(rng, backend, dtype):
    """4 sequences of different lengths in one shuffled paged cache; every
    step appends one token to each and attends it (seqlen_q == 1, the decode
    kernel): within tolerance of the reference at every step, and the cache
    holds exactly the appended tokens."""
    sim = backend in SIMULATED
    lengths, steps, d, h, hkv = ([1, 15, 16, 30], 3, 64, 2, 1) if sim else ([1, 15, 16, 70], 24, 128, 8, 2)
    page_size = 16
    ks, vs = kv_rows(rng, lengths, hkv, d, dtype)
    (kc, vc), table = paged(rng, [ks, vs], page_size, room=steps)
    seqlens = np.array(lengths, np.int32)
    sinks = sinks_for(rng, h)
    ref_k, ref_v = kc.copy(), vc.copy()
    reg = registry(backend)
    for step in range(steps):
        q = randn(rng, (4, 1, h, d), dtype)
        k_new, v_new = randn(rng, (4, 1, hkv, d), dtype), randn(rng, (4, 1, hkv, d), dtype)
        e_out, e_lse = reference.flash_attn_kvcache(q, ref_k, ref_v, k=k_new, v=v_new, cache_seqlens=seqlens,
                                                    block_table=table, causal=True, window_size=(40, 0),
                                                    sinks=sinks)
        out, lse = fm.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                              causal=True, window_size=(40, 0), sinks=sinks,
                                              return_softmax_lse=True, registry=reg)
        ref_k, ref_v = reference.kv_append(ref_k, ref_v, k_new, v_new, seqlens, table)
        assert_bits_equal(kc, ref_k, f"k_cache at step {step}")
        assert_out_lse(out, lse, e_out, e_lse, dtype, f"{backend} decode loop step {step}")
        seqlens += 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_route_float32_q_and_out_param(rng, backend):
    """seqlen_q == 1 takes float32 q too (decode's own dtype); `out` is filled in place."""
    kc, vc = randn(rng, (2, 40, 2, 64), F16), randn(rng, (2, 40, 2, 64), F16)
    seqlens = np.array([7, 40], np.int32)
    q = randn(rng, (2, 1, 4, 64), F32)
    out = np.full(q.shape, np.nan, F32)
    res = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, out=out, registry=registry(backend))
    assert res is out
    assert_out_lse(out, None, reference.flash_attn_kvcache(q, kc, vc, cache_seqlens=seqlens)[0], None, F32,
                   f"{backend} f32 decode")


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_caches_are_appended_in_place(rng, backend):
    torch = pytest.importorskip("torch")
    kc, vc = randn(rng, (2, 20, 2, 64), F16), randn(rng, (2, 20, 2, 64), F16)
    tk, tv = torch.from_numpy(kc.copy()), torch.from_numpy(vc.copy())
    q, kn, vn = randn(rng, (2, 1, 2, 64), F16), randn(rng, (2, 1, 2, 64), F16), randn(rng, (2, 1, 2, 64), F16)
    seqlens = torch.tensor([3, 19], dtype=torch.int32)
    out = fm.flash_attn_with_kvcache(torch.from_numpy(q), tk, tv, torch.from_numpy(kn), torch.from_numpy(vn),
                                     cache_seqlens=seqlens, registry=registry(backend))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    exp_k, exp_v = reference.kv_append(kc, vc, kn, vn, np.array([3, 19]))
    assert_bits_equal(tk.numpy(), exp_k, "torch k_cache")
    assert_bits_equal(tv.numpy(), exp_v, "torch v_cache")
    assert seqlens.tolist() == [3, 19]
    e_out = reference.flash_attn_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=np.array([3, 19]))[0]
    assert_out_lse(out.numpy(), None, e_out, None, F16, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_512_prefill_pages_of_8(rng, backend):
    """D=512's key tile is 8: pages of 8 keys serve the prefill route."""
    lengths = [9, 3]
    ks, vs = kv_rows(rng, lengths, 1, 512, BF16)
    (kp, vp), table = paged(rng, [ks, vs], 8)
    q = randn(rng, (2, 2, 2, 512), BF16)
    seqlens = np.array(lengths, np.int32)
    out, lse = fm.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table, causal=True,
                                          return_softmax_lse=True, registry=registry(backend))
    e_out, e_lse = reference.flash_attn_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table, causal=True)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{backend} D=512 pages of 8")
