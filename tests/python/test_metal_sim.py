"""The Metal backend on the metal-sim runtime (Linux): what only it shows.
The numeric suite runs on metal-sim through the `registry` fixture; here:
the emulated device in info(), Registry.empty memory that Metal wraps once,
the counters per call, every memoryBarrier the backend places being needed,
the pipeline thread limit, and the device choice."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

import flashmetal as fm
from conftest import BACKENDS
from flashmetal import reference
from flashmetal.registry import metal_sim_counters
from metal_sim_delta import delta
from numerics import F16, F32, assert_close, randn

pytestmark = pytest.mark.skipif("metal-sim" not in BACKENDS, reason="this build has no metal-sim backend")
PAGE = 16384


@pytest.fixture(scope="module")
def msim() -> fm.Registry:
    r = fm.Registry("metal-sim")
    yield r
    r.close()


def test_info_names_the_emulated_device(msim):
    i = fm.info(msim)
    assert i["backend"] == "metal-sim"
    assert i["device"].startswith("Apple M2 (metal-sim") and " on " in i["device"], i["device"]
    assert fm.info("cpu")["device"] != i["device"]


def test_empty_is_page_aligned_zeroed_and_owned(msim):
    a = msim.empty((3, 5, 7), F16)
    assert a.shape == (3, 5, 7) and a.dtype == F16 and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % PAGE == 0
    assert not a.any()
    a[...] = 1.5
    b = msim.empty([4], np.int32)
    b[:] = 7
    del b
    assert (a == np.float16(1.5)).all()
    v = a[1]
    del a
    import gc
    gc.collect()
    assert (v == np.float16(1.5)).all(), "a view keeps the memory alive"
    assert msim.empty((0, 4), F32).shape == (0, 4)
    with pytest.raises(ValueError):
        msim.empty((-1, 4), F32)
    with pytest.raises(TypeError):
        msim.empty((2,), "not a dtype")
    with pytest.raises(ValueError, match="more than any allocation"):
        msim.empty((2**40, 2**40), F32)
    with pytest.raises(ValueError, match="cannot allocate"):
        msim.empty((2**58,), F32)
    with pytest.raises(ValueError):
        fm.registry._native.call_static("fm_free_host", fm.registry._native.ffi().NULL, op="free_host")


def test_empty_memory_is_shared_with_torch(msim):
    torch = pytest.importorskip("torch")
    a = msim.empty((2, 3), F32)
    t = torch.from_numpy(a)
    t += 2
    assert (a == 2).all()


def _decode(reg, q, k, v, kv_len, out=None):
    return fm.flash_attn_decode(q, k, v, kv_len, out=out, registry=reg)


def test_decode_over_a_library_cache_wraps_and_copies_nothing(msim, rng):
    h, hkv, cap, d = 4, 2, 512, 64
    tmp_bytes = h * 32 * (d + 2) * 4
    k, v = msim.empty((hkv, cap, d), F16), msim.empty((hkv, cap, d), F16)
    k[...] = randn(rng, k.shape, F16)
    v[...] = randn(rng, v.shape, F16)
    q, out = msim.empty((h, d), F32), msim.empty((h, d), F32)
    for step in range(3):
        q[...] = randn(rng, q.shape, F32)
        before = metal_sim_counters()
        _decode(msim, q, k, v, 300 + step, out=out)
        c = delta(before)
        assert_close(out, reference.decode(q, k, v, 300 + step), F32, f"step {step}")
        assert c["command_buffers"] == 1 and c["encoders"] == 1 and c["dispatches"] == 2, c
        assert c["bytes_copied_in"] == 0 and c["bytes_copied_out"] == 0, c
        if step == 0:
            assert c["bytes_wrapped"] >= k.nbytes + v.nbytes, c
        else:
            # Only the library's own scratch (tmp) is new memory.
            assert c["bytes_wrapped"] <= tmp_bytes + 2 * PAGE, c
    # The same step over a cache in ordinary numpy memory wraps it again.
    kn, vn = np.array(k), np.array(v)
    _decode(msim, q, kn, vn, 300)
    before = metal_sim_counters()
    _decode(msim, q, kn, vn, 300)
    assert delta(before)["bytes_wrapped"] >= kn.nbytes + vn.nbytes


def test_counters_per_call_and_batch(msim, rng):
    q = randn(rng, (4, 64), F32)
    k = randn(rng, (2, 40, 64), F16)
    v = randn(rng, (2, 40, 64), F16)
    before = metal_sim_counters()
    with msim.batch():
        a = _decode(msim, q, k, v, 30)
        b = _decode(msim, q, k, v, 40)
    c = delta(before)
    assert c["command_buffers"] == 1 and c["commits"] == 1 and c["dispatches"] == 4 and c["barriers"] == 3, c
    assert c["live_command_buffers"] == 0 and c["violations"] == 0, c
    assert_close(a, reference.decode(q, k, v, 30), F32, "batched a")
    assert_close(b, reference.decode(q, k, v, 40), F32, "batched b")


def test_a_call_with_nothing_to_run_makes_no_command_buffer(msim, rng):
    """Varlen prefill whose every query sequence is empty: the dispatch list
    is empty, and the backend makes no command buffer (one made and never
    committed would hold one of the queue's 64 slots)."""
    q = np.zeros((0, 4, 64), F16)
    k = randn(rng, (5, 2, 64), F16)
    before = metal_sim_counters()
    out = fm.flash_attn_varlen_func(q, k, k, cu_seqlens_q=np.array([0, 0], np.int32),
                                    cu_seqlens_k=np.array([0, 5], np.int32), max_seqlen_q=1, max_seqlen_k=5,
                                    registry=msim)
    assert out.shape == (0, 4, 64)
    assert delta(before) == dict.fromkeys(before, 0)


def test_threads_without_a_pool_release_every_command_buffer(msim, rng):
    """Python threads have no autorelease pool: the backend drains its own
    per call, so 70 calls (more than a queue's 64 command buffers) on two
    threads leave none alive and break no rule."""
    import threading

    q = randn(rng, (4, 64), F32)
    k, v = randn(rng, (2, 40, 64), F16), randn(rng, (2, 40, 64), F16)
    exp = reference.decode(q, k, v, 40)
    results = []

    def work():
        for _ in range(35):
            results.append(_decode(msim, q, k, v, 40))

    before = metal_sim_counters()
    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c = delta(before)
    assert len(results) == 70 and c["command_buffers"] == 70 and c["live_command_buffers"] == 0, c
    for r in results:
        assert_close(r, exp, F32, "threaded decode")


# Each multi-dispatch operation: (name, run(reg, rng) -> (actual, expected)).
def _vec(reg, rng):
    q, k, v = randn(rng, (4, 64), F32), randn(rng, (2, 48, 64), F16), randn(rng, (2, 48, 64), F16)
    return _decode(reg, q, k, v, 45), reference.decode(q, k, v, 45)


def _vec_seq(reg, rng):
    q = randn(rng, (2, 1, 4, 64), F32)
    kc, vc = randn(rng, (2, 40, 2, 64), F16), randn(rng, (2, 40, 2, 64), F16)
    lens = np.array([33, 17], dtype=np.int32)
    out = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, registry=reg)
    return out, reference.flash_attn_kvcache(q, kc, vc, cache_seqlens=lens)[0]


