"""Fuzzing: the C ABI through cffi and the Python API through hypothesis.

Contract: every call either succeeds -- with the output matching the float64
reference when the inputs are finite -- or raises ValueError / TypeError whose
message starts with the op's name; never a crash, never a write outside
`out`, inputs never modified.

Counts: FLASHMETAL_FUZZ_SCALE (default 1) multiplies every count; `make fuzz`
raises it and runs the same cases against an AddressSanitizer build. The
C-ABI cases run in a subprocess (tests/fuzz/run_fuzz.py) so that a crash is
reported with the case that caused it instead of killing pytest.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashmetal as fm
from flashmetal import _loader, reference
from numerics import BF16, F16, F32, TOLERANCE
from cabi import err_text

ROOT = Path(__file__).resolve().parents[2]
SCALE = float(os.environ.get("FLASHMETAL_FUZZ_SCALE", "1"))
RANDOM = os.environ.get("FLASHMETAL_FUZZ_RANDOM", "0") == "1"
G = 64


def n(k: int) -> int:
    return max(1, int(k * SCALE))


FUZZ = settings(max_examples=n(400), deadline=None, database=None, derandomize=not RANDOM,
                suppress_health_check=list(HealthCheck), print_blob=True)

# ------------------------------------------------------------------ C ABI


# metal-sim runs the sim's kernels behind the Metal host code: half the sim's
# cases keep its share of `make test` proportionate.
ABI_CASES = {"cpu": 9000, "sim": 1200, "metal-sim": 600}


def _backends():
    out = []
    for b in ("cpu", "sim", "metal-sim"):
        try:
            fm.Registry(b).close()
            out.append(b)
        except ValueError:
            pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", _backends())
def test_abi_fuzz(backend, tmp_path):
    """Seeded C-ABI cases in a subprocess; see tests/fuzz/fuzz_abi.py."""
    cases = n(ABI_CASES[backend])
    seed = int(os.environ.get("FLASHMETAL_FUZZ_SEED", "0"))
    state = tmp_path / "state.txt"
    env = dict(os.environ, FLASHMETAL_LIB=str(_loader.library_path()))
    p = subprocess.run([sys.executable, str(ROOT / "tests/fuzz/run_fuzz.py"), "--backend", backend,
                        "--cases", str(cases), "--seed", str(seed), "--state", str(state)],
                       capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode not in (0, 1):
        last = state.read_text() if state.exists() else "(no state)"
        pytest.fail(f"fuzz subprocess died with status {p.returncode} on:\n{last}\n"
                    f"stderr tail:\n{p.stderr[-3000:]}")
    if not p.stdout.strip():
        pytest.fail(f"fuzz subprocess printed no summary (status {p.returncode}); stderr tail:\n{p.stderr[-3000:]}")
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    print(summary)
    assert summary["failures"] == 0, "\n".join(summary["first_failures"])
    assert summary["cases"] == cases


# ------------------------------------------------------- reproducers / bugs


def _subprocess(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FLASHMETAL_LIB=str(_loader.library_path()))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


_PRELUDE = """
import numpy as np
from flashmetal import _loader
ffi, lib = _loader.load()
h = ffi.new("FMRegistry **"); err = ffi.new("FMError *")
assert lib.fm_create_registry(b"cpu", h, err) == 0
reg = h[0]
buf = np.zeros(4096, np.uint8)
def T(dtype, shape, nbytes=64):
    t = ffi.new("FMTensor *"); t.data = ffi.cast("void *", buf.ctypes.data)
    t.nbytes = nbytes; t.dtype = dtype; t.ndim = len(shape)
    for i, d in enumerate(shape): t.shape[i] = d
    return t
"""


def test_abi_prefill_huge_seq_len_small_buffer():
    """A q of seq_len 2^63-1 over a 64-byte buffer is refused before any
    arithmetic on its dims (q_offset + seq_len_q would overflow and trap):
    TensorRef checks nbytes against the shape on entry."""
    p = _subprocess(_PRELUDE + """
