"""Non-finite inputs, huge finite biases and large GQA on the cpu backend.

Every test named *cpu* here also runs once per ISA path the machine has
(test_cpu_isa.test_suite_under_forced_isa). The rules (the same on every
path and on Metal):
- a masked cell (additive -inf, bool False, causal) is -inf; any other
  cell's score is raised to -FLT_MAX/2 (the running max's start) when below
  it, NaN kept: a row whose keys all carry finfo(bf16).min averages them;
- NaN in a q row gives a NaN row; NaN or +inf in K, or a +inf / NaN mask
  cell, gives NaN in the rows that see it;
- blk marks a tile skippable only when every cell is -inf.
reference.attention maps NaN rows to zero, so NaN expectations are explicit
and the ISA paths are compared with the portable path."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F16, F32, assert_bits_equal, assert_close, randn

HERE = Path(__file__).resolve().parent
H, HKV, QL, KL = 4, 2, 70, 150


def _qkv(dtype, d, seed=5):
    rng = np.random.default_rng(seed)
    return (randn(rng, (1, H, QL, d), dtype), randn(rng, (1, HKV, KL, d), dtype),
            randn(rng, (1, HKV, KL, d), dtype))


def _attend(q, k, v, mask=None, causal=False, registry=None):
    """float32 goes through the front door's sdpa route (the fast prefill on
    an ISA with one); 16-bit through flash_attn_prefill."""
    if q.dtype == F32:
        return fm.sdpa(q, k, v, mask=mask, causal=causal, registry=registry)
    return fm.flash_attn_prefill(q, k, v, mask=mask, causal=causal, registry=registry)


def nonfinite_cases(registry=None) -> dict[str, np.ndarray]:
    """Outputs (as float32) of every non-finite case, per dtype and head dim."""
    out = {}
    for dtype, d in ((BF16, 64), (F16, 128), (F32, 64)):
        tag = f"{np.dtype(dtype).name}_{d}"
        q, k, v = _qkv(dtype, d)
        qn = q.copy()
        qn[0, 1, 5, 3] = np.nan
        out[f"qnan_{tag}"] = _attend(qn, k, v, registry=registry)
        kn = k.copy()
        kn[0, 0, 10, 7] = np.nan
        out[f"knan_{tag}"] = _attend(q, kn, v, registry=registry)
        ki = k.copy()
        ki[0, 1, 20, 2] = np.inf
        out[f"kinf_{tag}"] = _attend(q, ki, v, registry=registry)
        m = np.zeros((QL, KL), np.float32)
        m[3, 7] = np.inf
        m[9, 100] = np.nan
        m[20, :50] = -np.inf
        out[f"masknf_{tag}"] = _attend(q, k, v, mask=m.astype(dtype), registry=registry)
    rng = np.random.default_rng(9)
    qd = rng.standard_normal((4, 64)).astype(np.float32)
    qd[2, 5] = np.nan
    for kvdt in (F32, F16, BF16):
        kc, vc = randn(rng, (2, 300, 64), kvdt), randn(rng, (2, 300, 64), kvdt)
        out[f"dec_qnan_{np.dtype(kvdt).name}"] = fm.flash_attn_decode(qd, kc, vc, 300, registry=registry)
        kc[1, 40, 0] = np.nan
        out[f"dec_knan_{np.dtype(kvdt).name}"] = fm.flash_attn_decode(qd, kc, vc, 300, registry=registry)
    return {key: np.asarray(val).astype(np.float32) for key, val in out.items()}


def _nan_rows(o):
    """[B, H, L] (or [H]) booleans: the row is NaN in every element."""
    return np.isnan(o).all(axis=-1)


def _finite_rows(o):
    return np.isfinite(o).all(axis=-1)


def test_nonfinite_expectations_cpu(cpu):
    o = nonfinite_cases(cpu)
    d = {"bfloat16_64": 64, "float16_128": 128, "float32_64": 64}
    for tag in d:
        q, _, _ = _qkv({"bfloat16": BF16, "float16": F16, "float32": F32}[tag.split("_")[0]], d[tag])
        qnan = _nan_rows(o[f"qnan_{tag}"])
        assert qnan[0, 1, 5] and qnan.sum() == 1, tag
        assert _finite_rows(o[f"qnan_{tag}"]).sum() == H * QL - 1, tag
        knan = _nan_rows(o[f"knan_{tag}"])
        assert knan[0, :2].all() and _finite_rows(o[f"knan_{tag}"])[0, 2:].all(), tag
        # +inf in K[.., key 20, dim 2]: score +inf (NaN row) where q[.., 2] > 0,
        # -inf (floored to -FLT_MAX/2: weight 0) where q[.., 2] < 0
        pos = q[0, 2:, :, 2].astype(np.float32) > 0
        kinf = o[f"kinf_{tag}"][0, 2:]
        assert np.array_equal(_nan_rows(kinf), pos), tag
        assert _finite_rows(kinf)[~pos].all(), tag
        masknf = _nan_rows(o[f"masknf_{tag}"])
        assert masknf[0, :, 3].all() and masknf[0, :, 9].all() and masknf.sum() == 2 * H, tag
    for kvdt in ("float32", "float16", "bfloat16"):
        qn = _nan_rows(o[f"dec_qnan_{kvdt}"])
        assert qn.tolist() == [False, False, True, False], kvdt
        kn = _nan_rows(o[f"dec_knan_{kvdt}"])
        assert kn.tolist() == [False, False, True, True], kvdt


def test_forced_isa_nonfinite_matches_portable(tmp_path):
    """Each ISA path: the same NaN rows as the portable path, the finite
    values within the dtype's tolerance of it."""
    from test_cpu_isa import run_py, supported_isas  # noqa: PLC0415 (cycle)
    code = ("import numpy as np, test_cpu_nonfinite as t\n"
            f"np.savez(r'{tmp_path}/' + __import__('os').environ['FLASHMETAL_CPU_ISA'] + '.npz',"
            " **t.nonfinite_cases())\n")
    outs = {}
    for isa in supported_isas():
        r = run_py(code, FLASHMETAL_CPU_ISA=isa)
        assert r.returncode == 0, r.stderr[-3000:]
        outs[isa] = np.load(tmp_path / f"{isa}.npz")
    base = outs["portable"]
    for isa, o in outs.items():
        for key in base.files:
            a, b = o[key], base[key]
            assert np.array_equal(np.isnan(a), np.isnan(b)), (isa, key)
            fin = ~np.isnan(b)
            dt = BF16 if "bfloat16" in key else F16 if "float16" in key else F32
            assert_close(a[fin], b[fin].astype(np.float64), dt if not key.startswith("dec") else F32,
                         f"{isa} {key}")


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_huge_finite_bias_averages_cpu(cpu, dtype):
    """Rows whose every key carries finfo(bf16).min (or -1e30) get the
    softmax over them (a uniform average), as the reference and torch."""
    q, k, v = _qkv(dtype, 64, seed=6)
    huge = float(ml_dtypes.finfo(dtype).min)  # bf16: below -FLT_MAX/2; f32: -FLT_MAX
    m = np.zeros((QL, KL), np.float32)
    m[4, :] = huge
    m[8, :] = huge if dtype == F16 else -1e30
    m[12, :] = huge
    m[12, 30] = 0.0  # one ordinary key dominates the rest
    m[16, :60] = -np.inf
    m[16, 60:] = huge  # -inf keys stay masked
    mt = m.astype(dtype)
    o = _attend(q, k, v, mask=mt, registry=cpu)
    ref = reference.attention(q, k, v, mask=mt.astype(np.float32))
    assert_close(o, ref, dtype, "huge finite bias")
    if dtype == F16:
        return  # -65504 is far above -FLT_MAX/2: scores still differ (as the reference says)
    vf = v.astype(np.float64)
    assert_close(o[0, :, 4], np.repeat(vf.mean(axis=2), H // HKV, axis=1)[0], dtype, "uniform average")
    assert_close(o[0, :, 16], np.repeat(vf[:, :, 60:].mean(axis=2), H // HKV, axis=1)[0], dtype,
                 "average over the unmasked keys")


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_blk_skips_only_all_neg_inf_tiles_cpu(cpu, dtype):
    """A tile of -1e30 (or the dtype's most negative finite) is mixed (1), not
    skipped (0): with and without blk the output is bit-identical for every
    finite mask value."""
    d = 128
    q, k, v = _qkv(dtype, d, seed=8)
    huge = float(ml_dtypes.finfo(dtype).min)
    m = np.zeros((QL, KL), np.float32)
    m[:, :64] = -1e30 if dtype == BF16 else huge
    m[:32, 64:128] = huge
    m[32:64, 64:128] = -np.inf
    mt = m.astype(dtype)
    blk = fm.build_blk(mt, d, registry=cpu)
    bk = 16  # key tile of d = 128
    assert (blk[:, :64 // bk] == 1).all(), "a -1e30 tile must not be skipped"
    assert (blk[:1, 64 // bk:128 // bk] == 1).all()
    assert (blk[1:2, 64 // bk:128 // bk] == 0).all(), "an all -inf tile is skipped"
    a = fm.flash_attn_prefill(q, k, v, mask=mt, registry=cpu)
    b = fm.flash_attn_prefill(q, k, v, mask=mt, blk=blk, registry=cpu)
    assert_bits_equal(a, b, "blk")
    assert_close(a, reference.attention(q, k, v, mask=mt.astype(np.float32)), dtype, "reference")


def test_decode_large_gqa_on_a_small_stack():
    """H=32768 query heads on one kv head from a thread with a 256 KiB stack
    (the decode's per-row state once lived on the stack: 256 KiB here); 256
    keys give 8 workgroups, so the pool's workers run items too."""
    code = (
        "import threading, numpy as np, flashmetal as fm\n"
        "from flashmetal import reference\n"
        "rng = np.random.default_rng(2)\n"
        "H, D, n = 32768, 64, 256\n"
        "q = rng.standard_normal((H, D)).astype(np.float32)\n"
        "k = rng.standard_normal((1, n, D)).astype(np.float32)\n"
        "v = rng.standard_normal((1, n, D)).astype(np.float32)\n"
        "res = {}\n"
        "def run():\n"
        "    try:\n"
        "        res['o'] = fm.flash_attn_decode(q, k, v, n, registry=fm.Registry('cpu'))\n"
        "    except BaseException as e:\n"
        "        res['e'] = e\n"
        "threading.stack_size(256 * 1024)\n"
        "t = threading.Thread(target=run); t.start(); t.join()\n"
        "assert 'e' not in res, res.get('e')\n"
        "rows = [0, 1, 12345, H - 1]\n"
        "ref = reference.attention(q[None, rows, None, :], np.repeat(k[None], 4, 1),"
        " np.repeat(v[None], 4, 1))[0, :, 0]\n"
        "err = np.abs(res['o'][rows] - ref).max()\n"
        "assert err < 1e-4, err\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(HERE),
                       timeout=300, env=dict(os.environ, FLASHMETAL_NUM_THREADS="2"))
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert r.stdout.strip().endswith("ok")
