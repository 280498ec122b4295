"""A process holding a cpu (and a sim) Registry, used or not, can fork;
the child computes, closes and exits without hanging, and nobody's CPU
affinity is changed by the library (only the pool's own workers are pinned)."""
from __future__ import annotations

import sys

import pytest

from subprocess_run import run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="affinity checks use Linux APIs")

FORK = """
used = {used}
reg = fm.Registry("cpu")
sim = fm.Registry("sim")
if used:
    check_decode(reg, h=8, length=4096, d=128)  # long enough to wake the pool's workers
    check_decode(sim)
affinity = os.sched_getaffinity(0)
pid = os.fork()
if pid == 0:
    # The child: compute (on a fresh pool), close, then a normal interpreter exit.
    check_decode(reg, h=8, length=4096, d=128)
    check_decode(fm.Registry("cpu"), h=8, length=4096, d=128)
    check_decode(sim)
    assert os.sched_getaffinity(0) == affinity, "the library changed the child's affinity"
    reg.close()
    sys.exit(0)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, f"child exit status {{status}}"
check_decode(reg, h=8, length=4096, d=128)
assert os.sched_getaffinity(0) == affinity, "the library changed the caller's affinity"
print("ok")
"""


@pytest.mark.parametrize("used", [True, False], ids=["used", "unused"])
def test_fork_child_computes_and_exits(used):
    p = run_python(FORK.format(used=used), timeout=60)
    assert p.stdout.strip() == "ok"


def test_fork_from_a_thread_while_the_pool_works():
    """A fork while another thread is inside a pool job: the child still runs."""
    p = run_python("""
    reg = fm.Registry("cpu")
    check_decode(reg, h=8, length=4096, d=128)  # the reference is computed (BLAS) before any fork
    stop = threading.Event()
    def busy():
        while not stop.is_set():
            check_decode(reg, h=8, length=4096, d=128)
    t = threading.Thread(target=busy)
    t.start()
    for i in range(8):
        time.sleep(0.013 * i)
        pid = os.fork()
        if pid == 0:
            check_decode(reg, h=8, length=4096, d=128)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    stop.set()
    t.join()
    print("ok")
    """, timeout=60)
    assert p.stdout.strip() == "ok"


def test_fork_while_a_package_lock_is_held():
    """The package's Python locks, held by another thread at fork(), are new
    in the child (a held lock would otherwise stay held there forever)."""
    p = run_python("""
    from flashmetal import _loader, registry
    reg = fm.Registry("cpu")
    check_decode(reg)
    with _loader._lock, registry._defaults_lock:
        pid = os.fork()
        if pid == 0:
            check_decode(reg)
            check_decode(fm.default_registry("cpu"))
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    print("ok")
    """, timeout=60)
    assert p.stdout.strip() == "ok"