def _append_then_decode(reg, rng):
    q = randn(rng, (1, 1, 4, 64), F32)
    kc, vc = randn(rng, (1, 40, 2, 64), F16), randn(rng, (1, 40, 2, 64), F16)
    kn, vn = randn(rng, (1, 1, 2, 64), F16), randn(rng, (1, 1, 2, 64), F16)
    lens = np.array([20], dtype=np.int32)
    exp = reference.flash_attn_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lens)[0]
    out = fm.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lens, registry=reg)
    return out, exp


_FLIP = itertools.count()


def _prefill_mask(reg, rng):
    """Causal and anti-causal masks in turn: the blk the library computes
    for one skips the tiles the other needs, so a prefill that reads the
    previous call's blk (the pre-pass not run first) is wrong."""
    q, k, v = (randn(rng, (1, 2, 160, 64), F16) for _ in range(3))
    mask = reference.mask_additive(160, 160, causal=True).astype(F16)
    if next(_FLIP) % 2:
        mask = np.ascontiguousarray(mask.T)
    out = fm.flash_attn_prefill(q, k, v, mask=mask, registry=reg)
    return out, reference.attention(q, k, v, mask=mask)


def _chained_calls_in_a_batch(reg, rng):
    """Two calls in one batch scope (one command buffer), the second reading
    what the first writes."""
    q, k, v = (randn(rng, (1, 2, 24, 64), F16) for _ in range(3))
    with reg.batch():
        o1 = fm.flash_attn_prefill(q, k, v, registry=reg)
        o2 = fm.flash_attn_prefill(o1, k, v, registry=reg)
    return o2, reference.attention(reference.attention(q, k, v).astype(F16), k, v)


