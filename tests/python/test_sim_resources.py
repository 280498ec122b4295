"""The simulator's fiber stacks and workers are bounded and
shared across concurrent calls (memory mappings stay under a budget, far from
vm.max_map_count), allocation failures come back as BackendError and the
process keeps working, and closing a registry frees the idle stacks."""
from __future__ import annotations

import sys

import pytest

from subprocess_run import run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts mappings in /proc")

MAPS = """
def mappings():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)
base = mappings()
BUDGET = 16384  # simulator.cpp kMapBudget
SLACK = 1024  # the interpreter's own mappings move too (thread stacks, arrays)
"""


def test_48_concurrent_decodes_with_1024_thread_reduce():
    p = run_python(MAPS, """
    regs = [fm.Registry("sim") for _ in range(24)]
    errors, peak = [], [0]
    def one(i):
        try:
            check_decode(regs[i % 24], h=1, length=64, d=64, seed=i % 4)
        except BaseException as e:
            errors.append(repr(e))
        peak[0] = max(peak[0], mappings())
    threads = [threading.Thread(target=one, args=(i,)) for i in range(48)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert not errors, errors[:3]
    assert peak[0] - base <= BUDGET + SLACK, f"{peak[0] - base} new mappings"
    check_decode(regs[0])  # still working
    held = mappings() - base
    for r in regs: r.close()
    print(held, mappings() - base)
    """, timeout=300)
    held, after_close = map(int, p.stdout.split())
    # The reduce's stacks (2 x 1024 mappings a worker) were kept for reuse,
    # and closing the registries gave them back.
    assert held - after_close >= 2048, (held, after_close)


def test_many_sim_workers_env():
    """FLASHMETAL_SIM_WORKERS=256 asks for more workers than the budget
    allows: calls share what there is, again and again."""
    p = run_python(MAPS, """
    reg = fm.Registry("sim")
    for seed in range(3):
        check_decode(reg, h=4, length=512, d=64, seed=seed)
    assert mappings() - base <= BUDGET + SLACK
    print("ok")
    """, env={"FLASHMETAL_SIM_WORKERS": "256"}, timeout=300)
    assert p.stdout.strip() == "ok"


def test_stack_allocation_failure_is_a_backend_error():
    """With the address space capped, the 1024-thread reduce cannot map its
    stacks: BackendError naming the mapping, and once the cap is lifted the
    same registry works."""
    p = run_python("""
    import resource
    reg = fm.Registry("sim")
    check_decode(reg, h=1, length=64, d=64)
    fm.Registry("sim").close()  # frees the idle stacks: the next call must map anew
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), hard))
    try:
        check_decode(reg, h=1, length=64, d=64)
        raise SystemExit("the call succeeded under the cap")
    except fm.BackendError as e:
        print(e)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    check_decode(reg, h=1, length=64, d=64)
    """, timeout=120)
    assert "cannot map" in p.stdout and "fiber stacks" in p.stdout
