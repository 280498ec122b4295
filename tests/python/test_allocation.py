"""Library-owned memory a call sizes: the cpu fast prefill packs only the keys
some row sees (a window over a 2^31-key cache packs the window), and an
allocation the machine cannot satisfy is a BackendError after which the
process keeps working. Each case runs in a fresh interpreter: before the
fix these aborted the process."""
from __future__ import annotations

import pytest

from subprocess_run import run_python

# A paged cache whose one sequence has 2^31 - 1 keys on two alternating
# pages of 2^16 keys, q rows at its end; `window` and the reference over the
# keys the rows see.
PAGED_HUGE = """
from numerics import F16, assert_close, randn
page, kl = 1 << 16, 2**31 - 1
rng = np.random.default_rng(5)
kc, vc = randn(rng, (2, page, 1, 64), F16), randn(rng, (2, page, 1, 64), F16)
table = (np.arange(-(-kl // page)) % 2).astype(np.int32)[None]
ql = 12  # more than a short query: the prefill, which packs the keys it reads
q = randn(rng, (1, ql, 2, 64), F16)
lens = np.array([kl], np.int32)

def expected(window):
    first = kl - ql - window
    p = np.arange(first, kl)
    rows = lambda c: c[table[0][p // page], p % page]
    return reference.attend_sequence(q[0], rows(kc), rows(vc), window_size=(window, -1))[0][None]
"""


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_window_over_a_2g_key_paged_cache_packs_only_the_window(backend):
    """window_size=(15, -1) over 2^31 - 1 paged keys: 18 keys are visible.
    Packing every key would ask for a 512 GiB buffer."""
    import flashmetal as fm
    if backend not in [b for b in ("cpu", "sim") if _has(fm, b)]:
        pytest.skip(f"no {backend} backend")
    run_python(PAGED_HUGE, f"""
        out = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                         window_size=(15, -1), registry={backend!r})
        assert_close(out, expected(15), F16, "window over 2^31 keys")
        print("ok")
    """, env={"PYTHONPATH": _tests_path()}, timeout=300)


def test_unallocatable_pack_buffer_is_a_backend_error_and_the_process_continues():
    """Full attention over the same cache needs ~1 TiB of packed keys: a
    BackendError naming the public function, then a normal call succeeds
    on the same registry."""
    p = run_python(PAGED_HUGE, """
        reg = fm.Registry("cpu")
        try:
            fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, registry=reg)
        except fm.BackendError as e:
            assert str(e).startswith("flash_attn_with_kvcache: ") and "cannot allocate" in str(e), e
            print("refused:", e)
        else:
            raise AssertionError("a 1 TiB pack buffer was allocated")
        out = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                         window_size=(15, -1), registry=reg)
        assert_close(out, expected(15), F16, "after the failed allocation")
        print("ok")
    """, env={"PYTHONPATH": _tests_path()}, timeout=300)
    assert "refused:" in p.stdout and p.stdout.rstrip().endswith("ok"), p.stdout


def _has(fm, name):
    try:
        fm.Registry(name).close()
        return True
    except (ValueError, fm.BackendError):
        return False


def _tests_path():
    import os
    return os.path.dirname(os.path.abspath(__file__))
