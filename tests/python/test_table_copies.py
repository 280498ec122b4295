"""Tables (block_table, cache_seqlens, cu_seqlens) are checked and bound as a
private copy: a second thread rewriting them during calls (a scheduler
reusing one array for its next step) cannot make a kernel follow an entry
nobody checked. Each call either is refused (the copy it took was bad) or
returns exactly what the good tables give. Before, the kernels re-read the
caller's tables while running: SIGSEGV. Also: an append whose writes of two
table entries land on one cache slot is refused."""
from __future__ import annotations

import os

import numpy as np
import pytest

import flashmetal as fm
from conftest import BACKENDS
from numerics import F16, assert_bits_equal, randn
from subprocess_run import run_python
from serving_native import KV_APPEND_OP, kv_append

_TESTS = os.path.dirname(os.path.abspath(__file__))

# Runs `calls` (name -> (function returning an array, good tables, bad
# tables)) while a thread flips every table between its good and bad
# contents; each result must be a refusal or the good tables' bits.
RACE = """
import sys
from numerics import F16, randn
sys.setswitchinterval(1e-6)

def race(reg, name, call, tables, good, bad, n):
    for t, g in zip(tables, good):
        t[...] = g
    want = call()
    stop = threading.Event()
    def writer():
        while not stop.is_set():
            for t, g, b in zip(tables, good, bad):
                t[...] = b
                time.sleep(0)  # gives up the GIL in the bad state too
                t[...] = g
                time.sleep(0)
    th = threading.Thread(target=writer)
    th.start()
    ok = refused = 0
    try:
        for _ in range(n):
            try:
                got = call()
            except fm.InvalidValueError:
                refused += 1
                continue
            assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)), \\
                f"{name}: a result that is not the good tables'"
            ok += 1
    finally:
        stop.set()
        th.join()
    print(name, "ok", ok, "refused", refused)

rng = np.random.default_rng(9)
B, H, D, PAGE = 2, 2, 64, 16
kp, vp = randn(rng, (9, PAGE, 1, D), F16), randn(rng, (9, PAGE, 1, D), F16)
table = np.zeros((B, 4), np.int32)
good_table = rng.permutation(8)[:8].reshape(B, 4).astype(np.int32)
bad_table = np.full((B, 4), 10**9, np.int32)
lens = np.zeros(B, np.int32)
good_lens, bad_lens = np.array([40, 64], np.int32), np.array([40, 10**9], np.int32)
q1 = randn(rng, (B, 1, H, D), F16)
q3 = randn(rng, (B, 3, H, D), F16)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_tables_rewritten_during_calls(backend):
    n = 200 if backend == "cpu" else 12
    p = run_python(RACE, f"""
        reg = fm.Registry({backend!r})
        for name, q in (("decode", q1), ("prefill", q3)):
            race(reg, name, lambda: fm.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table,
                                                               causal=True, registry=reg),
                 [table, lens], [good_table, good_lens], [bad_table, bad_lens], {n})
        qv, kv = randn(rng, (5, H, D), F16), randn(rng, (9, 1, D), F16)
        cu_q, cu_k = np.array([0, 2, 5], np.int32), np.zeros(3, np.int32)
        race(reg, "varlen", lambda: fm.flash_attn_varlen_func(qv, kv, kv, cu_q, cu_k, 3, 5, registry=reg),
             [cu_k], [np.array([0, 4, 9], np.int32)], [np.array([0, 4, 10**6], np.int32)], {n})
        from serving_native import kv_append
        kn = randn(rng, (B, 3, 1, D), F16)
        def append():
            kc, vc = kp.copy(), vp.copy()
            kv_append(reg, kn, kn, kc, vc, lens, table)
            return kc
        race(reg, "append", append, [table, lens], [good_table, good_lens - 3],
             [bad_table, np.array([40, 10**9], np.int32)], {n})
    """, env={"PYTHONPATH": _TESTS}, timeout=600)
    print(p.stdout)
    for name in ("decode", "prefill", "varlen", "append"):
        assert f"{name} ok" in p.stdout, p.stdout


def test_append_writing_one_slot_through_two_entries_is_refused(registry, rng):
    """Two sequences whose block_table rows name the same page, both writing
    row 5 of it (or one row naming a page twice over its written range): a
    ValueError naming the op, block_table and both entries; nothing written.
    Sharing a page whose written rows do not meet is fine (prefix sharing)."""
    d, page = 64, 8
    kc, vc = randn(rng, (6, page, 1, d), F16), randn(rng, (6, page, 1, d), F16)
    kn, vn = randn(rng, (2, 2, 1, d), F16), randn(rng, (2, 2, 1, d), F16)
    k9, v9 = randn(rng, (2, 9, 1, d), F16), randn(rng, (2, 9, 1, d), F16)  # more rows than a page
    before = kc.copy(), vc.copy()
    for table, lens, new, entries in (
            ([[0, 1], [2, 1]], [12, 12], (kn, vn), r"block_table\[0, 1\] and block_table\[1, 1\] both name page 1"),
            ([[0, 3], [3, 4]], [9, 1], (kn, vn), r"block_table\[0, 1\] and block_table\[1, 0\] both name page 3"),
            ([[5, 5], [2, 4]], [0, 0], (k9, v9), r"block_table\[0, 0\] and block_table\[0, 1\] both name page 5")):
        t, ln = np.array(table, np.int32), np.array(lens, np.int32)
        kn, vn = new
        with pytest.raises(fm.InvalidValueError, match=rf"^{KV_APPEND_OP}: {entries}"):
            kv_append(registry, kn, vn, kc, vc, ln, t)
        with pytest.raises(fm.InvalidValueError, match=rf"^flash_attn_with_kvcache: {entries}"):
            fm.flash_attn_with_kvcache(randn(rng, (2, 1, 2, d), F16), kc, vc, kn, vn, cache_seqlens=ln,
                                       block_table=t, registry=registry)
        assert_bits_equal(kc, before[0], "nothing written")
        assert_bits_equal(vc, before[1], "nothing written")
    # Page 1 shared: sequence 0 writes its rows 4-5, sequence 1 its rows 6-7.
    kn, vn = randn(rng, (2, 2, 1, d), F16), randn(rng, (2, 2, 1, d), F16)
    t, ln = np.array([[0, 1], [2, 1]], np.int32), np.array([12, 14], np.int32)
    kv_append(registry, kn, vn, kc, vc, ln, t)
    assert_bits_equal(kc[1, 4:6], kn[0], "sequence 0's rows of the shared page")
    assert_bits_equal(kc[1, 6:8], kn[1], "sequence 1's rows of the shared page")