MULTI = {"vec": _vec, "vec_seq": _vec_seq, "append_then_decode": _append_then_decode, "prefill_mask": _prefill_mask,
         "chained_calls_in_a_batch": _chained_calls_in_a_batch}


@pytest.fixture
def fresh_msim() -> fm.Registry:
    """A metal-sim registry of its own: its scratch pool holds only what the
    test's calls gave back, so which block a call reuses does not depend on
    the tests run before it."""
    r = fm.Registry("metal-sim")
    yield r
    r.close()


@pytest.mark.parametrize("op", sorted(MULTI))
def test_every_barrier_is_needed(fresh_msim, op, monkeypatch):
    """Dropping any one memoryBarrier the backend places (the runtime ignores
    the n-th) gives a wrong result; with all of them the result is right."""
    msim = fresh_msim
    run = MULTI[op]
    rng = np.random.default_rng(7)
    before = metal_sim_counters()
    out, exp = run(msim, rng)
    barriers = delta(before)["barriers"]
    assert barriers >= 1, f"{op} places no barrier"
    assert_close(np.asarray(out, dtype=np.float64), exp, out.dtype, op)
    for n in range(1, barriers + 1):
        run(msim, rng)  # the scratch the next call reuses holds this call's values
        monkeypatch.setenv("FLASHMETAL_METAL_SIM_DROP_BARRIER", str(n))
        out, exp = run(msim, rng)
        monkeypatch.delenv("FLASHMETAL_METAL_SIM_DROP_BARRIER")
        ok, worst = reference.close(np.asarray(out, dtype=np.float64), exp, 1e-2, 1e-2)
        assert not ok, f"{op}: without barrier {n} of {barriers} the result is still right"


RUN_AT_LIMIT = """
import numpy as np, flashmetal as fm
from flashmetal import reference
rng = np.random.default_rng(3)
reg = fm.Registry("metal-sim")
q, k, v = (rng.standard_normal((1, 2, 20, 64)).astype(np.float16) for _ in range(3))
out = fm.flash_attn_prefill(q, k, v, registry=reg)
ok, worst = reference.close(out.astype(np.float64), reference.attention(q, k, v), 2e-2, 2e-2)
qd, kd, vd = (rng.standard_normal(s).astype(np.float32) for s in ((4, 64), (2, 40, 64), (2, 40, 64)))
ok2, _ = reference.close(fm.flash_attn_decode(qd, kd, vd, 40, registry=reg), reference.decode(qd, kd, vd, 40),
                         1e-4, 1e-4)
from flashmetal.registry import metal_sim_counters
print(ok, ok2, metal_sim_counters()["violations"])
"""


@pytest.mark.parametrize("limit", [1024, 768, 512, 256, 64])
def test_pipelines_with_a_lower_thread_limit(limit):
    """Pipelines whose maxTotalThreadsPerThreadgroup is below what a kernel
    asks for (a real pipeline's limit depends on its register use): the
    decode reduce (1024 threads, flexible) narrows its threadgroups and stays
    right down to 256; prefill's 128-thread groups are refused at 64 with a
    clear error instead of a dispatch Metal would reject."""
    env = dict(os.environ, FLASHMETAL_METAL_SIM_MAX_THREADS=str(limit))
    p = subprocess.run([sys.executable, "-c", RUN_AT_LIMIT], capture_output=True, text=True, env=env, timeout=600)
    if limit >= 128:
        assert p.returncode == 0 and p.stdout.split() == ["True", "True", "0"], p.stdout + p.stderr
    else:
        assert p.returncode != 0 and "needs 128 threads per threadgroup, the pipeline allows 64" in p.stderr, \
            p.stdout + p.stderr


DEVICE = """
import flashmetal as fm
try:
    r = fm.Registry("metal-sim")
    print("OK", fm.info(r)["device"])
except fm.BackendError as e:
    print("REFUSED", e)
"""


