"""One rule, one report, one shape: the window rule shared by both routes of
flash_attn_with_kvcache, info()["threads"] as the pool decided it, errors of
scaled_dot_product_attention named after it, and empty batches (B, H or qL
of 0) returning empty results as torch does."""
from __future__ import annotations


import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import F16, F32, assert_close, randn
from subprocess_run import run_python


def test_one_window_rule_for_both_kvcache_routes(registry, rng):
    """window_size=(2**31 - 1, -1) hides no key on either route (the decode
    route refused it with a self-contradicting message); -2 is refused by
    both with the same message."""
    kc, vc = randn(rng, (2, 40, 1, 64), F16), randn(rng, (2, 40, 1, 64), F16)
    lens = np.array([17, 40], np.int32)
    for ql in (1, 3):
        q = randn(rng, (2, ql, 2, 64), F16)
        got = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, window_size=(2**31 - 1, -1),
                                         registry=registry)
        want, _ = reference.flash_attn_kvcache(q, kc, vc, cache_seqlens=lens)
        assert_close(got, want, F16, f"qL={ql}, window (2^31-1, -1)")
        for w in ((-2, -1), (0, -2)):
            i = 0 if w[0] == -2 else 1
            with pytest.raises(fm.InvalidValueError,
                               match=rf"^flash_attn_with_kvcache: window_size\[{i}\] must be -1 \(unbounded\) or >= 0, got -2$"):
                fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, window_size=w, registry=registry)


@pytest.mark.parametrize("value", ["2000", " 1", "+1", "3", "1", "abc"])
def test_info_threads_is_what_the_pool_uses(value):
    """info()["threads"] equals the threads the cpu pool runs a big job on
    (its workers plus the caller), whatever FLASHMETAL_NUM_THREADS holds:
    the library reads the variable, Python has no rules of its own for it."""
    p = run_python("""
        reg = fm.Registry("cpu")
        before = len(os.listdir("/proc/self/task"))
        q = np.random.default_rng(0).standard_normal((4, 8, 256, 64)).astype(np.float32)
        for _ in range(3):
            fm.sdpa(q, q, q, registry=reg)
        started = len(os.listdir("/proc/self/task")) - before
        print(fm.info(reg)["threads"], started + 1)
    """, env={"FLASHMETAL_NUM_THREADS": value}, timeout=120)
    reported, used = p.stdout.split()
    assert reported == used, f"FLASHMETAL_NUM_THREADS={value!r}: info says {reported}, the pool runs {used}"


def test_dropin_errors_name_the_dropin(registry, rng):
    """An error raised inside the route's function (decode, prefill, sdpa:
    here a scale float32 cannot hold) names scaled_dot_product_attention, the
    function the caller called, not the route's."""
    cases = {"flash_attn_decode": ((1, 2, 1, 64), F32, 8), "flash_attn_prefill": ((1, 2, 12, 64), F16, 16),
             "sdpa": ((1, 2, 4, 600), F32, 8)}  # (q shape, dtype, keys)
    for route, (shape, dtype, keys) in cases.items():
        q, k = randn(rng, shape, dtype), randn(rng, shape[:2] + (keys, shape[3]), dtype)
        assert fm.explain(q, k, k).kernel == route
        with pytest.raises(fm.InvalidValueError, match=r"^scaled_dot_product_attention: .*overflows float32") as e:
            fm.scaled_dot_product_attention(q, k, k, scale=1e39, registry=registry)
        assert e.value.op == "scaled_dot_product_attention", route


EMPTY_CASES = [  # (function, q shape, k shape, dtype)
    ("scaled_dot_product_attention", (0, 2, 4, 64), (0, 2, 8, 64), F16),
    ("scaled_dot_product_attention", (1, 0, 4, 64), (1, 0, 8, 64), F16),
    ("scaled_dot_product_attention", (1, 2, 0, 64), (1, 2, 8, 64), F32),
    ("scaled_dot_product_attention", (0, 4, 64), (0, 8, 64), F16),  # 3-D, no heads
    ("scaled_dot_product_attention", (2, 0, 64), (2, 8, 64), F32),  # 3-D, no rows
    ("flash_attn_prefill", (0, 2, 4, 64), (0, 2, 8, 64), F16),
    ("flash_attn_prefill", (1, 0, 4, 64), (1, 0, 8, 64), F16),
    ("flash_attn_prefill", (1, 2, 0, 64), (1, 2, 8, 64), F16),
    ("sdpa", (0, 2, 4, 64), (0, 2, 8, 64), F32),
    ("sdpa", (2, 0, 4, 64), (2, 0, 8, 64), F32),
    ("sdpa", (2, 2, 0, 64), (2, 2, 8, 64), F16),
    ("flash_attn_decode", (0, 2, 64), (0, 2, 8, 64), F32),
    ("flash_attn_decode", (2, 0, 64), (2, 0, 8, 64), F32),
    ("flash_attn_decode", (0, 64), (0, 8, 64), F32),  # 3-D cache, no heads
]


@pytest.mark.parametrize("fn,qs,ks,dtype", EMPTY_CASES, ids=[f"{c[0]}-{c[1]}" for c in EMPTY_CASES])
def test_empty_batch_gives_an_empty_result(registry, fn, qs, ks, dtype):
    q, k = np.zeros(qs, dtype), np.zeros(ks, dtype)
    extra = {"flash_attn_decode": (8,)}.get(fn, ())
    out = getattr(fm, fn)(q, k, k, *extra, registry=registry)
    assert out.shape == q.shape and out.dtype == (F32 if fn == "flash_attn_decode" else dtype)


def test_empty_batch_through_torch(registry):
    torch = pytest.importorskip("torch")
    q = torch.zeros(0, 2, 4, 64, dtype=torch.float16)
    out = fm.scaled_dot_product_attention(q, q, q, registry=registry)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (0, 2, 4, 64)


@pytest.mark.parametrize("dtype", [F16, F32])
def test_no_keys_gives_zeros_as_torch(registry, dtype):
    """key and value of sequence length 0: torch's SDPA returns zeros (each
    row attends to nothing); so does the drop-in, with or without a mask,
    instead of an error about a kv_len nobody passed."""
    torch = pytest.importorskip("torch")
    tdt = {F16: torch.float16, F32: torch.float32}[dtype]
    q = torch.randn(2, 4, 3, 64, dtype=tdt)
    k, v = torch.randn(2, 2, 0, 64, dtype=tdt), torch.randn(2, 2, 0, 32, dtype=tdt)
    for mask in (None, torch.ones(3, 0, dtype=torch.bool)):
        want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), mask,
                                                                enable_gqa=True)
        out = fm.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, registry=registry)
        assert out.dtype == tdt and out.shape == want.shape and torch.equal(out.double(), want)
        assert fm.last_route().kernel == "none"
    with pytest.raises(ValueError, match="attn_mask shape"):
        fm.scaled_dot_product_attention(q, k, v, torch.ones(3, 5, dtype=torch.bool), enable_gqa=True,
                                        registry=registry)
