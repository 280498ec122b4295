"""The cpu backend's ISA paths (FLASHMETAL_CPU_ISA) and the fast prefill's
bit-identity contract: blk vs no blk, thread count, every ISA path.

The prefill, sdpa, decode and non-finite suites run once per ISA path this
machine has (test_suite_under_forced_isa), so an AVX-512 machine also tests
its AVX2 and portable paths."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F16, assert_bits_equal, assert_close, randn

HERE = Path(__file__).resolve().parent
# x86-64 levels in order; arm64 has portable < neon.
ISAS = ["portable", "avx2", "avx512", "avx512vbmi", "avx512bf16"]


def lib_isa() -> tuple[int, str]:
    """fm_cpu_isa() of the loaded library (an exported C symbol of the cpu
    kernels). Looked up in the very file flashmetal loaded, through ctypes
    (which never unloads it): a second copy of the Swift library in the
    process, unloaded later, would corrupt the Swift runtime's caches."""
    import ctypes
    from flashmetal import _loader
    _loader.load()
    lib = ctypes.CDLL(str(_loader.library_path()))
    lib.fm_cpu_isa.restype = ctypes.c_int
    lib.fm_cpu_isa_name.restype = ctypes.c_char_p
    lib.fm_cpu_isa_name.argtypes = [ctypes.c_int]
    isa = lib.fm_cpu_isa()
    return isa, lib.fm_cpu_isa_name(isa).decode()


@functools.cache
def native_isa() -> str:
    """The path the library picks with FLASHMETAL_CPU_ISA unset (asked once: a subprocess)."""
    env = {k: v for k, v in os.environ.items() if k != "FLASHMETAL_CPU_ISA"}
    n = subprocess.run([sys.executable, "-c", "import test_cpu_isa as t; print(t.lib_isa()[1])"], env=env,
                       capture_output=True, text=True, cwd=str(HERE), timeout=600)
    assert n.returncode == 0, n.stderr
    return n.stdout.strip()


@functools.cache
def cpu_has_vbmi() -> bool:
    """Whether the CPU has AVX512-VBMI (its flags in /proc/cpuinfo): AVX512-BF16
    does not imply it, so a native avx512bf16 path may lack it."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512vbmi " in flags.replace("\n", " ")


def capped(want: str, native: str) -> str:
    """The path FLASHMETAL_CPU_ISA=want gives on a machine whose native path is
    native (an x86-64 ISA each): the lower of the two, avx512vbmi only where the
    CPU has VBMI."""
    order = {n: i for i, n in enumerate(ISAS)}
    got = min(want, native, key=order.get)
    return "avx512" if got == "avx512vbmi" and not cpu_has_vbmi() else got


def supported_isas() -> list[str]:
    """Every path this machine can run, portable first."""
    native = native_isa()
    if native == "neon":
        return ["portable", "neon"]
    if native not in ISAS:
        return ["portable"]
    return [i for i in ISAS[:ISAS.index(native) + 1] if i != "avx512vbmi" or cpu_has_vbmi()]


def run_py(code: str, **env: str) -> subprocess.CompletedProcess:
    e = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                          cwd=str(HERE), timeout=600)


def window_mask(ql, kl, w, off, dtype):
    t = off + np.arange(ql)[:, None]
    p = np.arange(kl)[None, :]
    vis = (p <= t) & (t - p < w)
    return np.where(vis, 0.0, -np.inf).astype(dtype)


def blk_from_mask(m, bq, bk):
    """Tile classes: 0 every cell -inf, 2 every cell 0, else 1."""
    ql, kl = m.shape
    nq, nk = -(-ql // bq), -(-kl // bk)
    out = np.ones((nq, nk), np.uint8)
    mf = m.astype(np.float32)
    for i in range(nq):
        for j in range(nk):
            t = mf[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            if np.all(np.isneginf(t)):
                out[i, j] = 0
            elif np.all(t == 0):
                out[i, j] = 2
    return out


def geometry(d):
    return (8, 8) if d == 512 else (32, 16)


@pytest.mark.parametrize("isa", ISAS + ["neon"])
def test_isa_env_caps_the_choice(isa):
    r = run_py("import test_cpu_isa as t; print(t.lib_isa()[1])", FLASHMETAL_CPU_ISA=isa)
    assert r.returncode == 0, r.stderr
    got = r.stdout.strip()
    native = native_isa()
    if isa == "neon" and native != "neon":  # another architecture's ISA
        assert got == "portable" and "not an ISA of this architecture" in r.stderr
        return
    assert got == capped(isa, native)
    assert r.stderr == ""


@pytest.mark.parametrize("value", ["AVX2", "Portable", "AVX512VBMI", "AVX512BF16"])
def test_isa_value_in_any_case(value):
    """AVX2 as oneDNN's ONEDNN_MAX_CPU_ISA spells it caps like avx2, without a warning."""
    r = run_py("import test_cpu_isa as t; print(t.lib_isa()[1])", FLASHMETAL_CPU_ISA=value)
    assert r.returncode == 0, r.stderr
    native, want = native_isa(), value.lower()
    if native == "neon" and want != "portable":  # an x86-64 ISA on arm64
        assert r.stdout.strip() == "portable" and "not an ISA of this architecture" in r.stderr
        return
    assert r.stdout.strip() == capped(want, native)
    assert r.stderr == ""