@pytest.mark.parametrize("devices,choice,expect", [
    ("paravirtual", "", "REFUSED"),
    ("paravirtual,m2", "", "REFUSED"),
    ("paravirtual,m2", "M2", "OK Apple M2"),
    ("m2", "no such gpu", "REFUSED"),
])
def test_device_choice(devices, choice, expect):
    env = dict(os.environ, FLASHMETAL_METAL_SIM_DEVICES=devices, FLASHMETAL_METAL_DEVICE=choice)
    p = subprocess.run([sys.executable, "-c", DEVICE], capture_output=True, text=True, env=env, timeout=120)
    assert p.stdout.startswith(expect), p.stdout + p.stderr
    if expect == "REFUSED" and not choice:
        assert "Apple7" in p.stdout and "FLASHMETAL_METAL_DEVICE" in p.stdout, p.stdout


COPY_PATH = """
import numpy as np, flashmetal as fm
from flashmetal import reference
from flashmetal.registry import metal_sim_counters
rng = np.random.default_rng(5)
reg = fm.Registry("metal-sim")
q = rng.standard_normal((1, 1, 4, 64)).astype(np.float32)
kc, vc = (rng.standard_normal((1, 40, 2, 64)).astype(np.float16) for _ in range(2))
kn, vn = (rng.standard_normal((1, 1, 2, 64)).astype(np.float16) for _ in range(2))
q0, kn0 = q.copy(), kn.copy()
lens = np.array([20], dtype=np.int32)
exp, _ = reference.flash_attn_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lens)
c0 = metal_sim_counters()
out = fm.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lens, registry=reg)
c1 = metal_sim_counters()
ok, _ = reference.close(out.astype(np.float64), exp, 1e-3, 1e-3)
appended = bool((kc[0, 20] == kn[0, 0]).all() and (vc[0, 20] == vn[0, 0]).all())
print(ok, appended, (q == q0).all() and (kn == kn0).all(), c1["bytes_wrapped"] - c0["bytes_wrapped"],
      c1["bytes_copied_in"] - c0["bytes_copied_in"] > 0, c1["bytes_copied_out"] - c0["bytes_copied_out"] > 0,
      c1["violations"])
"""


def test_copy_path_when_metal_refuses_to_wrap():
    """Where Metal refuses bytesNoCopy the backend copies tensors in, and back
    out only those a kernel wrote: the appended cache rows arrive, inputs
    are untouched, and the result is right."""
    env = dict(os.environ, FLASHMETAL_METAL_SIM_WRAP="0")
    p = subprocess.run([sys.executable, "-c", COPY_PATH], capture_output=True, text=True, env=env, timeout=300)
    assert p.stdout.split() == ["True", "True", "True", "0", "True", "True", "0"], p.stdout + p.stderr


def test_an_access_inside_one_wrap_and_past_another_is_in_bounds(msim, rng):
    """No-copy wraps reach to their page's end, over the next tensor in the
    same page: K's first column pair of head 1 (odd D, so a 4-byte load at an
    odd element) is placed across a page boundary right after q, whose wrap
    ends there. The access lies wholly inside K's binding: no violation, and
    the result matches the reference."""
    d = 111
    arena = np.zeros(4 * PAGE, np.uint8)
    page = (-arena.ctypes.data) % PAGE + 2 * PAGE  # a page boundary inside the arena

    def at(offset: int, shape: tuple[int, ...]) -> np.ndarray:
        x = np.ndarray(shape, F16, buffer=arena, offset=offset)
        x[...] = randn(rng, shape, F16)
        return x

    k_shape = (2, 17, 2, d)
    k = at(page - 2 * (d + 1), k_shape)  # element d (head 1, column 0) starts 2 bytes before the boundary
    q = at(page - 2 * (d + 1) - 2 * 2 * 6 * 2 * d, (2, 6, 2, d))  # q ends where k starts, in the same page
    v = randn(rng, k_shape, F16)
    before = metal_sim_counters()["violations"]
    kw = dict(causal=True, window_size=(5, 0), softcap=2.0)
    out, lse, _ = fm.flash_attn_func(q, k, v, return_attn_probs=True, registry=msim, **kw)
    assert metal_sim_counters()["violations"] == before
    e_out, _ = reference.flash_attn(q, k, v, **kw)
    assert_close(out, e_out, F16, "odd D across a page boundary")