o = ffi.new("FMPrefillOptions *"); o.scale = 0.1; o.q_offset = 1
q = T(2, [1, 1, 2**63 - 1, 64]); k = T(2, [1, 1, 4, 64])
s = lib.fm_dispatch_prefill(reg, q, k, k, ffi.NULL, ffi.NULL, q, o, err)
print(s, (ffi.string(err.op) + b": " + ffi.string(err.message)).decode())
""")
    assert p.returncode == 0, p.stderr[-2000:]
    status, msg = p.stdout.split(" ", 1)
    assert status == "1" and msg.startswith("flash_attn_prefill: q "), p.stdout


def test_abi_vec_huge_heads_small_buffer():
    """Found by the fuzzer: fm_dispatch_vec sized its own tmp from q's shape
    before checking q's buffer, and a [1, 2^31, 64] q of 64 bytes asked for
    18 TB: 'Fatal error: failed to allocate' (SIGABRT). Fixed by TensorRef."""
    p = _subprocess(_PRELUDE + """
o = ffi.new("FMVecOptions *"); o.scale = 0.1; o.kv_len = 1
q = T(0, [1, 2**31, 64]); k = T(0, [1, 1, 4, 64])
s = lib.fm_dispatch_vec(reg, q, k, k, ffi.NULL, ffi.NULL, q, o, err)
print(s, (ffi.string(err.op) + b": " + ffi.string(err.message)).decode())
""")
    assert p.returncode == 0, p.stderr[-2000:]
    status, msg = p.stdout.split(" ", 1)
    assert status == "1" and msg.startswith("flash_attn_vec: q buffer too small"), p.stdout


def _machine_grants_malloc(nbytes: int) -> bool:
    """Whether malloc(nbytes) succeeds here (the memory is freed untouched).
    Linux's heuristic overcommit refuses a request beyond RAM + swap; macOS
    and Linux's always-overcommit mode grant it, and then the library cannot
    see a failure to report."""
    import ctypes
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    p = libc.malloc(nbytes)
    libc.free(p)
    return p is not None


# Decode scratch for q = [1, _HUGE_ROWS, 64]: rows * NWG * (D + 2) floats.
_HUGE_ROWS = 2**22
_HUGE_TMP_BYTES = _HUGE_ROWS * 32 * (64 + 2) * 4


@pytest.mark.skipif(_machine_grants_malloc(_HUGE_TMP_BYTES),
                    reason=f"this machine grants a {_HUGE_TMP_BYTES / 1e9:.0f} GB malloc (overcommit), so there "
                           "is no allocation failure to report")
def test_abi_vec_tmp_allocation_failure_is_an_error():
    """An honest q of 1 GiB (untouched, never read) makes the library ask for
    ~34 GB of decode scratch: that must be an error, not an abort."""
    p = _subprocess(_PRELUDE + """
import mmap
rows = """ + str(_HUGE_ROWS) + """
nbytes = rows * 64 * 4
m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, 'MAP_NORESERVE', 0))
q = ffi.new("FMTensor *"); q.data = ffi.cast("void *", ffi.from_buffer(m)); q.nbytes = nbytes; q.dtype = 0
q.ndim = 3; q.shape[0] = 1; q.shape[1] = rows; q.shape[2] = 64
k = T(0, [1, 1, 4, 64], nbytes=1024)
o = ffi.new("FMVecOptions *"); o.scale = 0.1; o.kv_len = 1
s = lib.fm_dispatch_vec(reg, q, k, k, ffi.NULL, ffi.NULL, q, o, err)
print(s, (ffi.string(err.op) + b": " + ffi.string(err.message)).decode())
""")
    assert p.returncode == 0, p.stderr[-1500:]
    assert p.stdout.startswith("3 flash_attn_vec: cannot allocate"), p.stdout  # FM_ERROR_BACKEND


def test_alloc_blk_names_its_op():
    ffi, lib = _loader.load()
    t = ffi.new("FMTensor *")
    err = ffi.new("FMError *")
    assert lib.fm_alloc_blk(0, 16, 64, t, err) == 1
    assert err_text(err).decode().startswith("alloc_blk:")


def test_build_mask_checks_int32_before_allocating(cpu):
    with pytest.raises(ValueError, match="^build_mask: kv_len .* int32"):
        fm.build_mask(6, 2**31, registry=cpu)


# --------------------------------------------------------- the Python API

# Errors name the public function (the library's op when called through the ABI).
OPS = ("flash_attn_prefill", "flash_attn_vec", "flash_attn_vec_reduce_tq_hb_undo", "sdpa",
       "flash_attn_prefill_mask", "flash_attn_prefill_blk", "scaled_dot_product_attention", "blk_byte_len",
       "alloc_blk", "flash_attn_decode", "build_mask", "build_blk")


def _expect_error(e: BaseException, ops: tuple[str, ...]) -> None:
    assert isinstance(e, (ValueError, TypeError)), f"{type(e).__name__}: {e}"
    assert str(e).split(":", 1)[0] in ops, f"message does not name the op: {e}"


def _view(draw, a: np.ndarray) -> np.ndarray:
    """`a`'s values as a contiguous array or as a non-contiguous view."""
    kind = draw(st.sampled_from(["c", "c", "strided", "fortran", "reversed"]))
    if kind == "strided" and a.ndim:
        big = np.zeros(a.shape[:-1] + (a.shape[-1] * 2,), a.dtype)
        big[..., ::2] = a
        return big[..., ::2]
    if kind == "fortran":
        return np.asfortranarray(a)
    if kind == "reversed" and a.ndim:
        return np.ascontiguousarray(a[..., ::-1])[..., ::-1]
    return a