@pytest.mark.parametrize("value", ["avx3", "1", "avx2 ", "avx-2"])
def test_bad_isa_value_warns_and_keeps_the_default(value):
    r = run_py("import test_cpu_isa as t; print(t.lib_isa()[1])", FLASHMETAL_CPU_ISA=value)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == native_isa()
    assert f"FLASHMETAL_CPU_ISA='{value}' is not one of portable, avx2, avx512, avx512vbmi, avx512bf16, neon" in r.stderr


SUITES = ["test_prefill.py", "test_sdpa.py", "test_decode.py", "test_cpu_nonfinite.py", "test_cpu_isa.py",
          "test_serving_prefill_cpu.py", "test_serving_decode_sim.py", "test_serving_decode_cpu.py",
          "test_attention_chunk.py", "test_cache_leftpad_batch_idx.py", "test_alibi.py", "test_kv_codes_prefill.py",
          "test_page_sizes.py", "test_kvcache_ragged.py", "test_head_dims.py", "test_prefill_f32.py",
          "test_head_dim_v.py", "test_seqused.py", "test_kv_codec_decode.py", "test_kv_codes_decode_split.py",
          "test_kv_codes_alibi.py", "test_decode_head_major.py"]
# What a path changes, where it changes less than every suite: VBMI only the
# decode over 8-bit codes.
SUITES_OF = {"avx512vbmi": ["test_kv_codec_decode.py", "test_kv_codes_decode_split.py", "test_kv_codec_kvcache.py",
                            "test_kv_codes_alibi.py"]}


@pytest.mark.slow
@pytest.mark.parametrize("isa", ISAS + ["neon"])
def test_suite_under_forced_isa(isa):
    """The prefill, sdpa, decode, non-finite and serving-prefill cpu suites
    (numerics, resume, determinism, NaN/inf, huge biases, varlen/paged/window/
    sinks/LSE) and the serving decode suites on each path below the native one
    (the native path is the main run's)."""
    supported = supported_isas()
    if isa not in supported:
        pytest.skip(f"this cpu has no {isa} path")
    if isa == supported[-1] and not os.environ.get("FLASHMETAL_CPU_ISA"):
        pytest.skip(f"{isa} is the native path: the main run covers it")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        *[str(HERE / f) for f in SUITES_OF.get(isa, SUITES)],
                        "-k", "cpu and not forced_isa and not env_caps and not bad_isa"],
                       env=dict(os.environ, FLASHMETAL_CPU_ISA=isa), capture_output=True,
                       text=True, cwd=str(HERE), timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout
    assert lib_isa_in_subprocess(isa) == isa


