"""Interpreter exit while the process-wide cpu pool's workers are alive: cffi
closes the library when its handle is collected at shutdown, and a library
that dlclose could unmap would pull the code out from under those workers
(a segfault after the script printed its result, every run with 1024
threads). The library is linked so that it is never unloaded."""
from __future__ import annotations

import sys

import pytest

from subprocess_run import run_python

COMPUTE = """
reg = fm.Registry("cpu")
for seed in range(2):
    check_decode(reg, h=2, length=256, d=64, seed=seed)
print("ok")
"""


@pytest.mark.parametrize("run", range(3))
def test_exit_with_many_pool_workers_is_clean(run):
    p = run_python(COMPUTE, env={"FLASHMETAL_NUM_THREADS": "1024"}, timeout=120, check=False)
    assert (p.returncode, p.stdout.strip()) == (0, "ok"), f"exit status {p.returncode}\n{p.stderr[-2000:]}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF dynamic flags")
def test_library_is_marked_nodelete():
    import subprocess

    from flashmetal import _loader
    out = subprocess.run(["readelf", "-d", str(_loader.library_path())], capture_output=True, text=True).stdout
    assert "NODELETE" in out, out
