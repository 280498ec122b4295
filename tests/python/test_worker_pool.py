"""One process-wide cpu worker pool, bounded by
FLASHMETAL_NUM_THREADS and started on first use, whatever the number of
registries (threads counted in /proc/self/task)."""
from __future__ import annotations

import sys

import pytest

from subprocess_run import run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")

COUNT = """
tasks = lambda: len(os.listdir("/proc/self/task"))
base = tasks()
regs = [fm.Registry("cpu") for _ in range(100)]
assert tasks() == base, f"registries started threads before any work: {{tasks() - base}}"
for r in regs:
    check_decode(r, h=8, length=4096, d=128)
extra = tasks() - base
print(extra)
for r in regs:
    r.close()
"""


@pytest.mark.parametrize("n", [1, 3, 16])
def test_one_bounded_pool_for_all_registries(n):
    p = run_python(COUNT, env={"FLASHMETAL_NUM_THREADS": str(n)}, timeout=120)
    # The caller is one of the n threads: at most n - 1 workers, however many registries.
    assert int(p.stdout.strip()) == n - 1