def lib_isa_in_subprocess(isa: str) -> str:
    r = run_py("import test_cpu_isa as t; print(t.lib_isa()[1])", FLASHMETAL_CPU_ISA=isa)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_blk_windowed_bit_identical(cpu, d, dtype):
    rng = np.random.default_rng(7)
    ql, kl, w = 150, 230, 57
    off = kl - ql
    hq, hkv = 4, 2
    q = randn(rng, (1, hq, ql, d), dtype)
    k = randn(rng, (1, hkv, kl, d), dtype)
    v = randn(rng, (1, hkv, kl, d), dtype)
    m = window_mask(ql, kl, w, off, dtype)
    # a band of finite biases so that class-1 tiles add real values
    m[:, 100:140] = np.where(np.isneginf(m[:, 100:140].astype(np.float32)), m[:, 100:140],
                             rng.uniform(-1, 0.5, (ql, 40))).astype(dtype)
    blk = blk_from_mask(m, *geometry(d))
    assert (blk == 0).any() and (blk == 2).any() and (blk == 1).any()
    a = fm.flash_attn_prefill(q, k, v, mask=m, registry=cpu)
    b = fm.flash_attn_prefill(q, k, v, mask=m, blk=blk, registry=cpu)
    assert_bits_equal(a, b, f"blk d={d}")
    assert_close(a, reference.attention(q, k, v, mask=m), dtype, f"window d={d}")
    c = fm.flash_attn_prefill(q, k, v, mask=m, blk=blk, causal=True, q_offset=off, registry=cpu)
    assert_bits_equal(a, c, f"blk+causal d={d}")


def test_results_do_not_depend_on_thread_count(tmp_path):
    code = (
        "import numpy as np, flashmetal as fm\n"
        "from numerics import randn, BF16, F16\n"
        "rng = np.random.default_rng(3)\n"
        "outs = []\n"
        "for d, dt in ((64, BF16), (128, F16), (256, BF16), (512, F16)):\n"
        "    q = randn(rng, (1, 4, 97, d), dt); k = randn(rng, (1, 2, 161, d), dt)\n"
        "    v = randn(rng, (1, 2, 161, d), dt)\n"
        "    r = fm.Registry('cpu')\n"
        "    outs.append(fm.flash_attn_prefill(q, k, v, causal=True, q_offset=64, registry=r)"
        ".astype(np.float32))\n"
        f"np.savez(r'{tmp_path}/' + __import__('os').environ['TAG'] + '.npz', *outs)\n")
    for n in ("1", "2", "3"):
        r = run_py(code, FLASHMETAL_NUM_THREADS=n, TAG=f"t{n}")
        assert r.returncode == 0, r.stderr
    base = np.load(tmp_path / "t1.npz")
    for n in ("2", "3"):
        other = np.load(tmp_path / f"t{n}.npz")
        for key in base.files:
            assert np.array_equal(base[key].view(np.uint32), other[key].view(np.uint32)), (n, key)


def test_long_unaligned_resume_bitwise(cpu):
    """Resume across several 64-key blocks and q items, unaligned everywhere."""
    rng = np.random.default_rng(11)
    total, cap, split = 301, 333, 131
    for dtype in (BF16, F16):
        q, k, v = (randn(rng, (1, 4, total, 128), dtype), randn(rng, (1, 2, cap, 128), dtype),
                   randn(rng, (1, 2, cap, 128), dtype))
        full = fm.flash_attn_prefill(q, k[:, :, :total], v[:, :, :total], causal=True, registry=cpu)
        chunk = fm.flash_attn_prefill(q[:, :, split:], k, v, causal=True, q_offset=split,
                                      kv_len=total, registry=cpu)
        assert_bits_equal(chunk, full[:, :, split:], "resume")
        assert_close(full, reference.attention(q, k[:, :, :total], v[:, :, :total], causal=True),
                     dtype, "long causal")


@pytest.mark.parametrize("isa", ["avx2", "avx512", "avx512vbmi", ""])
def test_info_says_whether_the_path_uses_vbmi(isa):
    """info()["cpu_vbmi"]: the CPU has VBMI and the path is avx512vbmi or above."""
    r = run_py("import flashmetal as fm; a = fm.info('cpu'); print(a['cpu_vbmi'], a['cpu_isa'])",
               FLASHMETAL_CPU_ISA=isa)
    assert r.returncode == 0, r.stderr
    vbmi, path = r.stdout.split()
    assert vbmi == str(cpu_has_vbmi() and path in ("avx512vbmi", "avx512bf16"))
