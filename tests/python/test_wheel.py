"""The installable wheel (mk/wheel.mk: `make wheel-test` builds it and runs this
file with FLASHMETAL_WHEEL set): platform-tagged, carrying a library that
needs no Swift toolchain, working in a fresh venv with the toolchain off PATH.
A missing toolchain or a failed library build is a build error."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WHEEL = os.environ.get("FLASHMETAL_WHEEL")
needs_wheel = pytest.mark.skipif(not WHEEL, reason="needs the wheel `make wheel-test` builds (FLASHMETAL_WHEEL)")


def clean_env(**extra: str) -> dict[str, str]:
    """No Swift toolchain on PATH, no LD_LIBRARY_PATH, no flashmetal overrides."""
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and "swift" not in p and not Path(p, "swift").exists())
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("FLASHMETAL_")}
    env.update(PATH=path, **extra)
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv (no system site-packages) with the wheel and its runtime deps."""
    venv = tmp_path_factory.mktemp("wheel") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=clean_env())
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", WHEEL], check=True, env=clean_env())
    return py


@needs_wheel
def test_platform_tag_and_contents():
    name = Path(WHEEL).name
    assert re.fullmatch(r"flashmetal-[\w.]+-py3-none-(manylinux|macosx)_\w+\.whl", name), name
    assert "none-any" not in name
    if sys.platform == "darwin":
        # The dylib's own: Apple silicon only, macOS 14 at least (Package.swift), never universal2.
        assert name.endswith("-py3-none-macosx_14_0_arm64.whl"), name
    with zipfile.ZipFile(WHEEL) as z:
        names = set(z.namelist())
    lib = "flashmetal/libflashmetal.dylib" if sys.platform == "darwin" else "flashmetal/libflashmetal.so"
    assert {lib, "flashmetal/flashmetal.h", "flashmetal/integrations/hf.py"} <= names


@needs_wheel
def test_library_needs_no_swift_runtime(installed):
    out = subprocess.run([str(installed), "-c", "from flashmetal import _loader; print(_loader.library_path())"],
                         capture_output=True, text=True, check=True, env=clean_env()).stdout.strip()
    assert str(installed.parent.parent) in out, f"the venv's copy must load, got {out}"
    if sys.platform == "darwin":
        return  # the Swift runtime is part of macOS
    ldd = subprocess.run(["ldd", out], capture_output=True, text=True, check=True, env=clean_env()).stdout
    assert "not found" not in ldd, ldd
    assert "libswift" not in ldd and "/opt/swift" not in ldd, ldd
    dyn = subprocess.run(["readelf", "-d", out], capture_output=True, text=True, check=True).stdout
    assert "/opt/swift" not in dyn, dyn


@needs_wheel
def test_demo_and_numbers_without_the_toolchain(installed):
    check = ("import numpy as np, flashmetal as fm\n"
             "from flashmetal import reference\n"
             "rng = np.random.default_rng(0)\n"
             "q, k, v = (rng.standard_normal((1, 4, 33, 80)).astype(np.float32) for _ in range(3))\n"
             "o = fm.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
             "ok, ratio = reference.close(o, reference.attention(q, k, v, causal=True), 1e-5, 1e-4)\n"
             "assert ok, ratio\n"
             "lib = fm._loader.load()[1]\n"
             "print(fm.__version__, fm._loader.load()[0].string(lib.fm_version()).decode(), fm.info()['backend'])\n")
    run = subprocess.run([str(installed), "-c", check], capture_output=True, text=True, env=clean_env(), cwd="/")
    assert run.returncode == 0, run.stderr
    py_version, lib_version, backend = run.stdout.split()
    wheel_version = Path(WHEEL).name.split("-")[1]
    assert py_version == lib_version == wheel_version and backend == "cpu"
    demo = subprocess.run([str(installed), "-m", "flashmetal.demo", "--length", "128", "--kv-len", "1024",
                           "--runs", "1"], capture_output=True, text=True, env=clean_env(), cwd="/")
    assert demo.returncode == 0 and "all lines PASS" in demo.stdout, demo.stdout + demo.stderr


def test_missing_toolchain_is_a_build_error(tmp_path):
    """No library, no wheel: the build fails and says why (not the first call)."""
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO / "python"), "-w", str(tmp_path),
                          "--no-deps", "--no-build-isolation"],
                         capture_output=True, text=True, env=dict(os.environ, FLASHMETAL_SWIFT="/bin/false"))
    assert run.returncode != 0
    assert "flashmetal: `swift build` failed (exit 1)" in run.stdout + run.stderr
    assert not list(tmp_path.glob("*.whl"))


@needs_wheel
@pytest.mark.skipif(sys.platform == "darwin", reason="Linux wheels only")
def test_linux_wheel_is_manylinux():
    """A manylinux tag (auditwheel repair's, mk/wheel.mk), which package indexes accept; a bare linux_* tag they
    refuse. The tag's glibc is at most this machine's, or pip here would not have installed it."""
    import platform

    m = re.search(r"-py3-none-manylinux_(\d+)_(\d+)_(x86_64|aarch64)\.whl$", Path(WHEEL).name)
    assert m, Path(WHEEL).name
    assert m.group(3) == platform.machine()
    libc, version = platform.libc_ver()
    assert libc == "glibc" and (int(m.group(1)), int(m.group(2))) <= tuple(int(x) for x in version.split(".")[:2])


@needs_wheel
def test_console_script_in_the_fresh_venv(installed):
    """The wheel installs the `flashmetal` command; verify runs there without the toolchain."""
    exe = installed.parent / "flashmetal"
    run = subprocess.run([str(exe), "verify", "--backend", "cpu", "--q-len", "16", "--kv-len", "40", "--causal",
                          "--heads", "4", "--kv-heads", "2", "-d", "64"],
                         capture_output=True, text=True, env=clean_env(), cwd="/")
    assert run.returncode == 0 and "all PASS" in run.stdout, run.stdout + run.stderr