class Guarded:
    """An output array in the middle of a buffer with random guard bytes."""

    def __init__(self, shape, dtype, rng):
        dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(shape)) * dtype.itemsize
        self.raw = rng.integers(0, 256, self.nbytes + 2 * G, dtype=np.uint8)
        self.snap = self.raw.copy()
        self.arr = self.raw[G:G + self.nbytes].view(dtype).reshape(shape)

    def guards_ok(self) -> bool:
        return (np.array_equal(self.raw[:G], self.snap[:G])
                and np.array_equal(self.raw[G + self.nbytes:], self.snap[G + self.nbytes:]))


def _values(rng, shape, dtype, nonfinite=False):
    x = rng.standard_normal(shape).astype(np.float32)
    if nonfinite and x.size:
        x.reshape(-1)[rng.integers(0, x.size, 1 + x.size // 40)] = rng.choice([np.nan, np.inf, -np.inf])
    return x.astype(dtype)


def _run(fn, inputs, out_guard, ops):
    """Calls fn(); returns the result or None after an allowed error; checks
    the inputs and the guard bytes either way."""
    before = [np.array(x, copy=True) for x in inputs]
    try:
        res = fn()
    except Exception as e:  # noqa: BLE001 - the type is the point of the check
        _expect_error(e, ops)
        res = None
    for x, b in zip(inputs, before):
        assert np.ascontiguousarray(x).tobytes() == b.tobytes(), "an input was modified"
    if out_guard is not None:
        assert out_guard.guards_ok(), "write outside out"
    return res


def _close(got, exp, dt, what):
    atol, rtol = TOLERANCE[np.dtype(dt)]
    ok, ratio = reference.close(got, exp, atol, rtol)
    assert ok, f"{what}: {ratio:.3g}x over tolerance"


@st.composite
def prefill_calls(draw):
    dt = draw(st.sampled_from([BF16, BF16, F16, F16, F32]))
    d = draw(st.sampled_from([64, 64, 128, 256, 512, 32, 0]))
    b = draw(st.integers(0, 2)) if draw(st.booleans()) else 1
    hkv = draw(st.integers(1, 2))
    h = hkv * draw(st.sampled_from([1, 2])) + draw(st.sampled_from([0] * 8 + [1]))  # mismatched heads
    cap = draw(st.integers(1, 48))
    kv_len = draw(st.one_of(st.none(), st.integers(-2, cap + 2), st.sampled_from([2**31, -2**40, 2**70])))
    kl = min(max(cap if kv_len is None else kv_len, 1), 64)
    ql = draw(st.integers(0, min(kl, 24) + 1))
    q_off = draw(st.one_of(st.integers(0, max(0, kl - ql)), st.integers(-3, kl + 3),
                           st.sampled_from([2**31 - 1, 2**31, -2**31 - 1])))
    causal = draw(st.booleans())
    mkind = draw(st.sampled_from(["none", "none", "add2", "bool2", "add4", "wrong"]))
    blk = draw(st.sampled_from(["none", "none", "right", "small", "wrongdtype"]))
    softcap = draw(st.sampled_from([0.0, 0.0, 5.0, -1.0, math.nan]))
    scale = draw(st.sampled_from([None, None, 0.1, math.inf]))
    layout = draw(st.sampled_from(["bhld", "bhld", "blhd", "bogus"]))
    use_out = draw(st.booleans())
    nonfinite = draw(st.integers(0, 19)) == 0
    return dict(dt=dt, d=d, b=b, h=h, hkv=hkv, cap=cap, kv_len=kv_len, ql=ql, q_off=q_off, causal=causal,
                mkind=mkind, blk=blk, softcap=softcap, scale=scale, layout=layout, use_out=use_out,
                nonfinite=nonfinite, view=draw(st.data()))


@pytest.mark.slow
@FUZZ
@given(c=prefill_calls(), seed=st.integers(0, 2**32 - 1))
def test_prefill_api(cpu, c, seed):
    rng = np.random.default_rng(seed)
    dt, d, b, h, hkv, cap, ql = c["dt"], c["d"], c["b"], c["h"], c["hkv"], c["cap"], c["ql"]
    seq = c["layout"] == "blhd"
    qs = (b, ql, h, d) if seq else (b, h, ql, d)
    ks = (b, cap, hkv, d) if seq else (b, hkv, cap, d)
    q, k, v = _values(rng, qs, dt, c["nonfinite"]), _values(rng, ks, dt), _values(rng, ks, dt)
    kl = cap if c["kv_len"] is None else c["kv_len"]
    mkl = min(max(kl, 0), 64)  # an out-of-range kv_len gets a (wrong) small mask, never a huge one
    mask = None
    if c["mkind"] in ("add2", "add4"):
        ms = (ql, mkl) if c["mkind"] == "add2" else (b, h, ql, mkl)
        mask = np.where(rng.random(ms) < 0.3, -np.inf, 0.0).astype(dt if dt != F32 else BF16)
    elif c["mkind"] == "bool2":
        mask = rng.random((ql, mkl)) < 0.7
    elif c["mkind"] == "wrong":
        mask = np.zeros((ql + 1, mkl), dt if dt != F32 else BF16)
    blk = None
    if c["blk"] == "right" and mask is not None and mask.ndim == 2 and mask.dtype != np.bool_ and d in fm.supported_head_dims("flash_attn_prefill"):
        try:
            blk = fm.build_blk(mask, d, registry=cpu)
        except ValueError:
            blk = np.zeros(1, np.uint8)
    elif c["blk"] == "small":
        blk = np.zeros(1, np.uint8)
    elif c["blk"] == "wrongdtype":
        blk = np.zeros(64, np.float16)
    draw = c["view"].draw
    qv, kv, vv = _view(draw, q), _view(draw, k), _view(draw, v)
    guard = Guarded(qs, dt, rng) if c["use_out"] and dt in (BF16, F16) else None
    kwargs = dict(mask=mask, causal=c["causal"], q_offset=c["q_off"], scale=c["scale"], softcap=c["softcap"],
                  layout=c["layout"], kv_len=c["kv_len"], blk=blk, registry=cpu)
    if guard is not None:
        kwargs["out"] = guard.arr
    inputs = [x for x in (qv, kv, vv, mask, blk) if x is not None]
    res = _run(lambda: fm.flash_attn_prefill(qv, kv, vv, **kwargs), inputs, guard, OPS)
    if res is None:
        return
    assert res.shape == qs and res.dtype == dt
    if guard is not None:
        assert res is guard.arr
    if c["nonfinite"] or res.size == 0:  # an empty batch returns an empty result
        return
    qh, kh, vh = ((x.transpose(0, 2, 1, 3) if seq else x) for x in (q, k, v))
    m = None if mask is None else (mask if mask.dtype == np.bool_ else mask.astype(np.float64))
    e = reference.attention(qh, kh[:, :, :kl], vh[:, :, :kl], scale=c["scale"], causal=c["causal"],
                            q_offset=c["q_off"], mask=m, softcap=c["softcap"])
    _close(res.transpose(0, 2, 1, 3) if seq else res, e, dt, "prefill")


@st.composite
def decode_calls(draw):
    return dict(
        qdt=draw(st.sampled_from([F32] * 6 + [F16])), kvdt=draw(st.sampled_from([F32, F16, BF16, np.dtype(np.int8)])),
        d=draw(st.sampled_from([64, 128, 256, 512, 96, 0])), batched=draw(st.booleans()),
        b=draw(st.integers(0, 2)), hkv=draw(st.integers(1, 2)), g=draw(st.sampled_from([1, 2, 3])),
        cap=draw(st.integers(1, 200)), kv_len=draw(st.one_of(st.integers(-1, 205), st.sampled_from([2**31, 2**64]))),
        window=draw(st.one_of(st.none(), st.integers(-1, 210))), causal=draw(st.booleans()),
        softcap=draw(st.sampled_from([0.0, 0.0, 10.0, -2.0, math.inf])),
        signs=draw(st.sampled_from(["none", "none", "ok", "short", "wrongdtype"])), fwht=draw(st.booleans()),
        use_out=draw(st.booleans()), nonfinite=draw(st.integers(0, 19)) == 0, view=draw(st.data()))


@pytest.mark.slow
@FUZZ
@given(c=decode_calls(), seed=st.integers(0, 2**32 - 1))
def test_decode_api(cpu, c, seed):
    rng = np.random.default_rng(seed)
    d, hkv = c["d"], c["hkv"]
    h = hkv * c["g"] if c["g"] != 3 else 3  # g=3 with hkv=2 -> mismatched heads
    b = c["b"] if c["batched"] else None
    qs = (h, d) if b is None else (b, h, d)
    ks = (hkv, c["cap"], d) if b is None else (b, hkv, c["cap"], d)
    kvdt = c["kvdt"]
    q = _values(rng, qs, c["qdt"], c["nonfinite"])
    k = (rng.integers(-3, 3, ks).astype(kvdt) if kvdt.kind == "i" else _values(rng, ks, kvdt))
    v = (rng.integers(-3, 3, ks).astype(kvdt) if kvdt.kind == "i" else _values(rng, ks, kvdt))
    signs = {"none": None, "ok": rng.integers(0, 256, max(d // 8, 1)).astype(np.uint8),
             "short": np.zeros(max(d // 8 - 1, 0), np.uint8), "wrongdtype": np.zeros(max(d // 8, 1), F32)}[c["signs"]]
    draw = c["view"].draw
    qv, kv, vv = _view(draw, q), _view(draw, k), _view(draw, v)
    guard = Guarded(qs, F32, rng) if c["use_out"] else None
    kwargs = dict(causal=c["causal"], window=c["window"], softcap=c["softcap"], fwht=c["fwht"], fwht_signs=signs,
                  registry=cpu)
    if guard is not None:
        kwargs["out"] = guard.arr
    inputs = [x for x in (qv, kv, vv, signs) if x is not None]
    res = _run(lambda: fm.flash_attn_decode(qv, kv, vv, c["kv_len"], **kwargs), inputs, guard, OPS)
    if res is None or c["nonfinite"]:
        return
    if res.size == 0:  # an empty batch returns an empty result of q's shape
        assert res.shape == qs
        return
    e = reference.decode(q, k, v, c["kv_len"], window=c["window"], softcap=c["softcap"])
    if c["fwht"] or signs is not None:
        e = reference.fwht_undo(e, signs)
    # The float32 result rounded once to q's dtype: a 16-bit q's output is in it (and so is its tolerance).
    _close(res, e, res.dtype if res.dtype in (F16, BF16) else F32, "decode")


@pytest.mark.slow
@FUZZ
@given(dt=st.sampled_from([F32, BF16, F16]), d=st.sampled_from([1, 8, 64, 100, 512, 513, 0]),
       b=st.integers(0, 2), hkv=st.integers(1, 2), g=st.sampled_from([1, 2, 3]), ql=st.integers(0, 40),
       cap=st.integers(0, 40), kv_len=st.one_of(st.none(), st.integers(-1, 42)), causal=st.booleans(),
       use_out=st.booleans(), data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_sdpa_api(cpu, dt, d, b, hkv, g, ql, cap, kv_len, causal, use_out, data, seed):
    rng = np.random.default_rng(seed)
    h = hkv * g if g != 3 else 3
    qs, ks = (b, h, ql, d), (b, hkv, cap, d)
    q, k, v = _values(rng, qs, dt), _values(rng, ks, dt), _values(rng, ks, dt)
    qv, kv, vv = _view(data.draw, q), _view(data.draw, k), _view(data.draw, v)
    guard = Guarded(qs, dt, rng) if use_out else None
    kw = dict(causal=causal, kv_len=kv_len, registry=cpu)
    if guard is not None:
        kw["out"] = guard.arr
    res = _run(lambda: fm.sdpa(qv, kv, vv, **kw), [qv, kv, vv], guard, OPS)
    if res is None:
        return
    if res.size == 0:  # an empty batch returns an empty result of q's shape
        assert res.shape == qs
        return
    kl = cap if kv_len is None else kv_len
    e = reference.attention(q, k[:, :, :kl], v[:, :, :kl], causal=causal, q_offset=kl - ql)
    _close(res, e, dt, "sdpa")


@pytest.mark.slow
@FUZZ
@given(ql=st.one_of(st.integers(-2, 80), st.sampled_from([2**31, 2**63, 2**64])),
       kl=st.one_of(st.integers(-2, 300), st.sampled_from([2**31, 2**63])), causal=st.booleans(),
       window=st.one_of(st.none(), st.integers(-2, 310), st.sampled_from([2**31, 2**32 + 5])),
       q_off=st.one_of(st.integers(-3, 310), st.sampled_from([2**31 - 1, 2**31, -2**31])),
       dt=st.sampled_from([BF16, F16, F32]), d=st.sampled_from([64, 128, 256, 512, 100, 300, 600]))
def test_mask_blk_api(cpu, ql, kl, causal, window, q_off, dt, d):
    big = ql * max(kl, 1) > 2**22  # a real multi-GiB mask is test_scale's business;
    # lengths >= 2^31: see test_build_mask_checks_int32_before_allocating
    res = None if big else _run(lambda: fm.build_mask(ql, kl, causal=causal, window=window, q_offset=q_off, dtype=dt,
                                     registry=cpu), [], None, OPS)
    if res is not None:
        e = reference.mask_additive(ql, kl, causal=causal, q_offset=q_off, window=window)
        assert np.array_equal(res.astype(np.float64), e)
        blk = _run(lambda: fm.build_blk(res, d, registry=cpu), [res], None, OPS)
        if blk is not None:
            assert d != 600, "head dim 600 (no kernel) was accepted"
            geom = (8, 8) if d > 256 else (32, 16)  # D = 100 runs on the D = 128 tile, 300 on the 512 one
            assert np.array_equal(blk, reference.blk_classes(res.astype(np.float64), *geom))
    n_ = _run(lambda: fm.blk_byte_len(ql, kl, d, registry=cpu), [], None, OPS)
    if n_ is not None:
        assert n_ % 32 == 0 and n_ >= 32


@pytest.mark.slow
@FUZZ
@given(dt=st.sampled_from([BF16, F16, F32]), d=st.sampled_from([64, 128, 512]), ql=st.integers(0, 20),
       kl=st.integers(1, 40), is_causal=st.booleans(), window=st.one_of(st.none(), st.integers(1, 40)),
       mask=st.sampled_from([None, "add", "bool"]), softcap=st.sampled_from([0.0, 5.0]),
       kv_len=st.one_of(st.none(), st.integers(0, 42)), seed=st.integers(0, 2**32 - 1))
def test_front_door_api(cpu, dt, d, ql, kl, is_causal, window, mask, softcap, kv_len, seed):
    rng = np.random.default_rng(seed)
    q, k, v = _values(rng, (1, 2, ql, d), dt), _values(rng, (1, 1, kl, d), dt), _values(rng, (1, 1, kl, d), dt)
    L = kl if kv_len is None else kv_len
    m = None
    if mask == "add":
        m = np.where(rng.random((ql, max(L, 0))) < 0.2, -np.inf, 0.0).astype(dt)
    elif mask == "bool":
        m = rng.random((ql, max(L, 0))) < 0.8
    res = _run(lambda: fm.scaled_dot_product_attention(q, k, v, m, is_causal, softcap=softcap, window=window,
                                                       kv_len=kv_len, enable_gqa=True, align="bottom_right",
                                                       registry=cpu),
               [x for x in (q, k, v, m) if x is not None], None, OPS)
    if res is None:
        return
    if ql == 0:  # no query row: an empty result of q's shape, as torch's
        assert res.shape == q.shape and res.dtype == q.dtype
        return
    mm = None if m is None else (m if m.dtype == np.bool_ else m.astype(np.float64))
    e = reference.attention(q, k[:, :, :L], v[:, :, :L], causal=is_causal, q_offset=L - ql, mask=mm,
                            softcap=softcap, window=window)
    _close(res, e, dt, "sdpa front door")
